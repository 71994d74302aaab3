"""Notebook 01's pictures and control panel: bytes per token, and KV size against context."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from kvlab._validate import positive_int
from kvlab.capacity.models import ModelSpec, get_model, list_models, weights_bytes
from kvlab.capacity.sizing import KV_DTYPE_BYTES, breakdown, kv_bytes, kv_bytes_per_token
from kvlab.units import GiB, KiB, format_bytes
from kvlab.viz.widgets import error_area, figure_widget, guarded, replace_figure

DTYPE_COLOURS = {"fp32": "#6b7280", "fp16": "#2563eb", "bf16": "#1d4ed8", "fp8": "#f59e0b",
                 "fp8_e4m3": "#f59e0b", "fp8_e5m2": "#d97706", "int8": "#10b981", "nvfp4": "#db2777"}


def figure_bytes_per_token(
    models: Sequence[ModelSpec], kv_dtypes: Sequence[str] = ("bf16", "fp8", "nvfp4"), tp: int = 1
) -> go.Figure:
    """Grouped horizontal bars: KiB per token for each model (one row, largest on top) and KV dtype (colour).

    Horizontal, so a model's name reads without turning the head; a linear axis, so an FP8 bar
    is visibly half its bf16 bar; each bar labelled to three figures ("34.3", not "34.3125").
    """
    order = sorted(models, key=lambda m: kv_bytes_per_token(m, kv_dtypes[0], tp))
    fig = go.Figure()
    top = 0.0
    for dtype in reversed(list(kv_dtypes)):  # plotly stacks groups bottom-up: the first dtype on top
        values = [kv_bytes_per_token(m, dtype, tp) / KiB for m in order]
        top = max(top, *values)
        fig.add_bar(
            name=dtype, y=[m.name for m in order], x=values, orientation="h", marker_color=DTYPE_COLOURS.get(dtype),
            text=[f"{v:.3g}" for v in values], textposition="outside", cliponaxis=False,
            textfont=dict(size=12), hovertemplate=f"%{{y}}, {dtype}: %{{x:g}} KiB per token<extra></extra>",
        )
    fig.update_layout(
        title=f"KV bytes per token (one GPU, TP={tp})", barmode="group", bargap=0.22, bargroupgap=0.04,
        xaxis=dict(title="KiB per token", range=[0, top * 1.12], showgrid=True),
        yaxis=dict(automargin=True, tickfont=dict(size=13)),
        legend=dict(title="KV dtype", orientation="h", y=1.02, yanchor="bottom", x=1, xanchor="right",
                    traceorder="reversed"),
        height=150 + 42 * len(order) * max(len(kv_dtypes), 1) / 3 + 40, margin=dict(t=80, b=50, r=30),
    )
    return fig


def kv_context_state(
    model: ModelSpec, kv_dtype: str = "bf16", tp: int = 1, max_context: int = 131072, requests: int = 1
) -> dict[str, Any]:
    """``requests`` requests' KV on one GPU against context, and the context at which it outgrows the weights."""
    requests = positive_int("requests", requests)
    per_token = kv_bytes_per_token(model, kv_dtype, tp)
    weights = weights_bytes(model) / tp if model.num_params is not None else None
    crossing = weights / (requests * per_token) if weights else None
    return {"requests": requests, "kv_bytes_per_token": per_token, "weights_bytes_per_gpu": weights,
            "crossing_tokens": crossing,
            "figure": figure_kv_vs_context(model, kv_dtype, tp, max_context, requests)}


def figure_kv_vs_context(
    model: ModelSpec, kv_dtype: str = "bf16", tp: int = 1, max_context: int = 131072, requests: int = 1
) -> go.Figure:
    """KV GiB of ``requests`` requests against context length, beside the weights one GPU holds."""
    contexts = sorted({int(max_context * i / 64) for i in range(1, 65)} | {1})
    kv = [kv_bytes(model, t, kv_dtype, requests, tp) / GiB for t in contexts]
    fig = go.Figure()
    label = "1 request" if requests == 1 else f"{requests} requests"
    fig.add_scatter(x=contexts, y=kv, mode="lines", name=f"KV cache of {label}, {kv_dtype}", line=dict(width=3))
    if model.num_params is not None:
        weights = weights_bytes(model) / tp / GiB
        fig.add_scatter(
            x=[contexts[0], contexts[-1]], y=[weights, weights], mode="lines",
            line=dict(dash="dash", color="#6b7280", width=2), name=f"weights per GPU ({model.weights_dtype})",
        )
    fig.update_layout(
        title=f"{model.name}: KV cache against context (TP={tp})",
        xaxis_title="tokens per request", yaxis_title="GiB on one GPU", height=400, margin=dict(t=60, b=50),
        legend=dict(orientation="h", y=1.0, yanchor="bottom", x=0, xanchor="left"),
    )
    fig.update_layout(title=dict(y=0.97, yanchor="top"), margin=dict(t=80))
    return fig


