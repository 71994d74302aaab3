"""Notebook 08's pictures and panel: a hybrid model's prefix hit kind by kind, and its pool measured over time."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from kvlab.engine.hybrid import PoolUsage
from kvlab.errors import KvlabValueError
from kvlab.sim.hybrid_hits import GROUP_NAMES, HitWalkthrough, hit_walkthrough
from kvlab.units import KiB
from kvlab.viz.canvas import INK, MUTED, Canvas, text_width, wrap
from kvlab.viz.widgets import Panel, error_area, figure_widget, replace_figure

COLOURS = {"evicted": "#e5e7eb", "cached": "#f59e0b", "hit": "#16a34a", "null": "#111827", "scanned": "#93c5fd"}


def _cells(walk: HitWalkthrough, step: int) -> list[list[str]]:
    """The colour key of every block of each group (sliding first) at stepper step ``step``."""
    rows = []
    for g in range(2):
        cells = ["cached" if c else "evicted" for c in walk.cached[g][:walk.num_prompt_blocks]]
        name = GROUP_NAMES[g]
        if step == 1 and name == "full attention" or step == 2 and name == "sliding window":
            reach = walk.alone[g] // walk.block_size
            first = 0 if name == "full attention" else max(0, reach - walk.needed)
            for i in range(first, reach):
                cells[i] = "scanned"
        if step >= 4:
            for i, block_id in enumerate(walk.hit_block_ids[g]):
                cells[i] = "null" if block_id == 0 else "hit"
        rows.append(cells)
    return rows


def step_caption(walk: HitWalkthrough, step: int) -> str:
    """What stepper step ``step`` shows, in a sentence, with kvlab's numbers."""
    sliding, full = walk.alone
    if step == 0:
        return (f"A's prompt is cached in both groups (orange); grey blocks were evicted. B may hit at most "
                f"{walk.max_hit_tokens} tokens: its last token is always computed.")
    if step == 1:
        return (f"Full attention alone needs every block from the start: it scans left to right and stops at the "
                f"first miss, {full} tokens (blue).")
    if step == 2:
        return (f"A window of {walk.sliding_window} alone needs only the {walk.needed} block(s) before the hit's end "
                f"(the next token sees {walk.sliding_window - 1} earlier tokens): it scans right to left, "
                f"{sliding} tokens (blue).")
    if step == 3:
        text = "; ".join(f"round {i}: {kind} is offered {c} tokens and accepts {a}"
                         for i, (_, kind, c, a) in enumerate(walk.rounds, start=1))
        return f"The coordinator's agreement, one row per round: {text}."
    return (f"B hits {walk.hit_tokens} tokens in both groups (green): full attention is trimmed to it, the window "
            "keeps its last blocks and the null block (black) stands for the rest.")


ROUND_COLOURS = {"offered": "#dbeafe", "accepted": "#2563eb"}


def _round_label(number: int, kind: str) -> str:
    return f"round {number}: {kind}"


