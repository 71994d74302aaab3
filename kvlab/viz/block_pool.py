"""Notebook 03's pictures: the physical block pool, each block table, the free queue, and a step-through panel.

``figure_pool`` draws one ``PoolSnapshot`` (from ``kvlab.sim.block_scenarios``): one cell per
physical block, coloured by state (free, cached-but-free with its hash prefix, in use by one
sequence in that sequence's colour, shared with its ref count, null); below it each live
sequence's block table with an arrow from every entry to its physical block; at the bottom the
free queue from head (allocated next) to tail. ``BlockPoolPanel`` steps through a scenario with
next / back / reset; every redraw is a replay from a fresh pool (``step_at``).
"""

from __future__ import annotations

import html
import math
import textwrap
from typing import Any

import plotly.graph_objects as go

from kvlab.core.kv_cache_utils import short_hash
from kvlab.sim.block_scenarios import (
    SCENARIOS,
    BlockView,
    PoolSnapshot,
    Scenario,
    Step,
    get_scenario,
    record,
    step_at,
)
from kvlab.viz.widgets import error_area, figure_widget, guarded, replace_figure

#: Sequence colours (Okabe-Ito, told apart by colour-blind readers too).
SEQUENCE_COLOURS = ("#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#D55E00", "#0072B2")
STATE_COLOURS = {"free": "#F3F4F6", "cached": "#FFF7CC", "shared": "#334155", "held": "#94A3B8", "null": "#FFFFFF"}
MAX_COLUMNS = 16
MIN_COLUMNS = 12  # the width a small pool still gets, so the legend and captions fit
PITCH = 1.25  # distance between cell centres; a cell is 1 x 1
ROW = 1.4  # distance between rows
GAP = 1.7  # from the last row of one section to the first of the next
LABEL = 3.4  # width of the label column on the left
PX_PER_UNIT = 52  # a cell is 52 px: readable projected, and 16 columns fit 1280 px
MAX_WIDTH_PX = 820  # fits a notebook output area at 1280x720 with the file browser open


def assign_colours(steps: list[Step]) -> dict[str, str]:
    """A colour per sequence over a whole scenario: each new one takes the first colour no live one uses."""
    colours: dict[str, str] = {}
    for step in steps:
        for name in step.snapshot.tables:
            if name not in colours:
                taken = {colours[n] for n in step.snapshot.tables if n in colours}
                free = [c for c in SEQUENCE_COLOURS if c not in taken] or list(SEQUENCE_COLOURS)
                colours[name] = free[0]
    return colours


def _cell_style(view: BlockView, colours: dict[str, str]) -> tuple[str, str, str, str]:
    """Fill, border and text colour and the second text line of a physical block's cell."""
    if view.state == "null":
        return STATE_COLOURS["null"], "#6B7280", "#6B7280", "null"
    if view.state == "cached":
        return STATE_COLOURS["cached"], "#D97706", "#78350F", "#" + short_hash(view.block_hash)[:4]
    if view.state == "free":
        return STATE_COLOURS["free"], "#9CA3AF", "#6B7280", "free"
    if view.ref_cnt == 1 and len(view.holders) == 1:
        return colours[view.holders[0]], "#374151", "#111827", "ref 1"
    fill = STATE_COLOURS["shared"] if view.holders else STATE_COLOURS["held"]
    return fill, "#111827", "#FFFFFF", f"ref {view.ref_cnt}"


def _count(tokens: int) -> str:
    return f"{tokens} token" if tokens == 1 else f"{tokens} tokens"


def _hover(view: BlockView, block_size: int) -> str:
    parts = [f"block {view.block_id}: {view.state}", f"ref_cnt {view.ref_cnt}"]
    if view.holders:
        parts.append("in the tables of " + ", ".join(view.holders))
    if view.state in ("in use", "cached"):
        parts.append(f"{view.num_tokens} of {block_size} slots written")
    if view.block_hash is not None:
        parts.append("hash " + short_hash(view.block_hash))
    return "<br>".join(parts)


