"""The specification of the MLA kernels in plain torch: the latent cache write and paged decode.

``concat_and_cache_mla_ref`` writes each token's ``c_kv`` and ``k_pe`` side by side into its slot;
``mla_decode_ref`` gathers each sequence's latents through its block table into an ordinary
tensor and runs ``latent_attention`` (``mla_absorb.py``) in float32: no tiles, no online softmax.
The Triton kernels must agree with these on every input (``tests/test_kernels_mla*.py``), and
these are what runs when Triton is not installed.
"""

from __future__ import annotations

import torch
from kvlab.kernels.checks import HostMetadata
from kvlab.kernels.fp8 import dequantize_fp8, quantize_fp8
from kvlab.kernels.mla_absorb import latent_attention
from kvlab.kernels.mla_checks import check_concat_and_cache_mla, check_mla_decode
from kvlab.kernels.reference import gather_kv


def concat_and_cache_mla_ref(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, k_scale: float = 1.0,
                             slot_mapping_cpu: torch.Tensor | None = None) -> None:
    """Write token ``t``'s ``[c_kv, k_pe]`` into slot ``slot_mapping[t]`` (skipped when -1); FP8 stores x / k_scale."""
    w = check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, k_scale, slot_mapping_cpu)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = torch.cat([kv_c[keep], k_pe[keep]], dim=-1)                     # [num_written, L + R]
    kv_cache[slots // w.block_size, slots % w.block_size] = quantize_fp8(rows, w.k_scale) if w.fp8 else rows


def mla_decode_ref(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, *, scale: float, k_scale: float = 1.0, num_kv_splits: int | None = None,
                   out: torch.Tensor | None = None, host_metadata: HostMetadata | None = None) -> torch.Tensor:
    """Each sequence's one query token over all ``seq_lens[i]`` of its latents: ``[num_seqs, num_heads, L]``.

    Same signature as ``mla_decode``; ``num_kv_splits`` is accepted and ignored (splitting is
    scheduling, never a different answer).
    """
    batch = check_mla_decode(q_latent, q_pe, kv_cache, block_table, seq_lens, scale=scale, k_scale=k_scale,
                             num_kv_splits=num_kv_splits, out=out, host_metadata=host_metadata)
    out = torch.empty_like(q_latent) if out is None else out
    rank = batch.kv_lora_rank
    for i, seq_len in enumerate(batch.seq_lens):
        latents = gather_kv(kv_cache, block_table[i], seq_len)                 # [seq_len, L + R]
        latents = dequantize_fp8(latents, batch.k_scale) if batch.fp8 else latents.float()
        o = latent_attention(q_latent[i:i + 1].float(), q_pe[i:i + 1].float(), latents[:, :rank],
                             latents[:, rank:], batch.scale, causal=False)     # [1, N, L]
        out[i] = o[0].to(out.dtype)
    return out
