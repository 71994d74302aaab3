"""Notebook 10's exercises (a consistent hash's pick, the precise router's choice, random routing's hit rate)
and self-test."""

from __future__ import annotations

import random
from typing import Any

from kvlab.exercises.core import Case, Exercise, ask, register
from kvlab.fleet.metrics import ReplicaMetrics, hit_rate_between, parse_scrape
from kvlab.fleet.routers import KVBlockIndex, make_router
from kvlab.fleet.simulation import customer_workload, simulate_fleet

# ----------------------------------------------------------------- 10.ring_pick


def ring_pick(points: list[tuple[int, int]], key: int) -> int:
    """Reference: the replica owning the first ring point at or after ``key``, wrapping past the end."""
    ordered = sorted(points)
    for point, replica in ordered:
        if point >= key:
            return replica
    return ordered[0][1]


def _explain_ring(case: Case, expected: Any, actual: Any) -> str | None:
    points, key = case.args
    ordered = sorted(points)
    if key > ordered[-1][0] and actual != expected:
        return "past the last point the ring wraps around: the first point of the sorted ring owns the key"
    if any(p == key for p, _ in points) and actual != expected:
        return "a key that lands exactly on a point belongs to that point (at or after, not strictly after)"
    if points != ordered and actual == next((r for p, r in points if p >= key), None):
        return "sort the points first: the ring's order is the points' values, not the order you were given"
    return None


def _random_ring_case(rng: random.Random) -> Case:
    n = rng.randint(1, 4)
    points = [(rng.randrange(1000), r) for r in range(n) for _ in range(rng.randint(1, 3))]
    return Case((points, rng.randrange(1100)), probes="random points and key")


register(Exercise(
    id="10.ring_pick",
    title="which replica a consistent hash picks",
    task=("`points` are `(position, replica)` pairs on a hash ring, in any order; `key` is a session's position. "
          "Return the replica that owns the first point at or after `key`, wrapping around to the smallest point "
          "when `key` is past the largest. This is `SessionAffinityRouter`'s rule."),
    signature="def ring_pick(points: list[tuple[int, int]], key: int) -> int:",
    reference=ring_pick,
    edge_cases=[
        Case(([(10, 0), (20, 1), (30, 2)], 15), probes="between two points: the next one owns it"),
        Case(([(10, 0), (20, 1), (30, 2)], 20), probes="exactly on a point: that point owns it"),
        Case(([(10, 0), (20, 1), (30, 2)], 31), probes="past the last point: wrap to the first"),
        Case(([(30, 2), (10, 0), (20, 1)], 5), probes="the points arrive unsorted"),
    ],
    random_case=_random_ring_case,
    explain=_explain_ring,
    hints=["Sort the points by position: the ring is that order, closed into a circle.",
           "Walk the sorted points: the first whose position is at least key owns it.",
           "If none is, the key is past the largest point: the ring wraps, and the smallest point owns it."],
))


# ----------------------------------------------------------------- 10.precise_choice


def precise_choice(prompt_hashes: list[str], streams: list[list[tuple]]) -> int:
    """Reference: the replica whose events leave it holding the longest prefix of ``prompt_hashes`` (ties: lowest)."""
    index = KVBlockIndex(len(streams))
    kinds = {"stored": "BlockStored", "removed": "BlockRemoved", "cleared": "AllBlocksCleared"}
    for replica, stream in enumerate(streams):
        for kind, *hashes in stream:
            event = type(kinds[kind], (), {"block_hashes": tuple(hashes[0]) if hashes else ()})()
            index.apply(replica, event)
    overlaps = [index.overlap_blocks(prompt_hashes, r) for r in range(len(streams))]
    return max(range(len(streams)), key=lambda r: (overlaps[r], -r))


