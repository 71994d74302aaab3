"""Ranks and groups on ``torch.distributed``, as ``vllm/distributed/parallel_state.py`` holds them.

One process per rank. ``init_distributed_environment`` joins the world with ``init_method="env://"``:
the launcher (``torchrun``, or kvlab's ``MultiprocExecutor`` doing what torchrun does) gives every
process ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, so the same
code runs on one machine or across several (``torchrun --nnodes``). ``initialize_model_parallel``
then cuts the world into tensor-parallel groups, each a ``GroupCoordinator`` holding two process
groups, as vLLM's does: a ``device_group`` for the tensors of the forward (NCCL on GPUs, gloo on a
CPU) and a ``cpu_group`` on gloo beside it for small host-side messages (a pickled step, a barrier).

Every collective carries a timeout (``timeout_s``, vLLM's ``distributed_timeout_seconds``): a rank
that never arrives makes the others raise instead of waiting forever (nano-vllm's TP has none, so
one dead rank hangs the rest). A peer that exits is noticed sooner: gloo reports its closed
connection at once.

kvlab differs from vLLM in one way worth knowing: vLLM keeps its groups in module globals
(``_TP``, read by ``get_tp_group()``); kvlab returns them and the model's layers are handed their group,
so no module-level state decides what a layer does. ``GroupCoordinator.unconnected(rank, size)``
gives a group with a rank and a size but no processes: enough to build and load one rank's shard
(which rows of ``k_proj`` rank 2 of 4 loads) without starting any.
"""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvlab.errors import KvlabError

#: Seconds a collective may wait for the other ranks before it raises (kvlab's default; vLLM's
#: ``distributed_timeout_seconds`` is unset by default, leaving torch's 10 or 30 minutes).
DEFAULT_TIMEOUT_S = 60.0
#: The variables a launcher sets for ``init_method="env://"`` (torchrun sets them all).
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass
class CollectiveStats:
    """What a group's collectives moved since the last ``reset``: calls and payload bytes, and the seconds spent.

    The bytes are each call's payload on this rank (the tensor handed in); what the wire carries depends
    on the algorithm (a ring all-reduce sends ``2 (n - 1) / n`` of it per rank).
    """

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    all_gather_calls: int = 0
    all_gather_bytes: int = 0
    broadcast_calls: int = 0
    broadcast_bytes: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)


