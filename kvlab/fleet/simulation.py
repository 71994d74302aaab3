"""The fleet in one process: N replicas as ``kvlab.core`` managers, a router in front, requests arriving over time.

Each replica is a ``ReplicaCore``: a ``KVCacheManager`` with KV cache events on, serving one
request at a time (FIFO) and reporting what a vLLM replica reports: its events (fed to the
router) and its metrics (``EngineMetrics``, scraped as ``vllm:*``). The same ``ReplicaCore`` runs
inside each replica process (``kvlab.fleet.replica``), which is why the two agree request by request.

Time is modelled, not measured: a request starts when its replica is free, its prefill takes
``CostModel.forward_seconds(prefilled, cached)`` on a real GPU (``kvlab.capacity.cost_model``)
and each output token one decode step. kvlab simplifies: a request is served (and its blocks
cached) when it is routed, since a FIFO replica serves in routing order; decode tokens take no
blocks; the router sees each replica's events and load at once (no scrape interval).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvlab._validate import positive_int
from kvlab.capacity.cost_model import CostModel, cost_model
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request
from kvlab.engine.metrics import EngineMetrics
from kvlab.errors import KvlabValueError, ReplicaDiedError
from kvlab.fleet.routers import FLEET_HASH_SEED, FleetRequest, Router


@dataclass(frozen=True)
class Served:
    """What a replica did with one request: prompt tokens it found cached and those it computed."""

    request_id: str
    replica: int
    hit_tokens: int
    prefilled_tokens: int


class ReplicaCore:
    """One replica's KV cache: a manager with events on, serving a request whole before the next."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = positive_int("block_size", block_size)
        self.manager = KVCacheManager(num_blocks, block_size, hash_seed=FLEET_HASH_SEED, enable_kv_cache_events=True)
        self.metrics = EngineMetrics()

    def serve(self, request_id: str, prompt_token_ids: Sequence[int], replica: int = 0,
              block_hashes: Sequence[bytes] | None = None) -> Served:
        """Admit the prompt (its cached prefix hits), cache its full blocks, free it; return the counts.

        ``block_hashes``: the prompt's hashes if the caller has them (a router computes the same ones with
        ``FLEET_HASH_SEED``), so the manager need not hash the prompt again; it hashes any it is not given.
        """
        request = Request(request_id, list(prompt_token_ids))
        if block_hashes is not None:
            request.block_hashes.extend(block_hashes)
        hits, num_hits, _ = self.manager.get_computed_blocks(request)
        if self.manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits) is None:
            raise KvlabValueError(f"num_blocks: request {request_id!r} needs more blocks than the replica has")
        self.manager.free(request)
        self.metrics.prefix_cache_queries += request.num_tokens
        self.metrics.prefix_cache_hits += num_hits
        self.metrics.request_success["length"] += 1
        self.metrics.kv_cache_usage_perc = self.manager.usage
        return Served(request_id, replica, num_hits, request.num_tokens - num_hits)

    def take_events(self) -> list:
        return self.manager.take_events()


def customer_workload(num_customers: int = 16, queries_per_customer: int | Sequence[int] = 16,
                      context_tokens: int = 1024,
                      query_tokens: int = 32, output_len: int = 16, rate: float = 50.0,
                      seed: int = 0, vocab_size: int = 32000) -> list[FleetRequest]:
    """llm-d's benchmark shape, scaled down: customers each with a long shared context and many short queries.

    Each query is the customer's context then fresh tokens (ids in ``[1, vocab_size)``); queries arrive as
    a Poisson stream of ``rate`` per second in a random order of customers, so customers interleave.
    ``queries_per_customer`` is one count for all, or one per customer (a hot customer, say).
    """
    counts = ([queries_per_customer] * num_customers if isinstance(queries_per_customer, int)
              else list(queries_per_customer))
    if len(counts) != num_customers:
        raise KvlabValueError(f"queries_per_customer: {len(counts)} counts for {num_customers} customers")
    rng = random.Random(seed)
    contexts = [[rng.randrange(1, vocab_size) for _ in range(context_tokens)] for _ in range(num_customers)]
    order = [c for c in range(num_customers) for _ in range(counts[c])]
    rng.shuffle(order)
    t, out = 0.0, []
    for i, c in enumerate(order):
        t += rng.expovariate(rate)
        query = [rng.randrange(1, vocab_size) for _ in range(query_tokens)]
        out.append(FleetRequest(f"q{i}", tuple(contexts[c] + query), session=f"customer-{c}",
                                output_len=output_len, arrival=t))
    return out


