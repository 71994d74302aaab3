"""Execute the notebooks and write a static, self-contained HTML copy of the workbook (``make html``).

    python scripts/export_html.py [notebooks/NN_name.ipynb ...] [--out build/html] [--timeout 900]

Each page is one file that needs no network: plotly.js is inlined once per page, before
anything else can claim it as an AMD module, and every figure is a plotly div drawn by it;
formulas are converted from TeX to MathML, which browsers draw themselves (no MathJax).
Interactive panels cannot run without a kernel, so each is replaced by a static snapshot
built from the widget state that execution recorded: its controls (disabled, at their
values), its text and its figures, as a learner sees them after Run All. ``index.html``
lists the pages in order with their titles, and ``glossary.html`` is ``GLOSSARY.md`` with
links pointing at the pages.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import html
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PLOTLY = "application/vnd.plotly.v1+json"
PLOTLYJS_ID = "kvlab-plotlyjs"

STYLE = """
<style>
.kvlab-banner { font-family: var(--jp-ui-font-family, sans-serif); font-size: 13px; background: #f1f5f9;
  border-bottom: 1px solid #cbd5e1; padding: 6px 16px; }
.kvlab-banner a { margin-right: 1em; }
.kvlab-static-panel { border: 1px dashed #94a3b8; border-radius: 6px; padding: 8px; margin: 4px 0; max-width: 100%; }
.kvlab-static-note { font-size: 12px; color: #64748b; margin-bottom: 6px; }
.kvlab-static-vbox { display: flex; flex-direction: column; gap: 4px; }
.kvlab-static-hbox { display: flex; flex-direction: row; flex-wrap: wrap; gap: 4px 16px; align-items: baseline; }
.kvlab-static-control { display: flex; gap: 8px; align-items: baseline; }
.kvlab-static-control > label { min-width: 6em; text-align: right; color: #334155; }
.kvlab-static-control input[type=range] { flex: 1; }
.kvlab-static-control textarea { width: 100%; min-height: 4em; }
details.kvlab-folded > summary { font: 600 18px var(--jp-ui-font-family, sans-serif); cursor: pointer;
  padding: 8px 16px; }
</style>
"""


# JupyterLab's look, less the three scripts a static page must not fetch: require.js (nothing
# here needs it, and plotly.js must not become an AMD module), the widget manager, and MathJax
# from its CDN (the formulas are MathML already, see typeset_math).
TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
"""
# A code span or fence (left alone), display math $$...$$, or inline math $...$.
MATH = re.compile(r"(`+).*?\1|\$\$(.+?)\$\$|\$([^$\n]+?)\$", re.S)


@dataclasses.dataclass
class Page:
    """One exported notebook: where it went, its title and opening line, and what it shows."""

    notebook: Path
    html_path: Path
    title: str
    summary: str
    figures: int
    panels: int
    seconds: float
    executed: Any = dataclasses.field(default=None, repr=False)  # the notebook as executed, before snapshots


# --------------------------------------------------------------------------- execution


def execute(path: Path, timeout: int) -> Any:
    """Run a notebook top to bottom in a fresh kernel, in its own folder, recording widget state."""
    import nbformat
    from nbclient import NotebookClient

    os.environ["PLOTLY_RENDERER"] = "plotly_mimetype"  # figures as JSON only: drawn here by one inlined plotly.js
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


# --------------------------------------------------------------------------- static figures and panels


class Snapshot:
    """Turns widget views and plotly outputs of an executed notebook into static HTML."""

    def __init__(self, nb: Any):
        self.state: dict[str, Any] = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
        self.figures = 0
        self.panels = 0

    def figure(self, data: list, layout: dict) -> str:
        """A plotly div with its drawing script; plotly.js itself is inlined once per page elsewhere."""
        import plotly.io as pio

        self.figures += 1
        return pio.to_html({"data": data, "layout": layout}, include_plotlyjs=False, full_html=False,
                           validate=False, div_id=f"kvlab-figure-{self.figures}", config={"responsive": True})

    def output(self, out: dict) -> str:
        """One output (of a cell or of an Output widget) as HTML, richest representation first."""
        data = out.get("data", {})
        if out.get("output_type") == "stream":
            return f"<pre>{html.escape(out.get('text', ''))}</pre>"
        if out.get("output_type") == "error":
            return f"<pre>{html.escape(out.get('ename', ''))}: {html.escape(out.get('evalue', ''))}</pre>"
        if WIDGET_VIEW in data:
            return self.widget(data[WIDGET_VIEW]["model_id"])
        if PLOTLY in data:
            return self.figure(data[PLOTLY].get("data", []), data[PLOTLY].get("layout", {}))
        if "text/html" in data:
            return _text(data["text/html"])
        if "text/markdown" in data:
            from nbconvert.filters.markdown_mistune import markdown2html_mistune

            return markdown2html_mistune(_text(data["text/markdown"]))
        if "image/png" in data:
            return f'<img src="data:image/png;base64,{_text(data["image/png"]).strip()}">'
        return f"<pre>{html.escape(_text(data.get('text/plain', '')))}</pre>"

    def panel(self, model_id: str) -> str:
        """A displayed widget tree as a framed snapshot, with a line saying how to get the live one."""
        self.panels += 1
        return (
            '<div class="kvlab-static-panel"><div class="kvlab-static-note">Interactive panel, shown as it '
            "stands after the whole notebook ran. Open the notebook in JupyterLab (<code>make lab</code>) "
            f"to move its controls.</div>{self.widget(model_id)}</div>"
        )

    def widget(self, model_id: str) -> str:
        """One widget model, and its children, as static HTML."""
        model = self.state.get(model_id)
        if model is None:
            return '<div class="kvlab-static-note">(a widget whose state was not recorded)</div>'
        name, s = model["model_name"], model["state"]
        label = html.escape(s.get("description", ""))
        children = [c.removeprefix("IPY_MODEL_") for c in s.get("children", [])]
        if name in {"VBoxModel", "BoxModel", "GridBoxModel"}:
            return f'<div class="kvlab-static-vbox">{"".join(self.widget(c) for c in children)}</div>'
        if name == "HBoxModel":
            return f'<div class="kvlab-static-hbox">{"".join(self.widget(c) for c in children)}</div>'
        if name in {"HTMLModel", "HTMLMathModel"}:
            return f"<div>{s.get('value', '')}</div>"
        if name == "LabelModel":
            return f"<div>{html.escape(str(s.get('value', '')))}</div>"
        if name == "OutputModel":
            return "".join(self.output(out) for out in s.get("outputs", []))
        if name == "AnyModel" and "_widget_data" in s:  # plotly's FigureWidget
            return self.figure(s["_widget_data"], s.get("_widget_layout", {}))
        if name in {"DropdownModel", "SelectModel", "RadioButtonsModel", "ToggleButtonsModel"}:
            options = s.get("_options_labels", [])
            index = s.get("index")
            chosen = options[index] if isinstance(index, int) and 0 <= index < len(options) else ""
            return _control(label, f"<select disabled><option>{html.escape(str(chosen))}</option></select>")
        if name.endswith("SliderModel") and "value" in s and not isinstance(s["value"], list):
            value = s["value"]
            return _control(label, f'<input type="range" disabled min="{s.get("min")}" max="{s.get("max")}" '
                                   f'step="{s.get("step")}" value="{value}"><span>{value}</span>')
        if name in {"TextareaModel", "TextModel"}:
            text = html.escape(s.get("value", "")) or html.escape(s.get("placeholder", ""))
            return _control(label, f"<textarea disabled>{text}</textarea>")
        if name == "ButtonModel":
            return f"<div><button disabled>{label}</button></div>"
        if name == "CheckboxModel":
            return _control(label, f'<input type="checkbox" disabled{" checked" if s.get("value") else ""}>')
        if "value" in s:
            return _control(label, f"<span>{html.escape(str(s['value']))}</span>")
        return f'<div class="kvlab-static-note">({html.escape(name.removesuffix("Model"))})</div>'

    def apply(self, nb: Any) -> None:
        """Replace every widget view and plotly output in ``nb`` by its static HTML; drop the widget state."""
        for cell in nb.cells:
            quiz = re.search(r'self_test\("(\d\d)"\)', _text(cell.source)) if cell.cell_type == "code" else None
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if WIDGET_VIEW in data:
                    answers = self_test_answers(quiz.group(1)) if quiz else ""
                    out["data"] = {"text/html": self.panel(data[WIDGET_VIEW]["model_id"]) + answers}
                elif PLOTLY in data:
                    out["data"] = {"text/html": self.output(out)}
        nb.metadata.pop("widgets", None)  # else nbconvert would load a widget manager from a CDN


def self_test_answers(notebook: str) -> str:
    """The self-test's answers, computed by kvlab as the buttons would reveal them, folded away for readers."""
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    from kvlab.exercises import self_test

    items = "".join(f"<li>{markdown2html_mistune(a)}</li>" for a in self_test(notebook).answers().values())
    return f'<details class="kvlab-answers"><summary>Answers (computed by kvlab)</summary><ol>{items}</ol></details>'


def tex_to_mathml(markdown: str) -> str:
    """``markdown`` with its ``$...$`` and ``$$...$$`` formulas as MathML; code spans and fences untouched.

    Browsers draw MathML themselves, so a page needs neither MathJax nor the network. Inside
    ``\\text{...}`` an escaped ``\\_`` is a plain underscore (MathML text needs no escaping).
    """
    from latex2mathml.converter import convert

    def typeset(match: re.Match) -> str:
        if match.group(1):
            return match.group(0)
        display = match.group(2) is not None
        tex = (match.group(2) if display else match.group(3)).strip()
        tex = re.sub(r"\\text(?:tt)?\{[^}]*\}", lambda t: t.group(0).replace("\\_", "_"), tex)
        return convert(tex, display="block" if display else "inline")

    return MATH.sub(typeset, markdown)


def typeset_math(nb: Any) -> int:
    """Convert the formulas of every markdown cell to MathML, in place; returns how many cells changed."""
    changed = 0
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "$" in cell.source:
            typeset = tex_to_mathml(cell.source)
            changed += typeset != cell.source
            cell.source = typeset
    return changed


def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _control(label: str, control: str) -> str:
    return f'<div class="kvlab-static-control"><label>{label}</label>{control}</div>'


# --------------------------------------------------------------------------- pages


def page_name(notebook: Path) -> str:
    """``01_bytes_per_token.ipynb`` -> ``01_bytes_per_token.html``."""
    return notebook.with_suffix(".html").name


def rewrite_links(text: str, notebooks: set[str]) -> str:
    """Point links at the static copy: notebooks at their pages, the glossary at ``glossary.html``."""

    def fix(match: re.Match) -> str:
        target = match.group(2)
        path, _, anchor = target.partition("#")
        name = path.rsplit("/", 1)[-1]
        if name == "GLOSSARY.md":
            new = "glossary.html"
        elif name.endswith(".ipynb") and name in notebooks:
            new = name.removesuffix(".ipynb") + ".html"
        else:
            return match.group(0)
        return f'{match.group(1)}"{new}{"#" + anchor if anchor else ""}"'

    return re.sub(r'(href=)"((?![a-z]+:|#|/)[^"]*)"', fix, text)


def title_and_summary(nb: Any) -> tuple[str, str]:
    """The notebook's first heading, and the paragraph after it (its "what you will be able to do")."""
    first = next((_text(c.source) for c in nb.cells if c.cell_type == "markdown"), "")
    lines = first.strip().split("\n\n")
    title = lines[0].lstrip("#").strip() if lines and lines[0].startswith("#") else ""
    return title, (lines[1].strip() if len(lines) > 1 else "")


def with_plotlyjs(page: str) -> str:
    """Inline plotly.js once, first thing in <head>: before require.js could claim it, and with no CDN."""
    from plotly.offline import get_plotlyjs

    script = f'<script type="text/javascript" id="{PLOTLYJS_ID}">{get_plotlyjs()}</script>'
    return page.replace("<head>", f"<head>\n{script}\n{STYLE}", 1)


def banner(title: str, machine: str) -> str:
    return (
        f'<nav class="kvlab-banner"><a href="index.html">kvlab workbook</a><a href="glossary.html">glossary</a>'
        f"<span>A static copy of <b>{html.escape(title)}</b>, executed by <code>make html</code> on "
        f"{html.escape(machine)}.</span></nav>"
    )


FOLDED = "jp-MarkdownHeadingCollapsed"  # JupyterLab opens a heading cell with this metadata folded


def _heading_level(source: str) -> int | None:
    found = re.match(r"(#{1,6}) ", source.lstrip())
    return len(found.group(1)) if found else None


def fold_sections(body: str, nb: Any) -> str:
    """Each section JupyterLab opens folded (its heading cell's ``jp-MarkdownHeadingCollapsed``) wrapped in a
    ``<details>`` the reader opens, from its heading to the next heading of the same or a higher level."""
    cells = nb.cells
    for k, cell in enumerate(cells):
        level = _heading_level(_text(cell.source)) if cell.cell_type == "markdown" else None
        if not level or not cell.metadata.get(FOLDED):
            continue
        end = next((c.id for c in cells[k + 1:] if c.cell_type == "markdown"
                    and (_heading_level(_text(c.source)) or 99) <= level), None)
        start = body.rfind("<div", 0, body.index(f'id="cell-id={cell.id}"'))
        stop = body.rfind("<div", 0, body.index(f'id="cell-id={end}"')) if end else body.index("</main>")
        title = html.escape(_text(cell.source).lstrip().split("\n", 1)[0].lstrip("#").strip())
        body = (f'{body[:start]}<details class="kvlab-folded"><summary>{title} (folded: click to open)</summary>'
                f"{body[start:stop]}</details>{body[stop:]}")
    return body


def notebook_page(nb: Any, title: str, machine: str, notebooks: set[str]) -> str:
    """The executed, snapshotted notebook as one HTML page (JupyterLab's look, code shown)."""
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab", template_file="kvlab_static.html.j2",
                            extra_loaders=[DictLoader({"kvlab_static.html.j2": TEMPLATE})])
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
    body = fold_sections(body, nb)
    body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + banner(title, machine), body, count=1)
    return with_plotlyjs(rewrite_links(body, notebooks))


def simple_page(title: str, content: str) -> str:
    """A small standalone page (index, glossary) in the same style."""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>{STYLE}'
        "<style>body{font-family:system-ui,sans-serif;max-width:60em;margin:2em auto;padding:0 1em;line-height:1.5}"
        "table{border-collapse:collapse}td,th{border:1px solid #cbd5e1;padding:4px 8px;vertical-align:top}"
        f"</style></head><body>{content}</body></html>\n"
    )


def index_page(pages: list[Page], machine: str) -> str:
    items = "".join(
        f'<li><a href="{p.html_path.name}">{html.escape(p.title)}</a><br><small>{_inline_md(p.summary)}</small></li>'
        for p in pages
    )
    return simple_page("kvlab: the workbook, static copy", (
        "<h1>kvlab: how LLM serving engines manage the KV cache</h1>"
        "<p>A static copy of the workbook for reading without Python: every notebook was executed by "
        f"<code>make html</code> on {html.escape(machine)}, and every number in it was computed and checked "
        "there. Figures are drawn in the page; interactive panels are snapshots of their state after the "
        "notebook ran. To use them, run the workbook: <code>make lab</code>.</p>"
        f'<ol>{items}</ol><p><a href="glossary.html">Glossary</a>: each term in English, in the Chinese of the '
        "source articles, and where the workbook teaches it.</p>"
    ))


def glossary_page(notebooks: set[str]) -> str:
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    source = (ROOT / "GLOSSARY.md").read_text(encoding="utf-8")
    return simple_page("kvlab glossary", rewrite_links(markdown2html_mistune(source), notebooks))


def _inline_md(text: str) -> str:
    escaped = html.escape(text)
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", re.sub(r"`(.+?)`", r"<code>\1</code>", escaped))


# --------------------------------------------------------------------------- the whole copy


def export(notebooks: list[Path], out: Path, timeout: int = 900, log: Any = print) -> list[Page]:
    """Execute ``notebooks`` and write their pages, ``index.html`` and ``glossary.html`` to ``out``."""
    sys.path.insert(0, str(ROOT))
    from kvlab.machine import machine_line

    machine = machine_line()
    out.mkdir(parents=True, exist_ok=True)
    known = {p.name for p in NOTEBOOKS.glob("*.ipynb")} | {p.name for p in notebooks}
    pages = []
    for path in notebooks:
        start = time.monotonic()
        nb = execute(path, timeout)
        executed = copy.deepcopy(nb)
        title, summary = title_and_summary(nb)
        snapshot = Snapshot(nb)
        snapshot.apply(nb)
        typeset_math(nb)
        target = out / page_name(path)
        target.write_text(notebook_page(nb, title or path.stem, machine, known), encoding="utf-8")
        page = Page(path, target, title or path.stem, summary, snapshot.figures, snapshot.panels,
                    time.monotonic() - start, executed)
        log(f"{target}: {page.figures} figures, {page.panels} panels, {page.seconds:.1f} s")
        pages.append(page)
    (out / "index.html").write_text(index_page(pages, machine), encoding="utf-8")
    (out / "glossary.html").write_text(glossary_page(known), encoding="utf-8")
    log(f"{out / 'index.html'}: {len(pages)} notebooks; open it in a browser (no network needed for figures)")
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/NN_*.ipynb")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "html")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = parser.parse_args(argv)
    notebooks = [p.resolve() for p in args.notebooks] or sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    export(notebooks, args.out, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
