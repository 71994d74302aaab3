"""Figures that show wherever a notebook is opened: plotly's own output, plus an HTML copy that draws itself.

JupyterLab and VS Code draw plotly's mimetype (``application/vnd.plotly.v1+json``); a page made by plain
``jupyter nbconvert --to html``, or any viewer without plotly's renderer, ignores it and shows nothing. The
``"kvlab"`` renderer, plotly's default once ``kvlab.viz`` is imported, puts both in every figure's output: the
mimetype, which those front ends prefer, and ``text/html``, a div and a script that draws the figure with
plotly.js. plotly.js itself (from the installed plotly package, no network) rides along once per kernel, with
the first figure; later figures wait for it. require.js, which nbconvert's pages load, is kept from claiming it
as an anonymous module. ``PLOTLY_RENDERER`` set in the environment still wins (``make html`` sets it).
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import plotly.io as pio
from plotly.io._base_renderers import PlotlyRenderer

PLOTLY_MIME = "application/vnd.plotly.v1+json"
RENDERER = "kvlab"
WAIT_MS, TRIES = 50, 1200  # a figure waits up to a minute for plotly.js to arrive on the page


def plotlyjs_html() -> str:
    """plotly.js, inlined, defining ``window.Plotly`` even on a page where require.js is loaded."""
    from plotly.offline import get_plotlyjs

    return ('<script type="text/javascript">window.__kvlabDefine = window.define; window.define = undefined;</script>'
            f'<script type="text/javascript">{get_plotlyjs()}</script>'
            '<script type="text/javascript">window.define = window.__kvlabDefine;</script>')


def figure_html(figure: dict[str, Any]) -> str:
    """A div and a script that draws ``figure`` (plotly's JSON form) there once ``window.Plotly`` exists."""
    layout = figure.get("layout", {})
    width = f"{layout['width']}px" if isinstance(layout.get("width"), (int, float)) else "100%"
    height = f"{layout['height']}px" if isinstance(layout.get("height"), (int, float)) else "450px"
    div = f"kvlab-figure-{uuid.uuid4().hex[:12]}"
    data = json.dumps(figure).replace("</", "<\\/")  # no text in a figure can close the script
    return (f'<div id="{div}" class="plotly-graph-div kvlab-static-figure" style="width:{width};height:{height};'
            f'max-width:100%"></div><script type="text/javascript">(function () {{ var figure = {data}, tries = 0;'
            f' function draw() {{ var P = window.Plotly; if (P && P.newPlot) {{ P.newPlot("{div}", figure.data,'
            f' figure.layout, figure.config || {{}}); }} else if (tries++ < {TRIES}) {{ setTimeout(draw, {WAIT_MS});'
            " } } draw(); })();</script>")


class StaticFallbackRenderer(PlotlyRenderer):
    """Plotly's mimetype and, beside it, ``text/html`` that draws the same figure (plotly.js with the first)."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.plotlyjs_sent = False

    def to_mimebundle(self, fig_dict: dict[str, Any]) -> dict[str, Any]:
        bundle = super().to_mimebundle(fig_dict)
        first = "" if self.plotlyjs_sent else plotlyjs_html()
        self.plotlyjs_sent = True
        bundle["text/html"] = first + figure_html(bundle[PLOTLY_MIME])
        return bundle


JUPYTER_DEFAULTS = ("", "plotly_mimetype")  # what plotly picks in a Jupyter kernel, or outside one


def use_static_fallback(environ: dict[str, str] | None = None) -> str:
    """Make ``"kvlab"`` plotly's default renderer where plotly chose its Jupyter default (not where
    ``PLOTLY_RENDERER`` or plotly's own detection chose another: Colab, Databricks...); returns the default."""
    if RENDERER not in pio.renderers:
        pio.renderers[RENDERER] = StaticFallbackRenderer()
    chosen = (os.environ if environ is None else environ).get("PLOTLY_RENDERER")
    if not chosen and pio.renderers.default in JUPYTER_DEFAULTS:
        pio.renderers.default = RENDERER
    return pio.renderers.default
