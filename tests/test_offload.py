"""The CPU tier: its own block ids, capacity and LRU; evictions become stores; hits become loads; copies on tensors."""

import random

import pytest
import torch

from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, Request
from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector
from kvlab.core.kv_offload import CPUOffloadingManager, KVConnectorMetadata, OffloadingConnector
from kvlab.engine.kv_offload import OffloadingExecutor, allocate_cpu_kv_caches, transfer_blocks
from kvlab.errors import BlockStateError

# ----------------------------------------------------------------- the CPU tier's bookkeeping


def test_blocks_fill_free_ids_then_evict_the_least_recently_used():
    cpu = CPUOffloadingManager(3)
    assert cpu.prepare_store(["a", "b", "c"]) == [("a", 0), ("b", 1), ("c", 2)]
    cpu.touch(["a"])                                        # a is now the most recent
    assert cpu.lru_order() == ["b", "c", "a"]
    assert cpu.prepare_store(["d"]) == [("d", 1)]           # b, the least recent, gave its block to d
    assert cpu.lru_order() == ["c", "a", "d"] and "b" not in cpu and cpu.num_evicted == 1
    assert cpu.prepare_store(["a"]) == []                   # held already: only touched
    assert cpu.lru_order() == ["c", "d", "a"]


def test_lookup_is_a_prefix_like_the_gpus():
    cpu = CPUOffloadingManager(4)
    cpu.prepare_store(["a", "b", "d"])
    assert cpu.lookup(["a", "b", "c", "d"]) == 2 and cpu.lookup(["c", "a"]) == 0 and cpu.lookup([]) == 0


def test_a_block_being_loaded_is_not_evicted_until_its_load_completes():
    cpu = CPUOffloadingManager(2)
    cpu.prepare_store(["a", "b"])
    assert cpu.prepare_load(["a"]) == [0]                   # a is protected (and touched)
    assert cpu.prepare_store(["c"]) == [("c", 1)]           # b goes, not a
    assert cpu.prepare_store(["d"]) == [("d", 1)]           # c goes; a still protected
    cpu.complete_load(["a"])
    assert cpu.prepare_store(["e"]) == [("e", 0)]           # now a can go
    with pytest.raises(BlockStateError, match="not being loaded"):
        cpu.complete_load(["a"])
    with pytest.raises(BlockStateError, match="does not hold"):
        cpu.prepare_load(["zzz"])


def test_when_every_block_is_protected_a_store_is_skipped_not_forced():
    cpu = CPUOffloadingManager(1)
    cpu.prepare_store(["a"])
    cpu.prepare_load(["a"])
    assert cpu.prepare_store(["b"]) == [] and cpu.num_store_skipped == 1 and "a" in cpu


def test_swap_lends_blocks_evicting_cached_ones_and_refuses_when_it_cannot():
    cpu = CPUOffloadingManager(4)
    cpu.prepare_store(["a", "b", "c"])
    cpu.prepare_load(["c"])
    assert cpu.swap_out("r1", 2) == [3, 0]                  # the free block, then a's
    assert cpu.swap_out("r2", 2) is None                    # only b is evictable: nothing changes
    assert cpu.num_swap_blocks == 2 and cpu.lru_order() == ["b", "c"]
    assert cpu.swapped_blocks("r1") == [3, 0]
    cpu.free_swap("r1")
    assert cpu.num_free_blocks == 2
    cpu.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_capacity_is_never_exceeded_and_every_id_is_in_one_place(seed):
    rng = random.Random(seed)
    cpu = CPUOffloadingManager(8)
    loading: list[str] = []
    for _ in range(400):
        op = rng.choice(["store", "store", "load", "complete", "swap", "unswap"])
        if op == "store":
            cpu.prepare_store([f"h{rng.randrange(20)}" for _ in range(rng.randint(1, 4))])
        elif op == "load":
            held = cpu.lru_order()
            if held:
                h = rng.choice(held)
                cpu.prepare_load([h])
                loading.append(h)
        elif op == "complete" and loading:
            cpu.complete_load([loading.pop(rng.randrange(len(loading)))])
        elif op == "swap":
            request_id = f"r{rng.randrange(1000)}"
            if request_id not in cpu._swap:
                cpu.swap_out(request_id, rng.randint(0, 3))
        elif op == "unswap" and cpu._swap:
            cpu.free_swap(rng.choice(list(cpu._swap)))
        cpu.check_invariants()
        assert cpu.num_cached_blocks + cpu.num_swap_blocks + cpu.num_free_blocks == 8
        assert all(h in cpu for h in loading)               # nothing being loaded was evicted


# ----------------------------------------------------------------- the connector over a real KVCacheManager


def _manager_with_tier(num_gpu_blocks=4, num_cpu_blocks=8):
    manager = KVCacheManager(num_gpu_blocks, 4, hash_seed="tier")
    collector = KVCacheMetricsCollector()
    manager.block_pool.metrics_collector = collector
    return manager, OffloadingConnector(manager, CPUOffloadingManager(num_cpu_blocks)), collector


def _admit(manager, request):
    hits, num_hits, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return num_hits


