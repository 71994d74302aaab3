"""Each router's rule on worked cases small enough to check by hand."""

from __future__ import annotations

import pytest

from kvlab.core.kv_cache_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvlab.errors import KvlabValueError
from kvlab.fleet.routers import (
    CacheAwareRouter,
    DynamoCostRouter,
    FleetRequest,
    PreciseRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    SessionAffinityRouter,
    make_router,
    ring_position,
)

CONTEXT = tuple(range(1, 65))  # 4 blocks of 16


def req(rid: str, tokens: tuple[int, ...], session: str | None = None) -> FleetRequest:
    return FleetRequest(rid, tokens, session=session)


def test_round_robin_cycles_and_skips_a_dead_replica():
    router = RoundRobinRouter(3)
    assert [router.route(req(str(i), CONTEXT)) for i in range(4)] == [0, 1, 2, 0]
    router.mark_dead(1)
    assert [router.route(req(str(i), CONTEXT)) for i in range(3)] == [2, 0, 2]


def test_session_affinity_is_the_first_ring_point_after_the_sessions_hash():
    router = SessionAffinityRouter(4, virtual_nodes=8)
    key = ring_position("customer-7")
    points = sorted((ring_position(f"replica-{i}-{v}"), i) for i in range(4) for v in range(8))
    owner = next((i for p, i in points if p >= key), points[0][1])
    assert router.route(req("a", CONTEXT, "customer-7")) == owner
    before = {s: router.route(req("x", CONTEXT, f"s{s}")) for s in range(40)}
    router.mark_dead(owner)
    after = {s: router.route(req("x", CONTEXT, f"s{s}")) for s in range(40)}
    assert all(after[s] == before[s] for s in before if before[s] != owner)  # only the dead one's sessions move
    assert all(after[s] != owner for s in after)


def test_prefix_aware_follows_its_trie_and_never_learns_of_an_eviction():
    router = PrefixAwareRouter(2, chunk_size=16)
    router.update_load(0, 5)  # replica 1 is less loaded: the first request goes there
    assert router.route(req("a", CONTEXT + (100,))) == 1
    router.update_load(1, 9)  # now busier, but it holds the prefix
    assert router.route(req("b", CONTEXT + (200,))) == 1
    assert router.last_expected_hit_tokens == 64
    router.observe(1, [AllBlocksCleared()])  # the replica forgot everything; the trie does not hear it
    assert router.route(req("c", CONTEXT + (300,))) == 1 and router.last_expected_hit_tokens == 64


def test_cache_aware_balances_past_both_thresholds_else_follows_the_tree():
    router = CacheAwareRouter(2, block_size=16)
    assert router.route(req("a", CONTEXT)) == 0  # empty trees: the smallest, lowest index
    router.update_load(0, 100)
    router.update_load(1, 10)  # 90 > 64 and 100 > 1.5 x 10: imbalanced -> the least loaded
    assert router.imbalanced() and router.route(req("b", CONTEXT)) == 1
    router.update_load(0, 30)
    # 20 <= 64: balanced; both trees hold the 48 matching tokens of 80 (0.6 > 0.3): the lowest index
    assert not router.imbalanced() and router.route(req("c", CONTEXT[:48] + tuple(range(900, 932)))) == 0
    fresh = CacheAwareRouter(2, block_size=16)
    fresh.route(req("a", CONTEXT))  # replica 0 holds 4 blocks
    short_match = CONTEXT[:16] + tuple(range(500, 564))  # 16 of 80 tokens = 0.2 <= 0.3: the smaller tree
    assert fresh.route(req("d", short_match)) == 1
    assert fresh.route(req("e", CONTEXT)) == 0  # 64/64 > 0.3: the matching tree


def stored(request: FleetRequest, num_blocks: int) -> BlockStored:
    hashes = request.block_hashes(16)[:num_blocks]
    return BlockStored(tuple(hashes), None, (), 16)


def test_precise_router_reads_the_replicas_event_streams():
    router = PreciseRouter(2, block_size=16, load_weight=0.0)
    request = req("a", CONTEXT + tuple(range(100, 116)))
    router.observe(0, [stored(request, 1)])
    router.observe(1, [stored(request, 3)])
    assert router.route(request) == 1 and router.last_expected_hit_tokens == 48
    router.observe(1, [BlockRemoved((request.block_hashes(16)[0],))])  # its first block is gone: no prefix hit
    assert router.index.overlap_blocks(request.block_hashes(16), 1) == 0
    assert router.route(request) == 0


def test_precise_router_lets_load_override_affinity():
    router = PreciseRouter(2, block_size=16, load_weight=1.0)
    request = req("a", CONTEXT + tuple(range(100, 116)))
    router.observe(0, [stored(request, 5)])  # replica 0 holds the whole prompt: score 1 - load share
    router.update_load(0, 10)
    router.update_load(1, 0)
    assert router.scores(request) == {0: 0.0, 1: 0.0}  # 1 - 10/10 against 0 - 0: a tie, lowest index
    router.update_load(0, 20)
    router.update_load(1, 2)
    assert router.route(request) == 0  # 1 - 1 = 0 vs -0.1
    router.update_load(1, 0)
    router.load_weight = 1.5
    assert router.route(request) == 1  # 1 - 1.5 = -0.5 vs 0


def test_dynamo_cost_is_weighted_prefill_blocks_plus_active_decode_blocks():
    router = DynamoCostRouter(2, block_size=16, overlap_weight=2.0)
    request = FleetRequest("a", CONTEXT + tuple(range(100, 116)), output_len=16)  # 5 prompt blocks, 6 with output
    router.observe(0, [stored(request, 4)])
    router.active_blocks = [10, 0]
    assert router.costs(request) == {0: 2.0 * 1 + 10 + 6, 1: 2.0 * 5 + 0 + 6}  # 18 vs 16
    assert router.route(request) == 1 and router.active_blocks == [10, 6]
    router.finished("a")
    assert router.active_blocks == [10, 0]


def test_make_router_names_the_bad_name():
    with pytest.raises(KvlabValueError, match="name"):
        make_router("fastest", 2)
    with pytest.raises(KvlabValueError, match="num_replicas"):
        r = make_router("round_robin", 1)
        r.mark_dead(0)
        r.live()
