"""Notebook 01's pictures and control panel: bytes per token, and KV size against context."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from kvlab.capacity.models import ModelSpec, get_model, list_models, weights_bytes
from kvlab.capacity.sizing import KV_DTYPE_BYTES, breakdown, kv_bytes, kv_bytes_per_token
from kvlab.units import GiB, KiB, format_bytes
from kvlab.viz.widgets import error_area, figure_widget, guarded, replace_figure

DTYPE_COLOURS = {"fp32": "#6b7280", "fp16": "#2563eb", "bf16": "#1d4ed8", "fp8": "#f59e0b",
                 "fp8_e4m3": "#f59e0b", "fp8_e5m2": "#d97706", "int8": "#10b981", "nvfp4": "#db2777"}


def figure_bytes_per_token(
    models: Sequence[ModelSpec], kv_dtypes: Sequence[str] = ("bf16", "fp8", "nvfp4"), tp: int = 1
) -> go.Figure:
    """Grouped bars: KiB per token for each model (x) and KV dtype (colour), log scale."""
    fig = go.Figure()
    for dtype in kv_dtypes:
        values = [kv_bytes_per_token(m, dtype, tp) / KiB for m in models]
        fig.add_bar(
            name=dtype, x=[m.name for m in models], y=values,
            marker_color=DTYPE_COLOURS.get(dtype), text=[f"{v:g}" for v in values], textposition="outside",
        )
    fig.update_layout(
        title=f"KV bytes per token (one GPU, TP={tp})", barmode="group",
        yaxis=dict(title="KiB per token (log scale)", type="log"), legend_title="KV dtype",
        height=420, margin=dict(t=60, b=40),
    )
    return fig


def figure_kv_vs_context(
    model: ModelSpec, kv_dtype: str = "bf16", tp: int = 1, max_context: int = 131072, requests: int = 1
) -> go.Figure:
    """KV GiB of ``requests`` requests against context length, beside the weights one GPU holds."""
    contexts = sorted({int(max_context * i / 64) for i in range(1, 65)} | {1})
    kv = [kv_bytes(model, t, kv_dtype, requests, tp) / GiB for t in contexts]
    fig = go.Figure()
    fig.add_scatter(x=contexts, y=kv, mode="lines", name=f"KV cache, {requests} request(s), {kv_dtype}")
    if model.num_params is not None:
        weights = weights_bytes(model) / tp / GiB
        fig.add_scatter(
            x=[contexts[0], contexts[-1]], y=[weights, weights], mode="lines",
            line=dict(dash="dash", color="#6b7280"), name=f"weights per GPU ({model.weights_dtype})",
        )
    fig.update_layout(
        title=f"{model.name}: KV cache against context (TP={tp})",
        xaxis_title="tokens per request", yaxis_title="GiB on one GPU", height=380, margin=dict(t=60, b=40),
    )
    return fig


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
