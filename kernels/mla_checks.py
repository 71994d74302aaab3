"""Input checks for MLA's latent cache write and its paged decode, run before anything is launched or written.

MLA stores one vector per token and layer, ``c_kv`` (``kv_lora_rank`` values) followed by the
rotated ``k_pe`` (``qk_rope_head_dim`` values), in one cache tensor
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``: vLLM's ``MLAAttentionSpec``, one
"head" of ``head_size`` 576 for DeepSeek-V3 and no separate V. The kernels trust their inputs as
the K/V kernels do, so the same rules hold (``kvlab.kernels.checks``): index tensors contiguous in
their last dimension, slots and block ids inside the cache, nothing written when a check fails.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from kvlab.kernels.checks import (
    FP8_DTYPE,
    HostMetadata,
    _name,
    check_block_table,
    check_float_activations,
    check_host_metadata,
    check_index_tensor,
    check_kv_scales,
    check_ndim,
    check_no_aliasing,
    check_num_kv_splits,
    check_out,
    check_same_device,
    check_slot_mapping,
)

from kvlab.errors import KernelInputError

CACHE_LAYOUT = "[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]"


def check_mla_cache(kv_cache: object, compute_dtype: torch.dtype, latent_size: int) -> None:
    """One latent cache: 3-D ``CACHE_LAYOUT``, in the activations' dtype or FP8, ``latent_size`` wide."""
    check_ndim("kv_cache", kv_cache, 3, CACHE_LAYOUT)
    if kv_cache.dtype not in (compute_dtype, FP8_DTYPE):
        raise KernelInputError(
            f"kv_cache.dtype must be {_name(compute_dtype)} (as the activations) or float8_e4m3fn, "
            f"got {_name(kv_cache.dtype)}"
        )
    if kv_cache.stride(-1) != 1:
        raise KernelInputError("kv_cache must be contiguous in its last dimension (stride 1)")
    for dim, size in zip(("num_blocks", "block_size", "kv_lora_rank + qk_rope_head_dim"), kv_cache.shape,
                         strict=True):
        if size < 1:
            raise KernelInputError(f"kv_cache has {dim} = {size}: every dimension of {CACHE_LAYOUT} must be at least 1")
    if kv_cache.shape[2] != latent_size:
        raise KernelInputError(
            f"kv_cache holds vectors of {kv_cache.shape[2]} values, but kv_lora_rank + qk_rope_head_dim of the "
            f"inputs is {latent_size}: the cache is c_kv followed by k_pe"
        )


# --------------------------------------------------------------------------- cache write


@dataclasses.dataclass(frozen=True)
class MLACacheWrite:
    """What ``concat_and_cache_mla`` learned from its inputs (host-side numbers)."""

    num_tokens: int
    kv_lora_rank: int
    rope_dim: int
    num_blocks: int
    block_size: int
    fp8: bool
    k_scale: float


def check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, k_scale=1.0, slot_mapping_cpu=None) -> MLACacheWrite:
    """Validate ``concat_and_cache_mla``'s arguments; return their sizes."""
    check_ndim("kv_c", kv_c, 2, "[num_tokens, kv_lora_rank]")
    check_ndim("k_pe", k_pe, 2, "[num_tokens, qk_rope_head_dim]")
    check_float_activations("kv_c", kv_c)
    check_float_activations("k_pe", k_pe)
    if k_pe.dtype != kv_c.dtype:
        raise KernelInputError(f"kv_c and k_pe must share a dtype, got {_name(kv_c.dtype)} and {_name(k_pe.dtype)}")
    (num_tokens, rank), (pe_tokens, rope_dim) = kv_c.shape, k_pe.shape
    if pe_tokens != num_tokens:
        raise KernelInputError(f"kv_c has {num_tokens} tokens but k_pe has {pe_tokens}: one of each per token")
    if rank < 1 or rope_dim < 1:
        raise KernelInputError(f"kv_lora_rank = {rank} and qk_rope_head_dim = {rope_dim} must both be at least 1")
    check_mla_cache(kv_cache, kv_c.dtype, rank + rope_dim)
    num_blocks, block_size, _ = kv_cache.shape
    check_slot_mapping(slot_mapping, num_tokens, num_blocks, block_size, slot_mapping_cpu)
    check_same_device(kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping)
    check_no_aliasing(dict(kv_cache=kv_cache), dict(kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping))
    scale, _ = check_kv_scales(kv_cache.dtype, k_scale, 1.0)
    return MLACacheWrite(num_tokens, rank, rope_dim, num_blocks, block_size, kv_cache.dtype == FP8_DTYPE, scale)


