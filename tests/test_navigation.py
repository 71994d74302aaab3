"""The workbook reads in order, and every link in it leads somewhere.

Each notebook opens with its title (``# NN · Title``), a link to the glossary and a small
table whose **Builds on** row links earlier notebooks and whose **Next** row links the
following one; it ends with a **Next:** line that links the following notebook again. The
last notebook's **Next** leads back to the README. A link to a notebook is named by that
notebook's title, so a renamed notebook cannot leave a stale name behind. (The glossary's
links are checked in ``tests/test_glossary.py``.)
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from _links import broken_links, headings, local_links, markdown_cells, resolve

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
TITLE = re.compile(r"# (\d\d · .+)")
ROW = re.compile(r"^\| \*\*(.+?)\*\* \| (.+) \|$", re.M)


def _title(notebook: Path) -> str:
    """``01 · Bytes per token``: the first line of the notebook's first cell, without its ``#``."""
    first = markdown_cells(notebook)[0].splitlines()[0]
    match = TITLE.fullmatch(first)
    assert match and match.group(1).startswith(notebook.name[:2]), f"{notebook.name} opens with {first!r}"
    return match.group(1)


def _notebook_links(markdown: str, notebook: Path) -> list[tuple[Path, str]]:
    """``(notebook, link text)`` of every link in ``markdown`` to a notebook, anchors left out."""
    found = [(resolve(target, notebook)[0], text) for target, text in local_links(markdown)]
    return [(path, text) for path, text in found if path.suffix == ".ipynb"]


def _following(notebook: Path) -> Path | None:
    index = NOTEBOOKS.index(notebook)
    return NOTEBOOKS[index + 1] if index + 1 < len(NOTEBOOKS) else None


def _assert_named_by_title(found: list[tuple[Path, str]], where: str) -> None:
    for path, text in found:
        assert path.exists(), f"{where}: {path.name} does not exist"
        assert text == _title(path), f"{where}: call {path.name} {_title(path)!r}, not {text!r}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_every_link_in_a_notebook_leads_somewhere(notebook):
    broken = [b for source in markdown_cells(notebook) for b in broken_links(source, notebook)]
    assert not broken, broken


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md"])
def test_every_link_in_the_readme_and_contributing_leads_somewhere(page):
    broken = broken_links((ROOT / page).read_text(encoding="utf-8"), ROOT / page)
    assert not broken, broken


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_the_opening_links_the_glossary_and_what_comes_before_and_after(notebook):
    opening = markdown_cells(notebook)[0]
    _title(notebook)
    assert "(../GLOSSARY.md)" in opening, f"{notebook.name}: link the glossary near the opening"
    rows = dict(ROW.findall(opening))
    assert {"Builds on", "Next"} <= set(rows), f"{notebook.name}: the opening table needs Builds on and Next"

    before = _notebook_links(rows["Builds on"], notebook)
    _assert_named_by_title(before, f"{notebook.name}, Builds on")
    assert all(path.name < notebook.name for path, _ in before), f"{notebook.name} builds on a later notebook"
    assert bool(before) == (notebook != NOTEBOOKS[0]), f"{notebook.name}: Builds on links the earlier notebooks"

    following = _following(notebook)
    after = _notebook_links(rows["Next"], notebook)
    _assert_named_by_title(after, f"{notebook.name}, Next")
    if following:
        assert after and after[0][0] == following, f"{notebook.name}: Next links {following.name} first"
    else:
        assert "(../README.md)" in rows["Next"], f"{notebook.name}: the last notebook's Next leads back to the README"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_the_last_cell_says_what_to_read_next(notebook):
    last = json.loads(notebook.read_text(encoding="utf-8"))["cells"][-1]
    assert last["cell_type"] == "markdown", f"{notebook.name} ends with a Markdown cell"
    closing = "".join(last["source"]).strip().split("\n\n")[-1]
    assert closing.startswith("**Next:** "), f"{notebook.name}: the last paragraph is a **Next:** line"

    following = _following(notebook)
    after = _notebook_links(closing, notebook)
    _assert_named_by_title(after, f"{notebook.name}, closing Next")
    if following:
        assert after and after[0][0] == following, f"{notebook.name}: the closing Next links {following.name} first"
    else:
        assert "(../README.md)" in closing, f"{notebook.name}: the last notebook's closing Next leads to the README"


# Asides a class may skip (issue 19): each is marked **Optional** in its heading's cell, or in a
# note just before it, and that note links to a later section of the same notebook.
OPTIONAL = {
    "01_bytes_per_token.ipynb": ["Checking-the-articles"],
    "02_budget_simulator.ipynb": ["4.-The-source-table,-row-by-row", "Checking-the-articles"],
    "03_block_table.ipynb": ["9.-Performance-aside:-O(1)-per-block"],
    "04_prefix_cache.ipynb": ["5.-The-seed-of-every-chain:-NONE_HASH", "6.-What-hashing-costs,-and-what-a-hit-saves",
                              "7.-When-two-blocks-share-a-hash", "Checking-the-articles"],
}


@pytest.mark.parametrize("name, heading", [(n, h) for n, hs in OPTIONAL.items() for h in hs])
def test_the_asides_a_class_may_skip_say_so_and_where_to_go_on(name, heading):
    notebook = ROOT / "notebooks" / name
    cells = markdown_cells(notebook)
    index = next(k for k, source in enumerate(cells) if any(
        line.startswith("## ") and line.replace("`", "").replace(" ", "-")[3:] == heading
        for line in source.splitlines()))
    note = next((c for c in (cells[index], cells[index - 1]) if "**Optional" in c), None)
    assert note is not None, f"{name}: mark {heading!r} as **Optional**"
    later = [target for target, _ in local_links(note) if target.startswith("#")]
    assert later, f"{name}: the note on {heading!r} says where to read on"
    order = list(headings(notebook))
    assert all(order.index(target[1:]) > order.index(heading) for target in later), later   # onwards, not back


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_the_opening_says_what_to_read_first_when_arriving_from_the_vllm_docs(notebook):
    rows = dict(ROW.findall(markdown_cells(notebook)[0]))
    assert "From the vLLM docs?" in rows, f"{notebook.name}: the opening table needs a **From the vLLM docs?** row"
    earlier = [p for p, _ in _notebook_links(rows["From the vLLM docs?"], notebook) if p != notebook]
    assert earlier or notebook == NOTEBOOKS[0], f"{notebook.name}: name what to read first"
    assert all(p.name < notebook.name for p in earlier), f"{notebook.name}: read first means an earlier notebook"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_the_opening_states_how_long_run_all_takes_as_measured(notebook):
    """The **Time** row is the one ``scripts/time_notebooks.py`` writes from data/measurements/notebook_times.json."""
    spec = importlib.util.spec_from_file_location("time_notebooks", ROOT / "scripts" / "time_notebooks.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    measured = json.loads((ROOT / "data" / "measurements" / "notebook_times.json").read_text())
    assert notebook.name in measured["results"], f"run scripts/time_notebooks.py {notebook.relative_to(ROOT)}"
    expected = script.time_row(measured["results"][notebook.name], measured["machine"])
    assert expected in markdown_cells(notebook)[0].splitlines(), (
        f"{notebook.name}: its **Time** row is not the measurement; run scripts/time_notebooks.py --openings-only")
