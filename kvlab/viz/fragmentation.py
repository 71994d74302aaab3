"""Pictures for workloads and for the fragmentation simulation (notebook 02, reused later).

``figure_lengths`` draws a workload's prompt and output lengths as the PagedAttention paper's
Fig. 11 does; ``figure_breakdown`` stacks where a KV pool's slots went, as its Fig. 2 does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from kvlab.sim.fragmentation import CATEGORIES, FragmentationResult
from kvlab.sim.workloads import validate_requests

CATEGORY_COLOURS = {
    "used": "#16a34a",
    "reserved": "#facc15",
    "internal": "#f97316",
    "external": "#dc2626",
    "free": "#d1d5db",
}
CATEGORY_LABELS = {
    "used": "token KV (used)",
    "reserved": "reserved for future tokens",
    "internal": "internal fragmentation",
    "external": "external fragmentation",
    "free": "free",
}


def result_label(result: FragmentationResult) -> str:
    """``"max"``, ``"pow2"``, ``"oracle"`` or ``"paged (block 16)"``."""
    return f"paged (block {result.block_size})" if result.policy == "paged" else result.policy


def figure_breakdown(results: Sequence[FragmentationResult], title: str = "Where the KV pool's slots go") -> go.Figure:
    """One stacked bar per simulation: the shares of the pool used, reserved, wasted inside and outside, free."""
    labels = [result_label(r) for r in results]
    fig = go.Figure()
    for category in CATEGORIES:
        shares = [100 * r.breakdown[category] for r in results]
        fig.add_bar(
            name=CATEGORY_LABELS[category], x=labels, y=shares, marker_color=CATEGORY_COLOURS[category],
            text=[f"{s:.1f}%" if s >= 3 else "" for s in shares], textposition="inside",
            hovertemplate=f"{CATEGORY_LABELS[category]}: %{{y:.2f}}%<extra></extra>",
        )
    fig.update_layout(
        title=title, barmode="stack", yaxis=dict(title="share of the pool's slots (%)", range=[0, 100]),
        height=440, margin=dict(t=60, b=40), legend=dict(traceorder="normal", orientation="h", y=-0.15),
        uniformtext=dict(minsize=11, mode="hide"),  # a segment too thin for its label shows none
    )
    return fig


def figure_lengths(requests: Sequence[Sequence[int]] | np.ndarray, title: str = "Request lengths") -> go.Figure:
    """Histograms of prompt and output lengths, with their means marked."""
    array = validate_requests(requests)
    fig = go.Figure()
    for column, name, colour in ((0, "prompt (input)", "#2563eb"), (1, "output", "#f97316")):
        values = array[:, column]
        fig.add_histogram(x=values, name=f"{name}: mean {values.mean():.1f}", marker_color=colour, opacity=0.6,
                          xbins=dict(start=0, size=max(1, int(array.sum(axis=1).max()) // 64)))
    fig.update_layout(
        title=title, barmode="overlay", yaxis_title="requests", height=340, margin=dict(t=60, b=40),
        # from just left of 0, so the axes' two "0" labels do not meet in the corner
        xaxis=dict(title="tokens", range=[-0.03 * int(array.sum(axis=1).max()), int(array.sum(axis=1).max())]),
    )
    return fig
