"""Hooks for the whole run: each notebook nbval runs is then shown in JupyterLab from its executed copy.

The plugin is ``tests/_rendered.py`` (why and how: its docstring). At the end every run prints its wall
time and its five slowest files (the time of their tests added up, on whichever worker ran them), so a
slow test is seen when it lands. Every temporary file of the run is made in one folder, removed at its end.
"""

import multiprocessing.util
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

import _rendered  # noqa: E402
import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before -m selects, so the items' ui marker is honoured
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    _rendered.add_render_items(session, items)


SLOWEST_FILES = 5
START = pytest.StashKey[float]()
TMPDIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """One temporary folder for the run, inherited by every process it starts (xdist's workers, nbval's kernels,
    the grader's checkers, ranks): nbval kills a notebook's kernel at its end, so the kernel's own clean-up
    (a ``TemporaryDirectory``'s finalizer, an ``atexit``) never runs, and its files would stay behind."""
    if hasattr(config, "workerinput"):  # a worker: its controller's folder is already in TMPDIR
        return
    multiprocessing.util.get_temp_dir()  # its folder outside ours: multiprocessing removes it itself, after us
    path = tempfile.mkdtemp(prefix="kvlab-test-")
    config.stash[TMPDIR] = path
    os.environ["TMPDIR"] = path
    tempfile.tempdir = None  # this process, too, finds it on its next call


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(TMPDIR, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[START] = time.monotonic()
    if not hasattr(session.config, "workerinput"):  # the controlling process (or the only one)
        _rendered.clear_screenshots()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The run's wall time and its slowest files (setup, call and teardown of every test in the file)."""
    per_file: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                per_file[report.nodeid.split("::")[0]] += report.duration
    if not per_file:
        return
    wall = time.monotonic() - config.stash[START]
    slowest = sorted(per_file.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]
    terminalreporter.write_sep("-", f"wall time {wall // 60:.0f} min {wall % 60:.0f} s; "
                                    f"{sum(per_file.values()):.0f} s of tests in {len(per_file)} files")
    for name, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f} s  {name}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    renderer = session.config.stash.get(_rendered.RENDERER_KEY, None)
    if renderer is not None:
        renderer.close()
