"""Notebook 07's block-lifetime pictures: the two histograms the diagnostic compares, and hit rates by pool."""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go

from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector
from kvlab.viz.canvas import wrap


def figure_lifetime_histograms(collector: KVCacheMetricsCollector, title: str = "") -> go.Figure:
    """Reuse gaps and idle time before eviction, in steps, with the p90 gap and the median idle time marked."""
    diagnosis = collector.diagnose("steps")
    fig = go.Figure()
    for metric, colour, label in (("reuse_gap", "#2563eb", "reuse gap"),
                                  ("idle_before_evict", "#b45309", "idle before eviction")):
        values = collector.histogram(metric, "steps").values
        fig.add_histogram(x=values, name=f"{label} ({len(values):,} values)", marker_color=colour, opacity=0.6,
                          xbins=dict(size=4))
    marks = ((diagnosis.reuse_gap_p90, "#2563eb", "p90 reuse gap"),
             (diagnosis.idle_before_evict_p50, "#b45309", "median idle before eviction"))
    for x, colour, label in marks:
        if x is not None:  # the line in the plot, its name and value in the legend: never over a bar or a tick
            fig.add_vline(x=x, line=dict(color=colour, dash="dash", width=2))
            fig.add_scatter(x=[None], y=[None], mode="lines", line=dict(color=colour, dash="dash", width=2),
                            name=f"{label}: {x:g} steps")
    verdict = "too small" if diagnosis.too_small else "large enough"
    lines = wrap(f"the pool is {verdict}: {diagnosis}" if title else str(diagnosis), 760, 12)
    heading = "<br>".join([f"<b>{title}</b>"] * bool(title) + [f"<span style='font-size:12px'>{line}</span>"
                                                                 for line in lines])
    top = max(values_max(collector), 1)
    fig.update_layout(
        barmode="overlay", height=380 + 16 * len(lines), margin=dict(t=64 + 18 * len(lines), b=40),
        title=dict(text=heading, x=0.01, xanchor="left", font=dict(size=15)),
        xaxis=dict(title="steps", range=[-0.02 * top, top * 1.02]), yaxis_title="blocks",
        legend=dict(orientation="h", y=-0.25),
    )
    return fig


def values_max(collector: KVCacheMetricsCollector) -> float:
    """The largest value of the two histograms, in steps (the x axis' extent)."""
    found = [v for metric in ("reuse_gap", "idle_before_evict") for v in collector.histogram(metric, "steps").values]
    return max(found, default=1)


def figure_hit_rates(rows: Mapping[str, Mapping[str, float]]) -> go.Figure:
    """Grouped bars: the prefix-cache hit rate of each run (GPU hits, and CPU-tier hits stacked on them)."""
    names = list(rows)
    fig = go.Figure()
    fig.add_bar(name="GPU prefix cache", x=names, y=[100 * rows[n]["gpu"] for n in names], marker_color="#1b7f3b",
                text=[f"{100 * rows[n]['gpu']:.1f}%" for n in names], textposition="inside")
    cpu = [100 * rows[n].get("cpu", 0.0) for n in names]
    if any(cpu):
        fig.add_bar(name="CPU tier", x=names, y=cpu, marker_color="#b45309",
                    text=[f"+{c:.1f}%" if c else "" for c in cpu], textposition="inside")
    fig.update_layout(barmode="stack", height=360, margin=dict(t=60, b=40),
                      title="Share of prompt tokens found in the cache", yaxis=dict(title="% of prompt tokens",
                                                                                     range=[0, 100]))
    return fig
