"""A pixel canvas for kvlab's schematic pictures (block pools, hash chains, K and V per layer).

The diagrams are boxes, texts and arrows, placed by hand. Placing them in *pixels* lets a
picture check its own layout: ``text_width`` estimates how wide a label is drawn, so a layout
can wrap a legend, widen a column or cut a word before two texts collide. The figure's data
coordinates are its pixels (x to the right, y down, no margins), so a shape at ``y=40`` is
drawn 40 px below the top. The browser tests measure the result (``tests/_browser.py``).

The font is fixed (Arial and its metric twins) so that the estimate holds on every machine;
plotly's default falls back to Verdana or DejaVu Sans, a good deal wider.
"""

from __future__ import annotations

import html
import math
import re
import textwrap
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

FONT = "Arial, 'Liberation Sans', Helvetica, sans-serif"
INK = "#111827"
MUTED = "#4B5563"
MIN_FONT_PX = 11  # the smallest text a picture draws: readable when projected at 1280x720
_TAG = re.compile(r"<[^>]+>")


def text_width(text: str, size: float, bold: bool = False) -> float:
    """About how many pixels ``text`` (HTML tags ignored, one line) takes at ``size`` px in ``FONT``.

    A slight overestimate for Arial (average 0.5 em a character, digits 0.56): layouts that
    trust it leave a little room rather than collide.
    """
    plain = html.unescape(_TAG.sub("", text))
    return len(plain) * size * (0.6 if bold else 0.55)


def wrap(text: str, width_px: float, size: float) -> list[str]:
    """``text`` broken into lines that each fit ``width_px`` at ``size`` px."""
    per_line = max(int(width_px / (size * 0.55)), 8)
    return textwrap.wrap(text, per_line) or [""]


def tint(colour: str, share: float = 0.7) -> str:
    """``colour`` (``#RRGGBB``) mixed with white: ``share`` of white."""
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#{:02X}{:02X}{:02X}".format(*(round(c + (255 - c) * share) for c in (r, g, b)))


