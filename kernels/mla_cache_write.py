"""Writing MLA's latent into the paged cache by slot: vLLM's ``concat_and_cache_mla`` in Triton.

Each new token brings ``c_kv`` (``[kv_lora_rank]``, after ``kv_a_layernorm``) and its rotated
``k_pe`` (``[qk_rope_head_dim]``). One program per token writes them side by side, ``c_kv``
first, into ``kv_cache[slot // block_size, slot % block_size]``: a single vector of
``kv_lora_rank + qk_rope_head_dim`` values (576 for DeepSeek-V3), where a GQA layer writes a K and
a V per KV head. A slot of -1 is padding and is skipped. An FP8 cache stores ``x / k_scale``
rounded to e4m3 (``quantize_e4m3``, shared with ``reshape_and_cache``); vLLM's kernel is CUDA
(``torch.ops._C_cache_ops.concat_and_cache_mla``), called through ``concat_and_cache_mla`` in ``vllm/_custom_ops.py``.
"""

from __future__ import annotations

import torch
from kvlab.kernels._backend import backend, require_triton
from kvlab.kernels.cache_write import quantize_e4m3
from kvlab.kernels.checks import check_kernel_device
from kvlab.kernels.fp8 import E4M3_MAX
from kvlab.kernels.grid import next_power_of_2
from kvlab.kernels.mla_checks import check_concat_and_cache_mla

require_triton()  # sets TRITON_INTERPRET (or not) before the decorators below run

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def concat_and_cache_mla_kernel(
    kv_c_ptr,            # [num_tokens, KV_LORA_RANK]   c_kv after kv_a_layernorm
    k_pe_ptr,            # [num_tokens, ROPE_DIM]       the rotated rope part of the key
    kv_cache_ptr,        # [num_blocks, BLOCK_SIZE, KV_LORA_RANK + ROPE_DIM]
    slot_mapping_ptr,    # [num_tokens]; -1 = padding, not written
    k_scale,             # FP8 only: the cache stores x / k_scale
    stride_c_tok, stride_pe_tok, stride_cache_blk, stride_cache_slot,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    # 1. Our token's slot; a padding token owns none.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    dst = kv_cache_ptr + (slot // BLOCK_SIZE) * stride_cache_blk + (slot % BLOCK_SIZE) * stride_cache_slot

    # 2. c_kv into the first KV_LORA_RANK values of the slot.
    lat = tl.arange(0, LATENT_PAD)
    c = tl.load(kv_c_ptr + token * stride_c_tok + lat, mask=lat < KV_LORA_RANK)          # [LATENT_PAD]
    # 3. k_pe right after it.
    rope = tl.arange(0, ROPE_PAD)
    pe = tl.load(k_pe_ptr + token * stride_pe_tok + rope, mask=rope < ROPE_DIM)           # [ROPE_PAD]
    if FP8:
        c = quantize_e4m3(c, k_scale, FP8_MAX)
        pe = quantize_e4m3(pe, k_scale, FP8_MAX)
    tl.store(dst + lat, c.to(kv_cache_ptr.dtype.element_ty), mask=lat < KV_LORA_RANK)
    tl.store(dst + KV_LORA_RANK + rope, pe.to(kv_cache_ptr.dtype.element_ty), mask=rope < ROPE_DIM)


def concat_and_cache_mla_triton(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                                slot_mapping: torch.Tensor, k_scale: float = 1.0,
                                slot_mapping_cpu: torch.Tensor | None = None) -> None:
    """Check the inputs, then write every non-padding token's ``[c_kv, k_pe]`` into its slot (in place)."""
    w = check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, k_scale, slot_mapping_cpu)
    check_kernel_device(backend(), kv_c.device)
    if w.num_tokens == 0:
        return
    concat_and_cache_mla_kernel[(w.num_tokens,)](
        kv_c, k_pe, kv_cache, slot_mapping, w.k_scale,
        kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        KV_LORA_RANK=w.kv_lora_rank, ROPE_DIM=w.rope_dim, LATENT_PAD=next_power_of_2(w.kv_lora_rank),
        ROPE_PAD=next_power_of_2(w.rope_dim), BLOCK_SIZE=w.block_size, FP8=w.fp8, FP8_MAX=E4M3_MAX, num_warps=4,
    )