def figure_hit_steps(walk: HitWalkthrough, step: int) -> go.Figure:
    """Both groups' blocks of A's prompt as rows of cells, coloured for stepper step ``step``, on an axis of tokens
    (the unit the captions count in); from step 3 on, one row per round of the coordinator's agreement, drawn in
    order: the length each kind is offered (light) and the length it accepts (dark)."""
    fig = go.Figure()
    rows = _cells(walk, step)
    bs = walk.block_size
    for key, colour in COLOURS.items():
        xs, ys = [], []
        for g, cells in enumerate(rows):
            for i, cell in enumerate(cells):
                if cell == key:
                    xs.append(i)
                    ys.append(GROUP_NAMES[g])
        fig.add_bar(x=[bs] * len(xs), base=[x * bs for x in xs], y=ys, orientation="h", name=key,
                    marker_color=colour, marker_line=dict(color="white", width=1),
                    hovertext=[f"block {x}: tokens {x * bs}–{x * bs + bs - 1}" for x in xs], hoverinfo="text")
    categories = list(GROUP_NAMES)
    if step >= 3:  # the agreement, round by round: each kind is offered a length and accepts one
        labels = [_round_label(i + 1, kind) for i, (_, kind, _, _) in enumerate(walk.rounds)]
        for name, pick in (("offered", 2), ("accepted", 3)):
            fig.add_bar(x=[r[pick] for r in walk.rounds], base=[0] * len(walk.rounds), y=labels, orientation="h",
                        name=name, marker_color=ROUND_COLOURS[name], width=0.45 if name == "accepted" else 0.8,
                        marker_line=dict(color=ROUND_COLOURS["accepted"], width=1),
                        hovertext=[f"{r[1]} is {name} {r[pick]} tokens" for r in walk.rounds], hoverinfo="text")
        fig.add_scatter(x=[r[3] for r in walk.rounds], y=labels, mode="text", showlegend=False, hoverinfo="skip",
                        text=[f"  {r[2]} → {r[3]} tokens" for r in walk.rounds], textposition="middle right",
                        textfont=dict(size=13))
        categories += labels
    fig.update_layout(title=f"step {step}: {walk.steps[step]}", barmode="overlay", template="plotly_white",
                      height=230 + 34 * (len(categories) - 2), margin=dict(t=50, b=40, l=10),
                      legend=dict(orientation="h", y=-0.3),
                      xaxis=dict(title=f"tokens of A's prompt (blocks of {bs})", tick0=0, dtick=bs, zeroline=False,
                                 range=[0, walk.num_prompt_blocks * bs + 3 * bs]),
                      yaxis=dict(categoryorder="array", categoryarray=categories[::-1]))
    return fig


GROUP_COLOURS = ("#56B4E9", "#E69F00")  # the sliding-window group, the full-attention group (as notebook 03's tables)
_W, _PAD, _LABEL = 820, 10, 96
_CELL_W, _CELL_PITCH, _CELL_H = 36, 40, 28
_HEAD_H, _ROW_H, _GAP = 18, 22, 44


def _pool_x(block_id: int, pitch: float) -> tuple[float, float]:
    x = _LABEL + block_id * pitch
    return x, x + pitch - 4


