"""Notebook 04's pictures and panel are thin views: the numbers are the library's, errors are visible."""

import pytest

import kvlab.viz.prefix_cache as viz
from kvlab.core.kv_cache_manager import KVCacheManager, Request
from kvlab.core.kv_cache_utils import short_hash
from kvlab.errors import UnknownNameError
from kvlab.sim.prefix_sim import WORKLOADS, admit, simulate, sweep_pool_sizes


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
    cells = [a.text for a in fig.layout.annotations if a.text.startswith("<b>") and a.text[3].isdigit()]
    assert cells == ["<b>2</b>", "<b>3</b>", "<b>4</b>", "<b>5</b>", "<b>1*</b>"]
    assert fig.layout.xaxis.visible is False   # boxes on a canvas: no axis running from -1 to 10
    rows = [{"hash_fn": "sha256", "block_size": 16, "seconds_per_block": 1e-6},
            {"hash_fn": "xxhash", "block_size": 64, "seconds_per_block": 2e-6}]
    fig = viz.figure_hash_cost(rows, {"prefill": 5e-4})
    assert [t.type for t in fig.data] == ["bar", "bar", "scatter"] and fig.layout.yaxis.type == "log"


def test_the_hash_chain_is_cut_at_the_first_miss():
    manager = KVCacheManager(num_blocks=64, block_size=16, hash_seed="t")
    first = Request("a", list(range(70)))
    admit(manager, first)
    second = Request("b", list(range(40)) + list(range(7000, 7030)))
    fig = viz.figure_hash_chain(manager, second)
    shown = " ".join(a.text for a in fig.layout.annotations if a.text)
    assert shown.count("✓ cached") == 2 and shown.count("✗ miss: the lookup stops") == 1
    assert "never looked up" in shown and "not hashed" in shown       # block 3 after the cut; block 4 partial
    assert f"h0 = {short_hash(second.block_hashes[0])}" in shown and "32 tokens hit, 38 to prefill" in shown
    assert manager.get_block_ids("a") and "b" not in manager.req_to_blocks   # drawing looked up, changed nothing


def test_the_pool_sweep_is_prefix_sims_own():
    sizes, results = viz._sweep("shared system prompt", 16)
    requests = WORKLOADS["shared system prompt"]()
    assert list(results) == sweep_pool_sizes(requests, list(sizes), block_size=16)
