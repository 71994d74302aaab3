"""Notebook 09's pictures and panel: what decompressing and absorbing cost as the query grows, and TP against DP.

``absorb_state`` is the pure function behind ``AbsorbPanel``: for one MLA model, a context and a
query length it returns ``kvlab.capacity.mla``'s counts of both paths, which one needs fewer FLOPs
and which reads fewer bytes, where the FLOPs cross, and the figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.capacity.mla import absorb_crossover, mla_attention_cost
from kvlab.capacity.models import ModelSpec, resolve_model
from kvlab.capacity.parallel import ParallelPlan
from kvlab.capacity.sizing import KV_DTYPE_BYTES
from kvlab.units import GiB, format_bytes
from kvlab.viz.canvas import log_axis
from kvlab.viz.widgets import error_area, figure_widget, guarded, replace_figure

PATH_COLOURS = {"naive": "#b45309", "absorbed": "#1d4ed8"}
QUERY_LENS = tuple(2**i for i in range(13))  # 1 .. 4096
CONTEXTS = (0, 512, 1024, 4096, 16384, 65536)


def figure_absorb_costs(model: ModelSpec, context_len: int, kv_dtype: str = "bf16",
                        query_lens: Sequence[int] = QUERY_LENS, marked: int | None = None) -> go.Figure:
    """FLOPs and bytes read of both paths for one layer, against the query length (log-log), after ``context_len``."""
    costs = [mla_attention_cost(model, q, context_len, kv_dtype=kv_dtype) for q in query_lens]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("FLOPs", "bytes read"), horizontal_spacing=0.12)
    for col, metric in ((1, "flops"), (2, "bytes_read")):
        for path in ("naive", "absorbed"):
            values = [getattr(getattr(c, path), metric) for c in costs]
            fig.add_scatter(x=list(query_lens), y=values, mode="lines+markers", name=path, legendgroup=path,
                            showlegend=col == 1, line=dict(color=PATH_COLOURS[path]), row=1, col=col)
        if marked is not None:
            fig.add_vline(x=marked, line=dict(dash="dot", color="#6b7280"), row=1, col=col)
        # explicit ticks: plotly's own log ticks draw the 2s and 5s at 9 px, unreadable when projected
        fig.update_xaxes(log_axis(query_lens, "query tokens per sequence"), row=1, col=col)
        fig.update_yaxes(type="log", dtick=1, exponentformat="SI", row=1, col=col)   # one tick per decade
    fig.update_layout(title=f"{model.name}: one layer, {context_len:,} latents cached before the queries ({kv_dtype})",
                      height=380, margin=dict(t=70, b=40), legend_title="path")
    return fig


def absorb_state(model: ModelSpec | str, query_len: int, context_len: int, kv_dtype: str = "bf16") -> dict[str, Any]:
    """Everything ``AbsorbPanel`` shows, as plain numbers and names."""
    spec = resolve_model(model)
    cost = mla_attention_cost(spec, query_len, context_len, kv_dtype=kv_dtype)
    return {
        "model": spec.name, "query_len": query_len, "context_len": context_len, "kv_dtype": kv_dtype,
        "cost": cost, "flops_ratio": cost.flops_ratio, "bytes_read_ratio": cost.bytes_read_ratio,
        "fewer_flops": cost.fewer_flops, "fewer_bytes_read": cost.fewer_bytes_read,
        "crossover": absorb_crossover(spec, context_len),
        "figure": figure_absorb_costs(spec, context_len, kv_dtype, marked=query_len),
    }


def _summary_html(state: dict[str, Any]) -> str:
    cost, crossover = state["cost"], state["crossover"]
    cross = (f"from <b>{crossover:,}</b> query tokens on, decompressing needs fewer FLOPs" if crossover
             else "absorbing needs fewer FLOPs at every query length shown")
    return (f"<p>{state['query_len']:,} query tokens after {state['context_len']:,} cached: naive / absorbed = "
            f"<b>{state['flops_ratio']:.2f}x</b> the FLOPs, <b>{state['bytes_read_ratio']:.2f}x</b> the bytes read "
            f"(naive reads {format_bytes(cost.naive.bytes_read)}, absorbed {format_bytes(cost.absorbed.bytes_read)}). "
            f"Fewer FLOPs: <b>{state['fewer_flops']}</b>; fewer bytes: <b>{state['fewer_bytes_read']}</b>. "
            f"At this context, {cross}.</p>")


class AbsorbPanel:
    """Query length, context and latent dtype over naive-against-absorbed counts and their plot."""

    def __init__(self, model: str = "deepseek-v3", query_len: int = 1, context_len: int = 4096,
                 kv_dtype: str = "bf16") -> None:
        import ipywidgets as w

        self.model_name = model
        self.query_len = w.SelectionSlider(options=list(QUERY_LENS), value=query_len, description="query tokens",
                                           continuous_update=False, layout=w.Layout(width="420px"))
        self.context_len = w.SelectionSlider(options=list(CONTEXTS), value=context_len, description="cached",
                                             continuous_update=False, layout=w.Layout(width="420px"))
        self.kv_dtype = w.Dropdown(options=[d for d in KV_DTYPE_BYTES if d != "nvfp4"], value=kv_dtype,
                                   description="latent dtype")
        self.summary = w.HTML()
        self.errors = error_area()
        self.state: dict[str, Any] = absorb_state(model, query_len, context_len, kv_dtype)
        self.figure = figure_widget(self.state["figure"])
        for control in (self.query_len, self.context_len, self.kv_dtype):
            control.observe(guarded(self._update, self.errors), names="value")
        self.summary.value = _summary_html(self.state)
        self.view = w.VBox([w.HBox([self.query_len, self.context_len]), self.kv_dtype, self.errors, self.summary,
                            self.figure])

    def _update(self, _change: Any = None) -> None:
        self.state = absorb_state(self.model_name, self.query_len.value, self.context_len.value, self.kv_dtype.value)
        self.summary.value = _summary_html(self.state)
        replace_figure(self.figure, self.state["figure"])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.view)


def figure_parallel(plans: dict[str, ParallelPlan]) -> go.Figure:
    """Per layout: one GPU's weights and KV pool (stacked GiB), and the distinct requests the deployment holds."""
    names = list(plans)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("one GPU's memory (GiB)", "requests the deployment holds"),
                        horizontal_spacing=0.15)
    weights = [plans[n].per_gpu.weights_bytes / GiB for n in names]
    pool = [plans[n].per_gpu.kv_pool_bytes / GiB for n in names]
    fig.add_bar(x=names, y=weights, name="weights", marker_color="#6b7280", row=1, col=1)
    fig.add_bar(x=names, y=pool, name="KV pool", marker_color="#1d4ed8", row=1, col=1)
    fig.add_bar(x=names, y=[plans[n].requests for n in names], name="requests", marker_color="#059669",
                text=[str(plans[n].requests) for n in names], textposition="outside", showlegend=False, row=1, col=2)
    fig.update_layout(barmode="stack", height=360, margin=dict(t=60, b=40))
    return fig