def _explain_precise(case: Case, expected: Any, actual: Any) -> str | None:
    prompt, streams = case.args
    if any(kind == "removed" for s in streams for kind, *_ in s):
        return "a BlockRemoved event takes its hashes out of that replica's index: they no longer hit"
    if any(kind == "cleared" for s in streams for kind, *_ in s):
        return "AllBlocksCleared empties that replica's index"
    return "a prefix hit stops at the first block the replica does not hold: count leading blocks only"


def _random_precise_case(rng: random.Random) -> Case:
    prompt = [f"h{i}" for i in range(rng.randint(1, 6))]
    streams = []
    for _ in range(rng.randint(2, 3)):
        stream: list[tuple] = []
        for _ in range(rng.randint(0, 4)):
            kind = rng.choice(["stored", "stored", "removed", "cleared"])
            stream.append((kind,) if kind == "cleared" else (kind, rng.sample(prompt, rng.randint(1, len(prompt)))))
        streams.append(stream)
    return Case((prompt, streams), probes="random event streams")


register(Exercise(
    id="10.precise_choice",
    title="the precise router's choice from two replicas' event streams",
    task=("`prompt_hashes` are a prompt's block hashes in order; `streams[r]` is replica r's KV events in order: "
          "`(\"stored\", hashes)`, `(\"removed\", hashes)` or `(\"cleared\",)`. Return the replica that holds the "
          "longest *prefix* of the prompt's blocks after its events (the lowest index on a tie): the precise "
          "router's choice with no load term."),
    signature="def precise_choice(prompt_hashes: list[str], streams: list[list[tuple]]) -> int:",
    reference=precise_choice,
    edge_cases=[
        Case((["a", "b", "c"], [[("stored", ["a"])], [("stored", ["a", "b"])]]), probes="the longer prefix wins"),
        Case((["a", "b", "c"], [[("stored", ["a", "b"])], [("stored", ["b", "c"])]]),
             probes="blocks after a miss do not count"),
        Case((["a", "b"], [[("stored", ["a"])], [("stored", ["a", "b"]), ("removed", ["a"])]]),
             probes="a removed first block ends the prefix"),
        Case((["a", "b"], [[("stored", ["a"])], [("stored", ["a", "b"]), ("cleared",)]]),
             probes="a cleared replica holds nothing"),
        Case((["a"], [[("stored", ["a"])], [("stored", ["a"])]]), probes="a tie: the lowest index"),
    ],
    random_case=_random_precise_case,
    explain=_explain_precise,
    hints=["Keep one set of hashes per replica and apply its events in order.",
           "stored adds, removed discards, cleared empties the set.",
           "Then count, per replica, how many of the prompt's hashes from the start are in its set, stopping at "
           "the first that is not."],
))


# ----------------------------------------------------------------- 10.random_hit_rate


def random_hit_rate(single_replica_hit_rate: float, queries_per_customer: int, num_replicas: int) -> float:
    """Reference: the single-replica rate scaled by the share of queries that find their context on their replica.

    On one replica each customer's first query misses and the other ``q - 1`` hit. Routed uniformly
    at random over N replicas with room for every context, a customer's q queries visit on average
    ``N (1 - (1 - 1/N)^q)`` distinct replicas, and the first query on each one misses.
    """
    q, n = queries_per_customer, num_replicas
    if q == 1:
        return 0.0
    visited = n * (1 - (1 - 1 / n) ** q)
    return single_replica_hit_rate * (q - visited) / (q - 1)


def _random_rate_case(rng: random.Random) -> Case:
    return Case((round(rng.uniform(0.3, 0.95), 3), rng.randint(2, 64), rng.randint(1, 64)),
                probes="random rate, queries and replicas")


