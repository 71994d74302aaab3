"""A router in front of replica processes, in real time: requests sent at their arrival times, TTFT measured.

``serve_timed`` is the router's event loop. Before each request it reads what the replicas
published (their KV events over ZMQ, received as they arrive, so an event-fed index is exactly as
fresh as a real one) and their load (the requests it sent that have not finished, as a router
counts them, and the KV usage each replica last reported), routes, and sends the request; the
replicas (``ReplicaFleet``, ``LLMEngine``s with continuous batching) serve many at once. TTFT is
the replica's clock at the end of the step that sampled the first token minus the router's clock
when it sent the request: one machine, one ``time.time()``. Beside it each replica reports CPU
seconds (the wait and the work with a core per replica, which other load on a shared machine
hardly changes). A replica that dies is reported, taken out of routing, and every request it had
not finished is routed again (its TTFT still counts from the first send), so none is lost. Every
wait is bounded by ``timeout``.

kvlab simplifies: requests go over a pipe rather than HTTP, and the router is one thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from kvlab.errors import KvlabValueError
from kvlab.fleet.routers import FleetRequest, Router


@dataclass(frozen=True)
class Measured:
    """One request as the router saw it: where it finished, its TTFT and end-to-end seconds, its hit."""

    request_id: str
    replica: int
    ttft: float  # wall seconds, router's send to the replica's first token
    e2e: float
    cpu_ttft: float  # the replica's step CPU seconds from its arrival to its first token
    hit_tokens: int
    prefilled_tokens: int
    expected_hit_tokens: int | None  # what the router expected the replica to hold (None: no guess)
    rerouted: int  # how many times a dead replica's loss sent it elsewhere


@dataclass
class MeasuredRun:
    """A timed run: each request's measurement (in workload order), the wall time, and who died."""

    router: str
    requests: list[Measured]
    wall_seconds: float
    num_replicas: int
    output_tokens: int
    dead: list[int] = field(default_factory=list)
    replica_cpu_seconds: float = 0.0  # the CPU time of every replica's steps in this run, added up

    @property
    def prefilled_tokens(self) -> int:
        return sum(m.prefilled_tokens for m in self.requests)

    @property
    def hit_rate(self) -> float:
        total = sum(m.hit_tokens + m.prefilled_tokens for m in self.requests)
        return sum(m.hit_tokens for m in self.requests) / total if total else 0.0

    @property
    def ttft(self) -> list[float]:
        return [m.ttft for m in self.requests]

    def ttft_quantile(self, q: float) -> float:
        ordered = sorted(self.ttft)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def mean_ttft(self) -> float:
        return sum(self.ttft) / len(self.requests)

    @property
    def mean_cpu_ttft(self) -> float:
        """Mean TTFT in replica CPU seconds: the wait each request would see with a core per replica."""
        return sum(m.cpu_ttft for m in self.requests) / len(self.requests)

    @property
    def throughput(self) -> float:
        """Output tokens per second of wall time, the whole fleet together."""
        return self.output_tokens / self.wall_seconds

    @property
    def tokens_per_cpu_second(self) -> float:
        """Output tokens per second of replica CPU: the throughput of a fleet with a core per replica."""
        return self.output_tokens / self.replica_cpu_seconds if self.replica_cpu_seconds else 0.0

    @property
    def requests_per_replica(self) -> list[int]:
        counts = [0] * self.num_replicas
        for m in self.requests:
            counts[m.replica] += 1
        return counts

    @property
    def prediction_error_tokens(self) -> int:
        """Sum over requests of |hit tokens the router expected - hit tokens the replica served|."""
        return sum(abs(m.expected_hit_tokens - m.hit_tokens) for m in self.requests
                   if m.expected_hit_tokens is not None)


