"""DeepSeek's rotary embedding: YaRN frequencies, interleaved pairs, and the softmax scale YaRN changes.

MLA rotates only the ``qk_rope_head_dim`` dimensions of each query head and the one shared
``k_pe``; the ``c_kv`` latent carries no position, which is what lets the decompression (or its
absorption) be a plain matrix product. Three details decide whether kvlab's tokens equal
transformers' (``transformers/models/deepseek_v3/modeling_deepseek_v3.py`` and
``modeling_rope_utils._compute_yarn_parameters``, read for this module):

* **YaRN** (DeepSeek-V3: ``factor`` 40 over ``original_max_position_embeddings`` 4096): each
  frequency is blended between ``inv_freq`` and ``inv_freq / factor`` by a linear ramp over the
  dimensions, bounded by ``beta_fast``/``beta_slow`` rotations; cos and sin are multiplied by an
  ``attention_factor`` (``mscale / mscale_all_dim`` in YaRN's ``0.1 ln(factor) + 1`` form: 1.0 for V3);
* the **softmax scale** becomes ``qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2``
  (``yarn_apply_mscale``; vLLM's ``DeepseekV2Attention`` does the same for ``deepseek_yarn``);
* **interleaved pairs** (``rope_interleave``, default true): dimensions ``(0, 1), (2, 3), ...`` rotate
  together. transformers writes the rotated pairs de-interleaved (even outputs, then odd), and
  so does kvlab, so the cached ``k_pe`` is laid out as transformers computes it; vLLM's GPT-J-style
  kernel (``is_neox_style=False``) keeps them interleaved. Queries and keys are permuted alike, so
  every score is the same either way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from kvlab.engine.config import RopeConfig
from kvlab.engine.rope import rope_inv_freq, rotate_half
from kvlab.errors import MissingConfigKeyError, UnknownNameError

#: Rotary variants of DeepSeek configs kvlab computes exactly as transformers does.
DEEPSEEK_ROPE_TYPES = ("default", "yarn")


@dataclasses.dataclass(frozen=True)
class DeepseekRope:
    """The rotary parameters of a DeepSeek config (``rope_parameters``, or the older ``rope_scaling``)."""

    rope_type: str
    rope_theta: float
    interleave: bool = True
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def deepseek_rope(cfg: Mapping[str, Any]) -> DeepseekRope:
    """Read the rotary parameters in either spelling (``rope_parameters``; ``rope_theta`` + ``rope_scaling``)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in DEEPSEEK_ROPE_TYPES:
        raise UnknownNameError("rope_type", rope_type, DEEPSEEK_ROPE_TYPES)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    interleave = bool(cfg.get("rope_interleave", True))
    if rope_type == "default":
        return DeepseekRope("default", theta, interleave)
    if "factor" not in params or "original_max_position_embeddings" not in params:
        missing = "factor" if "factor" not in params else "original_max_position_embeddings"
        raise MissingConfigKeyError(missing, where="rope_parameters (yarn)")
    optional = {key: float(params[key]) for key in ("mscale", "mscale_all_dim", "attention_factor")
                if params.get(key) is not None}
    return DeepseekRope(
        "yarn", theta, interleave, factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)), **optional,
    )


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not scaled)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(rope: DeepseekRope, qk_head_dim: int) -> float:
    """``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN when ``mscale_all_dim`` is set."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        mscale = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def yarn_inv_freq(rope: DeepseekRope, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies ``[dim // 2]`` and its cos/sin ``attention_factor``, as transformers computes them."""
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = float(yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor,
                                                                                             rope.mscale_all_dim))
    else:
        attention_factor = yarn_get_mscale(rope.factor)
    base, original = rope.rope_theta, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:  # the dimension that turns num_rotations times in `original`
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)  # CPU: as rope.py
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp                                        # 1: keep the original frequency (high frequencies)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


class DeepseekRotaryEmbedding(torch.nn.Module):
    """Rotates the rope part of the query heads and the shared ``k_pe``, given each token's position."""

    def __init__(self, rope: DeepseekRope, rope_dim: int) -> None:
        super().__init__()
        self.interleave = rope.interleave
        if rope.rope_type == "yarn":
            self.inv_freq, self.attention_factor = yarn_inv_freq(rope, rope_dim)     # [rope_dim // 2]
        else:
            self.inv_freq, self.attention_factor = rope_inv_freq(RopeConfig("default", rope.rope_theta), rope_dim), 1.0

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One tensor ``[..., rope_dim]`` with cos/sin ``[..., rope_dim // 2]`` broadcast to it."""
        if self.interleave:  # pairs (0, 1), (2, 3), ... written de-interleaved, as transformers does
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return x * cos + rotate_half(x) * sin

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor,
                k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q_pe [num_tokens, num_heads, R]`` and ``k_pe [num_tokens, R]`` by ``positions [num_tokens]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]   # [T, R // 2]
        cos = (freqs.cos() * self.attention_factor).to(q_pe.dtype)
        sin = (freqs.sin() * self.attention_factor).to(q_pe.dtype)
        return self.rotate(q_pe, cos[:, None, :], sin[:, None, :]), self.rotate(k_pe, cos, sin)
