"""Notebook 07's capacity-planning panel: a thin view over ``kvlab.capacity.playbook.plan_deployment``.

``panel_state`` is the pure function behind ``PlaybookPanel``; tests and notebook cells call
it directly, and the panel keeps its last result in ``panel.state``.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from kvlab._validate import one_of
from kvlab.capacity.hardware import list_gpus
from kvlab.capacity.models import WEIGHT_DTYPE_BYTES, list_models
from kvlab.capacity.playbook import Deployment, PlaybookResult, Workload, concurrency_at, plan_deployment
from kvlab.capacity.sizing import KV_DTYPE_BYTES
from kvlab.capacity.source_deployments import SOURCE_DEPLOYMENTS
from kvlab.units import format_bytes
from kvlab.viz.canvas import log_axis
from kvlab.viz.widgets import Panel, error_area, figure_widget, replace_figure

CHECKPOINT = "checkpoint"  # the weights dtype the model's config declares
TP_SIZES = (1, 2, 4, 8)
BAND_COLOURS = {"< 10": "#b42318", "10 to 50": "#b45309", ">= 50": "#1b7f3b"}


def figure_levers(result: PlaybookResult) -> go.Figure:
    """Horizontal bars: the deployment as configured, then each applicable lever in rank order.

    Two bars per row: vLLM's logged maximum concurrency, and the requests of the workload's
    typical length held at once. The traces are the same for every setting, so the panel can
    redraw by copying coordinates.
    """
    rows = [("as configured", result.max_concurrency, result.concurrency_typical)]
    rows += [(lever.name, lever.max_concurrency, lever.concurrency_typical)
             for lever in result.levers if lever.applicable]
    names = [r[0] for r in rows][::-1]
    fig = go.Figure()
    fig.add_bar(name=f"max concurrency at {result.deployment.max_model_len:,} tokens (vLLM's log)",
                y=names, x=[r[1] for r in rows][::-1], orientation="h", marker_color="#2563eb",
                text=[f"{r[1]:.2f}x" for r in rows][::-1], textposition="outside")
    fig.add_bar(name=f"requests of {result.workload.typical_tokens:,} tokens held at once",
                y=names, x=[r[2] for r in rows][::-1], orientation="h", marker_color="#16a34a",
                text=[str(r[2]) for r in rows][::-1], textposition="outside")
    spec = result.deployment.spec
    fig.update_layout(
        barmode="group", height=120 + 48 * len(rows), margin=dict(t=60, b=40, l=10, r=40),
        title=f"{spec.name} on {result.deployment.tp} x {result.deployment.gpu_spec.name}: what each lever buys",
        xaxis=dict(title="requests", rangemode="tozero"), legend=dict(orientation="h", y=-0.15),
    )
    return fig


def figure_shared_prefix(deployment: Deployment, workload: Workload, num_points: int = 20) -> go.Figure:
    """Requests of the workload's typical length held at once, against the share of the prompt they share."""
    plan = deployment.plan()
    shares = [i / num_points for i in range(num_points + 1)]
    counts = [concurrency_at(plan.num_usable_blocks, plan.block_size, workload.typical_tokens,
                             Workload(workload.mean_prompt_tokens, workload.mean_output_tokens, s).shared_prefix_tokens)
              for s in shares]
    fig = go.Figure()
    fig.add_scatter(x=[100 * s for s in shares], y=counts, mode="lines+markers", name="typical requests at once",
                    line=dict(color="#16a34a", width=3))
    fig.add_scatter(x=[0, 100], y=[plan.max_concurrency] * 2, mode="lines", line=dict(color="#2563eb", dash="dash"),
                    name=f"vLLM's logged max concurrency ({deployment.max_model_len:,} tokens each)")
    fig.update_layout(
        title=(f"{deployment.spec.name} on {deployment.gpu_spec.name}: requests of {workload.typical_tokens:,} tokens "
               "held at once"),
        xaxis_title="share of the prompt that every request shares (%)",
        yaxis=log_axis([*counts, plan.max_concurrency], "requests"),
        height=380, margin=dict(t=60, b=40), legend=dict(orientation="h", y=-0.25),
    )
    return fig


def figure_source_vs_exact(rows: Sequence[dict[str, Any]]) -> go.Figure:
    """Grouped bars per worked deployment: the source's concurrency, its arithmetic redone, kvlab's exact log."""
    fig = go.Figure()
    labels = [r["deployment"].split(")")[0] + ")" for r in rows]
    for key, name, colour in (("source arithmetic: concurrency", "the source's arithmetic", "#9ca3af"),
                              ("exact: concurrency (vLLM log)", "exact: real config, real GPU memory", "#2563eb")):
        values = [float(r[key].rstrip("x")) for r in rows]
        fig.add_bar(name=name, x=labels, y=values, marker_color=colour, text=[f"{v:.2f}x" for v in values],
                    textposition="outside")
    fig.update_layout(barmode="group", height=360, title="Maximum concurrency: the source's figures against exact",
                      yaxis=dict(title="requests of max_model_len", rangemode="tozero"), margin=dict(t=60, b=40))
    return fig


