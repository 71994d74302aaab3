"""FP8 (e4m3) KV cache: per-tensor scales, quantization, and how much accuracy the scale decides.

An FP8 cache stores ``round_e4m3(x / scale)`` and the kernel reads ``stored * scale`` back. e4m3
keeps 3 mantissa bits for magnitudes from 2^-6 up to 448 and only a few coarse subnormal steps
(2^-9 apart) below that. ``scale`` decides which window of magnitudes lands in that range:
vLLM 0.33.0 takes an fp8 cache's ``k_scale`` / ``v_scale`` from the checkpoint
(``BaseKVCacheMethod.process_weights_after_loading``, ``vllm/model_executor/layers/quantization/kv_cache.py``)
and, when it has none, uses 1.0 (``set_default_quant_scales``, ``vllm/model_executor/layers/attention/attention.py``),
which trusts the activations to already live there; it measures no per-tensor scale at run time (only the
per-token-head dtypes compute theirs as they write). A calibrated scale moves them there: kvlab's
``calibrated_scale`` takes ``amax(|k|) / 200`` and ``amax(|v|) / 100`` (kvlab's choice, leaving headroom for
later tokens larger than the ones measured).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(FP8_DTYPE).max)      # 448.0
E4M3_MIN_NORMAL = 2.0**-6                          # below this only subnormal steps of 2^-9 remain
K_SCALE_CONSTANT = 200.0                           # kvlab's calibration: k_scale = amax(|k|) / 200
V_SCALE_CONSTANT = 100.0                           # kvlab's calibration: v_scale = amax(|v|) / 100


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` rounded to e4m3 (nearest, ties to even), saturating at ±448 as vLLM's kernels do."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a kernel computes with: the stored value times the per-tensor scale, in float32."""
    return x.float() * scale


def calibrated_scale(x: torch.Tensor, range_constant: float = K_SCALE_CONSTANT) -> float:
    """A per-tensor scale measured from data (kvlab's calibration, not 0.33.0's): ``amax(|x|) / range_constant``."""
    amax = float(x.abs().max())
    return amax / range_constant if amax > 0 else 1.0


def synthetic_kv(num_tokens: int, num_heads: int, head_size: int, magnitude: float = 1.0, *,
                 outlier_channels: int = 4, outlier_factor: float = 20.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Activations shaped like real K/V: uneven channels, a few outlier channels, a loud first token.

    ``[num_tokens, num_heads, head_size]`` float32. Each channel gets its own spread (log-normal),
    ``outlier_channels`` channels per head are ``outlier_factor`` times louder (as in the K of many
    LLMs), token 0 is 4x louder (an attention sink), and everything is multiplied by ``magnitude``.
    """
    g = generator
    channel = torch.exp(0.5 * torch.randn(num_heads, head_size, generator=g))        # [H, D]
    loud = torch.stack([torch.randperm(head_size, generator=g)[:outlier_channels] for _ in range(num_heads)])
    channel.scatter_(1, loud, outlier_factor)
    x = torch.randn(num_tokens, num_heads, head_size, generator=g) * channel           # [T, H, D]
    x[0] *= 4.0
    return x * magnitude


def fp8_error_sweep(magnitudes: Sequence[float], *, num_seqs: int = 8, seq_len: int = 128,
                    num_kv_heads: int = 2, num_queries_per_kv: int = 4, head_size: int = 64,
                    block_size: int = 16, seed: int = 0, query_scale: float = 0.02,
                    write: Callable | None = None, attend: Callable | None = None,
                    device: str | None = None) -> list[dict[str, float]]:
    """Attention error of an FP8 cache against a bf16 cache, for activations of growing magnitude.

    For each magnitude: write the same synthetic K/V into a bf16 cache and into two FP8 caches
    (scale 1.0, and the calibrated scales ``amax/200`` for K and ``amax/100`` for V), run
    ``kvlab.kernels.paged_attention`` for one decode token per sequence on all three, and report
    ``‖out_fp8 − out_bf16‖ / ‖out_bf16‖`` with each scale. The query is ``query_scale / magnitude``
    times a standard normal, so the attention weights stay the same across the sweep: only the
    cache's rounding changes. ``write`` and ``attend`` default to ``reshape_and_cache`` and
    ``paged_attention``; pass the ``_ref`` versions for the same numbers without the interpreter's cost.
    ``device`` defaults to the GPU when the kernels run natively.
    """
    from kvlab.kernels import TRITON_CUDA, backend, paged_attention, reshape_and_cache

    from kvlab.units import cdiv

    device = device or ("cuda" if backend() == TRITON_CUDA else "cpu")

    write = write or reshape_and_cache
    attend = attend or paged_attention

    g = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * num_queries_per_kv
    blocks_per_seq = cdiv(seq_len, block_size)
    num_blocks = num_seqs * blocks_per_seq
    block_table = torch.randperm(num_blocks, generator=g).reshape(num_seqs, blocks_per_seq).int()
    positions = torch.arange(seq_len)
    slots = (block_table.long()[:, positions // block_size] * block_size + positions % block_size).flatten()
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)                  # one decode token each
    block_table, slots, seq_lens, query_start_loc = (t.to(device) for t in (block_table, slots, seq_lens,
                                                                              query_start_loc))
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    rows = []
    for magnitude in magnitudes:
        key = torch.cat([synthetic_kv(seq_len, num_kv_heads, head_size, magnitude, generator=g)
                         for _ in range(num_seqs)]).to(torch.bfloat16)               # [num_seqs * seq_len, Hkv, D]
        value = torch.cat([synthetic_kv(seq_len, num_kv_heads, head_size, magnitude, outlier_factor=4.0,
                                        generator=g) for _ in range(num_seqs)]).to(torch.bfloat16)
        query = torch.randn(num_seqs, num_q_heads, head_size, generator=g) * (query_scale / magnitude)
        scales = {"scale 1.0": (1.0, 1.0),
                  "calibrated": (calibrated_scale(key, K_SCALE_CONSTANT), calibrated_scale(value, V_SCALE_CONSTANT))}
        key, value, query = key.to(device), value.to(device), query.to(torch.bfloat16).to(device)
        outs = {}
        for name, dtype, (ks, vs) in [("bf16", torch.bfloat16, (1.0, 1.0)),
                                      *[(n, FP8_DTYPE, kv) for n, kv in scales.items()]]:
            key_cache = torch.zeros(shape, dtype=dtype, device=device)
            value_cache = torch.zeros(shape, dtype=dtype, device=device)
            write(key, value, key_cache, value_cache, slots, k_scale=ks, v_scale=vs)
            outs[name] = attend(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                                k_scale=ks, v_scale=vs).float()
        ref = outs["bf16"]
        row = {"magnitude": float(magnitude), "amax_k": float(key.float().abs().max()),
               "k_scale_calibrated": scales["calibrated"][0], "v_scale_calibrated": scales["calibrated"][1]}
        for name in scales:
            row[f"error {name}"] = float((outs[name] - ref).norm() / ref.norm())
        rows.append(row)
    return rows


def e4m3_grid_step(magnitude: float) -> float:
    """Distance between neighbouring e4m3 values near ``magnitude`` (2^-9 in the subnormal range)."""
    if magnitude < E4M3_MIN_NORMAL:
        return 2.0**-9
    return 2.0 ** (math.floor(math.log2(magnitude)) - 3)
