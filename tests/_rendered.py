"""Every notebook nbval ran, shown in JupyterLab in Chromium from its executed copy: no second execution.

nbval executes each notebook once for its assertions. This plugin adds one more item to each
notebook's file, ``notebooks/NN_name.ipynb::rendered in JupyterLab``, that runs right after the
last cell on the same worker (``--dist loadfile`` keeps a file's items together, in order), while
nbval's kernel is still alive. It

1. asks that kernel, silently, what the notebook displayed (``_browser.KERNEL_PROBE``: widget views,
   FigureWidgets and their keys, reached from the widget outputs' model ids) and for the widget
   state (``ipywidgets.Widget.get_manager_state``), as ``nbclient``'s ``store_widget_state`` saves it;
2. writes the executed copy: the notebook with nbval's outputs in every code cell and that state in
   its metadata, trusted (signed) for the test's own JupyterLab, in a staging folder;
3. opens it in JupyterLab: ipywidgets restores every widget from the saved state (its manager loads
   the notebook's ``widgets`` metadata when the page opens) and plotly draws every figure, and
4. checks what only a browser shows, as the live run did: no error output, every code cell
   executed, every expected view and figure drawn, no panel wider than 1280 px, every figure
   readable at 1280x720 (``_browser.figure_text_problems``), and saves the screenshots.

What it does not prove, a live run does: the kernel answering the page, a widget's callback, a
slider drag. ``tests/test_ui_browser.py`` keeps notebooks 01, 02 and 03 (``LIVE_IN_LAB``) running end
to end in JupyterLab for that, with the same checks, and notebook 03 in Voila; they get no item here.
The item carries the ``ui`` marker (``-m "not ui"`` drops it) and skips, saying why, without Chromium or playwright.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import _browser as ui
import pytest

SCREENSHOTS = Path(os.environ.get("KVLAB_UI_SCREENSHOTS") or ui.ROOT / "build" / "ui-screenshots")
FIGURE_SHOTS = SCREENSHOTS / "figures"
EXECUTED = SCREENSHOTS / "executed"  # the executed copies, as rendered
ITEM_NAME = "rendered in JupyterLab"
# Run end to end in JupyterLab by tests/test_ui_browser.py (their panels are driven there, which needs a live
# kernel), so their rendering is checked on that run: no executed copy is rendered for them.
LIVE_IN_LAB = ("01", "02", "03")
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PROBE_TIMEOUT_S = 120
# Run in nbval's kernel after the last cell: what the notebook displayed, and its widgets' state.
STATE_PROBE = ui.KERNEL_PROBE + r'''
def _kvlab_ui_state(model_ids, path):
    import json
    import ipywidgets
    found = json.loads(_kvlab_ui_probe(model_ids))
    state = ipywidgets.Widget.get_manager_state(drop_defaults=False)  # anywidget: _esm is a default
    with open(path, "w") as f:
        json.dump({"probe": found, "widgets": state}, f)
'''


def _nbval_classes() -> tuple[type, type] | None:
    try:
        from nbval.plugin import IPyNbCell, IPyNbFile
    except ImportError:
        return None
    return IPyNbFile, IPyNbCell


class Renderer:
    """One Chromium and one JupyterLab per pytest process, each started on first use, stopped at the end.

    Playwright's sync API allows one running instance per process, so every browser test of the process
    (``tests/test_ui_browser.py``, ``tests/test_html_export.py``) takes its pages from this one browser.
    """

    def __init__(self) -> None:
        self._stack = ExitStack()
        self.home: Path | None = None
        self.lab: ui.Server | None = None
        self.browser: Any = None

    def _home(self) -> Path:
        if self.home is None:
            self.home = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="kvlab-rendered-")))
        return self.home

    def start_browser(self) -> Any:
        """The process's Chromium context (a 1280x720 viewport, waits bounded by ``_browser.WAIT_S``)."""
        if self.browser is None:
            from playwright.sync_api import sync_playwright

            playwright = self._stack.enter_context(sync_playwright())
            self.browser = self._stack.enter_context(ui.chromium(playwright, self._home() / "profile"))
            self.browser.set_default_timeout(ui.WAIT_S * 1000)
        return self.browser

    def start(self) -> None:
        """The browser and a JupyterLab serving the staging folder of executed copies."""
        self.start_browser()
        if self.lab is None:
            ui.stage_workbook(self._home() / "workbook", [])
            self.lab = self._stack.enter_context(ui.jupyterlab(self.home / "lab", self.home / "workbook"))

    def close(self) -> None:
        stack, self._stack = self._stack, ExitStack()
        self.lab = self.browser = self.home = None
        stack.close()

    def trust(self, notebook: Path) -> None:
        """Sign ``notebook`` with the test server's own secret, so JupyterLab renders its widgets and figures."""
        trust(notebook, self.home / "lab" / "data")