def panel_state(
    model: str = "qwen3-8b",
    gpu: str = "L40S",
    *,
    tp: int = 1,
    max_model_len: int = 8192,
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = 0.92,
    weights_dtype: str | None = None,
    non_kv_gib: float = 0.0,
    mean_prompt_tokens: int = 1000,
    mean_output_tokens: int = 500,
    shared_prefix: float = 0.0,
    rank_by: str = "max_model_len",
) -> dict[str, Any]:
    """Everything the playbook panel shows, as plain values: the pure function behind ``PlaybookPanel``."""
    deployment = Deployment(model, gpu, max_model_len=max_model_len, tp=tp, kv_dtype=kv_dtype,
                            gpu_memory_utilization=gpu_memory_utilization, weights_dtype=weights_dtype,
                            non_kv_gib=non_kv_gib)
    workload = Workload(mean_prompt_tokens, mean_output_tokens, shared_prefix)
    result = plan_deployment(deployment, workload, rank_by=rank_by)  # type: ignore[arg-type]
    return {"result": result, "log": list(result.startup_log), "decision": result.decision,
            "levers": [lever.name for lever in result.levers if lever.applicable],
            "warnings": list(result.warnings), "figure": figure_levers(result)}


def _summary_html(state: dict[str, Any]) -> str:
    result: PlaybookResult = state["result"]
    plan, d = result.plan, result.deployment
    log = "<pre class='kvlab-startup-log' style='margin:4px 0'>" + "\n".join(
        html.escape(line if line.startswith("ValueError") else f"INFO {line}") for line in state["log"]) + "</pre>"
    colour = BAND_COLOURS[result.decision.band]
    decision = (f"<div class='kvlab-decision' style='border-left:4px solid {colour};padding:4px 10px;margin:4px 0'>"
                f"<b>Maximum concurrency {result.max_concurrency:.2f}x: band {html.escape(result.decision.band)}.</b> "
                f"{html.escape(result.decision.verdict)} Try, in order: "
                f"{html.escape('; '.join(result.decision.steps))}.</div>")
    facts = (f"<p>{format_bytes(plan.kv_bytes_per_token)} of KV per token on each of the {d.tp} GPU(s); "
             f"{plan.num_usable_blocks:,} usable blocks of {plan.block_size} tokens. Requests held whole at once: "
             f"<b>{result.concurrency_max_model_len}</b> of {d.max_model_len:,} tokens, "
             f"<b>{result.concurrency_typical}</b> of the workload's {result.workload.typical_tokens:,} "
             f"(shared prefix {result.workload.shared_prefix_tokens:,} tokens, stored once).</p>")
    head = "".join(f"<th style='padding:2px 8px;text-align:left'>{h}</th>" for h in
                   ("lever", "setting", "max concurrency", "typical", "what it costs"))
    body = "".join(
        "<tr>" + "".join(f"<td style='padding:2px 8px;vertical-align:top'>{c}</td>" for c in (
            html.escape(lever.name), f"<code>{html.escape(lever.flag)}</code>",
            f"{lever.max_concurrency:.2f}x ({lever.gain_max_concurrency:+.2f})" if lever.applicable else "—",
            f"{lever.concurrency_typical} ({lever.gain_typical:+d})" if lever.applicable else "—",
            html.escape(lever.cost))) + "</tr>" for lever in result.levers)
    warnings = "".join(
        f"<div class='kvlab-budget-warning' style='border-left:4px solid #b45309;background:#fffbeb;"
        f"padding:4px 10px;margin:4px 0'>⚠ {html.escape(w)}</div>" for w in state["warnings"])
    return f"{log}{decision}{facts}<table class='kvlab-levers'><tr>{head}</tr>{body}</table>{warnings}"


