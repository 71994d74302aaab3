"""Notebook 06's panel is a thin view over panel_state: a real scheduler run, its numbers and its picture."""

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.loop import run_until_done
from kvlab.core.sched.output import GenerationRequest, SamplingParams
from kvlab.core.sched.scheduler import Scheduler
from kvlab.viz.engine import ServingPanel, figure_compare_runs, figure_engine_history, panel_state


def test_a_roomy_pool_never_preempts_and_a_tight_one_does():
    roomy, tight = panel_state(160, 256, 8, True), panel_state(12, 256, 8, True)
    assert roomy["num_preemptions"] == 0 and tight["num_preemptions"] > 0
    assert tight["peak_usage"] == 1.0 and roomy["peak_usage"] < 1.0


def test_prefix_caching_saves_exactly_the_tokens_it_hits():
    on, off = panel_state(160, 256, 8, True), panel_state(160, 256, 8, False)
    assert off["prefix_cache_hit_rate"] == 0 < on["prefix_cache_hit_rate"]
    hits = sum(h.prefix_cache_stats.hits for h in on["history"])
    assert off["tokens_computed"] - on["tokens_computed"] == hits


def test_the_history_figure_marks_each_preempting_step():
    scheduler = Scheduler(KVCacheManager(8, 4, hash_seed="0"), max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(GenerationRequest(f"r{i}", [10 * i + t for t in range(7)], SamplingParams(max_tokens=6)))
    history = run_until_done(scheduler)
    fig = figure_engine_history(history)
    (marks,) = [t for t in fig.data if t.name == "preemption"]
    assert list(marks.x) == [h.step for h in history if h.num_preempted_reqs] != []
    bars = figure_compare_runs({"a": {"x": 1.0, "y": 2.0}, "b": {"x": 3.0, "y": 4.0}}, "t").data
    assert [(b.name, b.y[0]) for b in bars] == [("a", 1.0), ("a", 2.0), ("b", 3.0), ("b", 4.0)]


def test_controls_drive_the_state():
    panel = ServingPanel(num_blocks=160)
    assert panel.state["num_preemptions"] == 0
    panel.num_blocks.value = 12
    assert panel.state["num_preemptions"] > 0
    assert "preemptions" in panel.summary.value and not panel.errors.outputs
    panel.enable_prefix_caching.value = False
    assert panel.state["prefix_cache_hit_rate"] == 0
