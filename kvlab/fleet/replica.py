"""Replicas as real processes: each a ``ReplicaCore`` publishing KV events over ZMQ and serving ``/metrics``.

``ReplicaFleet`` starts N replicas (``multiprocessing``, spawn) and stops them on exit, as one
context manager. Each replica binds a ZMQ PUB endpoint and a replay ROUTER on free
``tcp://127.0.0.1`` ports (``kvlab.distributed.kv_events``) and an HTTP ``/metrics`` server
(``prometheus_client`` on its own registry); the parent reaches them by address only, as a router
reaches vLLM pods, so the same code runs across machines with other addresses. Requests go over a
pipe (kvlab's stand-in for the OpenAI HTTP API). Every wait has a timeout: a replica that exits or
stops answering raises ``ReplicaDiedError`` naming it, and is never waited on again.

kvlab simplifies: the replicas run the no-compute ``ReplicaCore`` (the fleet simulation's), not an
``LLMEngine`` with a model, so both runs serve the same blocks and agree request by request.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import urllib.request
from collections.abc import Sequence
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from kvlab._validate import positive_int
from kvlab.errors import ReplicaDiedError
from kvlab.fleet.routers import FleetRequest
from kvlab.fleet.simulation import Served

LOOPBACK = "127.0.0.1"


def _replica_main(index: int, num_blocks: int, block_size: int, conn: Connection) -> None:
    """The replica process: bind, report the addresses, then serve messages until ``stop``."""
    from prometheus_client import start_http_server

    from kvlab.distributed.kv_events import KVEventsConfig, ZmqEventPublisher, make_batch
    from kvlab.fleet.metrics import ReplicaMetrics
    from kvlab.fleet.simulation import ReplicaCore

    core = ReplicaCore(num_blocks, block_size)
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://{LOOPBACK}:0",
                                                 replay_endpoint=f"tcp://{LOOPBACK}:0"), data_parallel_rank=index)
    metrics = ReplicaMetrics("kvlab-fleet", index, engine_metrics=core.metrics)
    server, _thread = start_http_server(0, addr=LOOPBACK, registry=metrics.registry)
    num_batches = 0
    try:
        conn.send(("ready", publisher.endpoint, publisher.replay_endpoint, server.server_port))
        while True:
            message = conn.recv()
            if message[0] == "stop":
                break
            if message[0] == "serve":
                _, request_id, tokens = message
                served = core.serve(request_id, tokens, index)
                events = core.take_events()
                if events:  # as vLLM's scheduler: a batch per step that has events
                    publisher.publish(make_batch(events))
                    num_batches += 1
                conn.send(("served", served.hit_tokens, served.prefilled_tokens, num_batches - 1))
            elif message[0] == "reset":
                assert core.manager.reset_prefix_cache(), "a replica between requests holds no blocks"
                publisher.publish(make_batch(core.take_events()))
                num_batches += 1
                conn.send(("reset", num_batches - 1))
            elif message[0] == "holds":
                conn.send(("holds", core.manager.block_pool.get_cached_block(message[1]) is not None))
    finally:
        publisher.shutdown()
        server.server_close()  # the serving thread is a daemon: it ends with the process
        conn.close()
    # Everything this process owns is closed: skip the interpreter's teardown (torch's takes seconds).
    os._exit(0)


class ReplicaHandle:
    """The parent's view of one replica: its process, pipe, addresses and event subscriber."""

    def __init__(self, index: int, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.index, self.process, self.conn = index, process, conn
        self.endpoint = self.replay_endpoint = ""
        self.metrics_url = ""
        self.subscriber: Any = None

    def ask(self, message: tuple, timeout: float) -> tuple:
        """Send one message and wait at most ``timeout`` s for the answer; a dead replica raises."""
        try:
            self.conn.send(message)
            if not self.conn.poll(timeout):
                raise ReplicaDiedError(self.index, f"no answer to {message[0]!r} within {timeout} s")
            return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as error:
            raise ReplicaDiedError(self.index, f"exited (exit code {self.process.exitcode})") from error


class ReplicaFleet:
    """N replica processes started on ``__enter__`` and stopped on ``__exit__``; the fleet simulation's backend.

    ``timeout`` bounds every wait: start-up, each request, each event batch, each scrape. ``serve``
    returns what the replica did and leaves its KV event batch for ``take_events`` (received over
    ZMQ, with a replay if a frame was missed); ``usage`` scrapes ``/metrics`` over HTTP.
    """

    def __init__(self, num_replicas: int, num_blocks: int, block_size: int = 16, timeout: float = 30.0) -> None:
        self.num_replicas = positive_int("num_replicas", num_replicas)
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
        self.timeout = float(timeout)
        self.handles: list[ReplicaHandle] = []
        self.dead: list[int] = []
        self._pending: dict[int, int] = {}  # replica -> the seq of its last batch, not yet received

    def __enter__(self) -> ReplicaFleet:
        from kvlab.distributed.kv_events import KVEventSubscriber

        ctx = multiprocessing.get_context("spawn")
        try:
            for i in range(self.num_replicas):
                parent, child = ctx.Pipe()
                process = ctx.Process(target=_replica_main, args=(i, self.num_blocks, self.block_size, child),
                                      name=f"kvlab-replica-{i}", daemon=True)
                process.start()
                child.close()
                self.handles.append(ReplicaHandle(i, process, parent))
            deadline = time.monotonic() + self.timeout
            for h in self.handles:
                if not h.conn.poll(max(0.0, deadline - time.monotonic())):
                    raise ReplicaDiedError(h.index, f"not ready within {self.timeout} s")
                _, h.endpoint, h.replay_endpoint, port = h.conn.recv()
                h.metrics_url = f"http://{LOOPBACK}:{port}/metrics"
                h.subscriber = KVEventSubscriber(h.endpoint, h.replay_endpoint)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for h in self.handles:
            if h.process.is_alive():
                with contextlib.suppress(OSError):
                    h.conn.send(("stop",))
        for h in self.handles:
            h.process.join(timeout=self.timeout)
            if h.process.is_alive():
                h.process.kill()
                h.process.join(timeout=self.timeout)
            if h.subscriber is not None:
                h.subscriber.close()
            h.conn.close()
        self.handles = []

    def kill(self, replica: int) -> None:
        """Kill a replica's process outright (SIGKILL), as a crashed pod dies: for tests and the notebook."""
        h = self.handles[replica]
        h.process.kill()
        h.process.join(timeout=self.timeout)

    def _handle(self, replica: int) -> ReplicaHandle:
        h = self.handles[replica]
        if replica in self.dead or not h.process.is_alive():
            if replica not in self.dead:
                self.dead.append(replica)
            raise ReplicaDiedError(replica, f"exited (exit code {h.process.exitcode})")
        return h

    def serve(self, replica: int, request: FleetRequest) -> Served:
        """Send one request to a replica and wait for its counts."""
        h = self._handle(replica)
        try:
            _, hits, prefilled, seq = h.ask(("serve", request.request_id, list(request.prompt_token_ids)),
                                            self.timeout)
        except ReplicaDiedError:
            self.dead.append(replica)
            raise
        self._pending[replica] = seq
        return Served(request.request_id, replica, hits, prefilled)

    def take_events(self, replica: int) -> list:
        """The event batches received from ``replica`` up to its last serve's batch (bounded wait)."""
        h, last = self.handles[replica], self._pending.pop(replica, -1)
        events: list = []
        deadline = time.monotonic() + self.timeout
        while h.subscriber.last_seq < last:
            if time.monotonic() > deadline:
                raise ReplicaDiedError(replica, f"event batch {last} did not arrive within {self.timeout} s")
            if h.subscriber.last_seq < 0 and time.monotonic() > deadline - self.timeout + 0.5:
                # a SUB socket misses what was sent before it joined: ask the replay endpoint
                for seq, batch in h.subscriber.replay(0, self.timeout):
                    if seq > h.subscriber.last_seq:
                        events.extend(batch.events)
                        h.subscriber.last_seq = seq
                continue
            for _seq, batch in h.subscriber.poll(0.05):
                events.extend(batch.events)
        return events

    def reset(self) -> None:
        """Empty every live replica's prefix cache (their ``AllBlocksCleared`` events are received and dropped)."""
        for h in self.handles:
            if h.index not in self.dead:
                self._pending[h.index] = h.ask(("reset",), self.timeout)[1]
                self.take_events(h.index)

    def scrape(self, replica: int) -> str:
        """The replica's ``/metrics`` text, over HTTP."""
        with urllib.request.urlopen(self._handle(replica).metrics_url, timeout=self.timeout) as response:
            return response.read().decode()

    def usage(self, replica: int) -> float:
        """``vllm:kv_cache_usage_perc`` from a scrape."""
        from kvlab.fleet.metrics import parse_scrape

        try:
            return parse_scrape(self.scrape(replica))["vllm:kv_cache_usage_perc"]
        except (OSError, ReplicaDiedError):
            return 0.0  # a scrape does not decide a death: the next request to it reports it

    def holds(self, replica: int, block_hash: bytes) -> bool:
        return bool(self._handle(replica).ask(("holds", block_hash), self.timeout)[1])


def alive(fleet: ReplicaFleet) -> Sequence[int]:
    """The replicas whose process is still running."""
    return [h.index for h in fleet.handles if h.process.is_alive()]