# --------------------------------------------------------------------------- decode


@dataclasses.dataclass(frozen=True)
class MLADecodeBatch:
    """The host-side description of one MLA decode batch: one query token per sequence."""

    num_seqs: int
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    num_blocks: int
    block_size: int
    seq_lens: tuple[int, ...]
    fp8: bool
    scale: float
    k_scale: float

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)


def _check_queries(q_latent: object, q_pe: object) -> tuple[int, int, int, int]:
    """The absorbed query and its rope part: ``[num_seqs, num_heads, *]`` each, one dtype, ≥ 1 of everything."""
    check_ndim("q_latent", q_latent, 3, "[num_seqs, num_heads, kv_lora_rank]")
    check_ndim("q_pe", q_pe, 3, "[num_seqs, num_heads, qk_rope_head_dim]")
    check_float_activations("q_latent", q_latent)
    check_float_activations("q_pe", q_pe)
    if q_pe.dtype != q_latent.dtype:
        raise KernelInputError(
            f"q_latent and q_pe must share a dtype, got {_name(q_latent.dtype)} and {_name(q_pe.dtype)}"
        )
    num_seqs, num_heads, rank = q_latent.shape
    if tuple(q_pe.shape[:2]) != (num_seqs, num_heads):
        raise KernelInputError(
            f"q_latent is [{num_seqs}, {num_heads}, ..] but q_pe is {list(q_pe.shape[:2])} + [..]: one query token "
            "per sequence, the same heads in both"
        )
    for name, size in (("num_seqs", num_seqs), ("num_heads", num_heads), ("kv_lora_rank", rank),
                       ("qk_rope_head_dim", q_pe.shape[2])):
        if size < 1:
            raise KernelInputError(f"the queries have {name} = {size}: it must be at least 1")
    return num_seqs, num_heads, rank, q_pe.shape[2]


def check_mla_decode(q_latent, q_pe, kv_cache, block_table, seq_lens, *, scale, k_scale=1.0, num_kv_splits=None,
                     out=None, host_metadata=None) -> MLADecodeBatch:
    """Validate ``mla_decode``'s arguments; return the batch as host-side numbers.

    ``host_metadata`` (``seq_lens_cpu``, ``block_table_cpu``): read instead of the device tensors, as in
    ``check_attention``, so nothing is synchronised.
    """
    num_seqs, num_heads, rank, rope_dim = _check_queries(q_latent, q_pe)
    check_mla_cache(kv_cache, q_latent.dtype, rank + rope_dim)
    check_index_tensor("block_table", block_table, 2, "[num_seqs, max_blocks_per_seq]")
    check_index_tensor("seq_lens", seq_lens, 1, "[num_seqs]")
    check_same_device(q_latent=q_latent, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    if seq_lens.shape[0] != num_seqs or block_table.shape[0] != num_seqs:
        raise KernelInputError(
            f"the queries are for {num_seqs} sequences, but seq_lens has {seq_lens.shape[0]} entries and "
            f"block_table {block_table.shape[0]} rows: one of each per sequence"
        )
    host = (HostMetadata.from_device(seq_lens, block_table) if host_metadata is None
            else check_host_metadata(host_metadata, seq_lens, block_table))
    lens = host.seq_lens_cpu.tolist()
    short = [i for i, n in enumerate(lens) if n < 1]
    if short:
        raise KernelInputError(
            f"seq_lens[{short[0]}] = {lens[short[0]]}: a decoding sequence attends to at least its own token, "
            "whose latent is written before attention"
        )
    num_blocks, block_size, _ = kv_cache.shape
    check_block_table(host.block_table_cpu, host.seq_lens_cpu, lens, block_size, num_blocks)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise KernelInputError(
            f"scale must be a finite number > 0 (1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's "
            f"mscale squared where the model uses it), got {scale!r}"
        )
    check_num_kv_splits(num_kv_splits)
    check_out(out, "q_latent", q_latent, "[num_seqs, num_heads, kv_lora_rank]",
              dict(q_latent=q_latent, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens))
    ks, _ = check_kv_scales(kv_cache.dtype, k_scale, 1.0)
    return MLADecodeBatch(num_seqs, num_heads, rank, rope_dim, num_blocks, block_size, tuple(lens),
                          kv_cache.dtype == FP8_DTYPE, float(scale), ks)
