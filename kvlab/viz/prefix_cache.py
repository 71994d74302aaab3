"""Notebook 04's pictures and panel: hash chains that hit or miss, the free queue, hashing costs, pool sweeps."""

from __future__ import annotations

import functools
import html
import math
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.core.block_pool import BlockPool
from kvlab.core.cache_stats import interpret_hit_rate
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import short_hash
from kvlab.core.request import Request
from kvlab.errors import UnknownNameError
from kvlab.sim.block_scenarios import BlockView
from kvlab.sim.prefix_sim import WORKLOADS, SimResult, min_num_blocks, simulate, sweep_pool_sizes
from kvlab.units import cdiv
from kvlab.viz.block_pool import draw_free_queue
from kvlab.viz.canvas import INK, MUTED, Canvas, log_axis
from kvlab.viz.widgets import error_area, figure_widget, guarded, replace_figure
from kvlab.viz.words import token_label

STATUS_COLOURS = {"hit": "#16a34a", "computed": "#2563eb", "partial": "#9ca3af"}
MAX_POOL_SIZE = 240


def block_statuses(manager: KVCacheManager, request: Request) -> list[str]:
    """Per logical block of ``request``: 'hit' (cached prefix), 'computed' (full, to prefill) or 'partial'."""
    _, num_hits, _ = manager.get_computed_blocks(request)
    hit_blocks = num_hits // manager.block_size
    full_blocks = request.num_tokens // manager.block_size
    total = cdiv(request.num_tokens, manager.block_size)
    return ["hit"] * hit_blocks + ["computed"] * (full_blocks - hit_blocks) + ["partial"] * (total - full_blocks)


def figure_hit_map(rows: dict[str, Sequence[str]], title: str = "Which blocks hit the prefix cache") -> go.Figure:
    """One row of coloured cells per request: its blocks, hit (green), to prefill (blue), partial (grey)."""
    fig = go.Figure()
    labels = list(rows)
    for status, colour in STATUS_COLOURS.items():
        xs, ys = [], []
        for label in labels:
            for i, s in enumerate(rows[label]):
                if s == status:
                    xs.append(i)
                    ys.append(label)
        fig.add_bar(x=[1] * len(xs), base=[x - 0.5 for x in xs], y=ys, orientation="h", name=status,
                    marker_color=colour,
                    marker_line=dict(color="white", width=1), hovertext=[f"block {x}" for x in xs])
    fig.update_layout(
        title=title, barmode="overlay", height=110 + 45 * len(labels), margin=dict(t=50, b=40, l=10),
        xaxis=dict(title="logical block", dtick=1, zeroline=False),
        yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=labels),
        legend=dict(orientation="h", y=-0.35),
    )
    return fig


def figure_free_queue(pool: BlockPool, title: str = "free_block_queue, head → tail") -> go.Figure:
    """The free queue as a row of boxes, head (allocated next) on the left; cached blocks marked *."""
    views = tuple(BlockView(b.block_id, b.ref_cnt, b.block_hash, b.is_null, 0, ()) for b in pool.blocks)
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    canvas = Canvas(820)
    canvas.text(10, 10, html.escape(f"{title} (* = still cached, can be hit)"), 15, INK, anchor="left",
                valign="top", bold=True)
    bottom = draw_free_queue(canvas, views, queue, 0, 40)
    return canvas.figure(bottom + 10, parts=("queue",))