def trust(notebook: Path, data_dir: Path) -> None:
    """Sign ``notebook`` as the Jupyter server whose data folder is ``data_dir`` will check it."""
    import nbformat
    from nbformat.sign import NotebookNotary

    notary = NotebookNotary(data_dir=str(data_dir), db_file=str(data_dir / "nbsignatures.db"))
    notary.sign(nbformat.read(str(notebook), as_version=4))
    notary.store.close()


# ipywidgets' manager restores the saved widgets once the kernel is ready; a second restore, from the kernel
# only, starts when the kernel connects and marks the manager restored before the notebook's models are in
# it, so a widget output rendered in that window says "model not found" (a race in ipywidgets 8, seen on a
# loaded machine). Reloading the notebook from disk renders its outputs again, against the models now loaded.
RELOADS = 3


def reload_from_disk(page: Any) -> None:
    """File > Reload Notebook from Disk, then wait until the notebook's cells are back.

    JupyterLab asks first when the notebook is dirty, as restoring widgets makes it (each model registered
    marks it changed).
    """
    dirty = page.locator(".lm-TabBar-tab.lm-mod-current.jp-mod-dirty").count() > 0
    page.locator(".lm-MenuBar-itemLabel", has_text="File").first.click()
    page.locator(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel",
                 has_text="Reload Notebook from Disk").first.click()
    if dirty:
        accept = page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept")  # "Are you sure ...?"
        accept.first.wait_for(state="visible")
        accept.first.click()
        accept.first.wait_for(state="detached")
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")