class Canvas:
    """Rectangles, texts, arrows and hover points in pixels, turned into one plotly figure."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.shapes: list[dict[str, Any]] = []
        self.notes: list[dict[str, Any]] = []
        self.hover: dict[str, tuple[list[float], list[float], list[str]]] = {}

    def rect(self, x0: float, y0: float, x1: float, y1: float, fill: str, line: str = "#374151",
             width: float = 1.5, dash: str = "solid") -> None:
        """A box from ``(x0, y0)`` (top left) to ``(x1, y1)``."""
        self.shapes.append(dict(type="rect", x0=x0, x1=x1, y0=y0, y1=y1, fillcolor=fill, layer="below",
                                line=dict(color=line, width=width, dash=dash)))

    def text(self, x: float, y: float, s: str, size: float = 13, colour: str = INK, anchor: str = "center",
             valign: str = "middle", bold: bool = False) -> None:
        """``s`` at ``(x, y)``; ``anchor`` is left, center or right, ``valign`` top, middle or bottom."""
        size = max(size, MIN_FONT_PX)
        self.notes.append(dict(x=x, y=y, text=f"<b>{s}</b>" if bold else s, showarrow=False, xanchor=anchor,
                               yanchor=valign, align=anchor if anchor != "center" else "center",
                               font=dict(size=size, color=colour, family=FONT)))

    def lines(self, x: float, y: float, lines: list[str], size: float = 13, colour: str = INK,
              bold_first: bool = False) -> float:
        """Left-aligned lines from ``(x, y)`` down; returns the y below the last one."""
        for k, line in enumerate(lines):
            self.text(x, y + k * size * 1.35, html.escape(line), size, colour, anchor="left", valign="top",
                      bold=bold_first and k == 0)
        return y + len(lines) * size * 1.35

    def line(self, start: tuple[float, float], end: tuple[float, float], colour: str, width: float = 1.8) -> None:
        """A straight line without a head."""
        self.shapes.append(dict(type="line", x0=start[0], y0=start[1], x1=end[0], y1=end[1],
                                line=dict(color=colour, width=width)))

    def dot(self, centre: tuple[float, float], radius: float, colour: str) -> None:
        """A filled circle."""
        x, y = centre
        self.shapes.append(dict(type="circle", x0=x - radius, x1=x + radius, y0=y - radius, y1=y + radius,
                                fillcolor=colour, line=dict(color=colour, width=0), layer="above"))

    def arrow(self, tail: tuple[float, float], head: tuple[float, float], colour: str, width: float = 1.8,
              dash: str | None = None) -> None:
        """A straight arrow from ``tail`` to ``head`` (dashed: a line shape with the head drawn apart)."""
        if dash:
            self.shapes.append(dict(type="line", x0=tail[0], y0=tail[1], x1=head[0], y1=head[1],
                                    line=dict(color=colour, width=width, dash=dash)))
            dx, dy = head[0] - tail[0], head[1] - tail[1]
            norm = max((dx * dx + dy * dy) ** 0.5, 1e-9)
            tail = (head[0] - 6 * dx / norm, head[1] - 6 * dy / norm)
        self.notes.append(dict(x=head[0], y=head[1], ax=tail[0], ay=tail[1], xref="x", yref="y", axref="x",
                               ayref="y", showarrow=True, arrowhead=2, arrowsize=1, arrowwidth=width,
                               arrowcolor=colour, text=""))

    def arc(self, start: tuple[float, float], end: tuple[float, float], rise: float, colour: str,
            width: float = 2.2) -> tuple[float, float]:
        """A curved arrow from ``start`` to ``end`` bulging ``rise`` px upwards; returns the curve's apex."""
        mid_x, top = (start[0] + end[0]) / 2, min(start[1], end[1]) - 2 * rise
        self.shapes.append(dict(type="path", path=f"M {start[0]},{start[1]} Q {mid_x},{top} {end[0]},{end[1]}",
                                line=dict(color=colour, width=width)))
        dx, dy = end[0] - mid_x, end[1] - top  # the curve's direction where it ends
        norm = max((dx * dx + dy * dy) ** 0.5, 1e-9)
        self.notes.append(dict(x=end[0], y=end[1], ax=end[0] - 7 * dx / norm, ay=end[1] - 7 * dy / norm,
                               xref="x", yref="y", axref="x", ayref="y", showarrow=True, arrowhead=2,
                               arrowsize=1, arrowwidth=width, arrowcolor=colour, text=""))
        return mid_x, (start[1] + 2 * top + end[1]) / 4

    def point(self, part: str, x: float, y: float, tip: str) -> None:
        """An invisible hover target at ``(x, y)`` in the trace named ``part``."""
        xs, ys, tips = self.hover.setdefault(part, ([], [], []))
        xs.append(x)
        ys.append(y)
        tips.append(tip)

    def figure(self, height: float, parts: tuple[str, ...] = ()) -> go.Figure:
        """The figure, ``self.width`` x ``height`` px; ``parts`` names hover traces to add even if empty."""
        fig = go.Figure()
        for part in dict.fromkeys([*parts, *self.hover]):
            xs, ys, tips = self.hover.get(part, ([], [], []))
            fig.add_scatter(x=xs, y=ys, mode="markers", name=part, hovertext=tips, hoverinfo="text",
                            marker=dict(size=26, opacity=0, symbol="square"), showlegend=False)
        fig.update_layout(
            shapes=self.shapes, annotations=self.notes, width=self.width, height=int(height),
            margin=dict(l=0, r=0, t=0, b=0), plot_bgcolor="white", paper_bgcolor="white",
            xaxis=dict(range=[0, self.width], visible=False, fixedrange=True),
            yaxis=dict(range=[int(height), 0], visible=False, fixedrange=True),
            hoverlabel=dict(font_size=14), font=dict(family=FONT), showlegend=False,
        )
        return fig


def log_axis(values: Sequence[float], title: str = "", **extra: Any) -> dict[str, Any]:
    """A log axis with its ticks at full size: 1, 2 and 5 per decade (1 alone over more than three decades).

    Plotly's own log ticks label the 2s and 5s between decades in a smaller font (9 px), which
    does not read when projected; explicit ticks are drawn like any other.
    """
    positive = [v for v in values if v is not None and v > 0]
    lo, hi = min(positive), max(positive)
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    steps = (1,) if last - first > 3 else (1, 2, 5)
    ticks = [m * 10.0**k for k in range(first, last + 1) for m in steps if lo / 1.5 <= m * 10.0**k <= hi * 1.5]
    text = [f"{v:,.0f}" if v >= 1000 else f"{v:g}" for v in ticks]
    return dict(type="log", tickvals=ticks, ticktext=text, title=title, **extra)