class _Canvas:
    """Rectangles, texts, arrows and hover points in data units (a cell is 1 x 1), turned into one figure."""

    def __init__(self) -> None:
        self.shapes: list[dict[str, Any]] = []
        self.notes: list[dict[str, Any]] = []
        self.hover: dict[str, tuple[list[float], list[float], list[str]]] = {
            part: ([], [], []) for part in ("pool", "tables", "queue")}

    def cell(self, x: float, y: float, fill: str, line: str, dash: str = "solid", width: float = 1.5) -> None:
        self.shapes.append(dict(type="rect", x0=x - 0.5, x1=x + 0.5, y0=y - 0.5, y1=y + 0.5, fillcolor=fill,
                                line=dict(color=line, width=width, dash=dash), layer="below"))

    def bar(self, x: float, y: float, share: float, colour: str) -> None:
        self.shapes.append(dict(type="rect", x0=x - 0.42, x1=x - 0.42 + 0.84 * share, y0=y - 0.42, y1=y - 0.31,
                                fillcolor=colour, line=dict(width=0)))

    def text(self, x: float, y: float, s: str, size: int = 16, colour: str = "#111827", **kw: Any) -> None:
        self.notes.append(dict(x=x, y=y, text=s, showarrow=False, font=dict(size=size, color=colour), **kw))

    def label(self, y: float, s: str, size: int = 15) -> None:
        self.text(-LABEL, y, s, size=size, xanchor="left")

    def arrow(self, tail: tuple[float, float], head: tuple[float, float], colour: str) -> None:
        self.notes.append(dict(x=head[0], y=head[1], ax=tail[0], ay=tail[1], xref="x", yref="y", axref="x",
                               ayref="y", showarrow=True, arrowhead=2, arrowsize=1, arrowwidth=1.8,
                               arrowcolor=colour, opacity=0.85, text=""))

    def point(self, part: str, x: float, y: float, tip: str) -> None:
        for values, v in zip(self.hover[part], (x, y, tip), strict=True):
            values.append(v)