register(Exercise(
    id="10.random_hit_rate",
    title="predict random routing's hit rate over N replicas from one replica's",
    task=("One replica serving a workload of customers, each sending `queries_per_customer` queries that share a "
          "long context, reaches `single_replica_hit_rate`: every query but the customer's first hits. Route the "
          "same queries uniformly at random over `num_replicas` replicas, each with room for every context. "
          "Return the expected cluster hit rate."),
    signature=("def random_hit_rate(single_replica_hit_rate: float, queries_per_customer: int, "
               "num_replicas: int) -> float:"),
    reference=random_hit_rate,
    edge_cases=[
        Case((0.9, 16, 1), probes="one replica: the rate is unchanged"),
        Case((0.9, 16, 4), probes="four replicas: each one a customer visits pays its own first miss"),
        Case((0.9, 2, 64), probes="few queries over many replicas: nearly every query is a first visit"),
        Case((0.5, 1, 8), probes="one query per customer: nothing can hit"),
    ],
    random_case=_random_rate_case,
    hints=["On one replica, a customer's misses are 1 of q queries; the hit rate counts the other q - 1.",
           "Over N replicas a query misses when it is the first of its customer on its replica: how many distinct "
           "replicas do q uniform draws reach? (1 - 1/N)^q is the chance one replica is never drawn.",
           "Hits are then q minus the replicas visited, instead of q - 1: scale the single-replica rate by that "
           "ratio."],
    transfer=True,
))


# ----------------------------------------------------------------- self-test


def _scrape_question() -> dict[str, Any]:
    metrics = ReplicaMetrics("quiz")
    metrics.engine_metrics.prefix_cache_queries, metrics.engine_metrics.prefix_cache_hits = 10_000, 9_000
    before = parse_scrape(metrics.exposition().decode())
    metrics.engine_metrics.prefix_cache_queries, metrics.engine_metrics.prefix_cache_hits = 20_000, 9_500
    after = parse_scrape(metrics.exposition().decode())
    return {"rate": hit_rate_between(before, after), "lifetime": 9_500 / 20_000}


ask("10.q1",
    ("A replica's counters read 10,000 queried and 9,000 hit tokens at one scrape and 20,000 and 9,500 at the next. "
     "What hit rate does seed 002's dashboard show, and what does its table say?"),
    _scrape_question,
    lambda v: (f"rate(hits) / rate(queries) = 500 / 10,000 = {v['rate']:.2f}, not the lifetime {v['lifetime']:.3f}: "
               "under 0.1 on a workload with shared prefixes, the table says to check whether multi-replica "
               "routing is random."))


def _copies_question() -> dict[str, Any]:
    workload = customer_workload(8, 8, 256, 16, seed=3)
    out = {}
    for name in ("random", "precise"):
        result = simulate_fleet(make_router(name, 4), workload, num_blocks=2000)
        out[name] = sum(result.copies_of_first_block.values()) / len(result.copies_of_first_block)
    return out


ask("10.q2",
    "Four replicas with room to spare, 8 customers of 8 queries each: how many replicas end up holding a customer's "
    "context under random routing, and under the precise router?",
    _copies_question,
    lambda v: (f"{v['random']:.2f} replicas on average under random routing (nearly every one: seed 002's 'stored "
               f"once in each pod'), {v['precise']:.0f} under the precise router, which sends a customer where its "
               "context already is."))


def _prediction_question() -> dict[str, Any]:
    workload = customer_workload(8, 8, 256, 16, seed=3)
    out = {}
    for num_blocks in (2000, 40):
        result = simulate_fleet(make_router("prefix_aware", 4), workload, num_blocks=num_blocks)
        out[num_blocks] = result.prediction_error_tokens
    precise = simulate_fleet(make_router("precise", 4), workload, num_blocks=40).prediction_error_tokens
    return {"roomy": out[2000], "tight": out[40], "precise": precise}


ask("10.q3",
    ("Transfer: the prefix-aware router's trie records every prefix it routed and never forgets one. Shrink each "
     "replica's pool until contexts are evicted: what happens to the hit tokens it expects against those served, and "
     "to the precise router's?"),
    _prediction_question,
    lambda v: (f"With room for everything the trie is right ({v['roomy']} tokens off in total); at 40 blocks a "
               f"replica evicts what the trie still lists and the expectation is {v['tight']:,} tokens off. The "
               f"precise router's index follows BlockRemoved events: {v['precise']} off."),
    transfer=True)