def figure_hybrid_pool(tables: tuple[list[int], list[int]], group_layers: tuple[list[int], list[int]],
                       num_blocks: int, title: str = "", caption: str = "") -> go.Figure:
    """One pool, the two groups' block tables of one request, and which layer writes each block's page.

    The window's table is drawn above the pool, full attention's below, each entry with an arrow to its
    block; the window's null entries (block 0) meet on one line with one arrow to the null block. Every
    block is a page in each of the K/V tensor pairs, and pair j holds layer j of every group (vLLM's
    ``KVCacheTensor`` "shared by" one layer per group), so a block owned by the window's group is written
    by the window's layers, one of full attention's by full attention's.
    """
    if len(tables) != 2 or len(group_layers) != 2 or len(group_layers[0]) != len(group_layers[1]):
        raise KvlabValueError("tables and group_layers must each hold the sliding window's group, then full "
                              "attention's, with as many layers in each group")
    owner = {b: g for g, table in enumerate(tables) for b in table if b != 0}
    if max([*owner, 0]) >= num_blocks:
        raise KvlabValueError(f"num_blocks must cover every block id in the tables, got {num_blocks}")
    pairs = len(group_layers[0])
    pitch = min(48.0, (_W - _PAD - _LABEL) / num_blocks)
    canvas = Canvas(_W)
    y = _PAD
    if title:
        y = canvas.lines(_PAD, y, wrap(title, _W - 2 * _PAD, 15), 15, INK, bold_first=True)
    if caption:
        y = canvas.lines(_PAD, y + 2, wrap(caption, _W - 2 * _PAD, 13), 13, "#1F2937")
    x = _PAD  # the key
    for fill, line, label in ((GROUP_COLOURS[0], INK, "the window's group"), (GROUP_COLOURS[1], INK,
                              "full attention's group"), ("#FFFFFF", "#6B7280", "null block (no KV)"),
                              ("#F3F4F6", "#9CA3AF", "free")):
        canvas.rect(x, y + 8, x + 13, y + 21, fill, line, 1.5, "dot" if "null" in label else "solid")
        canvas.text(x + 18, y + 15, label, 12, "#374151", anchor="left")
        x += 18 + text_width(label, 12) + 22
    y += 32
    names = [f"{GROUP_NAMES[g]} (layers {', '.join(map(str, group_layers[g]))})" for g in range(2)]

    def shelf(g: int, top: float, to_pool: float) -> None:
        """Group ``g``'s table at ``top``; its arrows end at the pool's edge ``to_pool``."""
        canvas.text(_PAD, top + _CELL_H / 2, f"<b>{'window' if g == 0 else 'full'}</b><br><b>table</b>", 13, INK,
                    anchor="left")
        edge = top + _CELL_H if to_pool > top else top
        step = 1 if to_pool > top else -1
        nulls = []
        own = [(i, b) for i, b in enumerate(tables[g]) if b != 0]
        start = _LABEL  # the first block of its own stands right above (below) that block, if the width allows
        if own:
            start = _pool_x(own[0][1], pitch)[0] - own[0][0] * _CELL_PITCH
            start = max(_LABEL, min(start, _W - _PAD - len(tables[g]) * _CELL_PITCH))
        for i, block_id in enumerate(tables[g]):
            cx = start + i * _CELL_PITCH
            null = block_id == 0
            canvas.rect(cx, top, cx + _CELL_W, top + _CELL_H, "#FFFFFF" if null else GROUP_COLOURS[g],
                        "#6B7280" if null else "#374151", 1.5, "dot" if null else "solid")
            canvas.text(cx + _CELL_W / 2, top + _CELL_H / 2, str(block_id), 14, MUTED if null else INK, bold=True)
            canvas.point("tables", cx + _CELL_W / 2, top + _CELL_H / 2,
                         f"{GROUP_NAMES[g]}: logical block {i} → {'the null block' if null else f'block {block_id}'}")
            if null:
                nulls.append(cx + _CELL_W / 2)
            else:
                bx0, bx1 = _pool_x(block_id, pitch)
                canvas.arrow((cx + _CELL_W / 2, edge), ((bx0 + bx1) / 2, to_pool), GROUP_COLOURS[g])
        if nulls:  # every null entry to the one null block: a bus and one arrow
            bus = edge + step * 12
            bx0, bx1 = _pool_x(0, pitch)
            mid = (bx0 + bx1) / 2
            for nx in nulls:
                canvas.line((nx, edge), (nx, bus), "#6B7280", 2)
                canvas.dot((nx, bus), 3, INK)
            canvas.line((min(*nulls, mid), bus), (max(*nulls, mid), bus), INK, 2)
            canvas.arrow((mid, bus), (mid, to_pool), INK)
        label_y = top - 18 if step > 0 else top + _CELL_H + 4
        canvas.text(start, label_y, html_escape(names[g]), 13, INK, anchor="left", valign="top")

    upper = y + 26
    pool_top = upper + _CELL_H + _GAP
    pool_bottom = pool_top + _HEAD_H + pairs * _ROW_H
    shelf(0, upper, pool_top)
    canvas.text(_PAD, pool_top + _HEAD_H / 2, "<b>block</b>", 13, INK, anchor="left")
    for b in range(num_blocks):
        x0, x1 = _pool_x(b, pitch)
        g = owner.get(b)
        fill = "#FFFFFF" if b == 0 else ("#F3F4F6" if g is None else GROUP_COLOURS[g])
        canvas.rect(x0, pool_top, x1, pool_bottom, fill, "#6B7280" if b == 0 else "#374151", 1.5,
                    "dot" if b == 0 else "solid")
        canvas.text((x0 + x1) / 2, pool_top + _HEAD_H / 2, str(b), 13, INK, bold=True)
        for j in range(pairs):
            word = "null" if b == 0 and j == 0 else ("" if b == 0 or g is None else f"L{group_layers[g][j]}")
            canvas.text((x0 + x1) / 2, pool_top + _HEAD_H + (j + 0.5) * _ROW_H, word, 11, MUTED if b == 0 else INK)
        writers = "no layer (free)" if g is None else ", ".join(
            f"pair {j}: layer {group_layers[g][j]}" for j in range(pairs))
        canvas.point("pool", (x0 + x1) / 2, (pool_top + pool_bottom) / 2,
                     "block 0: the null block, never written" if b == 0 else f"block {b}: {writers}")
    for j in range(pairs):  # each row of pages is one K/V tensor pair
        row = pool_top + _HEAD_H + (j + 0.5) * _ROW_H
        canvas.text(_PAD, row, f"K/V pair {j}", 12, "#374151", anchor="left")
    lower = pool_bottom + _GAP
    shelf(1, lower, pool_bottom)
    y = lower + _CELL_H + 24
    return canvas.figure(y + _PAD, parts=("pool", "tables"))