def figure_pool(
    snap: PoolSnapshot, title: str = "", caption: str = "", table_rows: int | None = None,
    colours: dict[str, str] | None = None,
) -> go.Figure:
    """The pool, the block tables and the free queue of one snapshot, sized to read when projected.

    ``table_rows`` reserves room for that many tables (so a step-through keeps one height);
    ``colours`` fixes each sequence's colour (default: in the order they appear here).
    """
    names = list(snap.tables)
    colours = {**{n: SEQUENCE_COLOURS[i % len(SEQUENCE_COLOURS)] for i, n in enumerate(names)}, **(colours or {})}
    cols = min(max(len(snap.blocks), 8), MAX_COLUMNS)
    canvas = _Canvas()

    def grid(i: int, top: float) -> tuple[float, float]:
        return (i % cols) * PITCH, top - (i // cols) * ROW

    # --- the physical pool: one cell per block
    canvas.label(0.0, "<b>physical blocks</b><br><span style='font-size:12px'>KV tensors, by block id</span>")
    where: dict[int, tuple[float, float]] = {}
    for view in snap.blocks:
        x, y = where[view.block_id] = grid(view.block_id, 0.0)
        fill, line, ink, second = _cell_style(view, colours)
        canvas.cell(x, y, fill, line, dash="dot" if view.is_null else "solid",
                    width=2.5 if view.state == "cached" else 1.5)
        if view.state in ("in use", "cached") and snap.block_size:
            canvas.bar(x, y, min(view.num_tokens / snap.block_size, 1.0), "#F9FAFB" if ink == "#FFFFFF" else "#111827")
        canvas.text(x, y + 0.16, f"<b>{view.block_id}</b>", 17, ink)
        canvas.text(x, y - 0.13, second, 12, ink)
        canvas.point("pool", x, y, _hover(view, snap.block_size))
    top = -(math.ceil(len(snap.blocks) / cols) - 1) * ROW - GAP - 0.5

    # --- the block tables: logical block i in column i, an arrow to its physical block
    canvas.label(top + 0.95, "<b>block tables</b> <span style='font-size:12px'>logical → physical</span>")
    for row, name in enumerate(names):
        y = top - row * ROW
        table = snap.tables[name]
        canvas.label(y, f"<b><span style='color:{colours[name]}'>■</span> {name}</b> · {_count(snap.num_tokens[name])}",
                     size=14)
        spread = (row - (len(names) - 1) / 2) * min(0.16, 0.7 / max(len(names), 1))  # arrows into one block fan out
        for logical, block_id in enumerate(table[:cols]):
            x = logical * PITCH
            canvas.cell(x, y, colours[name], "#374151")
            canvas.text(x, y, f"<b>{block_id}</b>", 16)
            px, py = where[block_id]
            canvas.arrow((x + spread, y + 0.5), (px + spread, py - 0.5), colours[name])
            first = logical * snap.block_size
            last = min(first + snap.block_size, snap.num_tokens[name]) - 1
            canvas.point("tables", x, y, f"{name}: logical block {logical} → physical block {block_id}"
                                         f"<br>tokens {first}–{last}")
        if len(table) > cols:
            canvas.text((cols - 1) * PITCH + 0.6, y, f"… +{len(table) - cols}", 13, xanchor="left")
    if not names:
        canvas.text(0, top, "no live sequence", 14, "#6B7280", xanchor="left")
    top -= (max(table_rows or 0, len(names), 1) - 1) * ROW + GAP

    # --- the free queue, head (allocated next) to tail
    canvas.label(top, f"<b>free queue</b><br><span style='font-size:12px'>{len(snap.free_queue)} free, "
                      "head → tail</span>")
    for pos, block_id in enumerate(snap.free_queue):
        view = snap.blocks[block_id]
        x, y = grid(pos, top)
        fill, line, ink, _ = _cell_style(view, colours)
        canvas.cell(x, y, fill, line, width=2.5 if view.state == "cached" else 1.5)
        canvas.text(x, y, f"<b>{block_id}</b>" + ("*" if view.block_hash is not None else ""), 16, ink)
        canvas.point("queue", x, y, f"queue position {pos}: " + _hover(view, snap.block_size))
    if len(snap.free_queue) == 1:
        canvas.text(0, top - 0.72, "head = tail", 12, "#374151")
    elif snap.free_queue:
        canvas.text(0, top - 0.72, "head: next", 12, "#374151")
        canvas.text(*grid(len(snap.free_queue) - 1, top - 0.72), "tail", 12, "#374151")
    else:
        canvas.text(0, top, "empty: the next allocation is refused", 14, "#6B7280", xanchor="left")
    bottom = top - (max(1, math.ceil(len(snap.free_queue) / cols)) - 1) * ROW - 1.0

    canvas.text(-LABEL, 1.05, "<span style='color:#D1D5DB'>■</span> free   <span style='color:#D97706'>□</span> "
                "cached, free (#hash; * in the queue)   <span style='color:#334155'>■</span> shared, ref_cnt > 1   "
                "▬ slots written   a sequence and the blocks only it holds share a colour", 13, "#374151",
                xanchor="left")
    right = (max(cols, MIN_COLUMNS) - 1) * PITCH + 0.6
    return _figure(canvas, title, caption, [-LABEL - 0.1, right], [bottom, 1.45])


def _figure(canvas: _Canvas, title: str, caption: str, x_range: list[float], y_range: list[float]) -> go.Figure:
    fig = go.Figure()
    for part, (xs, ys, tips) in canvas.hover.items():
        fig.add_scatter(x=xs, y=ys, mode="markers", name=part, hovertext=tips, hoverinfo="text",
                        marker=dict(size=30, opacity=0, symbol="square"), showlegend=False)
    scale = min(PX_PER_UNIT, (MAX_WIDTH_PX - 20) / (x_range[1] - x_range[0]))
    width = int((x_range[1] - x_range[0]) * scale) + 20
    lines = [f"<b>{html.escape(title)}</b>"] if title else []
    lines += [html.escape(line) for line in textwrap.wrap(caption, width // 8)]
    top = 14 + 21 * len(lines)
    if lines:  # the heading sits in the top margin, above the drawing
        canvas.notes.append(dict(x=0, y=1, xref="paper", yref="paper", xanchor="left", yanchor="bottom",
                                 align="left", showarrow=False, text="<br>".join(lines), font=dict(size=15)))
    fig.update_layout(
        shapes=canvas.shapes, annotations=canvas.notes,
        width=width, height=int((y_range[1] - y_range[0]) * scale) + top + 10,
        margin=dict(l=10, r=10, t=top, b=10), plot_bgcolor="white", paper_bgcolor="white",
        xaxis=dict(range=x_range, visible=False, fixedrange=True),
        yaxis=dict(range=y_range, visible=False, fixedrange=True, scaleanchor="x", scaleratio=1),
        hoverlabel=dict(font_size=14),
    )
    return fig


def figure_step(scenario: Scenario, step: Step, caption: bool = True) -> go.Figure:
    """The picture of one step, titled with the scenario and the step (and its text, when ``caption``)."""
    steps = record(scenario)
    rows = max(len(s.snapshot.tables) for s in steps)
    return figure_pool(step.snapshot, f"{scenario.name} · step {step.index} of {step.total}",
                       step.text if caption else "", table_rows=rows, colours=assign_colours(steps))


def panel_state(scenario: str, seed: int, index: int) -> dict[str, Any]:
    """What the panel shows at step ``index`` of a named scenario: replayed from a fresh pool, then drawn."""
    chosen = get_scenario(scenario, seed)
    step = step_at(chosen, index)
    return {"scenario": chosen, "step": step, "index": step.index, "total": step.total, "text": step.text,
            "snapshot": step.snapshot, "figure": figure_step(chosen, step, caption=False)}


class BlockPoolPanel:
    """Step through a scenario: next / back / reset, a scenario picker and a seed for the random workload.

    ``next()``, ``back()`` and ``reset()`` are what the buttons call; ``state`` holds the current
    step's text and snapshot, so a notebook can drive the panel and assert on it.
    """

    def __init__(self, scenario: str = "walk 1: fork and copy-on-write", seed: int = 0) -> None:
        import ipywidgets as w

        self.scenario = w.Dropdown(options=list(SCENARIOS), value=scenario, description="scenario",
                                   layout=w.Layout(width="420px"))
        self.seed = w.BoundedIntText(value=seed, min=0, max=10**6, description="seed", layout=w.Layout(width="160px"))
        self.back_button = w.Button(description="◀ back", layout=w.Layout(width="100px"))
        self.next_button = w.Button(description="next ▶", button_style="primary", layout=w.Layout(width="100px"))
        self.reset_button = w.Button(description="reset", layout=w.Layout(width="80px"))
        self.text = w.HTML(layout=w.Layout(width="auto", min_height="64px"))
        self.errors = error_area()
        self.state: dict[str, Any] = panel_state(scenario, seed, 0)
        self.figure = figure_widget(self.state["figure"])
        self.scenario.observe(guarded(lambda _: self.reset(), self.errors), names="value")
        self.seed.observe(guarded(lambda _: self.reset(), self.errors), names="value")
        self.next_button.on_click(guarded(lambda _: self.next(), self.errors))
        self.back_button.on_click(guarded(lambda _: self.back(), self.errors))
        self.reset_button.on_click(guarded(lambda _: self.reset(), self.errors))
        self._show()
        self.view = w.VBox([
            w.HBox([self.scenario, self.seed, self.back_button, self.next_button, self.reset_button]),
            self.errors, self.text, self.figure,
        ])

    def next(self) -> None:
        """One operation forward (stays on the last step)."""
        self.go_to(min(self.state["index"] + 1, self.state["total"]))

    def back(self) -> None:
        """One operation back: a replay of the operations before it, from a fresh pool."""
        self.go_to(max(self.state["index"] - 1, 0))

    def reset(self) -> None:
        """Back to the fresh pool (and to the scenario and seed now chosen)."""
        self.go_to(0)

    def go_to(self, index: int) -> None:
        """Show the state after ``index`` operations."""
        self.state = panel_state(self.scenario.value, self.seed.value, index)
        self._show()
        replace_figure(self.figure, self.state["figure"])

    def _show(self) -> None:
        index, total = self.state["index"], self.state["total"]
        self.back_button.disabled = index == 0
        self.next_button.disabled = index == total
        self.seed.disabled = self.scenario.value != "random workload"
        self.text.value = (
            f"<div style='font-size:15px;line-height:1.45'><b>Step {index} of {total}</b> · "
            f"{html.escape(self.state['text'])}</div>"
        )

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.view)