class _Run:
    """The state of one ``serve_timed`` call (kept apart so that its helpers share it)."""

    def __init__(self, router: Router, requests: Sequence[FleetRequest], fleet: Any) -> None:
        self.router, self.fleet = router, fleet
        self.by_id = {r.request_id: r for r in requests}
        n = router.num_replicas
        self.in_flight: list[set[str]] = [set() for _ in range(n)]
        self.usage = [0.0] * n
        self.cpu_seconds = [0.0] * n  # each replica's step CPU since its reset, as last reported
        self.sent_at: dict[str, float] = {}
        self.replica_of: dict[str, int] = {}
        self.expected: dict[str, int | None] = {}
        self.first_at: dict[str, tuple[float, float]] = {}
        self.done: dict[str, Measured] = {}
        self.rerouted: dict[str, int] = {}
        self.dead: list[int] = []

    def feed_router(self) -> None:
        """What each live replica published since the last look (its events), and its load."""
        for i in self.router.live():
            h = self.fleet.handles[i]
            try:
                events = [e for _seq, batch in h.subscriber.poll(0) for e in batch.events]
            except TimeoutError:  # a replay that got no answer: the replica is going; its pipe will say so
                events = []
            if events:
                self.router.observe(i, events)
            self.router.update_load(i, len(self.in_flight[i]), self.usage[i])

    def dispatch(self, request: FleetRequest) -> None:
        """Route and send one request (again to another replica if the chosen one turns out dead)."""
        self.feed_router()
        block_size = getattr(self.router, "block_size", self.fleet.block_size)
        while True:
            i = self.router.route(request)
            guess = self.router.last_expected_hit_tokens
            try:
                self.fleet.handles[i].conn.send(("add", request.request_id, list(request.prompt_token_ids),
                                                 request.output_len))
                break
            except (BrokenPipeError, ConnectionResetError, OSError):
                self.died(i)
        cap = (len(request.prompt_token_ids) - 1) // block_size * block_size  # a hit leaves one token to compute
        self.expected[request.request_id] = None if guess is None else min(guess, cap)
        self.sent_at.setdefault(request.request_id, time.time())
        self.replica_of[request.request_id] = i
        self.in_flight[i].add(request.request_id)

    def died(self, i: int) -> None:
        """Replica ``i`` is gone: out of routing, and what it had not finished is routed again."""
        if i in self.dead:
            return
        self.dead.append(i)
        if i not in self.fleet.dead:
            self.fleet.dead.append(i)
        self.router.mark_dead(i)  # raises (a kvlab error) when no replica is left
        lost, self.in_flight[i] = sorted(self.in_flight[i]), set()
        for request_id in lost:
            self.router.finished(request_id)
            self.rerouted[request_id] = self.rerouted.get(request_id, 0) + 1
            self.dispatch(self.by_id[request_id])

    def receive(self, i: int) -> None:
        """Every message waiting from replica ``i``; its pipe's end means it died."""
        conn = self.fleet.handles[i].conn
        try:
            while conn.poll(0):
                _, messages, usage, cpu_seconds = conn.recv()
                self.usage[i], self.cpu_seconds[i] = usage, cpu_seconds
                for message in messages:
                    self.on_message(i, message)
        except (EOFError, ConnectionResetError, OSError):
            self.died(i)

    def on_message(self, i: int, message: tuple) -> None:
        request_id = message[1]
        if self.replica_of.get(request_id) != i:  # sent elsewhere since (cannot happen while i lives)
            return
        if message[0] == "first":
            self.first_at.setdefault(request_id, (message[2], message[3]))
            return
        _, _, hits, prefilled, at = message
        sent = self.sent_at[request_id]
        first, cpu_ttft = self.first_at[request_id]
        self.done[request_id] = Measured(request_id, i, first - sent, at - sent, cpu_ttft, hits, prefilled,
                                         self.expected[request_id], self.rerouted.get(request_id, 0))
        self.in_flight[i].discard(request_id)
        self.router.finished(request_id)


def serve_timed(router: Router, requests: Sequence[FleetRequest], fleet: Any, *, time_scale: float = 1.0,
                closed_loop: bool = False, timeout: float = 120.0,
                before_each: Callable[[int], None] | None = None) -> MeasuredRun:
    """Send the requests through ``router`` to ``fleet`` and measure each one; return once all have finished.

    Open loop (the default): request ``k`` is sent at ``arrival x time_scale`` seconds after the start,
    whatever the fleet is doing. Closed loop: each session (``FleetRequest.session``, a customer) sends
    its next request as soon as its previous one finished, all sessions at once, so the fleet always
    holds one request per session however fast the machine is. ``fleet`` is a started ``ReplicaFleet``
    whose caches the caller has emptied (``fleet.reset()``); ``before_each(k)`` runs before the ``k``-th
    request sent (to kill a replica mid-run). Raises ``TimeoutError`` naming how many requests had not
    finished after ``timeout`` seconds.
    """
    if router.num_replicas != fleet.num_replicas:
        raise KvlabValueError(f"router: it routes over {router.num_replicas} replicas, the fleet has "
                              f"{fleet.num_replicas}")
    if not time_scale > 0:
        raise KvlabValueError(f"time_scale must be > 0, got {time_scale!r}")
    run = _Run(router, requests, fleet)
    for i in fleet.dead:  # replicas that died in an earlier run stay out
        if router.alive[i]:
            router.mark_dead(i)
        run.dead.append(i)
    # what is sent when: open loop, by arrival; closed loop, each session's queue, its head sent when free
    queues: dict[str, list[FleetRequest]] = {}
    for r in requests if closed_loop else sorted(requests, key=lambda r: r.arrival):
        queues.setdefault((r.session or r.request_id) if closed_loop else "", []).append(r)
    heads = {key: 0 for key in queues}
    busy: dict[str, str] = {}  # session -> its request in flight (closed loop)
    start, deadline, sent = time.time(), time.monotonic() + timeout, 0
    while len(run.done) < len(requests):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(requests) - len(run.done)} of {len(requests)} requests unfinished after "
                               f"{timeout} s (replicas dead: {run.dead})")
        now = time.time() - start
        until_next = 0.05
        for key, queue in queues.items():
            if closed_loop and key in busy:
                if busy[key] not in run.done:
                    continue
                del busy[key]
            while heads[key] < len(queue):
                request = queue[heads[key]]
                if not closed_loop and request.arrival * time_scale > now:
                    until_next = request.arrival * time_scale - now
                    break
                if before_each is not None:
                    before_each(sent)
                run.dispatch(request)
                heads[key] += 1
                sent += 1
                if closed_loop:
                    busy[key] = request.request_id
                    break
        live = [fleet.handles[i] for i in router.live()]
        ready = wait([h.conn for h in live] + [h.process.sentinel for h in live],
                     timeout=max(0.0, min(until_next, 0.05)))
        for h in live:
            if h.conn in ready or h.process.sentinel in ready:
                run.receive(h.index)  # what it said before it died counts
            if h.process.sentinel in ready and h.index not in run.dead:
                run.died(h.index)
    wall = time.time() - start
    measured = [run.done[r.request_id] for r in requests]
    output_tokens = sum(r.output_len for r in requests)
    return MeasuredRun(router.name, measured, wall, router.num_replicas, output_tokens, run.dead,
                       sum(run.cpu_seconds))
