"""The engine's side of tensor parallelism: start one process per rank and drive them (vLLM's ``MultiprocExecutor``).

``MultiprocExecutor`` spawns ``tensor_parallel_size`` processes and gives each what torchrun would
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``; one share of
the cores each), so every rank runs ``kvlab.engine.worker.worker_main`` and joins with ``env://``. The
engine keeps the scheduler and the ``KVCacheManager``; each step it sends the ``SchedulerOutput`` down rank
0's pipe, rank 0 broadcasts it to the others over gloo, and rank 0's ``ModelRunnerOutput`` comes back (vLLM's
``output_rank``; every rank sampled the same tokens from the same all-gathered logits).

vLLM's executor writes each step once into a shared-memory ring (``MessageQueue``) that every worker reads;
kvlab hands it to rank 0 only, which relays it (``kvlab.engine.worker`` says why). Every wait here is
bounded: start-up, each request, shutdown. A rank that reports a failure, exits, or leaves a request
unanswered for ``EXECUTE_MODEL_TIMEOUT_S`` (vLLM's ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``) fails the executor:
the others' reports are collected for a moment, every rank still running is stopped, and
``RankFailedError`` names the rank that failed first. Nothing is left running: ``shutdown`` (also run when
the executor is garbage-collected) asks the ranks to exit, then terminates and kills what remains.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import socket
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from kvlab.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvlab.engine.engine_config import EngineConfig
from kvlab.engine.worker_proc import spawned_rank
from kvlab.errors import RankFailedError

LOOPBACK = "127.0.0.1"
#: The longest the engine waits for one step's answer (vLLM's ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` default).
EXECUTE_MODEL_TIMEOUT_S = 300.0
#: The longest start-up may take: spawn, import torch, join, load the shard (on a loaded laptop, seconds).
STARTUP_TIMEOUT_S = 300.0
#: After a first failure, how long the others' reports are awaited before every rank is stopped.
FAILURE_GRACE_S = 3.0


def get_open_port() -> int:
    """A free TCP port on the loopback (vLLM's ``get_open_port``: bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def rank_context(config: EngineConfig) -> Any:
    """How ranks are started: forked from a server that imported torch and the worker once (CPU engines), or
    spawned fresh (GPU engines: a process that may have touched CUDA must not fork).

    vLLM forks its workers by default and spawns once CUDA is initialised (``VLLM_WORKER_MULTIPROC_METHOD``).
    kvlab never forks the engine's own process, whose threads (a notebook kernel's, torch's) a fork would
    copy mid-flight; multiprocessing's fork server is a process of one thread that only imported modules, so
    each rank costs a fork instead of a fresh torch import (seconds per rank on a small CPU).
    """
    if config.device.type == "cuda":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["kvlab.engine.worker"])  # read when the server starts (once per process)
    return ctx


def _stop_processes(procs: list[Any], conns: list[Connection], timeout: float = 5.0) -> None:
    """Close the pipes (rank 0, reading the end of its pipe, tells every rank to stop), wait a little, then
    terminate and kill whatever is still running. Idempotent; also what garbage collection of the executor runs."""
    for c in conns:
        c.close()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


