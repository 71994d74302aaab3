"""How many bytes the KV cache takes: ``f x L x Hkv x D x b`` per token, then per request.

Everything here is exact integer arithmetic on a ``ModelSpec``; the budget simulator
(``kvlab.capacity.budget``) and every later notebook build on ``kv_bytes_per_token``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction
from typing import TYPE_CHECKING

from kvlab._validate import checked, positive_int
from kvlab.capacity.models import ModelSpec
from kvlab.errors import KvlabValueError

# The bytes of one element live beside the specs they size; notebooks and exercises read them here too.
from kvlab.kv_cache_interface import (  # noqa: F401 - re-exported
    KV_DTYPE_ALIASES,
    KV_DTYPE_BYTES,
    NVFP4_GROUP,
    canonical_kv_dtype,
    dtype_bytes,
    vector_bytes,
)
from kvlab.units import cdiv

if TYPE_CHECKING:
    import torch


@checked
def kv_heads_per_rank(model: ModelSpec, tp: int = 1) -> int:
    """Hkv on one GPU under tensor parallelism ``tp``.

    MHA/GQA split their KV heads across ranks; with more ranks than heads each rank keeps
    a replica of one head. MLA's latent is not split: every rank holds the whole of it.
    """
    tp = positive_int("tp", tp)
    if model.attention == "mla":
        return 1
    heads = model.num_kv_heads
    if tp <= heads:
        if heads % tp:
            raise KvlabValueError(f"tp={tp} must divide num_kv_heads={heads} of {model.name}")
        return heads // tp
    if tp % heads:
        raise KvlabValueError(f"tp={tp} must be a multiple of num_kv_heads={heads} of {model.name}")
    return 1


@checked
def kv_bytes_per_layer_token(model: ModelSpec, kv_dtype: str = "bf16", tp: int = 1) -> int:
    """Bytes one token's KV takes in one layer on one GPU: f x Hkv x D x b."""
    return model.kv_factor * kv_heads_per_rank(model, tp) * vector_bytes(model.head_dim, kv_dtype)


@checked
def kv_bytes_per_token(model: ModelSpec, kv_dtype: str = "bf16", tp: int = 1) -> int:
    """Bytes one token's KV takes on one GPU: f x L x Hkv x D x b (summed over all layers)."""
    return model.num_layers * kv_bytes_per_layer_token(model, kv_dtype, tp)


@checked
def page_size_bytes(model: ModelSpec, block_size: int, kv_dtype: str = "bf16", tp: int = 1) -> int:
    """One layer's page of ``block_size`` tokens on one GPU, as vLLM's ``AttentionSpec.page_size_bytes``.

    vLLM 0.33.0 (``vllm/v1/kv_cache_interface.py``): ``num_heads x num_states x (head_size +
    head_size_v) x dtype_size``, with ``head_size_v = head_size`` for MHA/GQA (a K and a V) and
    0 for MLA (one latent). A block of the pool holds this page in every layer.
    """
    return positive_int("block_size", block_size) * kv_bytes_per_layer_token(model, kv_dtype, tp)


@checked
def kv_bytes(
    model: ModelSpec, tokens: int, kv_dtype: str = "bf16", requests: int = 1, tp: int = 1
) -> int:
    """Bytes on one GPU for ``requests`` requests of ``tokens`` tokens each.

    A sliding-window layer keeps at most ``sliding_window`` tokens, so long contexts cost
    only the full-attention layers beyond the window.
    """
    tokens = positive_int("tokens", tokens)
    requests = positive_int("requests", requests)
    per_layer_token = kv_bytes_per_layer_token(model, kv_dtype, tp)
    held = sum(tokens_held_per_layer(model, tokens))
    return per_layer_token * held * requests


@checked
def tokens_held_per_layer(model: ModelSpec, tokens: int) -> list[int]:
    """How many of ``tokens`` each layer keeps: all of them, or the last ``sliding_window``."""
    tokens = positive_int("tokens", tokens)
    return [
        min(tokens, model.sliding_window) if kind == "sliding_attention" else tokens  # type: ignore[type-var]
        for kind in model.layer_types
    ]