def problems_in_lab(browser: Any, lab: ui.Server, path: str, want: dict[str, Any],
                    shot: Path | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """Open the notebook at ``path`` (under the server's root) and say where the page falls short of ``want``.

    Returns the problems (``_browser.problems``) and the figures' text boxes; with ``shot``, saves the
    screenshots too. The notebook's session is closed again, so its kernel does not linger.
    """
    page = browser.new_page()
    try:
        # A workspace of its own: the default one would reopen every notebook rendered before in this server
        # (each heavy with its widgets) before this one.
        ui.open_in_lab(page, lab, path, workspace="render-" + Path(path).stem.replace("_", "-"))
        root = ".jp-NotebookPanel:not(.lm-mod-hidden)"
        for _attempt in range(RELOADS + 1):
            report = ui.wait_for_render(page, root, want["views"], want["plots"])
            if not any("model not found" in e for e in report["widgetErrors"]):
                break
            reload_from_disk(page)
        figures = ui.figure_text_report(page, root)
        if shot is not None:
            ui.screenshot_whole(page, shot, ui.LAB_SCROLLER, figures=FIGURE_SHOTS)
        return ui.problems(ui.page_report(page, root), want["views"], want["plots"], want.get("keys")), figures
    finally:
        page.close()
        for session in lab.get_json("api/sessions"):
            if session["path"] == path:
                lab.delete(f"api/sessions/{session['id']}")


RENDERER_KEY = pytest.StashKey[Renderer]()


def shared_browser(config: pytest.Config) -> Any:
    """The process's one Chromium context, for any browser test (see ``Renderer``)."""
    return config.stash.setdefault(RENDERER_KEY, Renderer()).start_browser()


class RenderedNotebook(pytest.Item):
    """The notebook nbval just ran, opened from its executed copy in JupyterLab and checked as a learner sees it."""

    def __init__(self, *, cells: dict[int, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cells = cells  # cell number -> nbval's item, for the cells this run collected
        self.add_marker(pytest.mark.ui)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"{self.path.name}::{ITEM_NAME}"

    def runtest(self) -> None:
        if ui.chromium_path() is None:
            pytest.skip(f"no Chromium at {os.environ.get(ui.CHROMIUM_ENV) or ui.DEFAULT_CHROMIUM} "
                        f"(apt-get install chromium, or set {ui.CHROMIUM_ENV})")
        pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
        kernel = self.parent.kernel
        if kernel is None or not kernel.is_alive():
            pytest.skip("nbval's kernel is gone: the notebook did not run to its end")
        code_cells = sum(c.cell_type == "code" for c in self.parent.nb.cells)
        if len(self.cells) < code_cells or any(c.test_outputs is None for c in self.cells.values()):
            pytest.skip("only part of the notebook ran in this session (-k, -m ui, or a failure)")
        failed = [c.cell_num for c in self.cells.values() if c.test_outputs is not None
                  and any(o.get("output_type") == "error" for o in c.test_outputs)]
        if failed:
            pytest.skip(f"cells {failed} failed under nbval (reported there)")
        renderer = self.config.stash.setdefault(RENDERER_KEY, Renderer())
        renderer.start()
        executed = self._executed_copy(renderer)
        self._check_in_lab(renderer, executed)

    def _executed_copy(self, renderer: Renderer) -> tuple[Path, dict[str, Any], dict[str, Any]]:
        """The notebook with nbval's outputs and the kernel's widget state, trusted, in the staging folder."""
        import nbformat

        nb = copy.deepcopy(self.parent.nb)
        code_cells = [c for c in nb.cells if c.cell_type == "code"]
        for count, cell in enumerate(code_cells, start=1):
            item = self.cells.get(count - 1)
            ran = item is not None and item.test_outputs is not None
            cell.outputs = copy.deepcopy(item.test_outputs) if ran else []
            cell.execution_count = count if ran else None
            for out in cell.outputs:
                if out.output_type == "execute_result":
                    out.execution_count = count
        summary = ui.notebook_outputs_summary(nb)
        state_file = renderer.home / f"{self.path.stem}-state.json"
        kernel = self.parent.kernel
        msg_id = kernel.execute_cell_input(
            f"{STATE_PROBE}\n_kvlab_ui_state({summary['roots']!r}, {str(state_file)!r})", allow_stdin=False)
        kernel.await_reply(msg_id, timeout=PROBE_TIMEOUT_S)
        kernel.await_idle(msg_id, PROBE_TIMEOUT_S)
        assert state_file.exists(), "the kernel did not report its widgets"
        found = json.loads(state_file.read_text())
        nb.metadata["widgets"] = {WIDGET_STATE: found["widgets"]}
        path = renderer.home / "workbook" / "notebooks" / self.path.name
        nbformat.write(nb, str(path))
        renderer.trust(path)
        EXECUTED.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, EXECUTED / path.name)  # to open by hand after a failure
        probe = found["probe"]
        want = {"views": probe["views"], "plots": probe["figures"] + summary["plotly_outputs"],
                "keys": probe["figure_keys"] + summary["plotly_keys"], "missing": probe["missing"]}
        return path, json.loads(path.read_text()), want

    def _check_in_lab(self, renderer: Renderer, executed: tuple[Path, dict[str, Any], dict[str, Any]]) -> None:
        path, saved, want = executed
        summary = ui.notebook_outputs_summary(saved)
        assert not summary["errors"], summary["errors"]
        assert not summary["not_run"], f"code cells {summary['not_run']} never ran"
        assert want["missing"] == 0, "a displayed widget no longer exists in the kernel"
        start = time.monotonic()
        shot = SCREENSHOTS / f"lab-{path.stem}.png"
        found, figures = problems_in_lab(renderer.browser, renderer.lab, f"notebooks/{path.name}", want, shot)
        assert found == [], found
        assert len(figures) == want["plots"]
        unreadable = ui.figure_text_problems(figures)
        assert not unreadable, "\n".join([f"{len(unreadable)} problems (screenshots: {FIGURE_SHOTS}):", *unreadable])
        assert shot.stat().st_size > 0
        self.user_properties.append(("rendered_s", round(time.monotonic() - start, 1)))


def add_render_items(session: pytest.Session, items: list[pytest.Item]) -> None:
    """After each notebook's last nbval cell, its ``rendered in JupyterLab`` item."""
    classes = _nbval_classes()
    if classes is None:
        return
    file_class, cell_class = classes
    by_file: dict[Any, dict[int, Any]] = {}
    for item in items:
        if isinstance(item, cell_class) and isinstance(item.parent, file_class):
            by_file.setdefault(item.parent, {})[item.cell_num] = item
    if not by_file:
        return
    out: list[pytest.Item] = []
    for index, item in enumerate(items):
        out.append(item)
        cells = by_file.get(item.parent) if isinstance(item, cell_class) else None
        last = index + 1 == len(items) or items[index + 1].parent is not item.parent
        if cells and last and item.path.name[:2] not in LIVE_IN_LAB:
            out.append(RenderedNotebook.from_parent(item.parent, name=ITEM_NAME, cells=cells))
    items[:] = out


def clear_screenshots() -> None:
    """The screenshot folder shows this run only (called once, by the controlling process).

    Another run in the same checkout may be clearing it at the same moment (``make test-mutants`` runs two
    at a time): a file or folder already gone is what this wanted anyway."""
    for old in [*SCREENSHOTS.glob("*.png"), *FIGURE_SHOTS.glob("*.png"), *EXECUTED.glob("*.ipynb")]:
        old.unlink(missing_ok=True)
    if SCREENSHOTS.exists() and not any(SCREENSHOTS.iterdir()):
        shutil.rmtree(SCREENSHOTS, ignore_errors=True)
