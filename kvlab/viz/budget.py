"""Notebook 02's budget panel and pictures: one GPU's memory, its KV blocks, and the start-up log.

``panel_state`` is the pure function behind ``BudgetPanel``: it plans with
``kvlab.capacity.budget.plan_kv_cache`` and draws the figure; tests and notebook cells call it directly.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab._validate import one_of
from kvlab.capacity.budget import PRESETS, KVCachePlan, plan_kv_cache
from kvlab.capacity.models import WEIGHT_DTYPE_BYTES, get_model, list_models, weights_bytes
from kvlab.capacity.sizing import KV_DTYPE_BYTES
from kvlab.sim.fragmentation import FragmentationResult
from kvlab.units import GiB, format_bytes
from kvlab.viz.widgets import Panel, error_area, figure_widget, guarded, keep_for_new_views, replace_figure

#: The segments of the memory bar, left to right, with their colours.
SEGMENTS = {
    "weights": "#64748b",
    "non-KV peak": "#f59e0b",
    "CUDA graphs": "#a855f7",
    "KV pool": "#16a34a",
    "headroom": "#e5e7eb",
}
BLOCK_SIZES = (16, 32, 64, 128, 256)
TP_SIZES = (1, 2, 4, 8, 16)
AUTO_DTYPE = "checkpoint"  # the weights dtype the model's config declares


def memory_segments(plan: KVCachePlan) -> dict[str, int]:
    """Bytes of each bar segment; headroom is whatever the other four leave of the GPU (never < 0)."""
    parts = {
        "weights": plan.weights_bytes,
        "non-KV peak": plan.non_kv_peak_bytes,
        "CUDA graphs": plan.cudagraph_bytes,
        "KV pool": plan.kv_pool_bytes,
    }
    parts["headroom"] = max(plan.headroom_bytes, 0)
    return parts


def figure_memory(plan: KVCachePlan) -> go.Figure:
    """A stacked bar of one GPU's memory, with the budget ``gpu_memory_utilization x total`` marked.

    Every setting gives the same traces (five bars, two marker lines), so the panel can redraw
    by copying coordinates instead of rebuilding the figure.
    """
    fig = go.Figure()
    segments = memory_segments(plan)
    for name, size in segments.items():
        gib = size / GiB
        fig.add_bar(
            name=name, y=[0], x=[gib], orientation="h", width=0.6, marker_color=SEGMENTS[name],
            text=[f"{name}<br>{gib:.2f} GiB" if size else ""], textposition="inside", insidetextanchor="middle",
            hovertemplate=f"{name}: %{{x:.3f}} GiB<extra></extra>",
        )
    total, requested = plan.gpu_memory_bytes / GiB, plan.requested_bytes / GiB
    # The two lines' labels end at their line, one above the bar and one below it, so that
    # neither runs out of the figure nor over the other when the budget is close to the total.
    for x, label, colour, dash, text in ((requested, f"budget {plan.gpu_memory_utilization:g} × GPU", "#111827",
                                          "dash", ["", None]),
                                         (total, f"GPU {total:g} GiB", "#b42318", "solid", [None, ""])):
        fig.add_scatter(x=[x, x], y=[-0.42, 0.42], mode="lines+text", text=[label if t is None else t for t in text],
                        textposition=["bottom left", "top left"], textfont=dict(size=12),
                        line=dict(color=colour, dash=dash, width=2), showlegend=False, hoverinfo="skip")
    fig.update_layout(
        barmode="stack", height=260, margin=dict(t=50, b=40, l=50, r=20),
        uniformtext=dict(minsize=11, mode="hide"),  # a segment too narrow for its label shows none
        title=f"{plan.model}: one GPU's memory ({plan.kv_dtype} KV, block {plan.block_size}, TP={plan.tp})",
        xaxis=dict(title="GiB", range=[0, max(total, sum(segments.values()) / GiB) * 1.04]),
        yaxis=dict(tickvals=[0], ticktext=["GPU"], range=[-0.8, 0.8], fixedrange=True),
        legend=dict(orientation="h", y=-0.45, traceorder="normal"),
    )
    return fig


def redraw_memory(target: Any, figure: go.Figure) -> None:
    """Redraw ``target`` (a FigureWidget of ``figure_memory``) in place, in one ``batch_update``.

    Copies only what a setting changes (coordinates, labels, title, x range): several times
    cheaper than ``replace_figure``, which reassigns the whole layout.
    """
    if len(target.data) != len(figure.data):
        replace_figure(target, figure)
        return
    with target.batch_update():
        for old, new in zip(target.data, figure.data, strict=True):
            old.x, old.y, old.text = new.x, new.y, new.text
        target.layout.title.text = figure.layout.title.text
        target.layout.xaxis.range = figure.layout.xaxis.range
    keep_for_new_views(target, figure)


def figure_block_size_sweep(plans: Sequence[KVCachePlan], runs: Sequence[FragmentationResult] = (),
                            workload: str = "") -> go.Figure:
    """Concurrency against block size: vLLM's plan (one plan per block size) and, with ``runs``, a simulation.

    The plan counts requests of ``max_model_len`` tokens, which block size barely moves. ``runs``
    (``kvlab.sim.fragmentation.simulate`` results, paged, one per block size) show requests that
    end long before a block is full: each holds at least one block, so larger blocks hold fewer.
    """
    sizes = [p.block_size for p in plans]
    fig = make_subplots(rows=1, cols=2 if runs else 1, horizontal_spacing=0.14, subplot_titles=(
        f"the plan: requests of {plans[0].max_model_len:,} tokens",
        *([f"simulated: {workload}, requests at once"] if runs else [])))
    fig.add_scatter(x=sizes, y=[p.max_concurrency for p in plans], mode="lines+markers",
                    name="max concurrency (vLLM's log)", row=1, col=1)
    fig.add_scatter(x=sizes, y=[p.usable_concurrency for p in plans], mode="lines+markers",
                    name="requests that hold all their blocks", row=1, col=1)
    if runs:
        fig.add_scatter(x=[r.block_size for r in runs], y=[r.mean_running for r in runs], mode="lines+markers",
                        name=f"{workload}: requests running at once (mean)", line=dict(color="#b42318", width=3),
                        row=1, col=2)
    for col in range(1, 3 if runs else 2):
        fig.update_xaxes(title_text="block_size (tokens)", type="log", tickvals=sizes,
                         ticktext=[str(s) for s in sizes], row=1, col=col)
        fig.update_yaxes(title_text="requests", rangemode="tozero", row=1, col=col)
    fig.update_layout(title=f"{plans[0].model}: concurrency against block size", height=400,
                      margin=dict(t=80, b=40), legend=dict(orientation="h", y=-0.25, x=0))
    return fig


def panel_state(
    model: str = "llama-3-70b",
    *,
    gpu_memory_gib: float = 160,
    gpu_memory_utilization: float = 0.92,
    weights_gib: float | None = None,
    weights_dtype: str | None = None,
    non_kv_peak_gib: float = 0.0,
    kv_dtype: str = "bf16",
    block_size: int = 64,
    max_model_len: int = 8192,
    tp: int = 1,
) -> dict[str, Any]:
    """Everything the budget panel shows, as plain values: the pure function behind ``BudgetPanel``."""
    plan = plan_kv_cache(
        model, gpu_memory_gib=gpu_memory_gib, gpu_memory_utilization=gpu_memory_utilization,
        weights_gib=weights_gib, weights_dtype=weights_dtype, non_kv_peak_gib=non_kv_peak_gib,
        kv_dtype=kv_dtype, block_size=block_size, max_model_len=max_model_len, tp=tp,
    )
    rows = [  # (figure, unrounded, as vLLM counts it, usable)
        ("KV budget", format_bytes(max(plan.available_bytes, 0)), format_bytes(plan.kv_pool_bytes), "—"),
        ("blocks", f"{plan.unrounded_blocks:,.2f}", f"{plan.num_blocks:,}", f"{plan.num_usable_blocks:,}"),
        ("token slots", f"{max(plan.available_bytes, 0) / plan.kv_bytes_per_token:,.1f}",
         f"{plan.num_blocks * plan.block_size:,}", f"{plan.usable_tokens:,}"),
        (f"requests of {plan.max_model_len:,} tokens", f"{plan.unrounded_concurrency:.2f}",
         f"{plan.max_concurrency:.2f} → {plan.concurrency}", f"{plan.usable_concurrency}"),
    ]
    return {
        "plan": plan,
        "rows": rows,
        "log": plan.startup_log(),
        "warnings": list(plan.warnings),
        "segments": memory_segments(plan),
        "figure": figure_memory(plan),
    }


def _summary_html(state: dict[str, Any]) -> str:
    plan: KVCachePlan = state["plan"]
    head = "".join(f"<th style='padding:2px 10px;text-align:right'>{h}</th>"
                   for h in ("", "unrounded (bytes)", "as vLLM counts (null block in)", "usable"))
    body = "".join(
        "<tr>" + "".join(f"<td style='padding:2px 10px;text-align:right'>{html.escape(str(c))}</td>" for c in row)
        + "</tr>" for row in state["rows"]
    )
    facts = (f"<p>{format_bytes(plan.kv_bytes_per_token)} of KV per token on this GPU; a block of "
             f"{plan.block_size} tokens is {format_bytes(plan.bytes_per_block)}; one request of "
             f"{plan.max_model_len:,} tokens takes {plan.blocks_per_request:,} blocks.</p>")
    log = "<pre class='kvlab-startup-log' style='margin:4px 0'>" + "\n".join(
        html.escape(f"INFO {line}" if not line.startswith("ValueError") else line) for line in state["log"]
    ) + "</pre>"
    warnings = "".join(
        f"<div class='kvlab-budget-warning' style='border-left:4px solid #b45309;background:#fffbeb;"
        f"padding:4px 10px;margin:4px 0'>⚠ {html.escape(w)}</div>" for w in state["warnings"]
    )
    return f"<table><tr>{head}</tr>{body}</table>{facts}{log}{warnings}"


class BudgetPanel(Panel):
    """Sliders over ``plan_kv_cache``: model, GPU, budget, weights, non-KV peak, KV dtype, block size, length, TP."""

    def __init__(self, preset: str | None = "A") -> None:
        import ipywidgets as w

        wide = w.Layout(width="460px")
        style = {"description_width": "150px"}
        self.model = w.Dropdown(options=list_models(), value="llama-3-70b", description="model", style=style)
        self.gpu_memory_gib = w.FloatSlider(value=160, min=8, max=1200, step=1, description="GPU memory (GiB)",
                                            continuous_update=False, layout=wide, style=style)
        self.gpu_memory_utilization = w.FloatSlider(value=0.92, min=0.05, max=1.0, step=0.01,
                                                    description="gpu_memory_utilization", readout_format=".2f",
                                                    continuous_update=False, layout=wide, style=style)
        self.weights_mode = w.ToggleButtons(options=["auto", "manual"], value="auto", description="weights",
                                            style=style)
        self.weights_dtype = w.Dropdown(options=[AUTO_DTYPE, *WEIGHT_DTYPE_BYTES], value=AUTO_DTYPE,
                                        description="weights dtype (auto)", style=style)
        self.weights_gib = w.BoundedFloatText(value=130, min=0, max=5000, step=0.125,
                                              description="weights (GiB, manual)", style=style)
        self.non_kv_peak_gib = w.FloatSlider(value=0, min=0, max=64, step=0.5, description="non-KV peak (GiB)",
                                             continuous_update=False, layout=wide, style=style)
        self.kv_dtype = w.Dropdown(options=list(KV_DTYPE_BYTES), value="bf16", description="KV dtype", style=style)
        self.block_size = w.Dropdown(options=list(BLOCK_SIZES), value=64, description="block_size", style=style)
        self.max_model_len = w.IntSlider(value=8192, min=128, max=262144, step=128, description="max_model_len",
                                         continuous_update=False, layout=wide, style=style)
        self.tp = w.Dropdown(options=list(TP_SIZES), value=1, description="TP", style=style)
        self.preset_buttons = {name: w.Button(description=f"preset {name}", tooltip=_preset_tip(name))
                               for name in PRESETS}
        self.summary = w.HTML()
        self.errors = error_area()
        self.state: dict[str, Any] = panel_state(**self.settings())
        self.figure = figure_widget(self.state["figure"])
        self.weights_mode.observe(guarded(self._on_weights_mode, self.errors), names="value")  # before the redraw
        self._connect(self.controls, self.preset_buttons, preset)
        self.view = w.VBox([
            w.HBox(list(self.preset_buttons.values())),
            w.HBox([w.VBox([self.model, self.kv_dtype, self.block_size, self.tp]),
                    w.VBox([self.weights_mode, self.weights_dtype, self.weights_gib])]),
            self.gpu_memory_gib, self.gpu_memory_utilization, self.non_kv_peak_gib, self.max_model_len,
            self.errors, self.figure, self.summary,
        ])

    @property
    def controls(self) -> list[Any]:
        """Every control whose value feeds ``panel_state``."""
        return [self.model, self.gpu_memory_gib, self.gpu_memory_utilization, self.weights_mode, self.weights_dtype,
                self.weights_gib, self.non_kv_peak_gib, self.kv_dtype, self.block_size, self.max_model_len, self.tp]

    def settings(self) -> dict[str, Any]:
        """The controls' values as ``panel_state`` keyword arguments."""
        manual = self.weights_mode.value == "manual"
        return {
            "model": self.model.value,
            "gpu_memory_gib": self.gpu_memory_gib.value,
            "gpu_memory_utilization": self.gpu_memory_utilization.value,
            "weights_gib": self.weights_gib.value if manual else None,
            "weights_dtype": None if manual or self.weights_dtype.value == AUTO_DTYPE else self.weights_dtype.value,
            "non_kv_peak_gib": self.non_kv_peak_gib.value,
            "kv_dtype": self.kv_dtype.value,
            "block_size": self.block_size.value,
            "max_model_len": self.max_model_len.value,
            "tp": self.tp.value,
        }

    def apply_preset(self, name: str) -> None:
        """Set every control to preset ``name`` ("A", "B", "C"): what its button does."""
        preset = PRESETS[one_of("name", name, PRESETS)]
        with self.hold():
            self.model.value = preset["model"]
            self.gpu_memory_gib.value = preset["gpu_memory_gib"]
            self.gpu_memory_utilization.value = preset["gpu_memory_utilization"]
            self.weights_mode.value = "manual"
            self.weights_gib.value = preset["weights_gib"]
            self.non_kv_peak_gib.value = 0
            self.kv_dtype.value = preset["kv_dtype"]
            self.block_size.value = preset["block_size"]
            self.max_model_len.value = preset["max_model_len"]
            self.tp.value = preset["tp"]

    def _on_weights_mode(self, change: Any) -> None:
        """Switching to manual starts from the automatic estimate, so the figure does not jump."""
        if change["new"] == "manual" and not self._holding:
            settings = self.settings()
            dtype = None if self.weights_dtype.value == AUTO_DTYPE else self.weights_dtype.value
            estimate = weights_bytes(get_model(settings["model"]), dtype) / settings["tp"] / GiB
            self.weights_gib.value = round(estimate, 3)

    def compute(self) -> dict[str, Any]:
        """``panel_state`` on the controls' values."""
        return panel_state(**self.settings())

    def _render(self) -> None:
        self.summary.value = _summary_html(self.state)
        redraw_memory(self.figure, self.state["figure"])


def _preset_tip(name: str) -> str:
    p = PRESETS[name]
    return (f"{p['model']}, {p['gpu_memory_gib']} GiB, {p['gpu_memory_utilization']}, weights {p['weights_gib']} GiB, "
            f"{p['max_model_len']:,} tokens, TP={p['tp']}")
