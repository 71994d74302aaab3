"""The fleet simulation's invariants: every token is a hit or prefilled, routers hash as replicas do, and
random routing stores each shared prefix once per replica when the pools are large."""

from __future__ import annotations

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request
from kvlab.fleet.routers import FLEET_HASH_SEED, make_router
from kvlab.fleet.simulation import customer_workload, simulate_fleet

WORKLOAD = customer_workload(num_customers=8, queries_per_customer=8, context_tokens=256, query_tokens=16, seed=1)


def test_the_router_hashes_a_prompt_as_every_replica_does():
    request = WORKLOAD[0]
    manager = KVCacheManager(64, 16, hash_seed=FLEET_HASH_SEED)
    mine = Request("r", list(request.prompt_token_ids))
    manager.get_computed_blocks(mine)
    assert list(mine.block_hashes) == request.block_hashes(16)


def test_every_prompt_token_is_a_hit_or_prefilled_and_every_request_is_served_once():
    result = simulate_fleet(make_router("precise", 4), WORKLOAD, num_blocks=200)
    assert [s.request_id for s in result.served] == [r.request_id for r in WORKLOAD]
    for s, r in zip(result.served, WORKLOAD, strict=True):
        assert s.hit_tokens + s.prefilled_tokens == len(r.prompt_token_ids)
        assert s.hit_tokens % 16 == 0 and s.hit_tokens < len(r.prompt_token_ids)
    assert sum(result.requests_per_replica) == len(WORKLOAD)
    assert result.prediction_error_tokens == 0  # the index is the replicas' own account


def test_random_routing_stores_each_prefix_once_per_replica_and_prefix_routing_once():
    random_run = simulate_fleet(make_router("random", 4), WORKLOAD, num_blocks=2000)
    precise_run = simulate_fleet(make_router("precise", 4), WORKLOAD, num_blocks=2000)
    assert sum(random_run.copies_of_first_block.values()) / 8 > 3.5  # 8 queries each: nearly all 4 replicas
    assert set(precise_run.copies_of_first_block.values()) == {1}
    assert precise_run.prefilled_tokens < random_run.prefilled_tokens / 2