class PlaybookPanel(Panel):
    """Model, GPU, TP, context, KV dtype, utilization, weights and workload over the playbook's answer."""

    def __init__(self, preset: str | None = "a") -> None:
        import ipywidgets as w

        style = {"description_width": "170px"}
        wide = w.Layout(width="480px")
        self.model = w.Dropdown(options=list_models(), value="qwen3-8b", description="model", style=style)
        self.gpu = w.Dropdown(options=list_gpus(), value="L40S", description="GPU", style=style)
        self.tp = w.Dropdown(options=list(TP_SIZES), value=1, description="tensor parallel", style=style)
        self.max_model_len = w.BoundedIntText(value=8192, min=256, max=1_048_576, step=1024,
                                              description="max_model_len", style=style)
        self.kv_dtype = w.Dropdown(options=list(KV_DTYPE_BYTES), value="bf16", description="KV dtype", style=style)
        self.weights_dtype = w.Dropdown(options=[CHECKPOINT, *WEIGHT_DTYPE_BYTES], value=CHECKPOINT,
                                        description="weights dtype", style=style)
        self.gpu_memory_utilization = w.FloatSlider(value=0.92, min=0.5, max=0.99, step=0.01, readout_format=".2f",
                                                    description="gpu_memory_utilization", continuous_update=False,
                                                    layout=wide, style=style)
        self.non_kv_gib = w.BoundedFloatText(value=0.0, min=0, max=64, step=0.25, description="non-KV memory (GiB)",
                                             style=style)
        self.mean_prompt_tokens = w.BoundedIntText(value=1000, min=1, max=1_000_000, description="mean prompt",
                                                   style=style)
        self.mean_output_tokens = w.BoundedIntText(value=500, min=0, max=1_000_000, description="mean output",
                                                   style=style)
        self.shared_prefix = w.FloatSlider(value=0.0, min=0, max=1, step=0.05, readout_format=".2f",
                                           description="shared prefix (of prompt)", continuous_update=False,
                                           layout=wide, style=style)
        self.rank_by = w.ToggleButtons(options=["max_model_len", "typical"], value="max_model_len",
                                       description="rank levers by", style=style)
        self.preset_buttons = {key: w.Button(description=f"deployment ({key})", tooltip=source.title)
                               for key, source in SOURCE_DEPLOYMENTS.items()}
        self.summary = w.HTML()
        self.errors = error_area()
        self.state: dict[str, Any] = panel_state(**self.settings())
        self.figure = figure_widget(self.state["figure"])
        self._connect(self.controls, self.preset_buttons, preset)
        self.view = w.VBox([
            w.HBox(list(self.preset_buttons.values())),
            w.HBox([w.VBox([self.model, self.gpu, self.tp, self.max_model_len]),
                    w.VBox([self.kv_dtype, self.weights_dtype, self.mean_prompt_tokens, self.mean_output_tokens])]),
            self.gpu_memory_utilization, self.non_kv_gib, self.shared_prefix, self.rank_by,
            self.errors, self.summary, self.figure,
        ])

    @property
    def controls(self) -> list[Any]:
        """Every control whose value feeds ``panel_state``."""
        return [self.model, self.gpu, self.tp, self.max_model_len, self.kv_dtype, self.weights_dtype,
                self.gpu_memory_utilization, self.non_kv_gib, self.mean_prompt_tokens, self.mean_output_tokens,
                self.shared_prefix, self.rank_by]

    def settings(self) -> dict[str, Any]:
        """The controls' values as ``panel_state`` keyword arguments."""
        return {
            "model": self.model.value, "gpu": self.gpu.value, "tp": self.tp.value,
            "max_model_len": self.max_model_len.value, "kv_dtype": self.kv_dtype.value,
            "weights_dtype": None if self.weights_dtype.value == CHECKPOINT else self.weights_dtype.value,
            "gpu_memory_utilization": self.gpu_memory_utilization.value, "non_kv_gib": self.non_kv_gib.value,
            "mean_prompt_tokens": self.mean_prompt_tokens.value, "mean_output_tokens": self.mean_output_tokens.value,
            "shared_prefix": self.shared_prefix.value, "rank_by": self.rank_by.value,
        }

    def apply_preset(self, key: str) -> None:
        """Load the source material's worked deployment ``key`` ("a", "b" or "c"): what its button does."""
        source = SOURCE_DEPLOYMENTS[one_of("key", key, SOURCE_DEPLOYMENTS)]
        d, wl = source.deployment, source.workload
        with self.hold():
            self.model.value = d.model if isinstance(d.model, str) else d.spec.name
            self.gpu.value = d.gpu if isinstance(d.gpu, str) else d.gpu_spec.name
            self.tp.value = d.tp
            self.max_model_len.value = d.max_model_len
            self.kv_dtype.value = d.kv_dtype
            self.weights_dtype.value = d.weights_dtype or CHECKPOINT
            self.gpu_memory_utilization.value = d.gpu_memory_utilization
            self.non_kv_gib.value = d.non_kv_gib
            self.mean_prompt_tokens.value = wl.mean_prompt_tokens
            self.mean_output_tokens.value = wl.mean_output_tokens
            self.shared_prefix.value = wl.shared_prefix

    def compute(self) -> dict[str, Any]:
        """``panel_state`` on the controls' values."""
        return panel_state(**self.settings())

    def _render(self) -> None:
        self.summary.value = _summary_html(self.state)
        replace_figure(self.figure, self.state["figure"])
