"""Notebook 05's pictures and panel: which blocks each program reads, the online softmax, layouts, FP8.

Every figure is drawn from numbers the kernels' own code computes: ``kvlab.kernels.grid``'s mirror
of the index arithmetic (checked against the kernel's trace by the tests), the kernel's recorded
softmax state, the layout conversion's offsets, and the FP8 sweep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
import torch

from kvlab.kernels import KernelConfig, check_attention, plan_launch
from kvlab.kernels.grid import LaunchPlan, ProgramReads, program_reads
from kvlab.kernels.layouts import flash_offsets, legacy_key_offsets, legacy_value_offsets
from kvlab.viz.canvas import log_axis
from kvlab.viz.widgets import error_area, figure_widget, guarded, replace_figure

SEQ_COLOURS = ["#2563eb", "#f59e0b", "#10b981", "#db2777", "#7c3aed", "#0891b2", "#b45309", "#4b5563"]


def reads_table(reads: Sequence[ProgramReads], seq_names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One row per working program: its grid coordinates, its rows and the blocks it reads, in order."""
    return [{
        "program (b, h, s)": r.program, "sequence": seq_names[r.seq] if seq_names else r.seq, "query block": r.q_block,
        "query tokens": f"{r.query_tokens[0]}..{r.query_tokens[-1]}",
        "tiles": f"{r.tile_range[0]}..{r.tile_range[1] - 1}" if r.tiles else "none",
        "keys read": r.keys_read(), "blocks in order": r.blocks_in_order(),
    } for r in reads]


def figure_program_reads(reads: Sequence[ProgramReads], kv_head: int = 0, title: str | None = None,
                         seq_names: Sequence[str] | None = None) -> go.Figure:
    """Programs (rows) against loop steps (columns); each cell names the physical blocks of that tile.

    Colours mark the sequence; only the programs of one KV head are drawn (the others read the
    same blocks, at their own head's offset inside each block).
    """
    mine = [r for r in reads if r.program[1] == kv_head]
    steps = max((len(r.tiles) for r in mine), default=0)
    fig = go.Figure()
    names = seq_names or [str(i) for i in range(max((r.seq for r in mine), default=0) + 1)]
    labels = [f"b={r.program[0]} s={r.program[2]} · seq {names[r.seq]} · q {r.query_tokens[0]}..{r.query_tokens[-1]}"
              for r in mine]
    for row, r in enumerate(mine):
        for step, tile in enumerate(r.tiles):
            blocks = []
            for b in tile:
                if b >= 0 and b not in blocks:
                    blocks.append(b)
            fig.add_shape(type="rect", x0=step - 0.45, x1=step + 0.45, y0=row - 0.4, y1=row + 0.4,
                          fillcolor=SEQ_COLOURS[r.seq % len(SEQ_COLOURS)], opacity=0.75, line_width=0)
            fig.add_annotation(x=step, y=row, text=" → ".join(map(str, blocks)) or "-", showarrow=False,
                               font=dict(color="white", size=12))
        if not r.tiles:
            fig.add_annotation(x=0, y=row, text="no tile in this split's range", showarrow=False,
                               font=dict(color="#6b7280", size=11))
    fig.add_scatter(x=[None], y=[None], showlegend=False)
    fig.update_layout(
        title=title or f"What each program reads, KV head {kv_head}: physical block ids per key tile",
        xaxis=dict(title="loop step (one key tile per step)", range=[-0.6, max(steps, 1) - 0.4], dtick=1),
        yaxis=dict(tickvals=list(range(len(mine))), ticktext=labels, range=[len(mine) - 0.5, -0.5]),
        height=110 + 34 * len(mine), margin=dict(l=260, t=60, b=50),
    )
    return fig


def figure_softmax_states(states: torch.Tensor, rows: Sequence[int] = (0, 1, 2)) -> go.Figure:
    """The running maximum m (left) and sum l (right) of a few rows after each key tile, as the kernel kept them."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=["m: largest score so far", "ℓ = Σ exp(score − m)"])
    tiles = list(range(1, states.shape[0] + 1))
    for i, row in enumerate(rows):
        colour = SEQ_COLOURS[i % len(SEQ_COLOURS)]
        for col in (1, 2):
            fig.add_scatter(x=tiles, y=states[:, row, col - 1].tolist(), mode="lines+markers", name=f"row {row}",
                            line=dict(color=colour), showlegend=col == 1, row=1, col=col)
    fig.update_xaxes(title_text="key tiles folded in", dtick=1)
    fig.update_layout(title="Online softmax, row by row: when m rises, ℓ is rescaled by exp(m_old − m_new)",
                      height=360, margin=dict(t=80))
    return fig


def figure_layout_offsets(block_size: int, head_size: int, x: int, num_kv_heads: int) -> go.Figure:
    """Where each (token, dimension) of one head's block lives, in three layouts: colour = address order."""
    from plotly.subplots import make_subplots

    panels = [("flash K and V [bs, H, D]<br>one token's head<br>is contiguous",
               flash_offsets(block_size, num_kv_heads, head_size)),
              (f"old K [H, D/x, bs, x], x = {x}<br>x dims of each token in turn,<br>chunk by chunk",
               legacy_key_offsets(block_size, head_size, x)),
              ("old V [H, D, bs]<br>one dimension's tokens<br>are contiguous",
               legacy_value_offsets(block_size, head_size))]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[0] for p in panels], horizontal_spacing=0.06)
    for col, (_, offsets) in enumerate(panels, start=1):
        order = offsets.flatten().argsort().argsort().reshape(offsets.shape)      # rank of each address
        fig.add_heatmap(z=order.tolist(), colorscale="Viridis", showscale=False, row=1, col=col,
                        hovertemplate="token %{y}, dim %{x}: element #%{z} in memory<extra></extra>")
        fig.update_xaxes(title_text="head dimension d", row=1, col=col)
        fig.update_yaxes(title_text="token in block" if col == 1 else None, autorange="reversed", row=1, col=col)
    fig.update_layout(height=430, margin=dict(t=140), title="Memory order inside one block, one KV head "
                      "(dark = low address, bright = high)")
    return fig