class KVContextPanel:
    """A slider for the number of requests over ``kv_context_state``: when does their KV outgrow the weights?"""

    def __init__(self, model: str = "llama-3-70b", kv_dtype: str = "bf16", tp: int = 8, max_context: int = 131072,
                 requests: int = 32) -> None:
        import ipywidgets as w

        self.spec, self.kv_dtype, self.tp, self.max_context = get_model(model), kv_dtype, tp, max_context
        self.requests = w.IntSlider(value=requests, min=1, max=128, description="requests (N)",
                                    continuous_update=False, layout=w.Layout(width="480px"),
                                    style={"description_width": "110px"})
        self.summary = w.HTML()
        self.errors = error_area()
        self.state: dict[str, Any] = kv_context_state(self.spec, kv_dtype, tp, max_context, requests)
        self.figure = figure_widget(self.state["figure"])
        self.requests.observe(guarded(self._update, self.errors), names="value")
        self.summary.value = self._summary()
        self.view = w.VBox([self.requests, self.errors, self.summary, self.figure])

    def _summary(self) -> str:
        crossing = self.state["crossing_tokens"]
        n = self.state["requests"]
        who = "one request's KV" if n == 1 else f"the KV of {n} requests"
        return (f"<p style='font-size:14px'>On one GPU (TP={self.tp}), {who} outgrows the weights at "
                f"<b>{crossing:,.0f}</b> tokens per request.</p>") if crossing else ""

    def _update(self, _change: Any = None) -> None:
        self.state = kv_context_state(self.spec, self.kv_dtype, self.tp, self.max_context, self.requests.value)
        self.summary.value = self._summary()
        replace_figure(self.figure, self.state["figure"])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.view)


def panel_state(model: ModelSpec | str | dict, kv_dtype: str, tp: int, context: int) -> dict[str, Any]:
    """Everything the control panel shows, as plain numbers: the pure function behind it."""
    spec = model if isinstance(model, ModelSpec) else (
        get_model(model) if isinstance(model, str) else ModelSpec.from_hf_config(model, name="pasted config")
    )
    per_token = kv_bytes_per_token(spec, kv_dtype, tp)
    per_request = kv_bytes(spec, context, kv_dtype, 1, tp)
    state = {
        "model": spec,
        "factors": breakdown(spec, kv_dtype, tp),
        "bytes_per_token": per_token,
        "bytes_per_request": per_request,
        "weights_bytes_per_gpu": weights_bytes(spec) // tp if spec.num_params else None,
    }
    state["figure"] = figure_kv_vs_context(spec, kv_dtype, tp, max(context, 1024))
    return state


def _summary_html(state: dict[str, Any], context: int) -> str:
    f = state["factors"]
    rows = "".join(f"<td style='padding:0 8px'>{f[k]}</td>" for k in ("attention", "f", "L", "Hkv", "D", "b"))
    weights = state["weights_bytes_per_gpu"]
    return (
        "<table><tr>" + "".join(f"<th style='padding:0 8px'>{k}</th>" for k in
                               ("attention", "f", "L", "Hkv", "D", "b")) + f"</tr><tr>{rows}</tr></table>"
        f"<p><b>{format_bytes(state['bytes_per_token'])}</b> per token on one GPU; "
        f"<b>{format_bytes(state['bytes_per_request'])}</b> for one request of {context:,} tokens"
        + (f"; weights on one GPU ≈ {format_bytes(weights)}" if weights else "") + ".</p>"
    )


class BytesPerTokenPanel:
    """Model preset or pasted config, KV dtype, TP and context length over the numbers and a plot."""

    def __init__(self, model: str = "llama-3-70b", kv_dtype: str = "bf16", tp: int = 1, context: int = 8192):
        import ipywidgets as w

        self.model = w.Dropdown(options=list_models() + ["pasted config"], value=model, description="model")
        self.config = w.Textarea(placeholder="paste a config.json here, then choose 'pasted config'",
                                 layout=w.Layout(width="auto", height="90px"))
        self.kv_dtype = w.Dropdown(options=list(KV_DTYPE_BYTES), value=kv_dtype, description="KV dtype")
        self.tp = w.Dropdown(options=[1, 2, 4, 8, 16], value=tp, description="TP")
        self.context = w.IntSlider(value=context, min=1024, max=262144, step=1024, description="context",
                                   continuous_update=False, layout=w.Layout(width="auto"))
        self.summary = w.HTML()
        self.errors = error_area()
        self.state: dict[str, Any] = panel_state(model, kv_dtype, tp, context)
        self.figure = figure_widget(self.state["figure"])
        for control in (self.model, self.config, self.kv_dtype, self.tp, self.context):
            control.observe(guarded(self._update, self.errors), names="value")
        self.summary.value = _summary_html(self.state, context)
        self.view = w.VBox([
            w.HBox([self.model, self.kv_dtype, self.tp]), self.context, self.config,
            self.errors, self.summary, self.figure,
        ])

    def _update(self, _change: Any = None) -> None:
        source: Any = self.model.value
        if source == "pasted config":
            if not self.config.value.strip():
                return
            source = json.loads(self.config.value)
        self.state = panel_state(source, self.kv_dtype.value, self.tp.value, self.context.value)
        self.summary.value = _summary_html(self.state, self.context.value)
        replace_figure(self.figure, self.state["figure"])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.view)