def test_a_gpu_eviction_becomes_a_store_and_the_metrics_collector_still_sees_it():
    manager, connector, collector = _manager_with_tier()
    first = Request("first", list(range(9)))                 # 2 full blocks of 4, one partial
    _admit(manager, first)
    gpu_ids = manager.get_block_ids("first")
    manager.free(first)
    _admit(manager, Request("second", list(range(100, 109))))  # needs the 3 usable blocks: evicts both full ones
    meta = connector.build_connector_meta()
    assert sorted(g for g, _ in meta.stores) == sorted(gpu_ids[:2]) and meta.loads == []
    assert first.block_hashes[0] in connector.cpu and first.block_hashes[1] in connector.cpu
    assert collector.histogram("lifetime").count == 3         # the chained observer saw every eviction


@pytest.mark.parametrize("collector_first", [True, False])
def test_the_connector_and_the_metrics_collector_both_observe_whichever_is_attached_first(collector_first):
    manager = KVCacheManager(4, 4, hash_seed="tier")
    collector = KVCacheMetricsCollector()
    if collector_first:
        manager.block_pool.metrics_collector = collector
    connector = OffloadingConnector(manager, CPUOffloadingManager(8))
    if not collector_first:
        manager.block_pool.metrics_collector = collector
    first = Request("first", list(range(9)))
    _admit(manager, first)
    manager.free(first)
    _admit(manager, Request("second", list(range(100, 109))))
    assert len(connector.build_connector_meta().stores) == 2
    assert collector.histogram("lifetime").count == 3


def _first_two_blocks_on_the_cpu_only():
    """A pool of 3 usable blocks of 4 tokens: tokens 0..7 ran, then another request pushed them to the CPU tier."""
    manager, connector, _ = _manager_with_tier(num_gpu_blocks=4)
    for request_id, tokens in (("first", list(range(8)) + [50]), ("other", list(range(100, 109)))):
        request = Request(request_id, tokens)
        _admit(manager, request)
        connector.build_connector_meta()                      # "other" evicts first's two full blocks
        manager.free(request)
    return manager, connector


def test_a_cpu_hit_starts_after_the_gpus_and_never_covers_the_last_token():
    manager, connector = _first_two_blocks_on_the_cpu_only()
    again = Request("again", list(range(8)) + [60, 61])
    hits, num_hits, _ = manager.get_computed_blocks(again)
    assert num_hits == 0 and connector.get_num_new_matched_tokens(again, 0) == (8, False)  # loaded synchronously
    exact = Request("exact", list(range(8)))                  # 8 tokens: the last must be computed
    manager.get_computed_blocks(exact)
    assert connector.get_num_new_matched_tokens(exact, 0) == (4, False)


def test_loads_go_into_the_blocks_the_scheduler_allocated_and_are_counted_once():
    manager, connector = _first_two_blocks_on_the_cpu_only()
    again = Request("again", list(range(8)) + [60, 61])
    manager.get_computed_blocks(again)
    external, _ = connector.get_num_new_matched_tokens(again, 0)
    assert manager.allocate_slots(again, again.num_tokens, 0, []) is not None
    connector.update_state_after_alloc(again, KVCacheBlocks(manager.get_blocks_per_group("again")), external)
    meta = connector.build_connector_meta()
    assert [g for _, g in meta.loads] == manager.get_block_ids("again")[:2]
    assert (connector.stats.external_prefix_cache_hits, connector.stats.blocks_loaded) == (8, 2)
    assert connector.stats.external_prefix_cache_queries == again.num_tokens
    connector.complete_step()
    assert not connector.cpu._protected


# ----------------------------------------------------------------- copies on tensors


def test_transfers_copy_whole_blocks_in_every_layer():
    gpu = [(torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(4, 2, 1, 3) + 100 * layer,
            -torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(4, 2, 1, 3)) for layer in range(2)]
    cpu = allocate_cpu_kv_caches(gpu, 3)
    assert cpu[0][0].shape == (3, 2, 1, 3) and cpu[0][0].dtype == torch.float32
    transfer_blocks(gpu, cpu, [(2, 0), (3, 2)])
    for (gk, gv), (ck, cv) in zip(gpu, cpu, strict=True):
        assert torch.equal(ck[0], gk[2]) and torch.equal(ck[2], gk[3]) and torch.equal(cv[2], gv[3])
        assert torch.equal(ck[1], torch.zeros_like(ck[1]))
    transfer_blocks(cpu, gpu, [(0, 1)])
    assert torch.equal(gpu[1][0][1], gpu[1][0][2])


def test_the_executor_stores_before_it_loads_and_then_runs_the_model():
    gpu = [(torch.zeros(3, 1, 1, 1), torch.zeros(3, 1, 1, 1))]
    gpu[0][0][1] = 7.0                                        # block 1 holds an evicted block's content
    cpu = allocate_cpu_kv_caches(gpu, 2)
    cpu[0][0][0] = 5.0                                        # a CPU hit, to be loaded into block 1
    ran = []

    class Inner:
        def execute_model(self, scheduler_output):
            ran.append(float(gpu[0][0][1]))
            return "sampled"

    class Output:
        kv_connector_metadata = KVConnectorMetadata(stores=[(1, 1)], loads=[(0, 1)])

    assert OffloadingExecutor(Inner(), gpu, cpu, connector=None).execute_model(Output()) == "sampled"
    assert float(cpu[0][0][1]) == 7.0 and ran == [5.0]        # stored first, then overwritten by the load