@checked
def breakdown(model: ModelSpec, kv_dtype: str = "bf16", tp: int = 1) -> dict[str, object]:
    """The factors of the per-token formula, in order, with their product (for tables)."""
    return {
        "model": model.name,
        "attention": model.attention.upper(),
        "f": model.kv_factor,
        "L": model.num_layers,
        "Hkv": kv_heads_per_rank(model, tp),
        "D": model.head_dim,
        "b": float(dtype_bytes(kv_dtype)),
        "bytes_per_token": kv_bytes_per_token(model, kv_dtype, tp),
    }


@checked
def mha_ratio(model: ModelSpec, kv_dtype: str = "bf16") -> float:
    """How many times smaller the model's KV is than the same model with one KV head per query head."""
    return kv_bytes_per_token(model.mha_equivalent(), kv_dtype) / kv_bytes_per_token(model, kv_dtype)


@checked
def kv_cache_tensors(
    model: ModelSpec,
    tokens: int,
    kv_dtype: str = "bf16",
    tp: int = 1,
    device: str = "meta",
) -> list[torch.Tensor]:
    """The cache as real torch tensors, one per layer, shaped ``[f, Hkv, T_layer, D]``.

    A second, independent way to count bytes: allocate (on the meta device, by default)
    the tensors an engine would hold and add up their ``nbytes``. nvfp4 is two tensors
    per layer: packed 4-bit values ``[f, Hkv, T, D/2]`` and fp8 scales ``[f, Hkv, T, D/16]``.
    """
    import torch

    try:
        torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise KvlabValueError(f"device must be a torch device such as 'meta', 'cpu' or 'cuda', got {device!r}") \
            from error

    name = canonical_kv_dtype(kv_dtype)
    torch_dtypes = {
        "fp32": torch.float32,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp8": torch.float8_e4m3fn,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
        "int8": torch.int8,
    }
    heads = kv_heads_per_rank(model, tp)
    out = []
    for held in tokens_held_per_layer(model, tokens):
        shape = (model.kv_factor, heads, held)
        if name == "nvfp4":
            out.append(torch.empty(*shape, math.ceil(model.head_dim / 2), dtype=torch.uint8, device=device))
            groups = math.ceil(model.head_dim / NVFP4_GROUP)
            out.append(torch.empty(*shape, groups, dtype=torch.float8_e4m3fn, device=device))
        else:
            out.append(torch.empty(*shape, model.head_dim, dtype=torch_dtypes[name], device=device))
    return out


@checked
def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Blocks a request of ``tokens`` tokens occupies: ``ceil(tokens / block_size)``."""
    return cdiv(positive_int("tokens", tokens), positive_int("block_size", block_size))


@checked
def tail_waste(tokens: int, block_size: int) -> int:
    """Empty slots in a request's last block: paging wastes at most ``block_size - 1`` per request."""
    return blocks_for_tokens(tokens, block_size) * block_size - tokens


@checked
def reservation_waste(tokens: int, reserved: int) -> int:
    """Slots a contiguous reservation of ``reserved`` tokens never fills when its request ends at ``tokens``.

    The internal fragmentation of reserving for the worst case: a request that stops after
    ``tokens`` leaves ``reserved - tokens`` slots nobody else may use.
    """
    tokens, reserved = positive_int("tokens", tokens), positive_int("reserved", reserved)
    if tokens > reserved:
        raise KvlabValueError(f"tokens={tokens} cannot exceed the reservation reserved={reserved}")
    return reserved - tokens


@checked
def mean_tail_waste(block_size: int, lengths: Iterable[int] | None = None) -> Fraction:
    """Mean empty slots in a request's last block: exact for uniform lengths, or measured over ``lengths``.

    With lengths spread evenly over the residues modulo ``block_size``, the empty slots take
    each value 0 .. block_size - 1 once, so the mean is ``(block_size - 1) / 2``, not
    ``block_size / 2``. Given ``lengths``, the mean of ``tail_waste`` over them.
    """
    block_size = positive_int("block_size", block_size)
    if lengths is None:
        return Fraction(block_size - 1, 2)
    lengths = list(lengths)
    for i, t in enumerate(lengths):
        positive_int(f"lengths[{i}]", t)
    wastes = [tail_waste(int(t), block_size) for t in lengths]
    if not wastes:
        raise KvlabValueError("lengths must hold at least one request length")
    return Fraction(sum(wastes), len(wastes))
