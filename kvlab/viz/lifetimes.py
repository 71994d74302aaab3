"""Notebook 07's block-lifetime pictures: the two histograms the diagnostic compares, and hit rates by pool."""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go

from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector


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
        if x is not None:
            fig.add_vline(x=x, line=dict(color=colour, dash="dash", width=2), annotation_text=f"{label}: {x:g}",
                          annotation_position="top")
    verdict = "too small" if diagnosis.too_small else "large enough"
    fig.update_layout(
        barmode="overlay", height=340, margin=dict(t=70, b=40),
        title=f"{title}<br><sup>the pool is {verdict}: {diagnosis}</sup>" if title else str(diagnosis),
        xaxis_title="steps", yaxis_title="blocks", legend=dict(orientation="h", y=-0.25),
    )
    return fig


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
