"""Start JupyterLab and Voilà headless on loopback, and the system Chromium to drive them (UI tests only).

Nothing here is downloaded at run time: the browser is Debian's ``chromium`` (or the
one ``KVLAB_CHROMIUM`` names), driven by Python Playwright through ``executable_path``.
Every server gets a free loopback port, a generated token and its own temporary
config, data, runtime and settings directories, so a developer's own JupyterLab
settings never leak into a test, and a test never writes into the working tree:
the notebooks are copied into a staging folder first.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ENV = "KVLAB_CHROMIUM"
DEFAULT_CHROMIUM = "/usr/bin/chromium"
# The closed network of CI: no GPU, no QUIC, nothing that phones home.
CHROMIUM_FLAGS = [
    "--headless", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
]
VIEWPORT = {"width": 1280, "height": 720}
# The longest any wait on the page may last. Every wait ends as soon as the page reports what it
# waits for (cells finished, views and figures drawn, a layout that stopped moving), so this
# only bounds a wait that will never end; a busy 2-core CI machine makes waits long, not flaky.
WAIT_S = float(os.environ.get("KVLAB_UI_WAIT", "300"))

# JupyterLab user settings for a test run: every cell stays in the page (windowing "none"),
# nothing is fetched from the internet, and nothing is saved behind the test's back.
LAB_SETTINGS: dict[str, dict[str, Any]] = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"checkForUpdates": False, "fetchNews": "false"},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
}
SERVER_CONFIG: dict[str, Any] = {
    "LabApp": {"news_url": None, "check_for_updates_class": "jupyterlab.NeverCheckForUpdate"},
    "LanguageServerManager": {"autodetect": False},
}


def chromium_path() -> str | None:
    """The Chromium executable to drive (``$KVLAB_CHROMIUM`` or Debian's), or None if it is not installed."""
    path = os.environ.get(CHROMIUM_ENV) or DEFAULT_CHROMIUM
    found = shutil.which(path)
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env(home: Path) -> dict[str, str]:
    """Environment for a Jupyter server whose config, data, runtime and settings all live under ``home``."""
    dirs = {name: home / name for name in ("config", "data", "runtime", "settings", "workspaces", "ipython")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    for plugin, values in LAB_SETTINGS.items():
        path = dirs["settings"] / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    (dirs["config"] / "jupyter_server_config.json").write_text(json.dumps(SERVER_CONFIG))
    env = dict(os.environ)
    env.update({
        "JUPYTER_CONFIG_DIR": str(dirs["config"]), "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]), "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
        "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]), "IPYTHONDIR": str(dirs["ipython"]),
        "JUPYTER_PLATFORM_DIRS": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    })
    return env


def stage_workbook(dest: Path, notebooks: Sequence[Path]) -> Path:
    """Copy ``notebooks`` into ``dest/notebooks`` and link the rest of the repository beside them.

    Relative links and paths (``../GLOSSARY.md``, ``../data``) keep working, while whatever
    the browser writes into a notebook stays in the copy.
    """
    (dest / "notebooks").mkdir(parents=True, exist_ok=True)
    for nb in notebooks:
        shutil.copy2(nb, dest / "notebooks" / nb.name)
    for entry in ROOT.iterdir():
        if entry.name not in {"notebooks", ".git", ".venv", "build"} and not (dest / entry.name).exists():
            (dest / entry.name).symlink_to(entry)
    return dest


class Server:
    """A Jupyter server (JupyterLab or Voilà) running as a child process, with its URL and token."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, port: int, token: str, log: Path):
        self.port, self.token, self.log = port, token, log
        self.base = f"http://127.0.0.1:{port}"
        self._log_file = log.open("w")
        self.process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._log_file, stderr=subprocess.STDOUT)

    def url(self, path: str) -> str:
        """``path`` on this server, with the token."""
        sep = "&" if "?" in path else "?"
        return f"{self.base}/{path.lstrip('/')}{sep}token={self.token}"

    def get_json(self, path: str) -> Any:
        """GET a JSON document from the server's REST API."""
        with urllib.request.urlopen(self.url(path), timeout=10) as response:
            return json.loads(response.read())

    def delete(self, path: str) -> None:
        """DELETE a REST resource (a session, so that its kernel stops)."""
        request = urllib.request.Request(self.url(path), method="DELETE")
        with urllib.request.urlopen(request, timeout=30):
            pass

    def wait_ready(self, path: str, timeout: float = 120.0) -> None:
        """Poll ``path`` until it answers 200; fail with the server's log if it dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url(path), timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        """Stop the server (and so its kernels): SIGTERM, then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()


@contextmanager
def serve(home: Path, root: Path, argv: Any, ready_path: str, name: str) -> Iterator[Server]:
    """Run ``argv(port, token)`` in ``root`` with an isolated environment under ``home``, until the block ends."""
    port, token = free_port(), secrets.token_hex(16)
    server = Server(argv(port, token), isolated_env(home), root, port, token, home / f"{name}.log")
    try:
        server.wait_ready(ready_path)
        yield server
    finally:
        server.stop()


def jupyterlab(home: Path, root: Path) -> Any:
    """JupyterLab serving ``root``, headless, on a free loopback port with a fresh token."""
    return serve(home, root, lambda port, token: [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
        *_as_root()], "api/status", "jupyterlab")


def voila(home: Path, root: Path) -> Any:
    """Voilà serving the notebooks under ``root`` (code hidden, tracebacks shown), on a free loopback port."""
    return serve(home, root, lambda port, token: [
        sys.executable, "-m", "voila", "--no-browser", "--Voila.ip=127.0.0.1", f"--port={port}",
        f"--Voila.token={token}", "--show_tracebacks=True", "--Voila.port_retries=0",
        f"--Voila.connection_dir_root={home / 'runtime'}", str(root)], "", "voila")


def _as_root() -> list[str]:
    """Jupyter refuses to run as root without ``--allow-root``; CI runs as root."""
    return ["--allow-root"] if _is_root() else []


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def chromium_args() -> list[str]:
    """Flags for the system Chromium: the closed-network set, plus ``--no-sandbox`` when running as root."""
    return CHROMIUM_FLAGS + (["--no-sandbox"] if _is_root() else [])


@contextmanager
def chromium(playwright: Any, profile: Path) -> Iterator[Any]:
    """A Playwright browser context on the system Chromium, with a new empty profile and a 1280×720 viewport."""
    executable = chromium_path()
    if executable is None:
        raise FileNotFoundError(f"no Chromium at {os.environ.get(CHROMIUM_ENV) or DEFAULT_CHROMIUM}")
    profile.mkdir(parents=True, exist_ok=True)
    context = playwright.chromium.launch_persistent_context(
        str(profile), executable_path=executable, headless=True, args=chromium_args(),
        chromium_sandbox=False, viewport=VIEWPORT, device_scale_factor=1,
    )
    try:
        yield context
    finally:
        context.close()


# --------------------------------------------------------------------------- what the kernel created

# Run here and in the kernel (one source, so both sides agree): what a plotly figure shows,
# in short, its title and its traces' types and names. Computed in the kernel for
# FigureWidgets, from saved outputs for plotly figures, and in the page by PAGE_REPORT_JS,
# it catches a figure that drew another state than the kernel holds, not only a blank one.
# An unnamed trace is "trace N" on one side and nameless on the other: both count as nameless.
FIGURE_KEY_SOURCE = r'''
def figure_key(figure):
    import json
    import re
    title = (figure.get("layout") or {}).get("title")
    title = title.get("text") if isinstance(title, dict) else title
    names = [t.get("name") or "" for t in figure.get("data") or []]
    names = ["" if re.fullmatch(r"trace \d+", n) else n for n in names]
    traces = [f"{t.get('type') or 'scatter'}:{n}" for t, n in zip(figure.get("data") or [], names)]
    return json.dumps([title or "", traces], separators=(",", ":"), ensure_ascii=False)
'''
_namespace: dict[str, Any] = {}
exec(FIGURE_KEY_SOURCE, _namespace)
figure_key = _namespace["figure_key"]  # (figure: dict) -> str

# Sent (silently) to a notebook's kernel: walks the widget trees a notebook displayed, from
# the model ids of its widget outputs, and counts what the browser must render. Plotly's
# FigureWidget is an anywidget and draws a plot, not an ipywidgets view; every other
# DOMWidget draws one root element, found in the page by VIEW_SELECTOR.
KERNEL_PROBE = FIGURE_KEY_SOURCE + r'''
def _kvlab_ui_probe(model_ids):
    import json
    from ipywidgets import DOMWidget
    from ipywidgets.widgets.widget import _instances
    try:
        from plotly.basewidget import BaseFigureWidget
    except ImportError:
        BaseFigureWidget = ()
    try:
        from anywidget import AnyWidget
    except ImportError:
        AnyWidget = ()
    found = {"views": 0, "figures": 0, "other": 0, "missing": 0, "names": {}, "figure_keys": []}

    def visit(w):
        if isinstance(w, BaseFigureWidget):
            found["figures"] += 1
            # Through plotly's attributes: a FigureWidget's to_plotly_json() can miss a trace
            # name that the frontend reported back as a default.
            shown = {"layout": {"title": {"text": w.layout.title.text}},
                     "data": [{"type": t.type, "name": t.name} for t in w.data]}
            found["figure_keys"].append(figure_key(shown))
            return
        if isinstance(w, AnyWidget) or not isinstance(w, DOMWidget):
            found["other"] += 1
            return
        found["views"] += 1
        found["names"][w._view_name] = found["names"].get(w._view_name, 0) + 1
        if w._view_name == "StackView":  # a Stack draws only its selected child
            index = w.selected_index
            shown = [] if index is None else [w.children[index]]
        else:
            shown = []
            for key in w.keys:
                if not key.startswith("_") and key not in ("layout", "style"):
                    value = getattr(w, key, None)
                    shown += value if isinstance(value, (list, tuple)) else [value]
        for child in shown:
            if isinstance(child, DOMWidget):
                visit(child)
        for out in w.outputs if w._view_name == "OutputView" else ():
            view = out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
            if view and view.get("model_id") in _instances:
                visit(_instances[view["model_id"]])

    for model_id in model_ids:
        if model_id in _instances:
            visit(_instances[model_id])
        else:
            found["missing"] += 1
    return json.dumps(found)
'''


class KernelProbe:
    """A second client on a running kernel, for questions the page cannot answer (what was created, ``panel.state``).

    It executes silently, so nothing it asks appears in the notebook.
    """

    def __init__(self, connection_file: Path):
        from jupyter_client import BlockingKernelClient

        self.client = BlockingKernelClient(connection_file=str(connection_file))
        self.client.load_connection_file()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self.run(KERNEL_PROBE)

    def run(self, code: str, expressions: dict[str, str] | None = None, timeout: float = 60) -> dict[str, Any]:
        """Execute ``code`` silently and return ``expressions`` evaluated afterwards (as their ``repr`` text)."""
        msg_id = self.client.execute(code, silent=True, store_history=False, user_expressions=expressions or {})
        deadline = time.monotonic() + timeout
        while True:
            reply = self.client.get_shell_msg(timeout=max(deadline - time.monotonic(), 0.1))
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        content = reply["content"]
        if content["status"] != "ok":
            raise RuntimeError(f"kernel probe failed: {content.get('ename')}: {content.get('evalue')}")
        values = {}
        for name, result in content.get("user_expressions", {}).items():
            if result.get("status") != "ok":
                raise RuntimeError(f"kernel probe {name!r} failed: {result.get('ename')}: {result.get('evalue')}")
            values[name] = result["data"]["text/plain"]
        return values

    def json(self, expression: str) -> Any:
        """Evaluate ``expression`` (which must return a JSON string) in the kernel and decode it."""
        import ast

        return json.loads(ast.literal_eval(self.run("", {"v": expression})["v"]))

    def displayed_widgets(self, model_ids: Sequence[str]) -> dict[str, Any]:
        """Counts of ipywidgets views and plotly FigureWidgets reachable from the displayed ``model_ids``."""
        return self.json(f"_kvlab_ui_probe({list(model_ids)!r})")

    def close(self) -> None:
        self.client.stop_channels()


def notebook_outputs_summary(nb: dict[str, Any]) -> dict[str, Any]:
    """From a saved notebook: widget-view roots, plotly outputs, errors, and code cells that never ran."""
    roots: list[str] = []
    plotly_outputs = 0
    plotly_keys: list[str] = []
    errors: list[str] = []
    not_run: list[int] = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if cell.get("execution_count") is None:
            not_run.append(index)
        for out in cell.get("outputs", []):
            if out["output_type"] == "error":
                errors.append(f"cell {index}: {out['ename']}: {out['evalue']}")
            data = out.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data:
                roots.append(data["application/vnd.jupyter.widget-view+json"]["model_id"])
            if "application/vnd.plotly.v1+json" in data:
                plotly_outputs += 1
                plotly_keys.append(figure_key(data["application/vnd.plotly.v1+json"]))
    return {"roots": roots, "plotly_outputs": plotly_outputs, "plotly_keys": plotly_keys, "errors": errors,
            "not_run": not_run}


# --------------------------------------------------------------------------- what the page shows

# Run in the page on the element that holds a notebook's outputs (JupyterLab's notebook
# panel, or Voilà's body): what rendered, what failed, and what sticks out at the side.
# ipywidgets marks the root element of almost every view with ``jupyter-widgets``; the
# views that do not (ToggleButtons, RadioButtons, the selection sliders) by their own class.
VIEW_SELECTOR = ".jupyter-widgets, .widget-toggle-buttons, .widget-radio, .widget-slider"

PAGE_REPORT_JS = r"""
(root) => {
  const width = window.innerWidth;
  const views = [...root.querySelectorAll('.jp-OutputArea-output :is(VIEW_SELECTOR)')];
  const plots = [...root.querySelectorAll('.js-plotly-plot')];
  const drawn = plots.filter(p => {
    const box = p.getBoundingClientRect();
    return p.querySelector('.main-svg') && box.width > 0 && box.height > 0
      && ((p._fullData && p._fullData.length > 0) || p.querySelector('g.trace'));
  });
  const outputs = [...root.querySelectorAll('.jp-OutputArea-output')];
  const widgetErrors = outputs.filter(o => o.textContent.trim().startsWith('Error displaying widget'))
    .map(o => o.textContent.trim().slice(0, 200));
  const tracebacks = outputs.filter(o => o.dataset.mimeType === 'application/vnd.jupyter.stderr'
    && /Traceback|Error:/.test(o.textContent)).map(o => o.textContent.trim().slice(0, 400));
  const callbackErrors = [...root.querySelectorAll('.kvlab-callback-error')].map(e => e.textContent.slice(0, 600));
  const describe = e => (e.className || '').toString().split(' ')
    .filter(c => c.startsWith('widget-') || c.startsWith('js-')).join('.');
  const overflow = [];
  for (const e of [...views, ...plots]) {
    const box = e.getBoundingClientRect();
    if (box.width > 0 && (box.left < -1 || box.right > width + 1)) {
      overflow.push(`${describe(e)} spans x=${Math.round(box.left)}..${Math.round(box.right)} in a ${width}px window`);
    }
  }
  for (const e of root.querySelectorAll('.jp-OutputArea-output .widget-box, .jp-OutputArea-output .widget-output')) {
    if (e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible') {
      overflow.push(`${describe(e)} scrolls sideways: ${e.scrollWidth}px of content in ${e.clientWidth}px`);
    }
  }
  const title = l => (l && l.title && typeof l.title === 'object' ? l.title.text : l && l.title) || '';
  const name = t => (/^trace \d+$/.test(t.name || '') ? '' : t.name || '');
  const plotKeys = plots.map(p => JSON.stringify([title(p.layout),
    (p.data || []).map(t => `${t.type || 'scatter'}:${name(t)}`)]));
  return {views: views.length, plots: plots.length, drawn: drawn.length, widgetErrors, tracebacks,
          callbackErrors, overflow, plotKeys};
}
"""


def page_report(page: Any, root_selector: str) -> dict[str, Any]:
    """Run ``PAGE_REPORT_JS`` on the first element matching ``root_selector``."""
    return page.locator(root_selector).first.evaluate(PAGE_REPORT_JS.replace("VIEW_SELECTOR", VIEW_SELECTOR))


def wait_for_render(page: Any, root_selector: str, expected_views: int, expected_plots: int,
                    timeout_s: float = WAIT_S) -> dict[str, Any]:
    """Wait until the page shows every expected view and figure drawn, or reports a failure; return its report.

    Widgets and figures render after the kernel sent them, later the busier the machine: the
    wait follows what the page reports, and stops early on an error that will not go away
    (a widget that failed to render, a traceback, a callback error).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        report = page_report(page, root_selector)
        done = report["views"] >= expected_views and report["drawn"] >= expected_plots == report["plots"]
        failed = report["widgetErrors"] or report["tracebacks"] or report["callbackErrors"]
        if done or failed or time.monotonic() > deadline:
            break
        page.wait_for_timeout(250)
    wait_for_layout(page, root_selector, timeout_s=max(deadline - time.monotonic(), 1))
    return page_report(page, root_selector)


# Resolves once the boxes of every cell and figure under the root stay the same over two
# animation frames and a short pause: the layout has settled (a figure drawn, a window resized).
LAYOUT_SETTLED_JS = r"""
async ([root, timeoutMs]) => {
  const shape = () => JSON.stringify([...root.querySelectorAll('.jp-Cell, .js-plotly-plot, .main-svg')]
    .map(e => { const b = e.getBoundingClientRect();
                return [Math.round(b.top), Math.round(b.width), Math.round(b.height)]; }));
  const frame = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => setTimeout(r, 100))));
  const end = performance.now() + timeoutMs;
  let last = shape();
  while (performance.now() < end) {
    await frame();
    const now = shape();
    if (now === last) return true;
    last = now;
  }
  return false;
}
"""


def wait_for_layout(page: Any, root_selector: str, timeout_s: float = WAIT_S) -> bool:
    """Wait until the layout under ``root_selector`` stops moving; True if it did within ``timeout_s``."""
    root = page.locator(root_selector).first.element_handle()
    return page.evaluate(LAYOUT_SETTLED_JS, [root, int(timeout_s * 1000)])


def problems(report: dict[str, Any], expected_views: int, expected_plots: int,
             expected_keys: Sequence[str] | None = None) -> list[str]:
    """Every way the page falls short of what the kernel created, in words; empty when it is all there."""
    found = []
    if expected_keys is not None and sorted(report["plotKeys"]) != sorted(expected_keys):
        shown, held = Counter(report["plotKeys"]), Counter(expected_keys)
        found.append(f"plotly figures show {sorted((shown - held).elements())} where the kernel holds "
                     f"{sorted((held - shown).elements())} (title, traces); a stale figure is a panel redrawn "
                     "without kvlab.viz.widgets.keep_for_new_views")
    if report["views"] != expected_views:
        found.append(f"{report['views']} ipywidgets views rendered, the notebook displays {expected_views}")
    if report["plots"] != expected_plots:
        found.append(f"{report['plots']} plotly figures in the page, the notebook displays {expected_plots}")
    if report["drawn"] != report["plots"]:
        found.append(f"only {report['drawn']} of {report['plots']} plotly figures have drawn traces")
    found += [f"widget failed to render: {e}" for e in report["widgetErrors"]]
    found += [f"traceback in the page: {e}" for e in report["tracebacks"]]
    found += [f"widget callback raised (kvlab-callback-error): {e}" for e in report["callbackErrors"]]
    found += [f"panel does not fit the {VIEWPORT['width']}px window: {e}" for e in report["overflow"]]
    return found


# --------------------------------------------------------------------------- driving JupyterLab

PROMPTS_JS = "() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-InputPrompt')]" \
             ".map(p => p.textContent.trim())"


def open_in_lab(page: Any, server: Server, path: str, timeout_s: float = 120, workspace: str | None = None) -> str:
    """Open the notebook at ``path`` (relative to the server root); return its kernel id once it is idle.

    With ``workspace``, in a JupyterLab workspace of that name, which restores no tab another page opened.
    """
    prefix = f"lab/workspaces/{workspace}" if workspace else "lab"
    page.goto(server.url(f"{prefix}/tree/{path}"), timeout=timeout_s * 1000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=timeout_s * 1000)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for session in server.get_json("api/sessions"):
            kernel = session.get("kernel") or {}
            if session["path"] == path and kernel.get("execution_state") == "idle" and kernel.get("connections"):
                # The open notebook's own indicator: JupyterLab may restore other notebooks' tabs
                # (hidden, each with an indicator of its own) from the workspace.
                page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) "
                                       ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout_s * 1000)
                return kernel["id"]
        time.sleep(0.5)
    raise TimeoutError(f"the kernel of {path} did not start within {timeout_s:.0f} s")


def run_all_in_lab(page: Any, timeout_s: float) -> None:
    """Run > Run All Cells, then wait until no cell is queued or running and the kernel is idle."""
    for _attempt in range(3):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel",
                     has_text="Run All Cells").first.click()
        try:  # the first prompt turns to [*] or [1] once the request is on its way
            page.wait_for_function(f"() => ({PROMPTS_JS})().some(p => /\\[(\\*|\\d+)\\]/.test(p))", timeout=20_000)
            break
        except Exception:  # the menu can open before the notebook has focus: try again
            page.keyboard.press("Escape")
    page.wait_for_function(
        f"""() => !({PROMPTS_JS})().some(p => p.includes('*')) &&
               document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator')
                 ?.dataset.status === 'idle'""",
        timeout=timeout_s * 1000, polling=500,
    )


def save_in_lab(page: Any, notebook_file: Path, timeout_s: float = 30) -> dict[str, Any]:
    """Save the open notebook (Ctrl+S) and return the saved file: the outputs exactly as the kernel sent them."""
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    page.wait_for_function(
        "() => !document.querySelector('.lm-TabBar-tab.lm-mod-current.jp-mod-dirty')", timeout=timeout_s * 1000
    )
    return json.loads(notebook_file.read_text())


LAB_SCROLLER = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer"
VOILA_SCROLLER = "#rendered_cells"


def screenshot_whole(page: Any, path: Path, scroller: str, max_height: int = 30_000,
                     figures: Path | None = None) -> None:
    """A screenshot of every cell: the window is made as tall as the cells (from the top), then put back.

    JupyterLab and Voilà scroll inside an element (``scroller``), so Playwright's full-page
    screenshot would show one screen only. With ``figures``, each plotly figure is also saved
    on its own there, as ``<stem>-cell<N>-<k>.png`` (N: the cell's index in the notebook).
    """
    height = page.locator(scroller).first.evaluate(
        """(s) => { s.scrollTop = 0;
             const cells = [...s.querySelectorAll('.jp-Cell')];
             return Math.max(...cells.map(c => c.getBoundingClientRect().bottom), 0) + 40; }"""
    )
    height = max(VIEWPORT["height"], min(int(height), max_height))
    page.set_viewport_size({"width": VIEWPORT["width"], "height": height})
    wait_for_layout(page, scroller)  # plots and the notebook lay themselves out again
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))
    if figures is not None:
        figures.mkdir(parents=True, exist_ok=True)
        for old in figures.glob(f"{path.stem}-cell*.png"):
            old.unlink()
        plots = page.locator(scroller).first.locator(".js-plotly-plot")
        cells = page.locator(scroller).first.evaluate(
            "(s) => [...s.querySelectorAll('.js-plotly-plot')].map(p => "
            "[...s.querySelectorAll('.jp-Cell')].indexOf(p.closest('.jp-Cell')))")
        for k, cell in enumerate(cells):
            plot = plots.nth(k)
            if plot.bounding_box():
                plot.screenshot(path=str(figures / f"{path.stem}-cell{cell}-{k + 1}.png"))
    page.set_viewport_size(VIEWPORT)
    wait_for_layout(page, scroller)


# --------------------------------------------------------------------------- is every figure readable?

# Run in the page on the element that holds the figures: for every drawn plotly figure, the
# boxes of its SVG text elements as the browser laid them out (hover labels left out, they
# appear only under the pointer). A figure is readable when no two texts overlap, no text
# leaves the figure (a legend or caption cut off at its edge), no legend entry is clipped by
# the legend's own scroll box, and no text is scaled below MIN_TEXT_PX (plotly shrinks a bar's
# label to fit its bar: "34.3125" at 6 px reads as nothing on a projector).
MIN_TEXT_PX = 10
OVERLAP_PX = 1  # px that two texts' ink boxes may share

FIGURE_TEXT_JS = r"""
(root) => {
  const figures = [];
  const plots = [...root.querySelectorAll('.js-plotly-plot')].filter(p => p.querySelector('.main-svg'));
  const cells = [...root.querySelectorAll('.jp-Cell')];
  const shown = e => {
    for (let n = e; n && n !== document; n = n.parentNode) {
      if (n.nodeType !== 1) continue;
      const style = getComputedStyle(n);
      if (style.display === 'none' || style.visibility === 'hidden' || parseFloat(style.opacity) === 0) return false;
    }
    return true;
  };
  for (const plot of plots) {
    const frame = plot.querySelector('.svg-container').getBoundingClientRect();
    if (frame.width === 0 || frame.height === 0) continue;  // not laid out (a hidden tab, a collapsed output)
    const title = (plot.layout && plot.layout.title && (plot.layout.title.text || plot.layout.title)) || '';
    const texts = [];
    for (const t of plot.querySelectorAll('svg.main-svg text')) {
      if (t.closest('.hoverlayer') || !t.textContent.trim() || !shown(t)) continue;
      const b = t.getBoundingClientRect();
      if (b.width === 0 || b.height === 0) continue;
      const m = t.getScreenCTM();
      const scale = m ? Math.sqrt(Math.abs(m.a * m.d - m.b * m.c)) : 1;
      const px = parseFloat(getComputedStyle(t).fontSize) * scale;
      const legend = t.closest('g.legend');
      const bg = legend && legend.querySelector('rect.bg');
      const where = legend ? 'legend' : (t.closest('g.annotation') ? 'annotation' :
        (t.closest('g.xtick, g.ytick, g.x2tick, g.y2tick') || /tick/.test(t.parentNode.getAttribute('class') || '')
         ? 'tick' : (t.closest('.textpoint') || t.classList.contains('bartext') ? 'data label' : 'title')));
      // The box of a line is about 1.2 em high, with room above the capitals and below the
      // baseline that glyphs do not use: trimmed, so only ink can overlap ink.
      texts.push({text: t.textContent.trim().slice(0, 60), where, px: Math.round(px * 10) / 10,
                  box: [b.left, b.top, b.right, b.bottom],
                  ink: [b.left, b.top + 0.2 * px, b.right, b.bottom - 0.1 * px],
                  clip: bg ? (r => [r.left, r.top, r.right, r.bottom])(bg.getBoundingClientRect()) : null});
    }
    figures.push({title: String(title).replace(/<[^>]+>/g, '').slice(0, 80),
                  cell: cells.indexOf(plot.closest('.jp-Cell')),
                  frame: [frame.left, frame.top, frame.right, frame.bottom], texts});
  }
  return figures;
}
"""


def figure_text_report(page: Any, root_selector: str) -> list[dict[str, Any]]:
    """Every drawn plotly figure under ``root_selector``: its title, frame and text boxes (``FIGURE_TEXT_JS``)."""
    return page.locator(root_selector).first.evaluate(FIGURE_TEXT_JS)


def _inside(box: Sequence[float], frame: Sequence[float], slack: float = 1.0) -> bool:
    return (box[0] >= frame[0] - slack and box[1] >= frame[1] - slack
            and box[2] <= frame[2] + slack and box[3] <= frame[3] + slack)


def _overlap(a: Sequence[float], b: Sequence[float]) -> float:
    """How far two boxes overlap: the smaller of the overlaps along x and along y (negative: apart)."""
    return min(min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1]))


def figure_text_problems(figures: Sequence[dict[str, Any]]) -> list[str]:
    """In words, every text that overlaps another, leaves its figure, is clipped in its legend or is too small."""
    found = []
    for k, figure in enumerate(figures):
        where = f"figure {k + 1}" + (f" (cell {figure['cell']})" if figure.get("cell", -1) >= 0 else "")
        name = f"{where} {figure['title']!r}" if figure["title"] else where
        texts = figure["texts"]
        for t in texts:
            if t["clip"] is not None and not _inside(t["box"], t["clip"]):
                found.append(f"{name}: legend entry {t['text']!r} is clipped by the legend's box")
            elif not _inside(t["box"], figure["frame"]):
                found.append(f"{name}: {t['where']} {t['text']!r} runs out of the figure "
                             f"({_box(t['box'])} in a frame {_box(figure['frame'])})")
            if t["px"] < MIN_TEXT_PX:
                found.append(f"{name}: {t['where']} {t['text']!r} is drawn at {t['px']} px "
                             f"(at least {MIN_TEXT_PX} px to read when projected)")
        for i, a in enumerate(texts):
            for b in texts[i + 1:]:
                if _overlap(a["ink"], b["ink"]) > OVERLAP_PX:
                    found.append(f"{name}: {a['where']} {a['text']!r} overlaps {b['where']} {b['text']!r}")
    return found


def _box(box: Sequence[float]) -> str:
    return f"x={box[0]:.0f}..{box[2]:.0f}, y={box[1]:.0f}..{box[3]:.0f}"
