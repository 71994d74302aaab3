"""Replicas as real processes: each publishes KV events over ZMQ and serves ``/metrics`` over HTTP.

``ReplicaFleet`` starts N replicas (``multiprocessing``, spawn) and stops them on exit, as one
context manager. A replica is either the no-compute ``ReplicaCore`` (the fleet simulation's) or,
given ``model_dir``, an ``LLMEngine`` serving that checkpoint (the trained ``tiny-pydoc-llama``)
whose own ``kv_events_config`` publisher sends its pool's events, as a vLLM pod started with
``--kv-events-config`` does. Each binds its ZMQ PUB endpoint and replay ROUTER on free
``tcp://127.0.0.1`` ports (``kvlab.distributed.kv_events``) and an HTTP ``/metrics`` server
(``prometheus_client`` on its own registry); the parent reaches them by address only, as a router
reaches vLLM pods, so the same code runs across machines with other addresses. Requests go over a
pipe (kvlab's stand-in for the OpenAI HTTP API). Every wait has a timeout: a replica that exits or
stops answering raises ``ReplicaDiedError`` naming it, and is never waited on again.

``serve`` is lockstep (one request at a time, its prompt only, as ``ReplicaCore`` serves it), so
either kind agrees with the fleet simulation request by request; ``kvlab.fleet.serving`` drives
engine replicas concurrently in real time instead, to measure TTFT. An engine replica hashes with
``PYTHONHASHSEED`` set to the routers' ``FLEET_HASH_SEED``: vLLM seeds its ``NONE_HASH`` from that
variable, and an indexer outside the engine (llm-d's, Dynamo's) must share it to name the same blocks.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import urllib.request
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from kvlab._validate import positive_int
from kvlab.errors import KvlabValueError, ReplicaDiedError
from kvlab.fleet.routers import FLEET_HASH_SEED, FleetRequest
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
            if message[0] in ("serve", "add"):  # the no-compute replica serves at once, either way
                served = core.serve(message[1], message[2], index)
                events = core.take_events()
                if events:  # as vLLM's scheduler: a batch per step that has events
                    publisher.publish(make_batch(events))
                    num_batches += 1
                if message[0] == "serve":
                    conn.send(("served", served.hit_tokens, served.prefilled_tokens, num_batches - 1))
                else:
                    now = time.time()
                    conn.send(("outputs", [("first", served.request_id, now, 0.0),
                                           ("done", served.request_id, served.hit_tokens, served.prefilled_tokens,
                                            now)], core.manager.usage, 0.0))
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


class _EngineLoop:
    """An engine replica's loop: take messages from the pipe, step while requests are unfinished, report back.

    ``serve`` (lockstep) runs one prompt to its first token and answers with its hit and prefilled counts;
    ``add`` queues a request among others, and each step's first tokens and finished requests go back in
    one ``outputs`` message stamped with this process's ``time.time()`` (one clock per machine), with the
    CPU seconds of its steps since the last ``reset``. A first token also carries its TTFT in CPU seconds:
    the CPU time of this replica's steps from the request's arrival to its first token
    (``time.thread_time``), what the wait would be with a core to itself.
    """

    IDLE_POLL = 0.05  # seconds the loop sleeps on the pipe when nothing is running

    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine, self.conn = engine, conn
        self.num_added = 0
        self.ids: dict[str, str] = {}  # engine request id -> the router's (ids repeat across runs, the engine's not)
        self.prompt_len: dict[str, int] = {}
        self.hits: dict[str, int] = {}
        self.first_sent: set[str] = set()
        self.cpu_clock = 0.0  # CPU seconds of every step so far
        self.cpu_at_add: dict[str, float] = {}

    def add(self, request_id: str, tokens: list[int], max_tokens: int) -> str:
        engine_id = f"{request_id}@{self.num_added}"
        self.num_added += 1
        self.engine.add_request(tokens, max_tokens=max_tokens, request_id=engine_id, ignore_eos=True)
        self.ids[engine_id], self.prompt_len[engine_id] = request_id, len(tokens)
        self.cpu_at_add[engine_id] = self.cpu_clock
        return engine_id

    def step(self) -> list[tuple]:
        """One engine step and its messages: ``("first", id, t, cpu_ttft)``, ``("done", id, hits, prefilled, t)``."""
        started = time.thread_time()
        outputs = self.engine.step()
        self.cpu_clock += time.thread_time() - started
        scheduled = self.engine.last_scheduler_output
        new = set(scheduled.scheduled_new_req_ids)
        for s in scheduled.scheduled:  # a request's hit: the tokens already cached when it was first scheduled
            if s.request_id in new and s.request_id not in self.hits:
                self.hits[s.request_id] = s.num_computed_tokens
        now, messages = time.time(), []
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids and rid not in self.first_sent:
                self.first_sent.add(rid)
                messages.append(("first", self.ids[rid], now, self.cpu_clock - self.cpu_at_add.pop(rid)))
            if out.finished:
                hits = self.hits.pop(rid)
                messages.append(("done", self.ids.pop(rid), hits, self.prompt_len.pop(rid) - hits, now))
                self.first_sent.discard(rid)
        return messages

    def handle(self, message: tuple) -> bool:
        """Answer one message; False on ``stop``."""
        kind, engine, publisher = message[0], self.engine, self.engine.kv_event_publisher
        if kind == "stop":
            return False
        if kind == "add":
            self.add(message[1], message[2], message[3])
        elif kind == "serve":
            assert not engine.has_unfinished_requests(), "lockstep serving: one request at a time"
            self.add(message[1], message[2], 1)
            done: list[tuple] = []
            while not done:
                done = [m for m in self.step() if m[0] == "done"]
            _, _, hits, prefilled, _ = done[0]
            self.conn.send(("served", hits, prefilled, publisher.num_published - 1))
        elif kind == "reset":
            assert engine.reset_prefix_cache(), "a replica between runs holds no blocks"
            self.cpu_clock = 0.0  # a run's CPU seconds count from its reset
            self.conn.send(("reset", publisher.num_published - 1))
        elif kind == "holds":
            self.conn.send(("holds", engine.kv_cache_manager.block_pool.get_cached_block(message[1]) is not None))
        return True

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            if self.conn.poll(0 if busy else self.IDLE_POLL):
                if not self.handle(self.conn.recv()):
                    return
                continue  # every waiting message before the next step
            if busy:
                messages = self.step()
                if messages:
                    self.conn.send(("outputs", messages, self.engine.kv_cache_manager.usage, self.cpu_clock))


def _engine_replica_main(index: int, num_blocks: int, block_size: int, model_dir: str,
                         engine_args: dict[str, Any], conn: Connection) -> None:
    """An ``LLMEngine`` replica: load, warm up, bind, report the addresses, then run ``_EngineLoop``."""
    os.environ["PYTHONHASHSEED"] = FLEET_HASH_SEED  # read by the engine's KVCacheManager, as vLLM reads it
    import torch
    from prometheus_client import start_http_server

    from kvlab.engine.kv_events_config import KVEventsConfig
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.fleet.metrics import ReplicaMetrics

    torch.set_num_threads(1)  # one core per replica: N replicas share the machine's cores
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://{LOOPBACK}:0",
                            replay_endpoint=f"tcp://{LOOPBACK}:0")
    engine = LLMEngine(model_dir, num_gpu_blocks=num_blocks, block_size=block_size, kv_events_config=events,
                       **engine_args)
    engine.generate([[1] * (2 * block_size)], max_tokens=2)  # the first forward pays torch's lazy set-up
    assert engine.reset_prefix_cache()
    metrics = ReplicaMetrics(engine.model_dir.name, index, engine_metrics=engine.metrics, latency=engine.latency,
                             kv_cache_metrics=engine.kv_cache_metrics)
    server, _thread = start_http_server(0, addr=LOOPBACK, registry=metrics.registry)
    bound = engine.kv_event_publisher.get_publisher_config()
    try:
        conn.send(("ready", bound.endpoint, bound.replay_endpoint, server.server_port))
        _EngineLoop(engine, conn).run()
    finally:
        engine.shutdown()
        server.server_close()
        conn.close()
    os._exit(0)  # everything this process owns is closed: skip the interpreter's teardown (torch's takes seconds)


def _context(engines: bool) -> Any:
    """Where replicas start: a fork server that imported the replica's modules once (torch's import alone
    costs each spawned replica seconds of CPU), else spawn (where there is no fork server: Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # torch._dynamo: building a model on the meta device (the loader's check) imports it lazily, at ~1 s of CPU
    ctx.set_forkserver_preload(["kvlab.fleet.replica", "prometheus_client", "zmq",
                                *(["torch", "torch._dynamo", "kvlab.engine.llm_engine"] if engines else [])])
    return ctx


def _stop_forkserver() -> None:
    """Stop the fork server once no process it started is alive, so nothing outlives the last ``with`` block.

    ``multiprocessing`` keeps one fork server per process and offers no public stop; ``_stop`` is the one
    its own tests use, and it waits for the server, which lives while any process it started does: so
    while another fleet's replicas (or any child of this process) still run, the server is left to the
    last fleet to close. Where ``_stop`` is missing the server ends with this process.
    """
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None and not multiprocessing.active_children():
        stop()


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

    ``num_blocks`` is each replica's pool (the null block included, as ``KVCacheManager`` and
    ``LLMEngine(num_gpu_blocks=...)`` count it). With ``model_dir`` each replica is an ``LLMEngine`` on that
    checkpoint, built with ``engine_args`` besides; without, the no-compute ``ReplicaCore``.
    ``timeout`` bounds every wait: start-up, each request, each event batch, each scrape. ``serve``
    returns what the replica did and leaves its KV event batch for ``take_events`` (received over
    ZMQ, with a replay if a frame was missed); ``usage`` scrapes ``/metrics`` over HTTP.
    """

    def __init__(self, num_replicas: int, num_blocks: int, block_size: int = 16, timeout: float = 30.0,
                 model_dir: str | os.PathLike | None = None, engine_args: Mapping[str, Any] | None = None) -> None:
        self.num_replicas = positive_int("num_replicas", num_replicas)
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
        self.timeout = float(timeout)
        self.model_dir = None if model_dir is None else str(model_dir)
        self.engine_args = dict(engine_args or {})
        if self.engine_args and self.model_dir is None:
            raise KvlabValueError("engine_args: the no-compute replicas take none; give model_dir for engine replicas")
        self.handles: list[ReplicaHandle] = []
        self.dead: list[int] = []
        self._pending: dict[int, int] = {}  # replica -> the seq of its last batch, not yet received

    def __enter__(self) -> ReplicaFleet:
        from kvlab.distributed.kv_events import KVEventSubscriber

        ctx = _context(self.model_dir is not None)
        try:
            for i in range(self.num_replicas):
                parent, child = ctx.Pipe()
                args: tuple = ((_replica_main, (i, self.num_blocks, self.block_size, child)) if self.model_dir is None
                               else (_engine_replica_main, (i, self.num_blocks, self.block_size, self.model_dir,
                                                            self.engine_args, child)))
                process = ctx.Process(target=args[0], args=args[1], name=f"kvlab-replica-{i}", daemon=True)
                process.start()
                child.close()
                self.handles.append(ReplicaHandle(i, process, parent))
            deadline = time.monotonic() + self.timeout
            for h in self.handles:
                try:
                    if not h.conn.poll(max(0.0, deadline - time.monotonic())):
                        raise ReplicaDiedError(h.index, f"not ready within {self.timeout} s")
                    _, h.endpoint, h.replay_endpoint, port = h.conn.recv()
                except (EOFError, OSError) as error:
                    h.process.join(timeout=self.timeout)
                    raise ReplicaDiedError(h.index, f"exited while starting (exit code {h.process.exitcode}); "
                                                    "its traceback is on stderr") from error
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
        _stop_forkserver()

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
