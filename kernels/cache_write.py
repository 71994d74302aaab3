"""Writing K and V into the paged cache by slot: vLLM's ``reshape_and_cache_flash`` in Triton.

The model produces each new token's K and V as ``[num_tokens, num_kv_heads, head_size]``. The
scheduler has already given every token a *slot*: ``slot = block_id * block_size + offset``
(``slot_mapping``, see ``kvlab.kernels.reference.compute_slot_mapping``). One program per token
copies its K and V to ``cache[slot // block_size, slot % block_size]``. A slot of -1 marks a
padding token (vLLM pads batches for CUDA graphs): its program returns without writing.

For an FP8 cache the program stores ``x / scale`` rounded to e4m3 and saturated at ±448.
"""

from __future__ import annotations

import torch
from kvlab.kernels._backend import backend, require_triton
from kvlab.kernels.checks import check_cache_write, check_kernel_device
from kvlab.kernels.fp8 import E4M3_MAX
from kvlab.kernels.grid import next_power_of_2

require_triton()  # sets TRITON_INTERPRET (or not) before the decorators below run

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def round_to_e4m3(x):
    """Round float32 ``x`` (|x| <= 448) to the nearest e4m3 value, ties to even, exactly.

    e4m3 keeps 3 mantissa bits: near ``2^e`` its values are ``2^(e-3)`` apart, and below the
    smallest normal, 2^-6, they are 2^-9 apart. So: find that step from the exponent bits of
    ``|x|``, scale to units of the step (exact: a power of two), round to an integer with the
    classic ``(y + 1.5 * 2^23) - 1.5 * 2^23`` (float32 addition rounds to nearest even), scale
    back and restore the sign (-0 included). The cast to fp8 that follows is then exact. (Rounding
    first also sidesteps Triton 3.9's interpreter, whose fp32 -> fp8 cast loses the carry when
    rounding up crosses a power of two: 7.94 became 4.)
    """
    bits = x.to(tl.int32, bitcast=True)
    magnitude = tl.abs(x)
    exponent = ((bits >> 23) & 0xFF) - 127                              # floor(log2 |x|) for normal x
    step_exp = tl.maximum(exponent, -6) - 3
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)         # 2^step_exp
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)     # 2^-step_exp
    rounded = ((magnitude * inv_step + 12582912.0) - 12582912.0) * step
    return tl.where(bits < 0, -rounded, rounded)


@triton.jit
def quantize_e4m3(x, scale, FP8_MAX: tl.constexpr):
    """``x / scale`` as e4m3, saturated at ±FP8_MAX, bit for bit what ``torch`` stores (NaN included).

    ``div_rn`` is correctly rounded like torch's ``x / scale`` (a GPU's default ``/`` may be
    approximate). ``tl.clamp`` may turn NaN into a bound where torch keeps NaN, so NaN is
    written explicitly as e4m3's NaN, 0x7F with the input's sign bit (0xFF when negative).
    """
    y = tl.math.div_rn(x.to(tl.float32), scale)
    q = round_to_e4m3(tl.clamp(y, -FP8_MAX, FP8_MAX)).to(tl.float8e4nv)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    nan = (sign | 0x7F).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return tl.where(y != y, nan, q)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr,              # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_size]
    slot_mapping_ptr,                # [num_tokens]; -1 = padding, not written
    k_scale, v_scale,
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_kc_blk, stride_kc_slot, stride_kc_head,
    stride_vc_blk, stride_vc_slot, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return                                            # a padding token owns no slot
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]                # [HEADS_PAD, 1]
    dims = tl.arange(0, HEAD_PAD)[None, :]                  # [1, HEAD_PAD]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE)

    k = tl.load(key_ptr + token * stride_key_tok + heads * stride_key_head + dims, mask=mask)   # [H, D]
    v = tl.load(value_ptr + token * stride_value_tok + heads * stride_value_head + dims, mask=mask)
    if FP8:
        k = quantize_e4m3(k, k_scale, FP8_MAX)
        v = quantize_e4m3(v, v_scale, FP8_MAX)
    k_dst = key_cache_ptr + block * stride_kc_blk + offset * stride_kc_slot + heads * stride_kc_head + dims
    v_dst = value_cache_ptr + block * stride_vc_blk + offset * stride_vc_slot + heads * stride_vc_head + dims
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                             k_scale: float = 1.0, v_scale: float = 1.0,
                             slot_mapping_cpu: torch.Tensor | None = None) -> None:
    """Check the inputs, then write every non-padding token's K and V into its slot (in place)."""
    w = check_cache_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, slot_mapping_cpu)
    check_kernel_device(backend(), key.device)
    if w.num_tokens == 0:
        return
    reshape_and_cache_kernel[(w.num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, w.k_scale, w.v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=w.num_kv_heads, HEAD_SIZE=w.head_size, HEADS_PAD=next_power_of_2(w.num_kv_heads),
        HEAD_PAD=next_power_of_2(w.head_size), BLOCK_SIZE=w.block_size, FP8=w.fp8, FP8_MAX=E4M3_MAX,
        num_warps=4,
    )