@dataclass
class FleetResult:
    """One run: each request's service, the modelled TTFTs, and the fleet's totals."""

    router: str
    served: list[Served]
    ttft: list[float]
    expected_hit_tokens: list[int | None]
    num_replicas: int
    usage: list[float]
    copies_of_first_block: dict[str, int]
    dead: list[int]

    @property
    def prefilled_tokens(self) -> int:
        return sum(s.prefilled_tokens for s in self.served)

    @property
    def hit_rate(self) -> float:
        """The cluster's prefix-cache hit rate: hit tokens over queried tokens, all replicas together."""
        total = sum(s.hit_tokens + s.prefilled_tokens for s in self.served)
        return sum(s.hit_tokens for s in self.served) / total if total else 0.0

    @property
    def requests_per_replica(self) -> list[int]:
        counts = [0] * self.num_replicas
        for s in self.served:
            counts[s.replica] += 1
        return counts

    @property
    def load_imbalance(self) -> float:
        """The busiest replica's requests over the mean (1.0 is perfect balance)."""
        counts = self.requests_per_replica
        return max(counts) / (sum(counts) / len(counts))

    def ttft_quantile(self, q: float) -> float:
        ordered = sorted(self.ttft)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def prediction_error_tokens(self) -> int:
        """Sum over requests of |hit tokens the router expected - hit tokens the replica served|."""
        return sum(abs(e - s.hit_tokens) for e, s in zip(self.expected_hit_tokens, self.served, strict=True)
                   if e is not None)


class LocalReplicas:
    """The fleet simulation's backend: ``ReplicaCore``s in this process (events and usage read directly)."""

    def __init__(self, num_replicas: int, num_blocks: int, block_size: int) -> None:
        self.replicas = [ReplicaCore(num_blocks, block_size) for _ in range(num_replicas)]
        self.dead: list[int] = []

    def serve(self, replica: int, request: FleetRequest) -> Served:
        core = self.replicas[replica]
        return core.serve(request.request_id, request.prompt_token_ids, replica, request.block_hashes(core.block_size))

    def take_events(self, replica: int) -> list:
        return self.replicas[replica].take_events()

    def usage(self, replica: int) -> float:
        return self.replicas[replica].manager.usage

    def holds(self, replica: int, block_hash: bytes) -> bool:
        return self.replicas[replica].manager.block_pool.get_cached_block(block_hash) is not None


def simulate_fleet(router: Router, requests: Sequence[FleetRequest], num_blocks: int, block_size: int = 16,
                   cost: CostModel | None = None, decode_step_seconds: float | None = None,
                   backend: Any = None, before_each: Callable[[int], None] | None = None) -> FleetResult:
    """Route every request, serve it on its replica, feed the router the replica's events and the load.

    ``backend`` serves the requests: ``LocalReplicas`` (the default, in this process) or a
    ``ReplicaFleet`` of processes; ``before_each(k)`` runs before request ``k`` (to kill a replica).
    A replica that dies (``ReplicaDiedError``) is taken out of routing and the request is routed
    again, so none is lost; ``FleetResult.dead`` lists it.
    """
    n = router.num_replicas
    cost = cost or cost_model("llama-3-8b")
    step = cost.forward_seconds(1, 0) if decode_step_seconds is None else decode_step_seconds
    backend = backend if backend is not None else LocalReplicas(n, num_blocks, block_size)
    prefill_seconds: dict[tuple[int, int], float] = {}  # (prefilled, hits) -> the cost model's seconds
    busy_until = [0.0] * n
    finishing: list[tuple[float, int, str]] = []  # a heap of (finish time, replica, request id)
    active: dict[str, int] = {}  # request id -> its replica, while it runs
    num_active = [0] * n
    changed = set(range(n))  # replicas whose load or KV usage the router has not been told since it changed
    served, ttft, expected, dead = [], [], [], []
    first_block: dict[str, bytes] = {}
    for k, request in enumerate(requests):
        if before_each is not None:
            before_each(k)
        now = request.arrival
        while finishing and finishing[0][0] <= now:
            _, i, request_id = heapq.heappop(finishing)
            if active.pop(request_id, None) is not None:  # None: its replica died and it was let go
                num_active[i] -= 1
                router.finished(request_id)
                changed.add(i)
        for i in changed:  # a scrape of each replica that changed: its requests and its KV usage
            if router.alive[i]:
                router.update_load(i, num_active[i], backend.usage(i))
        changed.clear()
        while True:
            i = router.route(request)
            guess = router.last_expected_hit_tokens
            try:
                s = backend.serve(i, request)
                router.observe(i, backend.take_events(i))
                break
            except ReplicaDiedError:
                dead.append(i)
                router.mark_dead(i)
                for request_id in [r for r, j in active.items() if j == i]:
                    del active[request_id]
                    router.finished(request_id)
                num_active[i] = 0
        expected.append(None if guess is None else min(guess, (len(request.prompt_token_ids) - 1) // block_size
                                                       * block_size))
        start = max(now, busy_until[i])
        key = (s.prefilled_tokens, s.hit_tokens)
        prefill = prefill_seconds.get(key)
        if prefill is None:
            prefill = prefill_seconds[key] = cost.forward_seconds(s.prefilled_tokens, s.hit_tokens)
        busy_until[i] = start + prefill + request.output_len * step
        heapq.heappush(finishing, (busy_until[i], i, request.request_id))
        active[request.request_id] = i
        num_active[i] += 1
        changed.add(i)
        served.append(s)
        ttft.append(start - now + prefill)
        if request.session is not None and request.session not in first_block:
            first_block[request.session] = request.block_hashes(block_size)[0]
    copies = {session: sum(backend.holds(i, h) for i in router.live()) for session, h in first_block.items()}
    return FleetResult(router.name, served, ttft, expected, n, [backend.usage(i) for i in router.live()], copies,
                       dead)
