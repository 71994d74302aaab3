"""Routers in front of many replicas, each behind one interface: ``route(request) -> replica``.

Every router sees what a real one sees: the request (its tokens, a session key), the replicas'
load from their scrapes (``update_load``: requests queued or running, KV cache usage) and, for
those built on them, the replicas' KV events (``observe``). Each class says where its rule comes
from and what kvlab simplifies. Block hashes are kvlab's (``kvlab.core.hashing``), chained per
``block_size`` tokens with the replicas' seed, as llm-d and Dynamo recompute vLLM's own hashes.
"""

from __future__ import annotations

import bisect
import hashlib
import inspect
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab._validate import positive_int
from kvlab.core.hashing import hash_block_tokens, none_hash_from_seed, sha256
from kvlab.errors import KvlabValueError

#: The seed every replica and router in a fleet hashes with (``KVCacheManager(hash_seed=...)``).
FLEET_HASH_SEED = "kvlab"
_FLEET_NONE_HASH = none_hash_from_seed(sha256, FLEET_HASH_SEED)
_hash_block = hash_block_tokens.__wrapped__  # type: ignore[attr-defined]  # the arguments are kvlab's own


@dataclass
class FleetRequest:
    """One request as the router sees it: id, prompt tokens, session key, output length and arrival time."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    session: str | None = None
    output_len: int = 1
    arrival: float = 0.0
    _hashes: dict[int, list[bytes]] = field(default_factory=dict, repr=False, compare=False)

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The chained SHA-256 hashes of the prompt's full blocks, as every replica computes them (cached)."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            tokens, parent, hashes = self.prompt_token_ids, _FLEET_NONE_HASH, []
            for start in range(0, len(tokens) - block_size + 1, block_size):  # hash_token_blocks, checked once
                parent = _hash_block(sha256, parent, tokens[start:start + block_size], None)
                hashes.append(parent)
            self._hashes[block_size] = hashes
        return hashes


class Router:
    """The interface: ``route`` picks a replica; ``update_load`` and ``observe`` feed it what replicas report."""

    name = "router"

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = positive_int("num_replicas", num_replicas)
        # requests queued or running, per replica (vllm:num_requests_running + vllm:num_requests_waiting)
        self.loads = [0] * num_replicas
        self.kv_usage = [0.0] * num_replicas  # vllm:kv_cache_usage_perc, per replica
        self.alive = [True] * num_replicas
        self._live = list(range(num_replicas))  # the replicas alive, kept as mark_dead changes it
        # the prompt tokens the router expected the chosen replica to hold, set by route() (None: no guess)
        self.last_expected_hit_tokens: int | None = None

    def route(self, request: FleetRequest) -> int:
        """The replica this request goes to."""
        raise NotImplementedError

    def update_load(self, replica: int, num_requests: int, kv_usage: float = 0.0) -> None:
        """A scrape of one replica: its queued plus running requests and its KV cache usage."""
        self.loads[replica], self.kv_usage[replica] = num_requests, kv_usage

    def observe(self, replica: int, events: Iterable[Any]) -> None:
        """KV events from one replica (core's records or the wire structs: the same field names)."""

    def finished(self, request_id: str) -> None:
        """A request the router sent has ended (routers that track what is active use it)."""

    def mark_dead(self, replica: int) -> None:
        """Take a replica out of routing (it died); its requests are the caller's to re-route."""
        self.alive[replica] = False
        self._live = [i for i in range(self.num_replicas) if self.alive[i]]
        self.observe(replica, [_Cleared()])

    def live(self) -> list[int]:
        """The replicas alive, in index order (the router's own list: do not change it)."""
        if not self._live:
            raise KvlabValueError("num_replicas: every replica is dead, nothing can serve the request")
        return self._live

    def least_loaded(self, among: Sequence[int] | None = None) -> int:
        """The live replica with the fewest requests (lowest index on a tie)."""
        return min(self.live() if among is None else among, key=lambda i: (self.loads[i], i))


class _Cleared:  # a dead replica's cache is gone: an AllBlocksCleared from the router's side
    pass


@dataclass(frozen=True)
class _Stored:  # what a history-fed index records for itself (named as the event it stands in for)
    block_hashes: tuple[Any, ...]


@dataclass(frozen=True)
class _Removed:
    block_hashes: tuple[Any, ...]


class RoundRobinRouter(Router):
    """Replica 0, 1, ..., N-1, 0, ...: the default of vLLM production-stack's router and Dynamo's frontend."""

    name = "round robin"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def route(self, request: FleetRequest) -> int:
        while True:
            replica, self._next = self._next, (self._next + 1) % self.num_replicas
            if self.alive[replica]:
                return replica


class RandomRouter(Router):
    """A seeded uniform pick: seed 002's "random routing", the baseline llm-d measures against."""

    name = "random"

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        super().__init__(num_replicas)
        self._rng = random.Random(seed)

    def route(self, request: FleetRequest) -> int:
        return self._rng.choice(self.live())


def ring_position(key: str) -> int:
    """Where ``key`` sits on the hash ring: the first 8 bytes of its SHA-256, big-endian."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


class SessionAffinityRouter(Router):
    """Consistent hashing of the session key (production-stack's ``session`` routing, as the issue describes).

    Each replica owns ``virtual_nodes`` points ``ring_position(f"replica-{i}-{v}")`` on a 64-bit ring;
    a session goes to the owner of the first point at or after ``ring_position(session)``, wrapping
    around. Removing a replica moves only its own sessions. A request without a session key goes by
    its request id. kvlab simplifies: SHA-256 for the ring, no weights.
    """

    name = "session affinity"

    def __init__(self, num_replicas: int, virtual_nodes: int = 64) -> None:
        super().__init__(num_replicas)
        self.virtual_nodes = positive_int("virtual_nodes", virtual_nodes)
        self._ring = sorted((ring_position(f"replica-{i}-{v}"), i)
                            for i in range(num_replicas) for v in range(virtual_nodes))
        self._points = [p for p, _ in self._ring]

    def route(self, request: FleetRequest) -> int:
        start = bisect.bisect_left(self._points, ring_position(request.session or request.request_id))
        for k in range(len(self._ring)):
            replica = self._ring[(start + k) % len(self._ring)][1]
            if self.alive[replica]:
                return replica
        raise AssertionError("live() would have raised")


class PrefixAwareRouter(Router):
    """vLLM production-stack's ``prefixaware`` routing: a hash trie over prompt chunks (as the issue describes).

    The prompt is cut into ``chunk_size``-token chunks; each trie node (the chained hash of the
    chunks so far) remembers the replicas it sent that prefix to. A request goes to the replica,
    among those at its deepest matching node, with the fewest requests; with no match, to the least
    loaded. Its record of a prefix is never removed: the router cannot know a replica evicted it.
    kvlab simplifies: chunks of tokens rather than of text, ties to the lowest index.
    """

    name = "prefix-aware (production-stack)"

    def __init__(self, num_replicas: int, chunk_size: int = 64) -> None:
        super().__init__(num_replicas)
        self.chunk_size = positive_int("chunk_size", chunk_size)
        self._trie: dict[bytes, set[int]] = {}

    def route(self, request: FleetRequest) -> int:
        hashes = request.block_hashes(self.chunk_size)
        best: list[int] = []
        for h in hashes:
            holders = [i for i in self._trie.get(h, ()) if self.alive[i]]
            if not holders:
                break
            best = holders
        replica = self.least_loaded(best) if best else self.least_loaded()
        self.last_expected_hit_tokens = self.expected_hit_tokens(request, replica)
        for h in hashes:
            self._trie.setdefault(h, set()).add(replica)
        return replica

    def expected_hit_tokens(self, request: FleetRequest, replica: int) -> int:
        """Tokens the trie believes ``replica`` holds for this prompt (its prediction, never corrected)."""
        n = 0
        for h in request.block_hashes(self.chunk_size):
            if replica not in self._trie.get(h, ()):
                break
            n += self.chunk_size
        return n


class CacheAwareRouter(Router):
    """SGLang router's ``cache_aware`` policy: an approximate radix tree per worker, from routing history.

    As its source comment states (sgl-project/sglang, the router's ``cache_aware`` policy): the
    system is imbalanced when ``max_load - min_load > balance_abs_threshold`` *and*
    ``max_load > balance_rel_threshold * min_load``; then the least loaded worker gets the request.
    Otherwise the worker whose tree matches the longest prefix gets it if the match covers more
    than ``cache_threshold`` of the prompt, else the worker with the smallest tree (the most room).
    The chosen worker's tree takes the prompt. Thresholds are the issue's (64, 1.5, 0.3; the
    sglang-router CLI's own defaults differ). kvlab simplifies: the tree is kept at
    ``block_size``-token granularity, and a worker's tree drops its least recently used prefixes
    past ``max_tree_blocks`` (SGLang evicts by size on a timer).
    """

    name = "cache-aware (SGLang)"

    def __init__(self, num_replicas: int, block_size: int = 16, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                 max_tree_blocks: int = 1 << 20) -> None:
        super().__init__(num_replicas)
        self.block_size = positive_int("block_size", block_size)
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_blocks = positive_int("max_tree_blocks", max_tree_blocks)
        self.trees: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._in_trees = KVBlockIndex(num_replicas)  # hash -> the trees holding it: one walk matches them all

    def imbalanced(self) -> bool:
        """SGLang's test: both the absolute and the relative load gap are past their thresholds."""
        loads = [self.loads[i] for i in self.live()]
        return (max(loads) - min(loads) > self.balance_abs_threshold
                and max(loads) > self.balance_rel_threshold * min(loads))

    def matched_tokens(self, request: FleetRequest, replica: int) -> int:
        """The prefix of the prompt ``replica``'s tree holds, in tokens."""
        tree, n = self.trees[replica], 0
        for h in request.block_hashes(self.block_size):
            if h not in tree:
                break
            n += self.block_size
        return n

    expected_hit_tokens = matched_tokens

    def route(self, request: FleetRequest) -> int:
        live = self.live()
        if self.imbalanced():
            replica = self.least_loaded()
        else:
            matches = self._in_trees.overlaps(request.block_hashes(self.block_size))  # blocks, per tree
            best = max(live, key=lambda i: (matches.get(i, 0), -i))
            ratio = matches.get(best, 0) * self.block_size / max(1, len(request.prompt_token_ids))
            replica = best if ratio > self.cache_threshold else min(live, key=lambda i: (len(self.trees[i]), i))
        self.last_expected_hit_tokens = self.matched_tokens(request, replica)
        tree, hashes = self.trees[replica], request.block_hashes(self.block_size)
        for h in hashes:
            tree[h] = None
            tree.move_to_end(h)
        self._in_trees.apply(replica, _Stored(tuple(hashes)))
        while len(tree) > self.max_tree_blocks:
            self._in_trees.apply(replica, _Removed((tree.popitem(last=False)[0],)))
        return replica


class KVBlockIndex:
    """Which replica holds which block hash, kept from the replicas' own KV events (llm-d's and Dynamo's indexer).

    ``held[i]`` is replica ``i``'s set; ``holders`` maps a hash to the replicas holding it, so one walk
    down a prompt's hashes scores every replica at once (``overlaps``), however many there are.
    """

    def __init__(self, num_replicas: int) -> None:
        self.held: list[set[Any]] = [set() for _ in range(num_replicas)]
        self.holders: dict[Any, set[int]] = {}

    def apply(self, replica: int, event: Any) -> None:
        """One event: ``BlockStored`` adds its hashes, ``BlockRemoved`` drops them, ``AllBlocksCleared`` empties."""
        kind = type(event).__name__
        held, holders = self.held[replica], self.holders
        if kind in ("BlockStored", "_Stored"):
            for h in event.block_hashes:
                if h not in held:
                    held.add(h)
                    holders.setdefault(h, set()).add(replica)
        elif kind in ("BlockRemoved", "_Removed"):
            for h in event.block_hashes:
                self._drop(replica, h)
        else:
            assert kind in ("AllBlocksCleared", "_Cleared"), kind
            for h in list(held):
                self._drop(replica, h)

    def _drop(self, replica: int, block_hash: Any) -> None:
        if block_hash in self.held[replica]:
            self.held[replica].discard(block_hash)
            replicas = self.holders[block_hash]
            replicas.discard(replica)
            if not replicas:
                del self.holders[block_hash]

    def overlap_blocks(self, hashes: Sequence[Any], replica: int) -> int:
        """How many of the leading blocks ``replica`` holds (a prefix hit stops at the first miss)."""
        held, n = self.held[replica], 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def overlaps(self, hashes: Sequence[Any]) -> dict[int, int]:
        """``overlap_blocks`` for every replica holding at least the first block, in one walk."""
        out: dict[int, int] = {}
        candidates: set[int] | None = None
        for k, h in enumerate(hashes):
            replicas = self.holders.get(h)
            if not replicas:
                break
            candidates = set(replicas) if candidates is None else candidates & replicas
            if not candidates:
                break
            for i in candidates:
                out[i] = k + 1
        return out


class _EventIndexed(Router):
    def __init__(self, num_replicas: int, block_size: int) -> None:
        super().__init__(num_replicas)
        self.block_size = positive_int("block_size", block_size)
        self.index = KVBlockIndex(num_replicas)

    def observe(self, replica: int, events: Iterable[Any]) -> None:
        for event in events:
            self.index.apply(replica, event)

    def expected_hit_tokens(self, request: FleetRequest, replica: int) -> int:
        """Tokens the event index says ``replica`` holds: the replica's own account, as fresh as its events."""
        return self.index.overlap_blocks(request.block_hashes(self.block_size), replica) * self.block_size


class PreciseRouter(_EventIndexed):
    """A precise prefix-cache router à la llm-d: an index of block hashes fed by the replicas' KV events, plus load.

    As llm-d's documentation describes its precise prefix-cache scorer and load-aware scorers:
    each replica scores ``prefix_weight x (cached share of the prompt's blocks)`` minus
    ``load_weight x (its requests / the most any replica has)`` minus ``kv_weight x KV usage``;
    the highest wins. On a tie llm-d's picker (the Gateway API Inference Extension's ``MaxScorePicker``,
    which shuffles the pods before a stable sort by score) picks at random: so does this router given a
    ``seed``; without one it takes the lowest index. kvlab simplifies: one weighted sum, scores from the
    last scrape and the events received so far.
    """

    name = "precise (llm-d)"

    def __init__(self, num_replicas: int, block_size: int = 16, prefix_weight: float = 1.0,
                 load_weight: float = 0.5, kv_weight: float = 0.0, seed: int | None = None) -> None:
        super().__init__(num_replicas, block_size)
        self.prefix_weight, self.load_weight, self.kv_weight = prefix_weight, load_weight, kv_weight
        self._rng = None if seed is None else random.Random(seed)

    def scores(self, request: FleetRequest) -> dict[int, float]:
        """Each live replica's score for this request."""
        hashes = request.block_hashes(self.block_size)
        overlaps, live, loads = self.index.overlaps(hashes), self.live(), self.loads
        most = max(1, max(loads[i] for i in live))
        per_block, per_load = self.prefix_weight / max(1, len(hashes)), self.load_weight / most
        return {i: per_block * overlaps.get(i, 0) - per_load * loads[i] - self.kv_weight * self.kv_usage[i]
                for i in live}

    def route(self, request: FleetRequest) -> int:
        scores = self.scores(request)
        replica = max(scores, key=lambda i: (scores[i], -i))
        if self._rng is not None:
            replica = self._rng.choice([i for i in scores if scores[i] == scores[replica]])
        self.last_expected_hit_tokens = self.expected_hit_tokens(request, replica)
        return replica


class ApproximateRouter(PreciseRouter):
    """llm-d's approximate prefix-cache scheduling: the precise router's scores, its index built from routing history.

    The Gateway API Inference Extension's ``prefix-cache-scorer`` (llm-d's default, its
    ``pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go``) scores a pod by the share of the
    prompt's blocks its indexer lists for it, and after each pick records every block of the prompt
    for the chosen pod, in an LRU of ``lru_capacity_per_server`` blocks per pod (31,250 by default).
    Its picture is what the router sent, never what a replica evicted: the replicas' KV events are
    ignored. Everything else (the load term, the random tie-break given a ``seed``) is
    ``PreciseRouter``'s, so the two differ only in where their index comes from, as in llm-d's
    benchmark. kvlab simplifies: blocks of ``block_size`` tokens (the scorer hashes 64 bytes of text).
    """

    name = "approximate (llm-d)"

    def __init__(self, num_replicas: int, block_size: int = 16, prefix_weight: float = 1.0,
                 load_weight: float = 0.5, kv_weight: float = 0.0, seed: int | None = None,
                 lru_capacity_per_server: int = 31_250) -> None:
        super().__init__(num_replicas, block_size, prefix_weight, load_weight, kv_weight, seed)
        self.lru_capacity_per_server = positive_int("lru_capacity_per_server", lru_capacity_per_server)
        self._lru: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]

    def observe(self, replica: int, events: Iterable[Any]) -> None:
        """Events are not this router's source; only a dead replica's loss (``mark_dead``) is applied."""
        for event in events:
            if isinstance(event, _Cleared):
                self.index.apply(replica, event)
                self._lru[replica].clear()

    def route(self, request: FleetRequest) -> int:
        replica = super().route(request)
        lru = self._lru[replica]
        for h in request.block_hashes(self.block_size):  # the scorer's PreRequest: the pick now "holds" them
            lru[h] = None
            lru.move_to_end(h)
            self.index.apply(replica, _Stored((h,)))
        while len(lru) > self.lru_capacity_per_server:
            self.index.apply(replica, _Removed((lru.popitem(last=False)[0],)))
        return replica


class DynamoCostRouter(_EventIndexed):
    """NVIDIA Dynamo's KV router cost: ``overlap_weight x prefill_blocks + decode_blocks``, lowest wins.

    As Dynamo's router design document states: ``prefill_blocks`` are the prompt's blocks a worker
    would compute (its blocks minus the overlap its KV events report) and ``decode_blocks`` the
    blocks active on the worker with this request added; the router tracks the active blocks
    itself, adding a request's at routing and dropping them when it finishes (``finished``).
    kvlab simplifies: temperature 0 (always the lowest cost; ties to the lowest index).
    """

    name = "cost (Dynamo)"

    def __init__(self, num_replicas: int, block_size: int = 16, overlap_weight: float = 1.0) -> None:
        super().__init__(num_replicas, block_size)
        self.overlap_weight = float(overlap_weight)
        self.active_blocks = [0] * num_replicas
        self._routed: dict[str, tuple[int, int]] = {}

    def costs(self, request: FleetRequest) -> dict[int, float]:
        """Each live replica's cost for this request."""
        hashes = request.block_hashes(self.block_size)
        overlaps = self.index.overlaps(hashes)
        request_blocks = -(-(len(request.prompt_token_ids) + request.output_len) // self.block_size)
        return {i: self.overlap_weight * (len(hashes) - overlaps.get(i, 0))
                + self.active_blocks[i] + request_blocks for i in self.live()}

    def route(self, request: FleetRequest) -> int:
        costs = self.costs(request)
        replica = min(costs, key=lambda i: (costs[i], i))
        self.last_expected_hit_tokens = self.expected_hit_tokens(request, replica)
        blocks = -(-(len(request.prompt_token_ids) + request.output_len) // self.block_size)
        self.active_blocks[replica] += blocks
        self._routed[request.request_id] = (replica, blocks)
        return replica

    def finished(self, request_id: str) -> None:
        """The request ended: its blocks no longer count as active on its replica."""
        replica, blocks = self._routed.pop(request_id)
        self.active_blocks[replica] -= blocks


ROUTERS: dict[str, type[Router]] = {
    "round_robin": RoundRobinRouter, "random": RandomRouter, "session": SessionAffinityRouter,
    "prefix_aware": PrefixAwareRouter, "cache_aware": CacheAwareRouter, "precise": PreciseRouter,
    "approximate": ApproximateRouter, "dynamo": DynamoCostRouter,
}


def make_router(name: str, num_replicas: int, *, seed: int | None = None, **kwargs: Any) -> Router:
    """A router by its short name (``ROUTERS``'s keys); ``seed`` seeds its random choices, if it makes any
    (random's pick, the precise and approximate routers' tie-break), and is ignored by the others."""
    if name not in ROUTERS:
        raise KvlabValueError(f"name must be one of {sorted(ROUTERS)}, got {name!r}")
    cls = ROUTERS[name]
    if seed is not None and "seed" in inspect.signature(cls).parameters:
        kwargs["seed"] = seed
    return cls(num_replicas, **kwargs)