class GroupCoordinator:
    """One group of ranks and its two process groups: ``device_group`` for tensors, ``cpu_group`` (gloo) for objects.

    ``rank`` is the global rank, ``ranks`` the group's global ranks, ``rank_in_group`` this process's
    place among them, ``local_rank`` its place on its machine (which GPU it drives), as in vLLM. A group of
    one needs no process group: its collectives return their input, as vLLM's bypass them.
    """

    def __init__(self, ranks: list[int], local_rank: int, backend: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 group_name: str = "tp", *, default_group: bool = False) -> None:
        self.unique_name = group_name
        self.ranks = list(ranks)
        self.world_size = len(self.ranks)
        self.local_rank = local_rank
        self.backend = backend
        self.timeout_s = timeout_s
        self.stats = CollectiveStats()
        self.device_group: Any = None
        self.cpu_group: Any = None
        if self.world_size == 1 and not dist.is_initialized():
            self.rank, self.rank_in_group = self.ranks[0], 0
            return
        self.rank = dist.get_rank()
        self.rank_in_group = self.ranks.index(self.rank) if self.rank in self.ranks else -1
        if default_group:  # the world: the default process group serves both (kvlab starts it on gloo)
            self.device_group = self.cpu_group = dist.group.WORLD
            return
        timeout = timedelta(seconds=timeout_s)
        # new_group is collective over the whole world: every rank creates every group, in the same order.
        self.device_group = dist.new_group(self.ranks, backend=backend, timeout=timeout)
        self.cpu_group = dist.new_group(self.ranks, backend="gloo", timeout=timeout)

    @classmethod
    def unconnected(cls, rank_in_group: int, world_size: int) -> GroupCoordinator:
        """A group with a rank and a size but no processes: for building and loading one rank's shard.

        Its collectives raise, except in a group of one; the layers use the rank and size to pick their shard.
        """
        if not 0 <= rank_in_group < world_size:
            raise KvlabError(f"rank_in_group={rank_in_group} must be in [0, world_size={world_size})")
        group = cls.__new__(cls)
        group.unique_name, group.ranks, group.world_size = "unconnected", list(range(world_size)), world_size
        group.local_rank = group.rank = group.rank_in_group = rank_in_group
        group.backend, group.timeout_s, group.stats = "none", 0.0, CollectiveStats()
        group.device_group = group.cpu_group = None
        return group

    def _require_group(self, what: str) -> None:
        if self.device_group is None:
            raise KvlabError(f"{what} on an unconnected group (rank {self.rank_in_group} of {self.world_size}): "
                             "start the ranks with init_distributed_environment first")

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum of ``input_`` over the group's ranks, out of place (vLLM's ``GroupCoordinator.all_reduce``)."""
        if self.world_size == 1:
            return input_
        self._require_group("all_reduce")
        started = time.perf_counter()
        output = input_.clone()
        dist.all_reduce(output, group=self.device_group)
        self.stats.all_reduce_calls += 1
        self.stats.all_reduce_bytes += input_.numel() * input_.element_size()
        self.stats.seconds += time.perf_counter() - started
        return output

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``input_`` concatenated along ``dim``, in rank order (the vocab-parallel logits)."""
        if self.world_size == 1:
            return input_
        self._require_group("all_gather")
        started = time.perf_counter()
        parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.all_gather(parts, input_.contiguous(), group=self.device_group)
        self.stats.all_gather_calls += 1
        self.stats.all_gather_bytes += input_.numel() * input_.element_size()
        self.stats.seconds += time.perf_counter() - started
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` from rank ``src`` of the group to every rank, pickled over the gloo ``cpu_group``.

        This is vLLM's ``broadcast_object`` without its shared-memory ``mq_broadcaster``: the path it takes
        when the group has none, as across machines.
        """
        if self.world_size == 1:
            return obj
        self._require_group("broadcast_object")
        started = time.perf_counter()
        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        self.stats.broadcast_calls += 1
        self.stats.seconds += time.perf_counter() - started
        return box[0]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on rank ``dst`` of the group, in rank order (None on the others), over ``cpu_group``."""
        if self.world_size == 1:
            return [obj]
        self._require_group("gather_object")
        out: list[Any] | None = [None] * self.world_size if self.rank_in_group == dst else None
        dist.gather_object(obj, out, dst=self.ranks[dst], group=self.cpu_group)
        return out

    def barrier(self) -> None:
        """Wait for every rank of the group, on ``cpu_group`` (vLLM avoids a device barrier too)."""
        if self.world_size > 1:
            self._require_group("barrier")
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        for group in {id(g): g for g in (self.device_group, self.cpu_group) if g is not None}.values():
            if group is not dist.group.WORLD and dist.is_initialized():
                dist.destroy_process_group(group)
        self.device_group = self.cpu_group = None

    def __repr__(self) -> str:
        return (f"GroupCoordinator({self.unique_name!r}, rank_in_group={self.rank_in_group}, "
                f"world_size={self.world_size}, backend={self.backend!r})")


def device_backend(device: torch.device | str) -> str:
    """The ``device_group``'s backend: NCCL for CUDA tensors, gloo for CPU ones (vLLM's CPU platform uses gloo)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def launcher_env() -> dict[str, str] | None:
    """The launcher's variables (``ENV_VARS``) if this process was started as a rank, else None."""
    if not all(name in os.environ for name in ENV_VARS):
        return None
    return {name: os.environ[name] for name in ENV_VARS}


def init_distributed_environment(backend: str = "gloo", distributed_init_method: str = "env://",
                                 timeout_s: float = DEFAULT_TIMEOUT_S) -> GroupCoordinator:
    """Join the world as the launcher says (``RANK``, ``WORLD_SIZE``, ... in the environment); the world group.

    vLLM's ``init_distributed_environment`` with ``distributed_init_method="env://"``, the one
    ``external_launcher`` uses. The default process group is created once per process.
    """
    env = launcher_env()
    if env is None:
        missing = [name for name in ENV_VARS if name not in os.environ]
        raise KvlabError(f"init_method='env://' needs {', '.join(missing)} in the environment: start the ranks with "
                         "torchrun, or let LLMEngine(tensor_parallel_size=N) start them")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=distributed_init_method,
                                world_size=int(env["WORLD_SIZE"]), rank=int(env["RANK"]),
                                timeout=timedelta(seconds=timeout_s))
    return GroupCoordinator(list(range(dist.get_world_size())), int(env["LOCAL_RANK"]), backend, timeout_s, "world",
                            default_group=True)


def initialize_model_parallel(tensor_model_parallel_size: int, world: GroupCoordinator,
                              backend: str | None = None) -> GroupCoordinator:
    """This rank's tensor-parallel group: consecutive ranks ``[k * tp, (k + 1) * tp)``, as vLLM groups them.

    ``new_group`` is collective over the world, so every rank creates every group in the same order and
    keeps its own. ``backend`` is the device group's (``device_backend``: NCCL on GPUs); by default the world's.
    """
    tp, size, backend = tensor_model_parallel_size, world.world_size, backend or world.backend
    if tp < 1 or size % tp:
        raise KvlabError(f"world_size={size} must be a multiple of tensor_parallel_size={tp}")
    mine = None
    for start in range(0, size, tp):
        group = GroupCoordinator(list(range(start, start + tp)), world.local_rank, backend, world.timeout_s)
        if world.rank in group.ranks:
            mine = group  # the others' groups were created for the protocol's sake; this rank is no member
    assert mine is not None
    return mine


def destroy_distributed_environment(*groups: GroupCoordinator) -> None:
    """Destroy the groups, then the default process group (vLLM's ``destroy_model_parallel`` and
    ``destroy_distributed_environment``)."""
    for group in groups:
        group.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
