"""Prefix-cache hit statistics, counted in tokens as vLLM's ``prefix_cache_queries`` / ``_hits`` are.

Mirrors ``PrefixCacheStats`` and ``CachingMetrics`` in ``vllm/v1/metrics/stats.py``: each
request admitted adds its ``num_tokens`` to *queries* and its prefix-cache hit tokens to
*hits*; requests resumed after a preemption are counted apart, so recomputing one's own
blocks does not flatter the hit rate. The hit rate shown in vLLM's log is taken over the
most recent ``max_recent_requests`` requests (1000 by default); in Prometheus it is
``rate(vllm:prefix_cache_hits[5m]) / rate(vllm:prefix_cache_queries[5m])``.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from kvlab._validate import checked, fraction_in_unit_interval, positive_int


@dataclasses.dataclass
class PrefixCacheStats:
    """Token counts of prefix-cache lookups: ``queries`` asked for, ``hits`` found, per kind of request."""

    reset: bool = False  # reset_prefix_cache() ran since these stats were taken
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @checked
    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Add one admitted request: ``num_tokens`` queried, ``num_hits`` of them found in the cache."""
        if preempted:  # the counts are ints >= 0: checked at the door
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        """Both stats' counts together (the manager's since-start totals: the steps taken plus the open one)."""
        return PrefixCacheStats(
            self.reset or other.reset, self.requests + other.requests, self.queries + other.queries,
            self.hits + other.hits, self.preempted_requests + other.preempted_requests,
            self.preempted_queries + other.preempted_queries, self.preempted_hits + other.preempted_hits)

    @property
    def hit_rate(self) -> float:
        """hits / queries over these stats (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@checked
class CachingMetrics:
    """Hit rate over the most recent ``max_recent_requests`` requests, as vLLM's logger shows it."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = positive_int("max_recent_requests", max_recent_requests)
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue: deque[tuple[int, int, int]] = deque()

    def _observe_request(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """``observe`` of one admitted request's lookup, without building its stats (the manager's path)."""
        if not preempted:
            self._push(1, num_tokens, num_hits)

    @checked
    def observe(self, stats: PrefixCacheStats) -> None:
        """Fold in one batch of stats; drop the oldest batches once the window holds too many requests."""
        if stats.reset:
            self.reset()
        if stats.requests == 0:  # preempted-only or empty batches do not push useful ones out
            return
        self._push(stats.requests, stats.queries, stats.hits)

    def _push(self, requests: int, queries: int, hits: int) -> None:
        self.query_queue.append((requests, queries, hits))
        self.aggregated_requests += requests
        self.aggregated_query_total += queries
        self.aggregated_query_hit += hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self.query_queue.popleft()
            self.aggregated_requests -= old_requests
            self.aggregated_query_total -= old_queries
            self.aggregated_query_hit -= old_hits

    def reset(self) -> None:
        """Forget everything (after ``reset_prefix_cache``)."""
        self.aggregated_requests = self.aggregated_query_total = self.aggregated_query_hit = 0
        self.query_queue.clear()

    @property
    def empty(self) -> bool:
        return self.aggregated_requests == 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens over the window (0.0 before any query)."""
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total


@checked
def interpret_hit_rate(hit_rate: float, workload_shares_prefixes: bool) -> str:
    """What a measured hit rate says about a deployment, and what to check next.

    Thresholds from the source material's reading of vLLM's metric: above 0.7 is healthy for
    multi-turn chat or a fixed system prompt; 0.3 to 0.7 suggests varying content ahead of
    the shared part; below 0.1 is a problem only if requests really share prefixes.
    """
    rate = 0.0 if hit_rate == 0 else fraction_in_unit_interval("hit_rate", hit_rate)
    if rate > 0.7:
        return "healthy: typical of multi-turn chat or a fixed system prompt; nothing to do"
    if rate >= 0.3:
        return "middling: something that varies may sit ahead of the shared part; check the prompt template's order"
    if rate >= 0.1:
        return "low: check the prompt template's order and whether the KV pool evicts prefixes before they return"
    if workload_shares_prefixes:
        return ("a problem: requests share prefixes yet do not hit; check random routing across replicas, "
                "a KV pool so small it evicts prefixes before reuse, and timestamps or ids at the prompt's start")
    return "expected: these requests share no prefix, so prefix caching cannot help; do not tune it"
