"""The static copy (``make html``): pages with their titles, figures and formulas embedded, drawn with no network.

``make html`` exports every notebook; here notebook 01 alone is exported (about 15 s),
which exercises every kind of output the copy handles: plotly figures, a widget panel
with a FigureWidget, the self-test, and the link to the glossary.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("export_html", ROOT / "scripts" / "export_html.py")
export_html = sys.modules.setdefault("export_html", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(export_html)

FIRST = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))[0]
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("html")
    (page,) = export_html.export([FIRST], out, log=lambda *_: None)
    return out, page, page.html_path.read_text(encoding="utf-8")


def _figures_created(nb) -> int:
    """Plotly outputs, plus the FigureWidgets whose state execution recorded."""
    outputs = sum("application/vnd.plotly.v1+json" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    return outputs + sum("_widget_data" in m["state"] for m in state.values())


def _widget_views(nb) -> int:
    return sum("application/vnd.jupyter.widget-view+json" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", []))


def test_index_links_each_page_in_order_with_its_title(exported):
    out, page, _ = exported
    index = (out / "index.html").read_text(encoding="utf-8")
    assert page.title.startswith("01") and page.title in index
    assert f'href="{page.html_path.name}"' in index and page.html_path.exists()
    assert 'href="glossary.html"' in index and (out / "glossary.html").exists()


def test_page_embeds_every_figure_and_one_inlined_plotly_js(exported):
    _, page, text = exported
    expected = _figures_created(page.executed)
    assert expected >= 3  # two figures and the panel's FigureWidget in notebook 01
    assert page.figures == expected == text.count('class="plotly-graph-div"') == text.count("Plotly.newPlot(")
    assert text.count(f'id="{export_html.PLOTLYJS_ID}"') == 1
    assert re.findall(r'<script[^>]+src="([^"]+)"', text) == []      # nothing from a CDN, MathJax included


def test_formulas_are_mathml_that_the_browser_draws_itself(exported):
    _, _, text = exported
    assert len(re.findall(r'<math [^>]*display="block"', text)) == 1        # notebook 01's one formula
    body = text.split("</head>", 1)[1]                                    # the head inlines plotly.js
    assert re.search(r"<mtext>bytes.per.token</mtext><mo>=</mo><mi>f</mi>", body) and "$$" not in body


def test_tex_becomes_mathml_outside_code_only():
    convert = export_html.tex_to_mathml
    assert convert("no math, `$PATH` and\n```\n$$x$$\n```") == "no math, `$PATH` and\n```\n$$x$$\n```"
    inline = convert("the sum $a+b$ here")
    assert inline.startswith("the sum <math") and 'display="inline"' in inline and inline.endswith("</math> here")
    block = convert("$$\\text{block\\_size} \\times 2$$")
    assert 'display="block"' in block and "<mtext>block_size</mtext>" in block and "\\" not in block


def test_panels_become_static_snapshots_with_the_self_test_answers(exported):
    _, page, text = exported
    assert page.panels == _widget_views(page.executed) == text.count('class="kvlab-static-panel"') >= 2
    assert "application/vnd.jupyter.widget-view+json" not in text
    assert "deepseek-v3: KV cache against context (TP=8)" in text  # the panel as it stands after the last cell
    assert text.count('class="kvlab-answers"') == 1 and "640 KiB" in text


def test_a_section_jupyterlab_opens_folded_is_a_details_the_reader_opens():
    import nbformat

    nb = nbformat.v4.new_notebook()
    for cid, source, folded in (("a", "## Main", False), ("b", "## Checking the articles", True), ("c", "x = 1", False),
                                ("d", "### a part of it", False), ("e", "## Where to go from here", False)):
        cell = nbformat.v4.new_code_cell(source) if cid == "c" else nbformat.v4.new_markdown_cell(source)
        cell.id = cid
        if folded:
            cell.metadata["jp-MarkdownHeadingCollapsed"] = True
        nb.cells.append(cell)
    page = export_html.notebook_page(nb, "t", "here", set())
    inside = page.split('<details class="kvlab-folded">', 1)[1].split("</details>", 1)[0]
    assert "<summary>Checking the articles (folded: click to open)</summary>" in inside
    assert all(f'id="cell-id={c}"' in inside for c in "bcd") and 'id="cell-id=e"' not in inside
    assert page.count("<details") == 1


def test_links_point_at_the_static_copy(exported):
    out, _, text = exported
    assert "GLOSSARY.md" not in text and 'href="glossary.html"' in text
    glossary = (out / "glossary.html").read_text(encoding="utf-8")
    assert f'href="{FIRST.stem}.html' in glossary and ".ipynb" not in glossary.replace("&quot;", "")


@pytest.mark.ui
def test_figures_draw_in_chromium_with_the_network_cut_off(exported, request):
    browser = pytest.importorskip("_browser")
    if browser.chromium_path() is None:
        pytest.skip("no Chromium: the static copy was checked as text only")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    from _rendered import shared_browser

    _, page, _ = exported
    tab = shared_browser(request.config).new_page()  # one Playwright per process (tests/_rendered.py)
    try:
        fetched: list[str] = []
        tab.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                  else (fetched.append(route.request.url), route.abort()))
        tab.goto(page.html_path.as_uri())
        tab.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot g.trace').length > 0"
                              f" && document.querySelectorAll('.js-plotly-plot').length >= {page.figures}")
        drawn = tab.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')]"
                             ".map(p => p.querySelectorAll('g.trace').length)")
        heights = tab.evaluate("() => [...document.querySelectorAll('math')]"
                               ".map(m => m.getBoundingClientRect().height)")
    finally:
        tab.close()
    assert len(drawn) == page.figures and all(drawn), drawn
    assert fetched == []
    assert heights and all(h > 10 for h in heights), heights    # laid out as formulas, not left as TeX