def figure_hash_chain(manager: KVCacheManager, request: Request, title: str = "", max_blocks: int = 6) -> go.Figure:
    """A request's blocks and their chained hashes h0 -> h1 -> ..., as a lookup walks them: hits, then the cut.

    Each hash folds in the one before it; the lookup stops at the first hash the cache does
    not hold, so every block after it is computed whatever the cache holds. Uses
    ``block_statuses`` (which looks up and changes nothing) and ``request.block_hashes``.
    """
    statuses = block_statuses(manager, request)[:max_blocks]
    hashes = request.block_hashes
    n, bs = len(statuses), manager.block_size
    pitch = min(150, (820 - 110) / max(n, 1))
    canvas = Canvas(820)
    canvas.text(10, 10, html.escape(title or f"request {request.request_id}: the hash chain a lookup walks"), 15,
                INK, anchor="left", valign="top", bold=True)
    canvas.rect(10, 110, 86, 146, "#F3F4F6", "#6B7280", 1.2)
    canvas.text(48, 128, "NONE_HASH", 11, INK, bold=True)
    first_miss = next((i for i, s in enumerate(statuses) if s != "hit"), None)
    for i, status in enumerate(statuses):
        x = 110 + i * pitch
        tokens = request.token_ids(i * bs, (i + 1) * bs)
        words = f"{token_label(tokens[0])} … {token_label(tokens[-1])}" if len(tokens) > 1 else token_label(tokens[0])
        canvas.rect(x, 40, x + pitch - 18, 86, STATUS_COLOURS[status], "#374151", 1.2)
        canvas.text(x + (pitch - 18) / 2, 53, f"block {i} · {len(tokens)} tokens", 12, "#FFFFFF", bold=True)
        canvas.text(x + (pitch - 18) / 2, 72, html.escape(words[:22]), 12, "#FFFFFF")
        canvas.arrow((x + (pitch - 18) / 2, 86), (x + (pitch - 18) / 2, 108), "#6B7280", 1.4)
        hashed = i < len(hashes) and status != "partial"
        looked = first_miss is None or i <= first_miss
        fill = "#DCFCE7" if status == "hit" else ("#FEE2E2" if hashed and looked else "#F9FAFB")
        canvas.rect(x, 110, x + pitch - 18, 146, fill, "#6B7280", 1.2, "solid" if hashed else "dot")
        label = f"h{i} = {short_hash(hashes[i])}" if hashed else "not hashed"
        canvas.text(x + (pitch - 18) / 2, 121, label, 12, INK, bold=hashed)
        verdict = ("✓ cached" if status == "hit" else "✗ miss: the lookup stops" if i == first_miss and hashed
                   else "never looked up" if hashed else "partial block")
        canvas.text(x + (pitch - 18) / 2, 137, verdict, 11, "#B42318" if i == first_miss else MUTED)
        left = (86, 128) if i == 0 else (x - 18, 128)
        canvas.arrow(left, (x, 128), "#374151", 1.6, dash="dot" if first_miss is not None and i > first_miss else None)
        canvas.point("blocks", x + (pitch - 18) / 2, 63, f"block {i}: tokens {i * bs}–{i * bs + len(tokens) - 1}, "
                     f"{status}<br>{html.escape(' '.join(token_label(t) for t in tokens))}")
    hit = sum(s == "hit" for s in statuses) * bs
    canvas.text(10, 160, f"h_i = H(h_(i-1), tokens of block i, extra keys): {hit} tokens hit, "
                f"{request.num_tokens - hit} to prefill.", 13, INK, anchor="left", valign="top")
    return canvas.figure(186, parts=("blocks",))


def figure_hash_cost(rows: Sequence[dict[str, Any]], prefill_per_block: dict[str, float] | None = None) -> go.Figure:
    """Microseconds per block for each hash function (bars by block size, log scale), prefill estimates as lines."""
    fig = go.Figure()
    for block_size in sorted({r["block_size"] for r in rows}):
        sel = [r for r in rows if r["block_size"] == block_size]
        fig.add_bar(name=f"block size {block_size}", x=[r["hash_fn"] for r in sel],
                    y=[r["seconds_per_block"] * 1e6 for r in sel],
                    text=[f"{r['seconds_per_block'] * 1e6:.2g}" for r in sel], textposition="outside")
    names = list(dict.fromkeys(r["hash_fn"] for r in rows))
    for (label, seconds), dash in zip((prefill_per_block or {}).items(), ("dash", "dot", "dashdot"), strict=False):
        fig.add_scatter(x=[names[0], names[-1]], y=[seconds * 1e6] * 2, mode="lines", name=label,
                        line=dict(color="#b42318", dash=dash))
    values = [r["seconds_per_block"] * 1e6 for r in rows] + [s * 1e6 for s in (prefill_per_block or {}).values()]
    top, bottom = math.log10(max(values)) + 0.8, math.log10(min(values)) - 0.3
    fig.update_layout(title="Hashing one block vs prefilling it", barmode="group", height=460,
                      yaxis=log_axis(values, "µs per block (log scale)", range=[bottom, top]),
                      margin=dict(t=60, b=40), legend=dict(orientation="h", y=-0.15))
    return fig


# ----------------------------------------------------------------- the pool-size panel


@functools.lru_cache(maxsize=8)
def _sweep(workload: str, block_size: int) -> tuple[tuple[int, ...], tuple[SimResult, ...]]:
    """Memo of ``sweep_pool_sizes`` over the panel's pool sizes (a pure function of its arguments)."""
    requests = WORKLOADS[workload]()
    sizes = tuple(range(min_num_blocks(requests, block_size), MAX_POOL_SIZE + 1, 12))
    return sizes, tuple(sweep_pool_sizes(requests, list(sizes), block_size=block_size))


