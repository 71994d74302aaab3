"""Rotary position embeddings, computed exactly as transformers computes them for Llama.

A token at position ``p`` has each pair of dimensions ``(i, i + D/2)`` of its query and key
rotated by the angle ``p * inv_freq[i]``. Because the rotation depends only on the token's own
position, a key can be rotated once, written to the cache, and reused by every later query:
this is why the paged cache stores *rotated* keys, and why ``positions`` travel with the batch.
"""

from __future__ import annotations

import math

import torch

from kvlab.engine.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` for the "default" or "llama3" rotary variant."""
    # on the CPU, always: under the loader's meta device an arange would go through torch's reference ops, whose
    # first use imports sympy and the compiler (seconds); the frequencies are a small constant anyway
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.rope_theta**exponents)  # [head_dim // 2]
    if rope.rope_type == "default":
        return inv_freq
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (the "neox" pairing transformers uses)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """Applies the rotation to query and key heads, given each token's absolute position.

    One instance serves every layer of a model (as vLLM's ``get_rope`` hands every layer the same one),
    and it keeps the cos and sin of the last ``positions`` tensor it saw: a step's layers share that
    tensor (a fresh one every step, never changed in place), so the angles are computed once per step.
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        # A plain attribute, not a buffer: `model.to(bf16)` must not round the frequencies.
        self.inv_freq = rope_inv_freq(rope, head_dim)  # [head_dim // 2], float32
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[num_tokens, head_dim]`` for integer ``positions [num_tokens]``."""
        inv_freq = self.inv_freq.to(positions.device)  # [head_dim // 2]; a no-op on the CPU
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        return emb.cos(), emb.sin()

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query [num_tokens, num_heads, head_dim]`` and ``key [num_tokens, num_kv_heads, head_dim]``."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == query.dtype:
            cos, sin = last[2], last[3]  # this step's: another layer computed them from the same tensor
        else:
            cos, sin = self.cos_sin(positions)
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate_half's sign moved onto sin: exact
            cos, sin = cos[:, None, :].to(query.dtype), sin[:, None, :].to(query.dtype)  # broadcast over heads
            self._last = (positions, query.dtype, cos, sin)
        # rotate_half(x) * sin == [x2, x1] * [-sin1, sin1], bit for bit: one roll instead of chunk, negate, cat
        half = query.shape[-1] // 2
        return query * cos + query.roll(half, -1) * sin, key * cos + key.roll(half, -1) * sin
