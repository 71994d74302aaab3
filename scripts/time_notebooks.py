"""Measure how long each notebook takes to run top to bottom, wall and CPU, and save it (data/measurements/).

    python scripts/time_notebooks.py [notebooks/NN_name.ipynb ...]    # measure, save, update the openings
    python scripts/time_notebooks.py --openings-only                   # rewrite the openings from the saved file

Method: each notebook runs in a fresh ipykernel through nbclient, in its own folder, as
Run All would (``KVLAB_KERNEL_BACKEND`` and the rest of the environment as given). Wall time
is from the first cell's start to the last cell's end; CPU time is the user plus system time of
the kernel and every process it started, over the same span (``psutil``, all their threads; the
kernel's start-up is not counted): a notebook's ranks, engines in other processes and fork servers
work for it too. It is read as, summed over the kernel and its live descendants, each one's own
time plus what its children that exited and were reaped had used (``cutime``/``cstime``, what
``getrusage(RUSAGE_CHILDREN)`` reports); a process that ends mid-cell moves its time into its
parent's children's share, so nothing is lost or counted twice. Both are also kept per cell,
so the slowest cells are named. The load average of the machine at the start and end is
recorded beside them: on a shared machine the wall time grows with the load, the CPU time much
less. Each notebook's opening states these figures
(``tests/test_navigation.py`` checks that it states the saved ones).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NAME = "notebook_times"
ROW = "| **Time** |"


def seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def time_row(result: dict, machine: dict) -> str:
    """The opening's **Time** row for one notebook's measurement (``tests/test_navigation.py`` reads it back).

    A result measured on another machine than the file's latest keeps its own ``machine``.
    """
    machine = result.get("machine", machine)
    return (f"{ROW} Run All takes {seconds(result['wall_s'])} ({seconds(result['cpu_s'])} of CPU time), measured on "
            f"{machine['cores']} cores of a shared {machine['cpu']} (load {result['load_before']:g}) on "
            f"{machine['date']} with `scripts/time_notebooks.py`; on a laptop with nothing else running, expect "
            "roughly the CPU time |")


def write_openings(measured: dict) -> list[Path]:
    """Put each measured notebook's **Time** row in its opening table, after its **Next** row (or in place)."""
    import nbformat

    changed = []
    for name, result in measured["results"].items():
        path = ROOT / "notebooks" / name
        nb = nbformat.read(path, as_version=4)
        opening = nb.cells[0]
        lines = [line for line in opening.source.split("\n") if not line.startswith(ROW)]
        at = next(k for k, line in enumerate(lines) if line.startswith("| **Next** |")) + 1
        lines.insert(at, time_row(result, measured["machine"]))
        if "\n".join(lines) != opening.source:
            opening.source = "\n".join(lines)
            path.write_text(nbformat.writes(nb) + "\n")
            changed.append(path)
    return changed


def tree_cpu_seconds(process) -> float:
    """CPU seconds (user + system) of ``process`` and all its descendants, the exited ones included.

    Each live process counts its own time and its reaped children's (``children_user``, ``children_system``:
    the kernel's ``cutime``/``cstime``, in which a reaped child's own reaped children are already counted);
    descendants still running are found by walking the tree. A process that exits between two readings
    is counted by its parent once reaped (multiprocessing, the fork server and subprocess all reap theirs).
    """
    import psutil

    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # gone since the walk: its parent's children_* count it once it is reaped
        total += t.user + t.system + t.children_user + t.children_system
    return total


def time_notebook(path: Path, timeout: int = 1800, all_cells: bool = False) -> dict:
    """Run one notebook; return its wall and CPU seconds, in all and for its slowest cells (every cell's too, under
    ``"cells"``, with ``all_cells``)."""
    import nbformat
    import psutil
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    cells: list[dict] = []
    marks: dict[str, float] = {}

    def cpu() -> float:
        return tree_cpu_seconds(process)

    def on_start(cell, cell_index):
        marks["wall"], marks["cpu"] = time.perf_counter(), cpu()

    def on_done(cell, cell_index, execute_reply):
        cells.append({"cell": cell_index, "id": cell.get("id"), "wall_s": round(time.perf_counter() - marks["wall"], 2),
                      "cpu_s": round(cpu() - marks["cpu"], 2)})

    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", on_cell_start=on_start,
                            on_cell_executed=on_done, resources={"metadata": {"path": str(path.parent)}})
    load_before = os.getloadavg()[0]
    with client.setup_kernel():
        process = psutil.Process(client.km.provisioner.process.pid)
        start_wall, start_cpu = time.perf_counter(), cpu()
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        wall, cpu_s = time.perf_counter() - start_wall, cpu() - start_cpu
    slowest = sorted(cells, key=lambda c: -c["wall_s"])[:3]
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu_s, 1), "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2), "slowest_cells": slowest,
            **({"cells": cells} if all_cells else {})}


def main(argv: list[str] | None = None) -> int:
    from kvlab.machine import load_measurement, save_measurement

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--openings-only", action="store_true", help="rewrite the openings from the saved file")
    args = parser.parse_args(argv)
    if args.openings_only:
        print(write_openings(load_measurement(NAME)))
        return 0
    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    saved = load_measurement(NAME)
    results = dict(saved["results"]) if saved else {}
    for name, result in results.items():  # results not re-measured keep the machine they were measured on
        if saved and "machine" not in result and name not in {p.name for p in notebooks}:
            result["machine"] = saved["machine"]
    for path in notebooks:
        results[path.name] = time_notebook(path.resolve())
        r = results[path.name]
        print(f"{path.name}: {r['wall_s']} s wall, {r['cpu_s']} s CPU (load {r['load_before']} -> {r['load_after']})")
    method = (__doc__.split("Method: ", 1)[1].split("Each notebook's opening", 1)[0]).replace("\n", " ").strip()
    print(save_measurement(NAME, dict(sorted(results.items())), method))
    print(write_openings(load_measurement(NAME)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
