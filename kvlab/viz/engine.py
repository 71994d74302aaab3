"""Notebook 06's pictures and control panel: a serving run step by step, and a scheduler you can squeeze.

``figure_engine_history`` draws one run from its per-step ``SchedulerStats``: KV cache usage
with the preemptions marked, running and waiting requests, and the tokens of each step split
into prefill and decode. ``ServingPanel`` replays a seeded shared-system-prompt workload
through the real scheduler and ``KVCacheManager`` with the no-compute executor, so the pool
size and token budget can be dragged and the consequences seen at once. ``figure_throughput``
and ``throughput_table`` show ``benchmarks/bench_throughput.py``'s saved measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.loop import NoComputeExecutor, run_until_done
from kvlab.core.sched.output import GenerationRequest, SamplingParams, SchedulerStats
from kvlab.core.sched.scheduler import Scheduler
from kvlab.sim.prefix_sim import shared_prompt_workload
from kvlab.viz.canvas import wrap
from kvlab.viz.widgets import error_area, figure_widget, guarded, replace_figure

COLOURS = {"usage": "#1d4ed8", "running": "#16a34a", "waiting": "#f59e0b", "preempted": "#b42318",
           "prefill": "#7c3aed", "decode": "#0891b2"}


def figure_engine_history(history: Sequence[SchedulerStats], title: str = "One serving run, step by step") -> go.Figure:
    """Three panels over the steps: KV usage (preemptions marked), running/waiting, tokens per step."""
    steps = [h.step for h in history]
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("KV cache usage", "requests", "tokens computed in the step"))
    fig.add_scatter(x=steps, y=[100 * h.kv_cache_usage for h in history], mode="lines", name="KV cache usage %",
                    line=dict(color=COLOURS["usage"]), row=1, col=1)
    preempting = [h for h in history if h.num_preempted_reqs]
    fig.add_scatter(x=[h.step for h in preempting], y=[100 * h.kv_cache_usage for h in preempting], mode="markers",
                    marker=dict(symbol="x", size=11, color=COLOURS["preempted"]),
                    name="preemption", text=[f"{h.num_preempted_reqs} preempted" for h in preempting], row=1, col=1)
    for key, label in (("num_running_reqs", "running"), ("num_waiting_reqs", "waiting")):
        fig.add_scatter(x=steps, y=[getattr(h, key) for h in history], mode="lines", line_shape="hv", name=label,
                        line=dict(color=COLOURS[label]), row=2, col=1)
    for key, label in (("num_prefill_tokens", "prefill"), ("num_decode_tokens", "decode")):
        fig.add_bar(x=steps, y=[getattr(h, key) for h in history], name=f"{label} tokens",
                    marker_color=COLOURS[label], row=3, col=1)
    fig.update_layout(title=title, barmode="stack", height=560, margin=dict(t=70, b=40), legend=dict(x=1.02, y=1))
    fig.update_yaxes(title_text="%", range=[0, 105], row=1, col=1)
    fig.update_xaxes(title_text="engine step", row=3, col=1)
    return fig


def figure_compare_runs(runs: dict[str, dict[str, float]], title: str) -> go.Figure:
    """One small bar chart per measure (each with its own scale), one bar per run: ``{run: {measure: value}}``."""
    measures = list(next(iter(runs.values())))
    fig = make_subplots(rows=1, cols=len(measures), subplot_titles=measures)
    palette = ["#1d4ed8", "#f59e0b", "#16a34a", "#b42318"]
    for i, (name, values) in enumerate(runs.items()):
        for col, measure in enumerate(measures, start=1):
            fig.add_bar(name=name, x=[name], y=[values[measure]], marker_color=palette[i % len(palette)],
                        text=[f"{values[measure]:.3g}"], textposition="outside", showlegend=col == 1,
                        row=1, col=col)
    lines = wrap(title, 700, 16)  # a long title (a machine's name) wraps rather than runs out of the figure
    fig.update_layout(title="<br>".join(lines), height=360 + 20 * len(lines), margin=dict(t=70 + 20 * len(lines), b=40),
                      bargap=0.3)
    fig.update_xaxes(showticklabels=False)
    return fig


THROUGHPUT_SYSTEMS = {"kvlab": ("kvlab engine (torch backend)", "#1d4ed8"),
                      "static_batch": ("transformers, padded static batch", "#f59e0b"),
                      "one_at_a_time": ("transformers, one at a time", "#b42318")}


def throughput_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per concurrency: tokens/s (wall, CPU), time per output token and peak KV tokens per system."""
    table = []
    for r in rows:
        row: dict[str, Any] = {"concurrency": r["concurrency"]}
        for system in THROUGHPUT_SYSTEMS:
            m = r[system]
            row |= {f"{system} tok/s": round(m["tokens_per_s"]), f"{system} tok/cpu-s": round(m["tokens_per_cpu_s"]),
                    f"{system} tpot ms": round(m["tpot_ms"], 1)}
        row |= {"kvlab peak KV tokens": r["kvlab"]["peak_kv_tokens"],
                "static peak KV tokens": r["static_batch"]["peak_kv_tokens"]}
        table.append(row)
    return table