def figure_fp8_error(rows: Sequence[dict[str, float]]) -> go.Figure:
    """Attention error of an FP8 cache against bf16, scale 1.0 vs calibrated, over activation magnitude."""
    x = [r["magnitude"] for r in rows]
    fig = go.Figure()
    fig.add_scatter(x=x, y=[r["error scale 1.0"] for r in rows], mode="lines+markers",
                    name="scale 1.0 (vLLM default)", line=dict(color="#b42318"))
    fig.add_scatter(x=x, y=[r["error calibrated"] for r in rows], mode="lines+markers",
                    name="calibrated: amax/200 (K), amax/100 (V)", line=dict(color="#1b7f3b"))
    fig.update_layout(
        title="FP8 (e4m3) KV cache: attention error against a bf16 cache",
        xaxis=log_axis(x, "activation magnitude (multiplies every K and V value)"),
        yaxis=log_axis([r[k] for r in rows for k in ("error scale 1.0", "error calibrated")],
                       "‖out_fp8 − out_bf16‖ / ‖out_bf16‖"), height=400,
    )
    return fig


def figure_gpu_bench(results: dict[str, Any], title: str) -> go.Figure:
    """A saved GPU benchmark: each decode shape's share of copy bandwidth against the goal line, SDPA's on hover."""
    from kvlab.kernels.bench import GOAL_COPY_FRACTION

    rows = [r for r in results["rows"] if "kernel_us" in r and r.get("kind") == "decode"]
    fig = go.Figure()
    for block_size, color in ((16, "#1f77b4"), (64, "#ff7f0e")):
        mine = [r for r in rows if r["block_size"] == block_size]
        fig.add_bar(x=[f"b{r['batch']} × {r['context'] // 1024}K"
                       + (f", window {r['sliding_window'] // 1024}K" if r.get("sliding_window") else "") for r in mine],
                    y=[r["copy_fraction"] for r in mine], name=f"block size {block_size}", marker_color=color,
                    customdata=[[r.get("speedup_vs_sdpa", float("nan")), r["kernel_us"]] for r in mine],
                    hovertemplate="%{x}: %{y:.0%} of copy bandwidth, %{customdata[1]:.1f} µs, "
                                  "%{customdata[0]:.2f}× SDPA's speed<extra></extra>")
    fig.add_hline(y=GOAL_COPY_FRACTION, line_dash="dash", annotation_text=f"goal {GOAL_COPY_FRACTION:.0%} (b64 × 8K)")
    fig.update_layout(title=title, barmode="group", height=420, yaxis=dict(title="share of copy bandwidth",
                      tickformat=".0%"), xaxis=dict(title="decode: batch × context"))
    return fig


def figure_window_reads(rows: Sequence[dict[str, Any]]) -> go.Figure:
    """Keys one decode program reads against the context length, with and without a sliding window."""
    fig = go.Figure()
    windows = list(dict.fromkeys(r["window"] for r in rows))            # in the rows' order
    for window in windows:
        mine = [r for r in rows if r["window"] == window]
        fig.add_bar(x=[str(r["context"]) for r in mine], y=[r["keys read"] for r in mine],
                    name="full attention" if window == "none" else f"sliding window {window}",
                    marker_color="#9ca3af" if window == "none" else "#2563eb", text=[r["keys read"] for r in mine],
                    textposition="outside")
    fig.update_layout(title="Keys a decode reads: the context, or only the window", barmode="group", height=380,
                      xaxis=dict(title="context length (tokens)"), yaxis=dict(title="keys read (kernel trace)"))
    return fig


