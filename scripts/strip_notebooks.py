"""Remove outputs, execution counts and volatile metadata from notebooks (``make strip``)."""

import sys
from pathlib import Path

import nbformat


def strip(path: Path) -> bool:
    """Strip one notebook in place; return True if it changed."""
    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in ("execution", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)
    nb.metadata.pop("widgets", None)
    after = nbformat.writes(nb)
    if after != before:
        path.write_text(after + ("" if after.endswith("\n") else "\n"))
    return after != before


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted(Path("notebooks").glob("*.ipynb"))
    for p in paths:
        if strip(p):
            print(f"stripped {p}")
