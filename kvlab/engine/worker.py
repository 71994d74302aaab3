"""One tensor-parallel rank: its shard of the model, its own KV cache, its model runner; and the loop every rank runs.

Mirrors ``vllm/v1/worker/gpu_worker.py``'s ``Worker`` (load the model, allocate the KV cache from a block
count, execute a step) and the worker half of ``vllm/v1/executor/multiproc_executor.py`` (``WorkerProc``:
the busy loop). ``worker_main`` is the entry point: ``MultiprocExecutor`` starts it in each process it
spawns, and under ``torchrun --nproc-per-node N -m kvlab.engine.launch`` ranks 1..N-1 run it unchanged
(rank 0 runs the ``LLMEngine``, vLLM's ``external_launcher``). It reads the launcher's ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ... and joins with ``init_method="env://"``.

**Who schedules, and how the others learn each step.** One scheduler, one ``KVCacheManager``: the engine's.
It hands each step's ``SchedulerOutput`` to rank 0 (the driver worker), and rank 0 broadcasts it to the
others over the tensor-parallel group's gloo ``cpu_group`` (``GroupCoordinator.broadcast_object``, pickled).
So every rank runs the same step on the same block table; only its heads (and its bytes of KV) differ. Why the
CPU group and not vLLM's shared-memory ``MessageQueue``: it is the same code on one machine and across
several (shared memory cannot cross machines; vLLM then adds a ZMQ socket), it needs no process outside the
group, and under torchrun there is no engine process to write a queue. The price is latency: a pickled step
crosses a TCP socket to every rank (tens of microseconds) where vLLM's ring buffer costs a few, a cost that
matters at thousands of steps per second on GPUs and not at all here. vLLM's ``external_launcher`` sends
nothing: every rank runs its own scheduler and relies on scheduling being deterministic; kvlab keeps one.

**Failures.** A rank whose step raises reports it (to the engine process, when one started it) and exits:
its closed connections make every collective on the other ranks raise at once, so they report and exit
too, and the engine stops whatever is left. A rank that hangs is caught by the collectives' timeout
(``distributed_timeout_seconds``). While the engine is idle, rank 0 broadcasts a no-op every quarter of that
timeout, so the others, waiting in a broadcast, never time out for lack of work.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvlab._validate import non_negative_int, one_of
from kvlab.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvlab.distributed.parallel_state import (
    CollectiveStats,
    GroupCoordinator,
    device_backend,
    init_distributed_environment,
    initialize_model_parallel,
    launcher_env,
)
from kvlab.engine.engine_config import KV_CACHE_DTYPES, EngineConfig
from kvlab.engine.kv_cache_interface import layer_tensors
from kvlab.engine.kv_connector_model_runner import KVOutputAggregator
from kvlab.engine.kv_pool import allocate_kv_caches, kv_cache_bytes, layer_groups
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.registry import load_model
from kvlab.errors import KvlabValueError
from kvlab.kv_cache_interface import KVCacheGroupSpec

#: Methods whose every rank's answer is gathered on rank 0 (the others' answer is theirs alone).
GATHERED = ("initialize_kv_cache", "load_report", "kv_cache_report", "collective_stats", "inject_fault", "kv_blocks")
#: What ``inject_fault`` can make a rank do at its next step (for tests and notebook 11).
FAULTS = ("raise", "exit", "hang")


def check_fault(world_size: int, rank: int, kind: str) -> None:
    """The door of every executor's ``inject_fault``: ``rank`` one of the ``world_size`` ranks, ``kind`` one of
    ``FAULTS``; checked before anything is sent, so a refused call arms nothing."""
    non_negative_int("rank", rank)
    if rank >= world_size:
        raise KvlabValueError(f"rank={rank}: the ranks are 0 to {world_size - 1} (tensor_parallel_size={world_size})")
    one_of("kind", kind, FAULTS)


class InjectedFault(RuntimeError):
    """The exception ``inject_fault("raise")`` makes a rank raise inside its next forward."""


class Worker:
    """One rank's model shard, KV cache and runner (vLLM's ``Worker``): built by ``worker_main`` or in-process."""

    def __init__(self, config: EngineConfig, tp_group: GroupCoordinator) -> None:
        self.config, self.tp_group = config, tp_group
        self.rank = tp_group.rank_in_group
        self.device = (torch.device("cuda", tp_group.local_rank) if config.device.type == "cuda"
                       else torch.device("cpu"))
        started = time.perf_counter()
        self.model = load_model(config.model_dir, config.dtype, config=config.model_config, tp_group=tp_group,
                                check=False).to(self.device)  # the engine checked the checkpoint already
        self.load_seconds = time.perf_counter() - started
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.cache_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or config.dtype
        self.kv_caches: list[Any] = []
        self.model_runner: ModelRunner | None = None
        self.kv_connector: Any = None  # this rank's worker half of the engine's KV connector, if it has one
        self.kv_output_aggregator = KVOutputAggregator(tp_group.world_size)  # rank 0 folds every rank's report
        self.num_blocks = 0
        self._fault: str | None = None

    # ------------------------------------------------------------- what the engine asks of every rank

    def load_report(self) -> dict[str, Any]:
        """This rank's weights: bytes and load time (gathered: the engine plans the pool with the largest)."""
        return {"rank": self.rank, "weights_bytes": self.weights_bytes, "load_seconds": self.load_seconds,
                "pid": os.getpid()}

    def initialize_kv_cache(self, num_blocks: int, groups: tuple[KVCacheGroupSpec, ...]) -> dict[str, Any]:
        """Allocate this rank's cache, ``num_blocks`` blocks like every rank's (one block table serves them all)."""
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(self.config, num_blocks, self.cache_dtype, groups)
        self.model_runner = ModelRunner(self.model, self.kv_caches, self.config.block_size,
                                        layer_groups=layer_groups(groups)[0],
                                        attention_backend=self.config.attention_backend)
        kvt = self.config.kv_transfer_config
        if kvt is not None and kvt.kv_connector not in (None, "OffloadingConnector"):
            # each rank its own worker half over its own caches (vLLM's ensure_kv_transfer_initialized)
            from kvlab.distributed.kv_transfer.kv_connector.factory import create_worker_connector, transfer_topology

            topology = transfer_topology(self.config.model_config, self.rank, self.tp_group.world_size)
            self.kv_connector = create_worker_connector(kvt, self.config.block_size, self.kv_caches, topology)
            self.model_runner.kv_connector = self.kv_connector
        return self.kv_cache_report()

    def kv_cache_report(self) -> dict[str, Any]:
        """This rank's cache as allocated: every tensor's shape and the bytes they hold (shared tensors once)."""
        unique = {id(t): t for cache in self.kv_caches for t in layer_tensors(cache)}.values()
        return {"rank": self.rank, "num_blocks": self.num_blocks, "kv_cache_bytes": kv_cache_bytes(self.kv_caches),
                "shapes": [tuple(t.shape) for t in unique], "dtype": str(self.cache_dtype),
                "kv_connector_handshake": self.kv_connector.get_handshake_metadata() if self.kv_connector else None}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run this rank's share of one step (every rank gets the same ``scheduler_output``)."""
        assert self.model_runner is not None, "initialize_kv_cache comes first"
        fault, self._fault = self._fault, None
        if fault == "exit":
            os._exit(3)  # as a killed process: no report, no cleanup
        handle = None
        if fault is not None:
            handle = self.model.model.layers[-1].register_forward_pre_hook(_fault_hook(fault, self.rank))
        try:
            output = self.model_runner.execute_model(scheduler_output)
        finally:
            if handle is not None:
                handle.remove()
        if self.kv_connector is not None:  # a request is sent or received once every rank's part of it is
            reports = self.tp_group.gather_object(output.kv_connector_output)
            if reports is not None:
                output = dataclasses.replace(output, kv_connector_output=self.kv_output_aggregator.aggregate(reports))
        return output

    def close(self) -> None:
        """Stop this rank's KV connector (its threads and sockets), before the rank leaves its groups."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None

    def kv_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """This rank's K and V (or latent) of every layer at ``block_ids``, copied to the CPU (to inspect what a
        connector moved): ``[len(block_ids), block_size, this rank's heads, head_size]`` each."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        return [t.index_select(0, index.to(t.device)).cpu() for kv in self.kv_caches for t in layer_tensors(kv)]

    def collective_stats(self, reset: bool = False) -> CollectiveStats:
        """What this rank's collectives moved since the last reset (then reset, if asked)."""
        stats = CollectiveStats(**vars(self.tp_group.stats))
        if reset:
            self.tp_group.stats.reset()
        return stats

    def inject_fault(self, rank: int, kind: str) -> bool:
        """Arm rank ``rank`` to ``raise`` inside, ``exit`` at, or ``hang`` in its next step (tests, notebook 11)."""
        if self.rank == rank:
            self._fault = kind
        return self.rank == rank

    def noop(self) -> None:
        """The idle heartbeat: keeps the other ranks' broadcast wait inside its timeout."""


def _fault_hook(kind: str, rank: int) -> Any:
    def hook(module: torch.nn.Module, args: Any) -> None:
        if kind == "hang":
            time.sleep(10**6)  # the collectives of the other ranks time out
        raise InjectedFault(f"rank {rank}: an injected fault in the last decoder layer's forward")
    return hook


def run_method(worker: Worker, method: str, args: Sequence[Any]) -> Any:
    """Run one broadcast method on this rank; for ``GATHERED`` methods rank 0 returns every rank's answer."""
    local = getattr(worker, method)(*args)
    if method in GATHERED:
        return worker.tp_group.gather_object(local)
    return local


class Driver:
    """Rank 0's side: broadcast a method to every rank, run it here too, return what rank 0 returns."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def call(self, method: str, *args: Any) -> Any:
        self.worker.tp_group.broadcast_object((method, args))
        if method == "shutdown":
            return None
        return run_method(self.worker, method, args)


def follow(worker: Worker) -> None:
    """Ranks 1..N-1: receive each method from rank 0 and run it, until ``shutdown``."""
    while True:
        method, args = worker.tp_group.broadcast_object(None)
        if method == "shutdown":
            return
        run_method(worker, method, args)


def start_rank(config: EngineConfig | None) -> tuple[Worker, GroupCoordinator]:
    """Join the world (``env://``), take rank 0's ``EngineConfig`` by broadcast, build the TP group and this
    rank's ``Worker`` (which loads its shard)."""
    world = init_distributed_environment("gloo", timeout_s=config.distributed_timeout_seconds if config else 600)
    config = world.broadcast_object(config)  # ranks > 0 learn the engine's configuration from rank 0
    if config.device.type == "cuda":
        torch.cuda.set_device(world.local_rank)
    tp_group = initialize_model_parallel(config.tensor_parallel_size, world,
                                         backend=device_backend(config.device))
    return Worker(config, tp_group), world


def worker_main(engine: Connection | None = None) -> None:
    """The entry point of every rank but an in-process rank 0: join, load, then serve until ``shutdown``.

    ``engine`` is rank 0's pipe to the ``LLMEngine`` that spawned the ranks (``MultiprocExecutor``); the
    other ranks get one too, for reporting a failure. Under torchrun there is no engine process: ranks > 0
    run this with ``engine=None`` and rank 0 is the engine.
    """
    env = launcher_env()
    assert env is not None, "worker_main needs RANK, WORLD_SIZE, ... (a launcher sets them)"
    rank = int(env["RANK"])
    config = engine.recv() if (engine is not None and rank == 0) else None
    worker = None
    try:
        worker, world = start_rank(config)
        if rank == 0:
            _drive(Driver(worker), engine)
        else:
            if engine is not None:
                engine.send(("ready", rank))
            follow(worker)
        _exit_cleanly(worker, world, engine)
    except BaseException as error:  # noqa: BLE001 - a rank reports what stopped it, then leaves
        _report_and_exit(rank, error, engine)


def _drive(driver: Driver, engine: Connection | None) -> None:
    """Rank 0 started by an engine: serve its requests (``(seq, method, args)``) until ``shutdown`` or its end."""
    assert engine is not None
    heartbeat = driver.worker.config.distributed_timeout_seconds / 4
    engine.send(("ready", 0, driver.call("load_report")))
    while True:
        if not engine.poll(heartbeat):
            driver.call("noop")  # keep ranks 1..N-1's broadcast within its timeout
            continue
        try:
            seq, method, args = engine.recv()
        except (EOFError, OSError):  # the engine process is gone: stop every rank
            driver.call("shutdown")
            return
        result = driver.call(method, *args)
        engine.send((seq, "ok", result))
        if method == "shutdown":
            return


def _exit_cleanly(worker: Worker, world: GroupCoordinator, engine: Connection | None) -> None:
    from kvlab.distributed.parallel_state import destroy_distributed_environment

    worker.close()
    destroy_distributed_environment(worker.tp_group, world)
    if engine is not None:
        engine.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # everything this rank owns is closed; skip the interpreter's teardown (torch's takes seconds)


def _report_and_exit(rank: int, error: BaseException, engine: Connection | None) -> None:
    """Tell the engine what stopped this rank, when, and the traceback (with no engine, torchrun's case, print it
    where torchrun collects it), then exit non-zero. A rank started by an engine prints nothing: in a notebook
    its output would land in whatever cell runs, and the engine's ``RankFailedError`` carries it instead."""
    text = "".join(traceback.format_exception(error))
    if engine is None:
        print(f"[kvlab rank {rank}] stopped by {type(error).__name__}: {error}\n{text}", file=sys.stderr, flush=True)
    else:
        try:
            engine.send(("failed", rank, time.time(), f"{type(error).__name__}: {error}", text))
            engine.close()
        except (OSError, ValueError):
            pass
    os._exit(1)