def panel_state(workload: str, num_blocks: int, block_size: int = 16) -> dict[str, Any]:
    """Everything the pool-size panel shows: one run at ``num_blocks`` and the sweep it sits on."""
    if workload not in WORKLOADS:
        raise UnknownNameError("workload", workload, WORKLOADS)
    result = simulate(WORKLOADS[workload](), num_blocks, block_size)
    sizes, sweep = _sweep(workload, block_size)
    return {
        "workload": workload,
        "num_blocks": num_blocks,
        "result": result,
        "sweep_sizes": sizes,
        "sweep": sweep,
        "verdict": interpret_hit_rate(result.hit_rate, workload_shares_prefixes=True),
        "figure": figure_pool_sweep(workload, result, sizes, sweep),
    }


def figure_pool_sweep(workload: str, result: SimResult, sizes: Sequence[int], sweep: Sequence[SimResult]) -> go.Figure:
    """Top: hit rate and evicted-before-reuse against pool size. Bottom: each request's prompt, hit or prefilled."""
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.16, specs=[[{"secondary_y": True}], [{}]],
                        subplot_titles=(f"{workload}: pool size against hit rate and evictions",
                                        f"each request's prompt at {result.num_blocks} blocks"))
    fig.add_scatter(x=list(sizes), y=[r.hit_rate for r in sweep], mode="lines+markers", name="hit rate",
                    line_color="#16a34a", row=1, col=1)
    fig.add_scatter(x=list(sizes), y=[r.num_blocks_evicted_before_reuse for r in sweep], mode="lines+markers",
                    name="blocks evicted before reuse", line_color="#b42318", row=1, col=1, secondary_y=True)
    fig.add_scatter(x=[result.num_blocks], y=[result.hit_rate], mode="markers", name="this pool",
                    marker=dict(size=14, color="#111827", symbol="diamond"), row=1, col=1)
    index = list(range(len(result.prompt_tokens)))
    fig.add_bar(x=index, y=list(result.hit_tokens), name="hit (not prefilled)", marker_color="#16a34a", row=2, col=1)
    fig.add_bar(x=index, y=[p - h for p, h in zip(result.prompt_tokens, result.hit_tokens, strict=True)],
                name="prefilled", marker_color="#2563eb", row=2, col=1)
    fig.update_layout(barmode="stack", height=620, margin=dict(t=60, b=40), legend=dict(orientation="h", y=-0.12))
    fig.update_yaxes(title_text="hit rate", range=[0, 1], row=1, col=1, secondary_y=False)
    fig.update_yaxes(title_text="evicted before reuse", rangemode="tozero", row=1, col=1, secondary_y=True)
    # stops short of the next round tick, which would meet the right axis' "0"
    fig.update_xaxes(title_text="pool size (blocks)", range=[sizes[0] - 6, sizes[-1] + 6], row=1, col=1)
    fig.update_xaxes(title_text="request, in admission order", row=2, col=1)
    fig.update_yaxes(title_text="prompt tokens", row=2, col=1)
    return fig


def _summary_html(state: dict[str, Any]) -> str:
    r: SimResult = state["result"]
    return (
        f"<p>Pool of <b>{r.num_blocks}</b> blocks of {r.block_size} tokens: hit rate <b>{r.hit_rate:.1%}</b>; "
        f"prefill tokens saved <b>{r.prefill_tokens_saved:,}</b>, computed {r.prefill_tokens_computed:,}; "
        f"{r.num_evicted_blocks} cached blocks evicted, <b>{r.num_blocks_evicted_before_reuse}</b> of them asked "
        f"for again later. <i>{state['verdict']}</i></p>"
    )


class PrefixCachePanel:
    """A workload and a pool-size slider over ``panel_state``: hit rate, evictions and prefill saved."""

    def __init__(self, workload: str = "multi-turn chat", num_blocks: int = 80, block_size: int = 16) -> None:
        import ipywidgets as w

        self.block_size = block_size
        self.state: dict[str, Any] = panel_state(workload, num_blocks, block_size)
        self.workload = w.Dropdown(options=list(WORKLOADS), value=workload, description="workload")
        smallest = max(min_num_blocks(make(), block_size) for make in WORKLOADS.values())
        self.num_blocks = w.IntSlider(value=num_blocks, min=smallest, max=MAX_POOL_SIZE, step=1,
                                      description="pool blocks", continuous_update=False,
                                      layout=w.Layout(width="auto"))
        self.summary = w.HTML(_summary_html(self.state))
        self.errors = error_area()
        self.figure = figure_widget(self.state["figure"])
        for control in (self.workload, self.num_blocks):
            control.observe(guarded(self._update, self.errors), names="value")
        self.view = w.VBox([self.workload, self.num_blocks, self.errors, self.summary, self.figure])

    def _update(self, _change: Any = None) -> None:
        self.state = panel_state(self.workload.value, self.num_blocks.value, self.block_size)
        self.summary.value = _summary_html(self.state)
        replace_figure(self.figure, self.state["figure"])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.view)

