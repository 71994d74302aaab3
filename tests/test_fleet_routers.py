"""Each router's rule on worked cases small enough to check by hand."""

from __future__ import annotations

import pytest

from kvlab.core.kv_cache_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvlab.errors import KvlabValueError
from kvlab.fleet.routers import (
    ApproximateRouter,
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


def test_precise_router_with_a_seed_breaks_ties_at_random_among_the_tied_only():
    request = req("a", CONTEXT + tuple(range(100, 116)))
    picks = set()
    for seed in range(20):
        router = PreciseRouter(4, block_size=16, seed=seed)
        router.observe(3, [stored(request, 5)])
        assert router.route(request) == 3  # a real lead is never a tie
        router.update_load(3, 50)  # loaded: 1 - 0.5 = 0.5 still leads
        assert router.route(req("b", tuple(range(2000, 2064)))) in (0, 1, 2)  # 0, 0, 0, -0.5: a tie of three
        picks.add(router.route(req("c", tuple(range(3000, 3064)))))
    assert picks == {0, 1, 2}  # MaxScorePicker shuffles: every tied replica gets picked
    assert PreciseRouter(4).route(req("d", tuple(range(4000, 4064)))) == 0  # no seed: the lowest index


def test_approximate_router_learns_from_its_own_routing_and_never_from_events():
    router = ApproximateRouter(2, block_size=16, lru_capacity_per_server=6)
    first = req("a", CONTEXT + tuple(range(100, 116)))  # 5 blocks
    assert router.route(first) == 0 and router.last_expected_hit_tokens == 0
    assert router.route(first) == 0 and router.last_expected_hit_tokens == 80  # it believes what it sent
    router.observe(0, [AllBlocksCleared(), BlockRemoved(tuple(first.block_hashes(16)))])  # the replica forgot
    assert router.index.overlap_blocks(first.block_hashes(16), 0) == 5  # the router did not hear it
    other = req("b", tuple(range(500, 532)))  # 2 blocks on replica 0 (load 0 each: the tie goes to 0)
    router.route(other)
    # the LRU holds 6 blocks per server: the oldest (the first prompt's first block) is forgotten
    assert router.index.overlap_blocks(first.block_hashes(16), 0) == 0
    router.mark_dead(0)
    assert router.route(first) == 1


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


def test_the_index_scores_every_replica_in_one_walk_as_it_would_one_by_one():
    import random

    from kvlab.fleet.routers import KVBlockIndex

    rng = random.Random(0)
    index = KVBlockIndex(3)
    chains = [req(str(c), tuple(rng.randrange(50) for _ in range(96))).block_hashes(16) for c in range(4)]
    for step in range(300):
        replica, chain = rng.randrange(3), rng.choice(chains)
        kind = rng.random()
        if kind < 0.5:
            index.apply(replica, BlockStored(tuple(chain[: rng.randint(1, 6)]), None, (), 16))
        elif kind < 0.95:
            index.apply(replica, BlockRemoved(tuple(rng.sample(chain, 2))))
        else:
            index.apply(replica, AllBlocksCleared())
        for probe in chains:
            one_by_one = {i: index.overlap_blocks(probe, i) for i in range(3)}
            assert index.overlaps(probe) == {i: n for i, n in one_by_one.items() if n}, step
        assert index.holders == {h: {i for i in range(3) if h in index.held[i]}
                                 for h in set().union(*index.held)}, step
