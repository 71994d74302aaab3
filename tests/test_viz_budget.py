"""Notebook 02's panel and figures are thin views: the numbers are the library's, errors and warnings show."""

import pytest

from kvlab import GiB
from kvlab.capacity.budget import plan_kv_cache, plan_preset
from kvlab.sim.fragmentation import CATEGORIES, simulate
from kvlab.sim.workloads import alpaca_like, sharegpt_like
from kvlab.viz.budget import BudgetPanel, figure_block_size_sweep, figure_memory, memory_segments, panel_state
from kvlab.viz.fragmentation import figure_breakdown, figure_lengths


def test_panel_state_is_the_library_plan():
    state = panel_state("llama-3-70b", gpu_memory_gib=160, weights_gib=130, max_model_len=8192)
    assert state["plan"] == plan_preset("A")
    assert state["log"] == plan_preset("A").startup_log()
    bars = [t for t in state["figure"].data if t.type == "bar"]
    assert [t.name for t in bars] == list(memory_segments(state["plan"]))


def test_memory_segments_add_up_to_the_gpu_when_the_plan_fits():
    plan = plan_preset("B")
    segments = memory_segments(plan)
    assert sum(segments.values()) == plan.gpu_memory_bytes
    assert segments["KV pool"] == plan.num_blocks * plan.bytes_per_block
    fig = figure_memory(plan)
    assert [d.x[0] for d in fig.data if d.type == "bar"] == pytest.approx([v / GiB for v in segments.values()])
    lines = [d.x[0] for d in fig.data if d.type == "scatter"]
    assert lines == pytest.approx([plan.requested_bytes / GiB, 141])


def test_the_panel_redraws_in_place_with_the_new_numbers():
    panel = BudgetPanel()
    widget = panel.figure
    panel.gpu_memory_gib.value = 200
    assert panel.figure is widget
    assert [d.x for d in widget.data] == [d.x for d in panel.state["figure"].data]
    assert widget.layout.title.text == panel.state["figure"].layout.title.text


def test_presets_are_one_call_and_preset_c_shows_its_warning():
    panel = BudgetPanel()
    assert panel.state["plan"] == plan_preset("A")
    panel.apply_preset("C")
    assert panel.state["plan"] == plan_preset("C") and panel.state["plan"].concurrency == 0
    assert "kvlab-budget-warning" in panel.summary.value and "131,072" in panel.summary.value
    panel.apply_preset("B")
    assert panel.state["plan"].concurrency == 24 and "kvlab-budget-warning" not in panel.summary.value
    assert "Maximum concurrency for 32,768 tokens per request: 24.06x" in panel.summary.value


def test_controls_drive_the_state():
    panel = BudgetPanel()
    panel.kv_dtype.value = "fp8"
    assert panel.state["plan"].concurrency == 13
    panel.weights_mode.value = "auto"
    panel.weights_dtype.value = "fp8"
    assert panel.state["plan"].concurrency == 65
    panel.weights_mode.value = "manual"  # starts from the automatic estimate
    assert panel.weights_gib.value == pytest.approx(70_553_706_496 / GiB, abs=1e-3)
    panel.max_model_len.value = 131072
    assert panel.state["plan"] == plan_kv_cache("llama-3-70b", gpu_memory_gib=160, weights_gib=panel.weights_gib.value,
                                                kv_dtype="fp8", block_size=64, max_model_len=131072)
    panel.tp.value = 8
    assert panel.state["plan"].kv_bytes_per_token == plan_kv_cache(
        "llama-3-70b", gpu_memory_gib=160, tp=8, kv_dtype="fp8", max_model_len=1).kv_bytes_per_token


def test_a_refused_setting_shows_its_error_in_the_panel_and_changes_nothing(monkeypatch):
    import kvlab.viz.budget as viz
    from kvlab.errors import KvlabValueError

    panel = BudgetPanel()
    before = panel.state

    def refuse(*args, **kwargs):
        raise KvlabValueError("max_model_len must be a positive integer, got 0")

    monkeypatch.setattr(viz, "plan_kv_cache", refuse)
    panel.max_model_len.value = 4096
    assert panel.state is before
    assert "kvlab-callback-error" in str(panel.errors.outputs) and "max_model_len" in str(panel.errors.outputs)
    monkeypatch.undo()
    panel.max_model_len.value = 8192
    assert panel.errors.outputs == () and panel.state["plan"] == plan_preset("A")


def test_every_model_and_tp_the_panel_offers_plans_with_automatic_weights():
    panel = BudgetPanel(preset=None)
    for model in panel.model.options:
        for tp in panel.tp.options:
            plan = plan_kv_cache(model, gpu_memory_gib=80, max_model_len=8192, tp=tp)  # must not raise
            assert plan.weights_bytes > 0 and plan.tp == tp


def test_block_size_sweep_figure_has_both_lines():
    plans = [plan_kv_cache("llama-3-70b", gpu_memory_gib=160, weights_gib=130, block_size=b, max_model_len=8192)
             for b in (16, 64, 256)]
    fig = figure_block_size_sweep(plans)
    assert [list(t.x) for t in fig.data] == [[16, 64, 256]] * 2
    assert list(fig.data[1].y) == [p.usable_concurrency for p in plans]
    runs = [simulate(alpaca_like(200, seed=1), pool_tokens=4096, max_model_len=2048, policy="paged", block_size=b)
            for b in (16, 64, 256)]
    fig = figure_block_size_sweep(plans, runs, "200 Alpaca-like requests")
    assert len(fig.data) == 3 and list(fig.data[2].y) == [r.mean_running for r in runs]
    assert fig.data[2].xaxis == "x2" and "Alpaca" in fig.layout.annotations[1].text   # its own panel, titled


def test_breakdown_figure_stacks_every_category_for_every_run():
    requests = sharegpt_like(200, seed=1)
    runs = [simulate(requests, pool_tokens=8192, max_model_len=2048, policy=p) for p in ("max", "paged")]
    fig = figure_breakdown(runs)
    assert len(fig.data) == len(CATEGORIES)
    assert list(fig.data[0].x) == ["max", "paged (block 16)"]
    for i, run in enumerate(runs):
        assert sum(trace.y[i] for trace in fig.data) == pytest.approx(100)
        assert fig.data[0].y[i] == pytest.approx(100 * run.utilization)


def test_lengths_figure_reports_the_means():
    requests = [(10, 30), (20, 50)]
    fig = figure_lengths(requests)
    assert [t.name for t in fig.data] == ["prompt (input): mean 15.0", "output: mean 40.0"]
