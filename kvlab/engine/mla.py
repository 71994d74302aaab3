"""The MLA layer that reads and writes the paged latent cache: absorbed decode, decompressing prefill.

One cache tensor per layer, ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, as
vLLM's ``MLAAttentionSpec`` describes it: one "head" of ``head_size`` 576 for DeepSeek-V3, no
separate V, so one token costs ``kv_lora_rank + qk_rope_head_dim`` values per layer where MHA
costs ``2 x num_heads x head_dim``. Each step, as vLLM's ``MLAAttention.forward_impl`` does:

1. write every new token's ``c_kv`` and rotated ``k_pe`` into its slot (``concat_and_cache_mla``);
2. decode requests (one query token) go the data-movement-friendly way: ``W_UK`` absorbed into the
   query, the paged Triton kernel ``mla_decode`` over the latents, ``W_UV`` absorbed into the output;
3. prefill requests (more than one query token: a prompt, a chunk of one, a prompt after a
   prefix-cache hit) go the compute-friendly way: gather the request's latents through its block
   table, decompress them into K and V with ``kv_b_proj``, causal attention (``naive_attention``).

vLLM reorders the batch so decodes come first and splits by a per-backend
``reorder_batch_threshold`` (1 for most backends); kvlab splits by query length 1 without
reordering. vLLM's prefill attends the new tokens with flash attention and the cached context in
chunks of a bounded workspace, merging the partial results by log-sum-exp; kvlab decompresses the
whole context at once in torch, which is the same function and small at kvlab's shapes.
"""

from __future__ import annotations

import torch

from kvlab import kernels
from kvlab.capacity.mla import MLADims
from kvlab.engine.attention import AttentionMetadata
from kvlab.kernels.fp8 import dequantize_fp8
from kvlab.kernels.mla_absorb import absorb_output, absorb_query, naive_attention, split_kv_b_proj
from kvlab.kernels.reference import gather_kv


def allocate_mla_kv_caches(dims: MLADims, num_layers: int, num_blocks: int, block_size: int,
                           dtype: torch.dtype = torch.float32,
                           device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """One zeroed latent cache per layer, each ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``."""
    shape = (num_blocks, block_size, dims.latent_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class MLAAttention(torch.nn.Module):
    """Latent cache write, then attention per request, absorbed or decompressed (vLLM's ``MLAAttention``).

    It holds no weights: the caller passes ``kv_b_proj``'s weight, whose two halves are ``W_UK``
    and ``W_UV``. ``k_scale`` is the per-tensor scale of an FP8 latent cache (1.0 otherwise).
    ``kernel_config`` and ``decode_kv_splits`` are kvlab's knobs on the decode kernel, as on
    ``Attention`` (set through ``ModelRunner``): ``tile_n`` latents per tile, ``block_m`` heads per
    program (``block_q`` is 1), and a split count; None lets ``mla_decode`` choose.
    """

    def __init__(self, dims: MLADims, scale: float) -> None:
        super().__init__()
        self.dims, self.scale = dims, scale
        self.k_scale = 1.0
        self.kernel_config: kernels.KernelConfig | None = None  # None: DEFAULT_MLA_CONFIG
        self.decode_kv_splits: int | None = None  # None: the kernel chooses (on a CPU: 1)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim], rope part rotated
        kv_c_normed: torch.Tensor,  # [num_tokens, kv_lora_rank], after kv_a_layernorm
        k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rotated
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        attn_metadata: AttentionMetadata,
        kv_b_weight: torch.Tensor,  # kv_b_proj.weight [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        d = self.dims
        kernels.concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, attn_metadata.slot_mapping, k_scale=self.k_scale,
                                     slot_mapping_cpu=attn_metadata.slot_mapping_cpu)
        w_uk, w_uv = split_kv_b_proj(kv_b_weight, d.num_heads, d.qk_nope_head_dim, d.v_head_dim)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        out = q.new_empty(q.shape[0], d.num_heads, d.v_head_dim)
        host = attn_metadata.host                                # the host copies: reading them costs no sync
        starts = (attn_metadata.query_start_loc if host is None else host.query_start_loc_cpu).tolist()
        decodes = [i for i in range(attn_metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
        if decodes:
            self._decode(decodes, starts, q_nope, q_pe, kv_cache, attn_metadata, w_uk, w_uv, out)
        for i in sorted(set(range(attn_metadata.num_seqs)) - set(decodes)):
            self._prefill(i, starts, q_nope, q_pe, kv_cache, attn_metadata, w_uk, w_uv, out)
        return out

    def _decode(self, seqs: list[int], starts: list[int], q_nope, q_pe, kv_cache, meta: AttentionMetadata,
                w_uk, w_uv, out) -> None:
        """The absorbed path for requests with one query token, in one kernel launch."""
        rows = torch.tensor([starts[i] for i in seqs], device=q_nope.device)               # their token indices
        picked = torch.tensor(seqs, device=q_nope.device)
        q_latent = absorb_query(q_nope[rows], w_uk)                                       # [D, N, L]
        host = None if meta.host is None else kernels.HostMetadata(meta.host.seq_lens_cpu[seqs],
                                                                   meta.host.block_table_cpu[seqs])
        o_latent = kernels.mla_decode(q_latent, q_pe[rows], kv_cache, meta.block_table[picked],
                                      meta.seq_lens[picked], scale=self.scale, k_scale=self.k_scale,
                                      num_kv_splits=self.decode_kv_splits, config=self.kernel_config,
                                      host_metadata=host)  # [D, N, L]
        out[rows] = absorb_output(o_latent, w_uv).to(out.dtype)                           # [D, N, V]

    def _prefill(self, i: int, starts: list[int], q_nope, q_pe, kv_cache, meta: AttentionMetadata,
                 w_uk, w_uv, out) -> None:
        """The decompressing path for one request's query tokens over all its latents, this step's included."""
        seq_len = int(meta.seq_lens[i])
        latents = gather_kv(kv_cache, meta.block_table[i], seq_len)                       # [S, L + R]
        latents = dequantize_fp8(latents, self.k_scale) if kv_cache.dtype == torch.float8_e4m3fn else latents
        latents = latents.to(q_nope.dtype)
        rank = self.dims.kv_lora_rank
        span = slice(starts[i], starts[i + 1])
        out[span] = naive_attention(q_nope[span], q_pe[span], latents[:, :rank], latents[:, rank:], w_uk, w_uv,
                                    self.scale, causal=True).to(out.dtype)                # [Sq, N, V]
