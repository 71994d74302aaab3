"""Notebook 08's pictures and panel: a hybrid model's prefix hit kind by kind, and its pool measured over time."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from kvlab.engine.hybrid import PoolUsage
from kvlab.sim.hybrid_hits import GROUP_NAMES, HitWalkthrough, hit_walkthrough
from kvlab.units import KiB
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
        text = "; ".join(f"round {r}: {kind} offered {c}, accepts {a}" for r, kind, c, a in walk.rounds)
        return f"The coordinator's agreement: {text}."
    return (f"B hits {walk.hit_tokens} tokens in both groups (green): full attention is trimmed to it, the window "
            "keeps its last blocks and the null block (black) stands for the rest.")


def figure_hit_steps(walk: HitWalkthrough, step: int) -> go.Figure:
    """Both groups' blocks of A's prompt as rows of cells, coloured for stepper step ``step``."""
    fig = go.Figure()
    rows = _cells(walk, step)
    for key, colour in COLOURS.items():
        xs, ys = [], []
        for g, cells in enumerate(rows):
            for i, cell in enumerate(cells):
                if cell == key:
                    xs.append(i)
                    ys.append(GROUP_NAMES[g])
        fig.add_bar(x=[1] * len(xs), base=[x - 0.5 for x in xs], y=ys, orientation="h", name=key,
                    marker_color=colour, marker_line=dict(color="white", width=1),
                    hovertext=[f"block {x}" for x in xs])
    fig.update_layout(title=f"step {step}: {walk.steps[step]}", barmode="overlay", height=230,
                      margin=dict(t=50, b=40, l=10), legend=dict(orientation="h", y=-0.45),
                      xaxis=dict(title="logical block", dtick=1, zeroline=False),
                      yaxis=dict(categoryorder="array", categoryarray=list(GROUP_NAMES)))
    return fig


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
