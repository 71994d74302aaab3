"""vLLM's older CUDA PagedAttention cache layout, converted to and from the flash layout kvlab uses.

The hand-written kernels in ``csrc/attention/`` (paged_attention_v1/v2; read at v0.6.6) store, per layer::

    K: [num_blocks, num_kv_heads, head_size / x, block_size, x]     x = 16 bytes / element size
    V: [num_blocks, num_kv_heads, head_size, block_size]

and vLLM V1's Triton and FlashAttention backends store both as
``[num_blocks, block_size, num_kv_heads, head_size]``. The older layout follows each product's
reduction: ``q . k`` sums over ``head_size``, so a thread loads x consecutive dimensions of one
key (16 bytes, one vector load) and the threads of a warp, each on its own key, find their
vectors side by side; ``p . v`` sums over tokens, so V keeps a block's tokens innermost.
"""

from __future__ import annotations

import torch

from kvlab.errors import KernelInputError

VECTOR_BYTES = 16  # the widest load a CUDA thread issues (LDG.128)


def legacy_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector: 8 for fp16/bf16, 16 for fp8, 4 for fp32."""
    return VECTOR_BYTES // torch.empty((), dtype=dtype).element_size()


def _check_flash(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise KernelInputError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_size], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    x = legacy_x(key_cache.dtype)
    if key_cache.shape[-1] % x:
        raise KernelInputError(f"head_size={key_cache.shape[-1]} must be a multiple of x={x} for this layout")
    return x


def to_legacy_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-layout caches as the older CUDA kernel's: K 5-D ``[nb, H, D/x, bs, x]``, V 4-D ``[nb, H, D, bs]``."""
    x = _check_flash(key_cache, value_cache)
    nb, bs, h, d = key_cache.shape
    k5 = key_cache.reshape(nb, bs, h, d // x, x).permute(0, 2, 3, 1, 4).contiguous()   # [nb, H, D/x, bs, x]
    v4 = value_cache.permute(0, 2, 3, 1).contiguous()                                  # [nb, H, D, bs]
    return k5, v4


def from_legacy_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``to_legacy_layout``: back to ``[num_blocks, block_size, num_kv_heads, head_size]``."""
    if key_cache.dim() != 5 or value_cache.dim() != 4:
        raise KernelInputError(
            "expected K [num_blocks, num_kv_heads, head_size/x, block_size, x] and V [num_blocks, num_kv_heads, "
            f"head_size, block_size], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    nb, h, d_x, bs, x = key_cache.shape
    if x != legacy_x(key_cache.dtype) or tuple(value_cache.shape) != (nb, h, d_x * x, bs):
        raise KernelInputError(
            f"K {tuple(key_cache.shape)} and V {tuple(value_cache.shape)} do not form one legacy cache "
            f"(x must be {legacy_x(key_cache.dtype)} for {key_cache.dtype})"
        )
    key = key_cache.permute(0, 3, 1, 2, 4).reshape(nb, bs, h, d_x * x).contiguous()      # [nb, bs, H, D]
    value = value_cache.permute(0, 3, 1, 2).contiguous()                                # [nb, bs, H, D]
    return key, value


def legacy_key_offsets(block_size: int, head_size: int, x: int) -> torch.Tensor:
    """Where key ``t``, dimension ``d`` sits inside one (block, head) slice of the 5-D K: ``[bs, D]``."""
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_size)[None, :]
    return (d // x) * (block_size * x) + t * x + d % x


def legacy_value_offsets(block_size: int, head_size: int) -> torch.Tensor:
    """Where value ``t``, dimension ``d`` sits inside one (block, head) slice of the 4-D V: ``[bs, D]``."""
    return torch.arange(head_size)[None, :] * block_size + torch.arange(block_size)[:, None]


def flash_offsets(block_size: int, num_kv_heads: int, head_size: int) -> torch.Tensor:
    """Where token ``t``, dimension ``d`` of head 0 sits inside one block of the flash layout: ``[bs, D]``."""
    return torch.arange(block_size)[:, None] * (num_kv_heads * head_size) + torch.arange(head_size)[None, :]