def html_escape(text: str) -> str:
    import html

    return html.escape(text)


def figure_pool_usage(hybrid: PoolUsage, full: PoolUsage) -> go.Figure:
    """KiB in use in the pool after each step, with KV cache groups and with every layer as full attention."""
    fig = go.Figure()
    for usage, name, colour in ((full, "every layer full attention", "#b42318"),
                                (hybrid, "sliding-window group apart (vLLM's default)", "#16a34a")):
        fig.add_scatter(x=list(range(1, len(usage.bytes_in_use) + 1)), y=[b / KiB for b in usage.bytes_in_use],
                        mode="lines+markers", name=name, line_color=colour)
    fig.update_layout(title="The pool in use, measured after every step", height=380, margin=dict(t=50, b=40),
                      xaxis_title="engine step", yaxis_title="KiB of KV blocks in use",
                      legend=dict(orientation="h", y=-0.25))
    return fig


class HybridHitPanel(Panel):
    """A window size, blocks to evict in each group, and a stepper through ``hit_walkthrough``."""

    def __init__(self, sliding_window: int = 8, evict_sliding: int = 8, evict_full: int = -1,
                 num_prompt_tokens: int = 40, block_size: int = 4) -> None:
        import ipywidgets as w

        self.num_prompt_tokens, self.block_size = num_prompt_tokens, block_size
        last = num_prompt_tokens // block_size - 1
        self.window = w.IntSlider(value=sliding_window, min=2, max=num_prompt_tokens, description="window W",
                                  continuous_update=False, layout=w.Layout(width="auto"))
        options = [("none", -1)] + [(str(i), i) for i in range(last + 1)]
        self.evict_sliding = w.Dropdown(options=options, value=evict_sliding, description="evict (window)")
        self.evict_full = w.Dropdown(options=options, value=evict_full, description="evict (full)")
        self.step = w.IntSlider(value=0, min=0, max=4, description="step", layout=w.Layout(width="auto"))
        self.caption = w.HTML()
        self.errors = error_area()
        self.state = self.compute()
        self.figure = figure_widget(self.state["figure"])
        self.view = w.VBox([self.window, w.HBox([self.evict_sliding, self.evict_full]), self.step, self.errors,
                            self.caption, self.figure])
        self._connect([self.window, self.evict_sliding, self.evict_full, self.step], {}, None)

    def compute(self) -> dict[str, Any]:
        walk = hit_walkthrough(self.num_prompt_tokens, self.window.value, self.block_size,
                               evict_sliding=() if self.evict_sliding.value < 0 else (self.evict_sliding.value,),
                               evict_full=() if self.evict_full.value < 0 else (self.evict_full.value,))
        step = self.step.value
        return {"walkthrough": walk, "step": step, "caption": step_caption(walk, step),
                "figure": figure_hit_steps(walk, step), "hit_tokens": walk.hit_tokens, "alone": walk.alone}

    def _render(self) -> None:
        self.caption.value = f"<p>{self.state['caption']}</p>"
        replace_figure(self.figure, self.state["figure"])
