"""Paged attention in plain torch for CPUs: one batched gather, then ``scaled_dot_product_attention``.

``paged_attention_torch`` has ``paged_attention``'s signature and answer. It reads the same paged
cache through the same block table, but instead of walking blocks in tiles it copies every
token's K and V from its slot into a padded ``[num_seqs, max_seq_len, num_kv_heads, head_size]``
tensor with one index operation and hands the whole batch to torch's fused SDPA with a boolean
mask (causal with context, varlen keys). Query heads are packed per KV head, ``[num_seqs, num_kv_heads,
group * max_query_len, head_size]``, so GQA never repeats K or V. Decode steps (one query token)
and longer queries (prefill chunks) run as two batches, so a long prompt does not pad every
decode to its length. FP8 caches are dequantized after the gather; everything is computed in
float32, as in the reference and the Triton kernel, then cast to the query's dtype.

vLLM runs on CPUs with ``CPU_ATTN`` (``vllm/v1/attention/backends/cpu_attn.py``), a C++ kernel
(``ops.cpu_attention_with_kv_cache``) that this function does not imitate. It reads the cache in
place, block by block, with micro-kernels per instruction set (AMX, AVX-512, NEON, VSX, RVV, a
16-wide fallback) and never copies or pads; it splits the work over threads with a scheduler
plan built once per step (``cpu_attn_get_scheduler_metadata``, optional KV splits); its cache is
head-major with K and V in one tensor (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
block sizes a multiple of 32, or 16 on the fallback), where ours is vLLM's flash layout; and it
supports ALiBi, logit soft-capping, attention sinks, encoder and cross attention, and FP8 (e4m3
and e5m2) only on AVX-512 or AMX machines. Here the gather costs memory proportional to
``num_seqs x longest sequence`` per group, and a sliding window is a term of the mask, not a
shorter gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvlab.kernels.checks import AttentionBatch, HostMetadata, check_attention
from kvlab.kernels.fp8 import dequantize_fp8
from kvlab.kernels.grid import KernelConfig


def visible_keys(seq_lens: torch.Tensor, query_lens: torch.Tensor, max_query_len: int, max_seq_len: int,
                 causal: bool, sliding_window: int | None = None) -> torch.Tensor:
    """``[num_seqs, max_query_len, max_seq_len]``: may query row ``r`` of sequence ``s`` read key ``j``?

    Key ``j`` exists if ``j < seq_lens[s]``; with ``causal`` it must also not lie after the query,
    whose absolute position is ``seq_lens[s] - query_lens[s] + r`` (the queries are the last
    tokens), and with a ``sliding_window`` W not lie W or more before it. Rows past
    ``query_lens[s]`` are padding and copy the last real row, so no row is empty.
    """
    device = seq_lens.device
    rows = torch.arange(max_query_len, device=device)                        # [Lq]
    keys = torch.arange(max_seq_len, device=device)[None, None, :]           # [1, 1, Lk]
    visible = (keys < seq_lens[:, None, None]).expand(-1, max_query_len, -1)
    if causal:
        rows = torch.minimum(rows[None, :], query_lens[:, None] - 1)         # [S, Lq]: padding -> last row
        q_pos = (seq_lens - query_lens)[:, None, None] + rows[:, :, None]    # [S, Lq, 1] absolute positions
        visible = visible & (keys <= q_pos)
        if sliding_window is not None:
            visible = visible & (keys > q_pos - sliding_window)
    return visible                                                            # [S, Lq, Lk]


def slot_positions(block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block ids, offsets)``, each ``[num_seqs, max_seq_len]``: where token ``j`` of sequence ``s`` lives.

    Token ``j`` is at ``block_table[s, j // block_size]``, offset ``j % block_size``. Positions past
    ``seq_lens[s]`` are padding; they read token 0's slot, which the checks saw and the mask hides,
    so no table entry past a sequence is followed and no slot past it is read.
    """
    positions = torch.arange(max_seq_len, device=block_table.device)[None, :]          # [1, Lk]
    positions = torch.where(positions < seq_lens[:, None], positions, 0)                # [S, Lk]
    return block_table.long().gather(1, positions // block_size), positions % block_size


def gather_padded(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                  scale: float | None) -> torch.Tensor:
    """K (or V) at those slots, ``[num_seqs, max_seq_len, num_kv_heads, head_size]`` float32, in one gather.

    ``scale`` is the FP8 dequantization scale, or None for a float cache.
    """
    if cache.stride(0) == cache.shape[1] * cache.stride(1):   # slots flatten as a view: copy whole [H, D] rows
        rows = cache.flatten(0, 1).index_select(0, (blocks * cache.shape[1] + offsets).flatten())
        kv = rows.view(*blocks.shape, *cache.shape[2:])                                  # [S, Lk, H, D]
    else:
        kv = cache[blocks, offsets]                                                      # [S, Lk, H, D]
    return dequantize_fp8(kv, scale) if scale is not None else kv.float()


def attend_group(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                 batch: AttentionBatch, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention for the sequences ``seqs`` as one padded SDPA call: ``(token indices, [n, Hq, D] float32)``."""
    device = query.device
    starts = [batch.query_start_loc[i] for i in seqs]
    q_lens = [batch.query_lens[i] for i in seqs]
    lens = [batch.seq_lens[i] for i in seqs]
    num_seqs, max_q, max_k = len(seqs), max(q_lens), max(lens)
    h_kv, group, head_size = batch.num_kv_heads, batch.num_queries_per_kv, batch.head_size
    seq_lens = torch.tensor(lens, device=device)                              # [S]
    query_lens = torch.tensor(q_lens, device=device)
    rows = torch.arange(max_q, device=device)
    real = rows[None, :] < query_lens[:, None]                                # [S, Lq]: not padding
    tokens = (torch.tensor(starts, device=device)[:, None] + rows[None, :])[real]   # [n]
    picked = query[tokens].float()                                            # [n, Hq, D]
    if len(picked) == num_seqs * max_q:                                       # equal lengths: nothing to pad
        q = picked.view(num_seqs, max_q, batch.num_q_heads, head_size)
    else:
        q = picked.new_zeros((num_seqs, max_q, batch.num_q_heads, head_size))
        q[real] = picked                                                      # [S, Lq, Hq, D]
    q = q.view(num_seqs, max_q, h_kv, group, head_size).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, h_kv, group * max_q, head_size)                  # [S, Hkv, G * Lq, D]
    table = block_table[torch.tensor(seqs, device=block_table.device)]
    blocks, offsets = slot_positions(table, seq_lens, max_k, batch.block_size)
    k = gather_padded(key_cache, blocks, offsets, batch.k_scale if batch.fp8 else None)
    v = gather_padded(value_cache, blocks, offsets, batch.v_scale if batch.fp8 else None)
    mask = visible_keys(seq_lens, query_lens, max_q, max_k, batch.causal, batch.sliding_window)  # [S, Lq, Lk]
    if max_q == 1:                                                            # decodes: one row for the group
        mask = mask[:, None]                                                  # [S, 1, 1, Lk]
    else:
        mask = mask[:, None, None].expand(-1, 1, group, -1, -1).reshape(num_seqs, 1, group * max_q, max_k)
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       scale=batch.scale)                     # [S, Hkv, G * Lq, D]
    o = o.view(num_seqs, h_kv, group, max_q, head_size).permute(0, 3, 1, 2, 4)
    return tokens, o.reshape(num_seqs, max_q, batch.num_q_heads, head_size)[real]   # [n, Hq, D]


def paged_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                          scale: float | None = None, causal: bool = True, k_scale: float = 1.0,
                          v_scale: float = 1.0, num_kv_splits: int | None = None, out: torch.Tensor | None = None,
                          config: KernelConfig | None = None, sliding_window: int | None = None,
                          host_metadata: HostMetadata | None = None) -> torch.Tensor:
    """``paged_attention`` through a batched gather and SDPA (module docstring): ``[num_tokens, Hq, D]``.

    Same arguments and checks as ``paged_attention``; ``num_kv_splits`` and ``config`` schedule
    the Triton kernel's work and are accepted and ignored here. ``sliding_window`` W hides keys
    W or more positions before a query (they are still gathered: the Triton kernel skips them).
    Decode steps and longer queries are attended in two batched calls.
    """
    batch = check_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=scale,
                            causal=causal, k_scale=k_scale, v_scale=v_scale, num_kv_splits=num_kv_splits, out=out,
                            sliding_window=sliding_window, host_metadata=host_metadata)
    out = torch.empty_like(query) if out is None else out
    decodes = [i for i, n in enumerate(batch.query_lens) if n == 1]
    longer = [i for i, n in enumerate(batch.query_lens) if n > 1]
    for seqs in (decodes, longer):
        if seqs:
            tokens, result = attend_group(query, key_cache, value_cache, block_table, batch, seqs)
            out[tokens] = result.to(out.dtype)
    return out
