"""Notebook 04's pictures and panel are thin views: the numbers are the library's, errors are visible."""

import pytest

import kvlab.viz.prefix_cache as viz
from kvlab.core.kv_cache_manager import KVCacheManager, Request
from kvlab.errors import UnknownNameError
from kvlab.sim.prefix_sim import WORKLOADS, simulate


def test_panel_state_is_the_simulation_at_that_pool_size():
    state = viz.panel_state("shared system prompt", 100)
    assert state["result"] == simulate(WORKLOADS["shared system prompt"](), 100)
    assert state["sweep_sizes"][0] <= 100 <= viz.MAX_POOL_SIZE
    assert len(state["sweep"]) == len(state["sweep_sizes"])
    assert [t.name for t in state["figure"].data] == [
        "hit rate", "blocks evicted before reuse", "this pool", "hit (not prefilled)", "prefilled"]
    with pytest.raises(UnknownNameError, match="multi-turn chat"):
        viz.panel_state("batch jobs", 100)


def test_controls_drive_the_state_and_errors_show_in_the_panel(monkeypatch):
    panel = viz.PrefixCachePanel("multi-turn chat", 60)
    panel.num_blocks.value = 200
    assert panel.state["result"].num_blocks == 200 and panel.state["result"].num_blocks_evicted_before_reuse == 0
    panel.workload.value = "shared system prompt"
    assert panel.state["workload"] == "shared system prompt"
    before = panel.state

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(viz, "simulate", broken)
    panel.num_blocks.value = 120
    assert panel.state is before and "simulated failure" in str(panel.errors.outputs)


def test_block_statuses_and_hit_map():
    manager = KVCacheManager(20, 4)
    first = Request("a", list(range(10)))
    hits, n, _ = manager.get_computed_blocks(first)
    manager.allocate_slots(first, 10)
    second = Request("b", list(range(8)) + [99] * 7)
    assert viz.block_statuses(manager, second) == ["hit", "hit", "computed", "partial"]
    fig = viz.figure_hit_map({"b": viz.block_statuses(manager, second)})
    assert [t.name for t in fig.data] == ["hit", "computed", "partial"] and list(fig.data[0].base) == [-0.5, 0.5]


def test_free_queue_and_hash_cost_figures():
    manager = KVCacheManager(6, 4)
    request = Request("a", list(range(6)))
    manager.allocate_slots(request, 6)
    manager.free(request)
    fig = viz.figure_free_queue(manager.block_pool)
    assert list(fig.data[0].text) == ["2", "3", "4", "5", "1*"]
    rows = [{"hash_fn": "sha256", "block_size": 16, "seconds_per_block": 1e-6},
            {"hash_fn": "xxhash", "block_size": 64, "seconds_per_block": 2e-6}]
    fig = viz.figure_hash_cost(rows, {"prefill": 5e-4})
    assert [t.type for t in fig.data] == ["bar", "bar", "scatter"] and fig.layout.yaxis.type == "log"