def figure_throughput(rows: Sequence[dict[str, Any]], title: str) -> go.Figure:
    """Tokens per second (wall, and per CPU-second dashed) against concurrent requests, one line per system."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("output tokens per second", "time per output token (ms)"))
    x = [r["concurrency"] for r in rows]
    for system, (label, colour) in THROUGHPUT_SYSTEMS.items():
        fig.add_scatter(x=x, y=[r[system]["tokens_per_s"] for r in rows], name=f"{label}, wall", mode="lines+markers",
                        line=dict(color=colour), row=1, col=1)
        fig.add_scatter(x=x, y=[r[system]["tokens_per_cpu_s"] for r in rows], name=f"{label}, per CPU-second",
                        mode="lines", line=dict(color=colour, dash="dot"), row=1, col=1)
        fig.add_scatter(x=x, y=[r[system]["tpot_ms"] for r in rows], name=label, mode="lines+markers",
                        line=dict(color=colour), showlegend=False, row=1, col=2)
    lines = wrap(title, 700, 16)
    fig.update_layout(title="<br>".join(lines), height=440 + 20 * len(lines),
                      margin=dict(t=70 + 20 * len(lines), b=120), legend=dict(orientation="h", y=-0.25, x=0))
    fig.update_xaxes(type="log", dtick=0.30103, title_text="concurrent requests")
    return fig


def panel_state(num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int, enable_prefix_caching: bool,
                block_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """Serve a seeded workload (12 questions behind 2 system prompts) with no model; the panel's numbers."""
    workload = shared_prompt_workload(num_requests=12, num_system_prompts=2, system_len=96, question_len=24,
                                      reply_len=24, seed=seed)
    manager = KVCacheManager(num_blocks, block_size, enable_caching=enable_prefix_caching, hash_seed=str(seed))
    scheduler = Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=4096)
    for w in workload:
        scheduler.add_request(GenerationRequest(w.request_id, w.prompt_token_ids,
                                                SamplingParams(max_tokens=len(w.output_token_ids), ignore_eos=True)))
    history = run_until_done(scheduler, NoComputeExecutor())
    queries = sum(h.prefix_cache_stats.queries for h in history)
    hits = sum(h.prefix_cache_stats.hits for h in history)
    return {
        "history": history,
        "steps": len(history),
        "num_preemptions": scheduler.num_preemptions,
        "tokens_computed": sum(h.num_scheduled_tokens for h in history),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "peak_usage": max(h.kv_cache_usage for h in history),
        "figure": figure_engine_history(history, title=f"{num_blocks} blocks, budget {max_num_batched_tokens} "
                                                       f"tokens, {max_num_seqs} sequences at most"),
    }


class ServingPanel:
    """Pool size, token budget, sequence cap and prefix caching over a no-compute serving run."""

    def __init__(self, num_blocks: int = 64, max_num_batched_tokens: int = 256, max_num_seqs: int = 8,
                 enable_prefix_caching: bool = True) -> None:
        import ipywidgets as w

        style = dict(continuous_update=False, layout=w.Layout(width="420px"), style={"description_width": "170px"})
        self.num_blocks = w.IntSlider(value=num_blocks, min=12, max=160, description="KV blocks (16 tokens)", **style)
        self.max_num_batched_tokens = w.IntSlider(value=max_num_batched_tokens, min=16, max=1024, step=16,
                                                  description="max_num_batched_tokens", **style)
        self.max_num_seqs = w.IntSlider(value=max_num_seqs, min=1, max=12, description="max_num_seqs", **style)
        self.enable_prefix_caching = w.Checkbox(value=enable_prefix_caching, description="prefix caching")
        self.summary = w.HTML()
        self.errors = error_area()
        self.state: dict[str, Any] = self._compute()
        self.figure = figure_widget(self.state["figure"])
        for control in (self.num_blocks, self.max_num_batched_tokens, self.max_num_seqs, self.enable_prefix_caching):
            control.observe(guarded(self._update, self.errors), names="value")
        self.summary.value = self._summary()
        # The two columns of controls wrap under each other where the notebook is narrow (a sidebar open).
        self.view = w.VBox([w.HBox([w.VBox([self.num_blocks, self.max_num_batched_tokens]),
                                    w.VBox([self.max_num_seqs, self.enable_prefix_caching])],
                                   layout=w.Layout(flex_flow="row wrap")),
                            self.errors, self.summary, self.figure])

    def _compute(self) -> dict[str, Any]:
        return panel_state(self.num_blocks.value, self.max_num_batched_tokens.value, self.max_num_seqs.value,
                           self.enable_prefix_caching.value)

    def _summary(self) -> str:
        s = self.state
        return (f"<p><b>{s['steps']}</b> steps, <b>{s['tokens_computed']:,}</b> tokens computed, "
                f"<b>{s['num_preemptions']}</b> preemptions, prefix-cache hit rate <b>{s['prefix_cache_hit_rate']:.0%}"
                f"</b>, peak KV usage <b>{s['peak_usage']:.0%}</b>.</p>")

    def _update(self, _change: Any = None) -> None:
        self.state = self._compute()
        self.summary.value = self._summary()
        replace_figure(self.figure, self.state["figure"])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.view)
