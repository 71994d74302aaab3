"""Notebook 09's panel is a thin view over absorb_state: the counts of kvlab.capacity.mla, and a figure with data."""

from kvlab import get_model
from kvlab.capacity.mla import absorb_crossover, mla_attention_cost
from kvlab.capacity.parallel import plan_parallel
from kvlab.viz.mla import AbsorbPanel, absorb_state, figure_parallel


def test_the_state_is_the_library_count():
    state = absorb_state("deepseek-v3", 1, 4096)
    cost = mla_attention_cost(get_model("deepseek-v3"), 1, 4096)
    assert state["flops_ratio"] == cost.flops_ratio and state["bytes_read_ratio"] == cost.bytes_read_ratio
    assert (state["fewer_flops"], state["fewer_bytes_read"]) == ("absorbed", "absorbed")
    assert state["crossover"] == absorb_crossover(get_model("deepseek-v3"), 4096)
    assert len(state["figure"].data) == 4                                  # two paths x (FLOPs, bytes)


def test_controls_drive_the_state():
    panel = AbsorbPanel()
    panel.context_len.value = 0
    panel.query_len.value = 64
    assert panel.state["fewer_flops"] == "naive" and panel.state["fewer_bytes_read"] == "naive"
    panel.kv_dtype.value = "fp8"
    assert panel.state["cost"] == mla_attention_cost(get_model("deepseek-v3"), 64, 0, kv_dtype="fp8")
    assert not panel.errors.outputs


def test_the_parallel_figure_shows_both_layouts():
    plans = {layout: plan_parallel("deepseek-v3", layout, num_gpus=8, gpu_memory_gib=141, max_model_len=32768)
             for layout in ("tp", "dp_attention")}
    fig = figure_parallel(plans)
    assert [t.name for t in fig.data] == ["weights", "KV pool", "requests"]
    assert list(fig.data[2].y) == [plans["tp"].requests, plans["dp_attention"].requests]


def test_the_cost_figure_labels_only_full_size_ticks():
    """Plotly's own log ticks print the 2s and 5s of each decade at 9 px, too small to read when projected."""
    fig = absorb_state("deepseek-v3", 64, 4096)["figure"]
    for axis in (fig.layout.xaxis, fig.layout.xaxis2):
        assert axis.type == "log" and list(axis.tickvals) == [1, 10, 100, 1000]
    assert (fig.layout.yaxis.dtick, fig.layout.yaxis2.dtick) == (1, 1)
