"""Linear layers split across tensor-parallel ranks, as ``vllm/model_executor/layers/linear.py`` splits them.

Megatron's two halves of one MLP, and of attention:

* ``ColumnParallelLinear`` splits the *output* features: rank ``r`` holds rows ``[r * n / tp, (r + 1) * n / tp)``
  of the weight ``[out, in]`` and computes its slice of the output from the whole input. No communication.
* ``RowParallelLinear`` splits the *input* features: rank ``r`` holds columns ``[r * k / tp, (r + 1) * k / tp)``,
  multiplies the slice of the input it already has (the column-parallel layer's output), and the ranks'
  partial products are summed by one all-reduce. The bias is added once, on rank 0.

So attention costs one all-reduce (after ``o_proj``) and the MLP one (after ``down_proj``): two per layer.

vLLM fuses q, k and v into one ``QKVParallelLinear`` (and gate and up into ``MergedColumnParallelLinear``);
kvlab keeps the checkpoint's separate modules, each a ``ColumnParallelLinear``, and ``qkv_partition`` says
what ``QKVParallelLinear.__init__`` decides: each rank's query heads and KV heads, and when there are fewer
KV heads than ranks, ``num_kv_head_replicas = tp / num_kv_heads`` ranks share (a copy of) each KV head.
Rank ``r`` then loads KV shard ``r // num_kv_head_replicas``, as ``QKVParallelLinear.weight_loader`` does;
``ColumnParallelLinear(num_replicas=...)`` is that rule.

Each sharded parameter keeps ``checkpoint_shape``, the full tensor's shape, so a checkpoint is checked
against the whole model whatever the rank, and a ``weight_loader`` that narrows the full tensor to this
rank's shard (vLLM's ``weight_loader`` attribute).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.distributed.parallel_state import GroupCoordinator
from kvlab.errors import KvlabValueError


def single_rank() -> GroupCoordinator:
    """The group a model built without tensor parallelism uses: one rank, no process group."""
    return GroupCoordinator.unconnected(0, 1)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, refusing a remainder (vLLM's ``divide`` asserts; kvlab names the fields)."""
    if numerator % denominator:
        raise KvlabValueError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


@dataclasses.dataclass(frozen=True)
class QKVPartition:
    """One rank's share of attention (``QKVParallelLinear``'s attributes): heads, KV heads, and KV replicas."""

    num_heads: int             # query heads on this rank: total / tp
    num_kv_heads: int          # KV heads on this rank: total / tp, or 1 when there are fewer than tp
    num_kv_head_replicas: int  # ranks holding a copy of each KV head: tp / total when total < tp, else 1


def qkv_partition(total_num_heads: int, total_num_kv_heads: int, tp_size: int) -> QKVPartition:
    """How ``QKVParallelLinear.__init__`` splits attention across ``tp_size`` ranks; an uneven split is refused.

    The query heads must divide by tp. KV heads either divide by tp (each rank its own) or, when there are
    fewer than tp, divide tp (each head replicated on ``tp / total`` consecutive ranks, so the query heads
    of a rank still find their KV head there).
    """
    if total_num_heads % tp_size:
        raise KvlabValueError(
            f"num_attention_heads={total_num_heads} is not divisible by tensor_parallel_size={tp_size}: every rank "
            "must hold the same number of query heads (vLLM: 'Total number of attention heads must be divisible "
            "by tensor parallel size')")
    if tp_size >= total_num_kv_heads:
        if tp_size % total_num_kv_heads:
            raise KvlabValueError(
                f"num_key_value_heads={total_num_kv_heads} (num_kv_heads) with tensor_parallel_size={tp_size}: with "
                "fewer KV heads than ranks, each KV head is replicated on tp / num_kv_heads ranks, so tp must be a "
                "multiple of num_kv_heads")
        return QKVPartition(total_num_heads // tp_size, 1, tp_size // total_num_kv_heads)
    if total_num_kv_heads % tp_size:
        raise KvlabValueError(
            f"num_key_value_heads={total_num_kv_heads} (num_kv_heads) is not divisible by "
            f"tensor_parallel_size={tp_size}: every rank must hold the same number of KV heads")
    return QKVPartition(total_num_heads // tp_size, total_num_kv_heads // tp_size, 1)


def checkpoint_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape the checkpoint's tensor has for ``param``: the full tensor, whatever shard this rank holds."""
    return getattr(param, "checkpoint_shape", tuple(param.shape))


def load_weight(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param``: through its ``weight_loader`` (this rank's shard), else whole."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, loaded)
    else:
        param.data.copy_(loaded.to(param.dtype))


def _shard_param(param: nn.Parameter, full_shape: tuple[int, ...], dim: int, shard: int) -> nn.Parameter:
    """Mark ``param`` as shard ``shard`` along ``dim`` of a checkpoint tensor shaped ``full_shape``.

    Left uninitialised, as vLLM's layers are (``torch.empty``): the checkpoint fills every parameter, and a
    random init would cost time for nothing (on the meta device, where the loader first builds the model to
    check the checkpoint, it even imports torch's reference ops).
    """
    size = param.shape[dim]

    def weight_loader(p: torch.Tensor, loaded: torch.Tensor) -> None:
        p.data.copy_(loaded.narrow(dim, shard * size, size).to(p.dtype))

    param.checkpoint_shape = full_shape  # type: ignore[attr-defined]
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A``'s rows (the outputs) split across ranks: each rank computes its slice of ``Y``.

    ``num_replicas`` consecutive ranks hold the same shard (``QKVParallelLinear``'s KV heads when they are fewer
    than the ranks): rank ``r`` loads shard ``r // num_replicas`` of ``tp / num_replicas``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_group: GroupCoordinator | None = None,
                 num_replicas: int = 1) -> None:
        super().__init__()
        self.tp_group = tp_group or single_rank()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        self.num_shards = divide(self.tp_size, num_replicas, "tensor_parallel_size / num_replicas")
        self.shard_rank = self.tp_rank // num_replicas
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, self.num_shards, "output features / shards")
        self.weight = _shard_param(nn.Parameter(torch.empty(self.output_size_per_partition, input_size)),
                                   (output_size, input_size), 0, self.shard_rank)
        self.bias = _shard_param(nn.Parameter(torch.empty(self.output_size_per_partition)), (output_size,), 0,
                                 self.shard_rank) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, input_size] -> [num_tokens, out / shards]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size_per_partition} of {self.output_size}, "
                f"shard={self.shard_rank}/{self.num_shards}")


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A``'s columns (the inputs) split: each rank multiplies its slice, one all-reduce sums.

    The input arrives already split (vLLM's ``input_is_parallel``): the column-parallel layer before it gave
    each rank its slice. The bias is added on rank 0 only, so the sum holds it once.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_group: GroupCoordinator | None = None,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.tp_group = tp_group or single_rank()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, self.tp_size, "input features / tensor_parallel_size")
        self.reduce_results = reduce_results
        self.weight = _shard_param(nn.Parameter(torch.empty(output_size, self.input_size_per_partition)),
                                   (output_size, input_size), 1, self.tp_rank)
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in / tp] -> [num_tokens, output_size]
        bias = self.bias if self.tp_rank == 0 else None
        output = F.linear(x, self.weight, bias)  # this rank's partial sum
        if self.reduce_results and self.tp_size > 1:
            output = self.tp_group.all_reduce(output)
        return output

    def extra_repr(self) -> str:
        return f"in={self.input_size_per_partition} of {self.input_size}, out={self.output_size}, rank={self.tp_rank}"
