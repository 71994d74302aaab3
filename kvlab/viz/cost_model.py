"""Notebook 07's cost-model pictures: time to first token against prefix reuse, and swap against recompute.

Every y value is modelled (``kvlab.capacity.cost_model``), and every title says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from kvlab.capacity.cost_model import CostModel
from kvlab.viz.canvas import log_axis

WHERE_LABELS = {
    "recompute": "no cache (or evicted from a GPU-only cache): recompute",
    "cpu": "hit in the CPU tier: copy back, then prefill the rest",
    "gpu": "hit in the GPU prefix cache: prefill the rest",
}
WHERE_COLOURS = {"recompute": "#b42318", "cpu": "#b45309", "gpu": "#1b7f3b"}


def _assumptions(cost: CostModel) -> str:
    return (f"{cost.model.name}, {cost.tp} x {cost.gpu.name} at {cost.prefill_mfu:g} of dense BF16 peak, "
            f"{cost.link.name} at {cost.link_efficiency:g} of theoretical")


def ttft_curves(cost: CostModel, prompt_tokens: int, num_points: int = 41) -> dict[str, list[float]]:
    """Modelled TTFT (seconds) for each place the reused prefix may sit, at reuse rates 0 .. just below 1."""
    rates = [min(i / (num_points - 1), (prompt_tokens - 1) / prompt_tokens) for i in range(num_points)]
    curves: dict[str, list[float]] = {"reuse_rate": rates}
    for where in WHERE_LABELS:
        curves[where] = [cost.ttft(prompt_tokens, int(r * prompt_tokens), where) for r in rates]  # type: ignore[arg-type]
    return curves


def figure_ttft_vs_reuse(cost: CostModel, prompt_tokens: int) -> go.Figure:
    """Modelled TTFT of one prompt against the share of it whose KV is reused, for the three places it may sit."""
    curves = ttft_curves(cost, prompt_tokens)
    fig = go.Figure()
    for where, label in WHERE_LABELS.items():
        fig.add_scatter(x=[100 * r for r in curves["reuse_rate"]], y=[1000 * s for s in curves[where]],
                        mode="lines", name=label, line=dict(color=WHERE_COLOURS[where], width=3))
    fig.update_layout(
        title=f"Modelled, not measured: TTFT of a {prompt_tokens:,}-token prompt<br><sup>{_assumptions(cost)}</sup>",
        xaxis_title="prefix reuse rate (% of the prompt whose KV exists)", yaxis_title="modelled TTFT (ms)",
        height=420, margin=dict(t=80, b=40), legend=dict(orientation="h", y=-0.25),
    )
    return fig


def figure_swap_vs_recompute(cost: CostModel, computed_tokens: Sequence[int], num_points: int = 51) -> go.Figure:
    """Modelled seconds to resume a preempted request by swap and by recompute, against the prefix-hit rate."""
    fig = go.Figure()
    palette = ["#2563eb", "#7c3aed", "#db2777", "#0891b2"]
    times: list[float] = []
    for colour, computed in zip(palette, computed_tokens, strict=False):
        rates = [i / (num_points - 1) for i in range(num_points)]
        hits = [round(r * computed) for r in rates]
        recompute = [1000 * cost.recompute_seconds(computed, h) for h in hits]
        swap = [1000 * cost.swap_seconds(computed, h) for h in hits]
        times += recompute + swap
        fig.add_scatter(x=[100 * r for r in rates], y=recompute,
                        mode="lines", name=f"recompute, {computed:,} tokens", line=dict(color=colour, width=3))
        fig.add_scatter(x=[100 * r for r in rates], y=swap,
                        mode="lines", name=f"swap, {computed:,} tokens", line=dict(color=colour, dash="dash"))
    fig.update_layout(
        title=f"Modelled, not measured: resuming a preempted request<br><sup>{_assumptions(cost)}</sup>",
        xaxis_title="prefix-hit rate on resume (% of its tokens still cached on the GPU)",
        yaxis=log_axis(times, "modelled time (ms, log scale)"), height=440, margin=dict(t=80, b=40),
        legend=dict(orientation="h", y=-0.25),
    )
    return fig


def figure_crossover(costs: Sequence[CostModel], computed_tokens: Sequence[int]) -> go.Figure:
    """The prefix-hit rate above which recompute is no slower than swap, against the request's length."""
    fig = go.Figure()
    for cost in costs:
        crossovers = [cost.crossover_hit_rate(n) for n in computed_tokens]
        fig.add_scatter(x=list(computed_tokens), y=[None if c is None else 100 * c for c in crossovers],
                        mode="lines+markers", name=f"{cost.model.name}, {cost.gpu.name}, {cost.link.name}")
    fig.update_layout(
        title="Modelled, not measured: where recompute stops losing to swap",
        xaxis=log_axis(list(computed_tokens), "tokens of the preempted request"),
        yaxis=dict(title="crossover prefix-hit rate (%)"), height=400, margin=dict(t=60, b=40),
        legend=dict(orientation="h", y=-0.3),
    )
    return fig