def figure_kernel_errors(report: Any, batch: str | None = None, cap: float = 1e3) -> go.Figure:
    """``check_kernel``'s error map for one batch: largest |out − ref| per query token (rows) and head (columns).

    ``batch`` names the batch (default: the first that failed, else the first). Colour is log10 of
    the error; NaN or infinite outputs are drawn at ``cap`` and say so on hover. Lines separate sequences.
    """
    result = next((r for r in report.results if r.name == batch), None) if batch else \
        next((r for r in report.results if not r.passed), report.results[0])
    if result is None:
        raise KeyError(f"no batch named {batch!r} in the report; batches: {[r.name for r in report.results]}")
    fig = go.Figure()
    if result.errors is None:
        fig.add_annotation(text=f"{result.name}: the function raised<br>{result.exception}", showarrow=False,
                           x=0.5, y=0.5, xref="paper", yref="paper")
        return fig.update_layout(height=240, title=f"check_kernel: {result.name}")
    errors = result.errors.clamp(max=cap)                                   # [num_tokens, num_q_heads]
    z = torch.log10(errors.clamp(min=1e-12)).tolist()
    labels = [f"seq {s} · q {t}" for s, t in zip(result.token_seq, result.token_pos, strict=True)]
    text = [["NaN or inf" if e >= cap else f"{e:.2e}" for e in row] for row in result.errors.tolist()]
    fig.add_heatmap(z=z, x=[f"head {h}" for h in range(errors.shape[1])], y=labels, text=text, zmin=-8, zmax=3,
                    colorscale="Inferno", colorbar=dict(title="log10 |error|"),
                    hovertemplate="%{y}, %{x}: |error| %{text}<extra></extra>")
    for i in range(1, len(labels)):
        if result.token_seq[i] != result.token_seq[i - 1]:
            fig.add_hline(y=i - 0.5, line_color="white", line_width=2)
    verdict = "passes" if result.passed else f"fails: relative error {result.relative_error:.3g}"
    fig.update_layout(title=f"check_kernel · {report.function}<br>{result.name} {verdict}",  # two lines: it fits
                      yaxis=dict(autorange="reversed", title="query token"), xaxis=dict(title="query head"),
                      height=min(660, 200 + 14 * len(labels)), margin=dict(l=120, t=90))
    return fig


# --------------------------------------------------------------------------- panel


def reads_state(query_lens: Sequence[int], seq_lens: Sequence[int], block_table: Sequence[Sequence[int]],
                block_size: int, num_kv_heads: int, num_queries_per_kv: int, tile_n: int, block_q: int,
                num_kv_splits: int) -> dict[str, Any]:
    """Everything the read-order panel shows: the launch plan and each program's reads (pure function)."""
    head_size = 16
    num_blocks = max(b for row in block_table for b in row) + 1
    query = torch.empty(sum(query_lens), num_kv_heads * num_queries_per_kv, head_size)   # shapes only
    cache = torch.empty(num_blocks, block_size, num_kv_heads, head_size)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    batch = check_attention(query, cache, cache, torch.tensor(block_table), torch.tensor(seq_lens), torch.tensor(qsl))
    block_m = max(16, 1 << (block_q * num_queries_per_kv - 1).bit_length())
    plan: LaunchPlan = plan_launch(batch, num_kv_splits, KernelConfig(block_q=block_q, block_m=block_m, tile_n=tile_n))
    reads = program_reads(plan, block_table)
    return {"plan": plan, "reads": reads, "table": reads_table(reads),
            "figure": figure_program_reads(reads), "working_programs": len(reads),
            "grid_programs": plan.grid[0] * plan.grid[1] * plan.grid[2]}


class ReadOrderPanel:
    """Tile size, query block and split count as controls over one batch; the picture follows."""

    def __init__(self, query_lens, seq_lens, block_table, block_size, num_kv_heads=1, num_queries_per_kv=4,
                 tile_n=16, block_q=4, num_kv_splits=1) -> None:
        import ipywidgets as w

        self._batch = dict(query_lens=query_lens, seq_lens=seq_lens, block_table=block_table, block_size=block_size,
                           num_kv_heads=num_kv_heads, num_queries_per_kv=num_queries_per_kv)
        self.tile_n = w.Dropdown(options=[16, 32, 64], value=tile_n, description="TILE_N")
        self.block_q = w.Dropdown(options=[1, 2, 4], value=block_q, description="BLOCK_Q")
        self.num_kv_splits = w.IntSlider(value=num_kv_splits, min=1, max=4, description="splits")
        self.errors = error_area()
        self.summary = w.HTML()
        self.state = reads_state(**self._batch, tile_n=tile_n, block_q=block_q, num_kv_splits=num_kv_splits)
        self.figure = figure_widget(self.state["figure"])
        for control in (self.tile_n, self.block_q, self.num_kv_splits):
            control.observe(guarded(self._update, self.errors), names="value")
        self._render()
        self.widget = w.VBox([w.HBox([self.tile_n, self.block_q, self.num_kv_splits]), self.summary,
                              self.errors, self.figure])

    def _update(self, _change: Any = None) -> None:
        self.state = reads_state(**self._batch, tile_n=self.tile_n.value, block_q=self.block_q.value,
                                 num_kv_splits=self.num_kv_splits.value)
        replace_figure(self.figure, self.state["figure"])
        self._render()

    def _render(self) -> None:
        plan = self.state["plan"]
        self.summary.value = (f"grid {plan.grid} = {self.state['grid_programs']} programs, "
                              f"{self.state['working_programs']} with work; BLOCK_M = {plan.config.block_m} rows")

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
