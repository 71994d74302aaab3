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


def e4m3_grid_step(magnitude: float) -> float:
    """Distance between neighbouring e4m3 values near ``magnitude`` (2^-9 in the subnormal range)."""
    if magnitude < E4M3_MIN_NORMAL:
        return 2.0**-9
    return 2.0 ** (math.floor(math.log2(magnitude)) - 3)