class MultiprocExecutor:
    """``tensor_parallel_size`` rank processes, started now and driven through rank 0 (vLLM's ``MultiprocExecutor``).

    ``load_reports`` and ``kv_cache_reports`` hold what each rank reported; ``execute_model`` is the
    ``Executor`` protocol the scheduler loop calls; ``collective_rpc(method, *args)`` runs a ``Worker``
    method on every rank (rank 0's answer, a list of every rank's for the gathered ones).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.is_failed = False
        self.failure: RankFailedError | None = None
        self.kv_cache_reports: list[dict[str, Any]] = []
        self._seq = itertools.count(1)
        self._closed = False
        ctx = rank_context(config)
        port = get_open_port()
        threads = max(1, (os.cpu_count() or 1) // self.world_size)  # each rank its share of the cores
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, self.conns)
        try:
            for rank in range(self.world_size):
                parent, child = ctx.Pipe()
                env = {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": str(threads)}
                process = ctx.Process(target=spawned_rank, args=(env, child), name=f"kvlab-tp-rank-{rank}",
                                      daemon=True)
                process.start()
                child.close()
                self.procs.append(process)
                self.conns.append(parent)
            self.conns[0].send(config)  # rank 0 broadcasts it to the others
            self.load_reports = self._wait_ready(time.monotonic() + max(STARTUP_TIMEOUT_S,
                                                                        config.distributed_timeout_seconds))
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------- requests

    def collective_rpc(self, method: str, *args: Any, timeout: float = EXECUTE_MODEL_TIMEOUT_S) -> Any:
        """Run ``Worker.<method>(*args)`` on every rank; rank 0's answer (every rank's for gathered methods)."""
        if self.is_failed:
            assert self.failure is not None
            f = self.failure
            raise RankFailedError(f.rank, f.reason, f.reports, f.tracebacks, f.exit_codes)
        if self._closed:
            raise RankFailedError(None, "the executor was shut down")
        seq = next(self._seq)
        try:
            self.conns[0].send((seq, method, args))
        except (OSError, ValueError):
            self._fail("rank 0's pipe is closed")
        return self._wait_reply(seq, time.monotonic() + timeout)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank; rank 0's sampled tokens."""
        return self.collective_rpc("execute_model", scheduler_output)

    def initialize_kv_cache(self, num_blocks: int, groups: Any) -> list[dict[str, Any]]:
        """Every rank allocates ``num_blocks`` blocks of its own size; their reports, rank by rank."""
        self.kv_cache_reports = self.collective_rpc("initialize_kv_cache", num_blocks, groups)
        return self.kv_cache_reports

    def inject_fault(self, rank: int, kind: str = "raise") -> None:
        """Make ``rank`` raise inside (``"raise"``), exit at (``"exit"``) or hang in (``"hang"``) its next step."""
        from kvlab.engine.worker import check_fault  # here: the worker imports torch, this module does not

        check_fault(self.world_size, rank, kind)
        self.collective_rpc("inject_fault", rank, kind)

    # ------------------------------------------------------------- waiting, failing, stopping

    def _wait_ready(self, deadline: float) -> list[dict[str, Any]]:
        ready: set[int] = set()
        reports: list[dict[str, Any]] = []
        while len(ready) < self.world_size:
            for message in self._receive(deadline, "start-up"):
                if message[0] == "ready":
                    ready.add(message[1])
                    if message[1] == 0:
                        reports = message[2]
        return reports

    def _wait_reply(self, seq: int, deadline: float) -> Any:
        while True:
            for message in self._receive(deadline, f"request {seq}"):
                if message[0] == seq:
                    return message[2]
                # an older request's answer (its wait was interrupted): dropped

    def _receive(self, deadline: float, what: str) -> list[tuple]:
        """The messages that arrive before ``deadline``; a failure report, a dead rank or the deadline fails."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self._fail(f"no answer to {what} within its timeout")
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        messages = []
        for obj in wait([*self.conns, *sentinels], timeout=remaining):
            rank = sentinels[obj] if isinstance(obj, int) else self.conns.index(obj)
            try:
                while self.conns[rank].poll(0):
                    messages.append(self.conns[rank].recv())
            except (EOFError, OSError):
                pass
            if any(m[0] == "failed" for m in messages) or not self.procs[rank].is_alive():
                self._fail(f"rank {rank} stopped", messages)
        return messages

    def _fail(self, reason: str, messages: list[tuple] = ()) -> None:
        """Collect every rank's report for a moment, stop every rank, and raise ``RankFailedError``.

        The rank named is the one that failed first: a rank that exited without a word (a crash, a kill) is
        a cause, never an effect; otherwise the earliest report (the others' are their collectives noticing).
        """
        reports = {m[1]: (m[2], m[3]) for m in messages if m[0] == "failed"}
        tracebacks = {m[1]: m[4] for m in messages if m[0] == "failed"}

        def collect() -> None:  # every failure report waiting in the pipes (a rank's first report stands)
            for conn in self.conns:
                with contextlib.suppress(EOFError, OSError):
                    while conn.poll(0):
                        m = conn.recv()
                        if m[0] == "failed":
                            reports.setdefault(m[1], (m[2], m[3]))
                            tracebacks.setdefault(m[1], m[4])

        deadline = time.monotonic() + FAILURE_GRACE_S
        while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            collect()
            time.sleep(0.05)
        collect()  # what the last ones to exit wrote
        crashed = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0) and r not in reports]
        hung = [r for r, p in enumerate(self.procs) if p.is_alive() and r not in reports]
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(2.0)
        exits = {r: p.exitcode for r, p in enumerate(self.procs)}
        ordered = sorted(reports.items(), key=lambda item: item[1][0])  # first failure first
        if crashed:
            rank, why = crashed[0], f"its process exited without a report (exit code {exits[crashed[0]]})"
        elif hung and ordered:
            rank, why = hung[0], (f"it stopped answering: the other ranks' collectives timed out after "
                                  f"{self.config.distributed_timeout_seconds:g} s waiting for it; it was killed")
        elif ordered:
            rank, why = ordered[0][0], ordered[0][1][1]
        else:
            rank, why = None, reason
        self.failure = RankFailedError(rank, why, {r: text for r, (_, text) in ordered}, tracebacks, exits)
        self.is_failed = True
        self._finalizer()
        self._closed = True
        raise self.failure

    def shutdown(self) -> None:
        """Ask every rank to exit (rank 0 relays it), wait a little, then stop whatever is still running."""
        if self._closed:
            return
        self._closed = True
        if not self.is_failed and self.procs and self.procs[0].is_alive():
            with contextlib.suppress(OSError, ValueError, EOFError):
                seq = next(self._seq)
                self.conns[0].send((seq, "shutdown", ()))
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline and self.conns[0].poll(max(0.0, deadline - time.monotonic())):
                    if self.conns[0].recv()[0] == seq:
                        break
        self._finalizer()

    def __repr__(self) -> str:
        state = "failed" if self.is_failed else "shut down" if self._closed else "running"
        return f"MultiprocExecutor(tensor_parallel_size={self.world_size}, {state}, pids={self.pids})"


def start_rank_executor(config: EngineConfig) -> Any:
    """The ranks of a tensor-parallel engine: spawned here (``"mp"``), or already started by torchrun, this
    process being rank 0 (``"external_launcher"``, ``kvlab.engine.uniproc_executor``)."""
    if config.distributed_executor_backend == "external_launcher":
        from kvlab.engine.uniproc_executor import ExecutorWithExternalLauncher

        return ExecutorWithExternalLauncher(config)
    return MultiprocExecutor(config)
