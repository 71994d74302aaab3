"""Figures that show wherever a notebook is opened (kvlab.viz.static): plotly's mimetype for JupyterLab and
VS Code, and HTML that draws itself for a page made by plain ``jupyter nbconvert --to html``."""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio
import pytest

import kvlab.viz  # noqa: F401  (makes "kvlab" plotly's default renderer)
from kvlab.viz.static import PLOTLY_MIME, RENDERER, StaticFallbackRenderer, figure_html, use_static_fallback


def _figure(title: str) -> go.Figure:
    return go.Figure(go.Bar(x=["a", "b"], y=[1, 2]), layout=dict(title=title, width=500, height=300))


def test_every_figure_carries_plotly_s_mimetype_and_html_and_plotly_js_comes_once():
    renderer = StaticFallbackRenderer()
    first, second = (renderer.to_mimebundle(_figure(t).to_dict()) for t in ("first", "second </script> here"))
    assert set(first) == set(second) == {PLOTLY_MIME, "text/html"}
    assert first[PLOTLY_MIME]["layout"]["title"]["text"] == "first"
    assert first["text/html"].count("window.__kvlabDefine") == 2 and len(first["text/html"]) > 1_000_000
    assert "__kvlabDefine" not in second["text/html"] and len(second["text/html"]) < 20_000
    assert second["text/html"].count("</script>") == 1          # a text in the figure cannot close the script
    assert 'style="width:500px;height:300px' in second["text/html"] and "P.newPlot(" in second["text/html"]


def test_kvlab_is_the_default_only_where_plotly_chose_its_jupyter_default():
    saved = pio.renderers.default
    try:
        pio.renderers.default = "plotly_mimetype"
        assert use_static_fallback({}) == RENDERER
        pio.renderers.default = "plotly_mimetype"
        assert use_static_fallback({"PLOTLY_RENDERER": "plotly_mimetype"}) == "plotly_mimetype"   # make html's choice
        pio.renderers.default = "colab"
        assert use_static_fallback({}) == "colab"                  # plotly knew better: left alone
    finally:
        pio.renderers.default = saved


def test_a_figure_without_a_size_fills_the_width():
    assert 'style="width:100%;height:450px' in figure_html({"data": [], "layout": {}})


@pytest.mark.ui
def test_a_plain_nbconvert_page_draws_every_figure_offline_and_beside_require_js(tmp_path, request):
    browser_module = pytest.importorskip("_browser")
    if browser_module.chromium_path() is None:
        pytest.skip("no Chromium: the HTML was checked as text only")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    import nbformat
    from _rendered import shared_browser
    from nbconvert import HTMLExporter

    renderer = StaticFallbackRenderer()
    nb = nbformat.v4.new_notebook()
    for title in ("one", "two", "three"):
        cell = nbformat.v4.new_code_cell(f"figure('{title}')")
        cell.outputs = [nbformat.v4.new_output("display_data", data=renderer.to_mimebundle(_figure(title).to_dict()))]
        nb.cells.append(cell)
    page, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)   # what `jupyter nbconvert --to html` writes
    path = tmp_path / "page.html"
    tab = shared_browser(request.config).new_page()
    try:
        for amd in (False, True):  # offline (require.js cannot load), then with an AMD loader on the page
            stub = "<script>window.define = function () {}; window.define.amd = {};</script>" if amd else ""
            path.write_text(page.replace("<head>", "<head>" + stub, 1), encoding="utf-8")
            tab.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                      else route.abort())
            tab.goto(path.as_uri())
            tab.wait_for_function("() => document.querySelectorAll('.js-plotly-plot g.trace').length >= 3",
                                  timeout=60_000)
            drawn = tab.evaluate("() => [...document.querySelectorAll('.kvlab-static-figure')]"
                                 ".map(p => p.querySelectorAll('g.trace').length)")
            assert drawn == [1, 1, 1], (amd, drawn)
    finally:
        tab.close()
