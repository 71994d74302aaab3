"""The specification: paged attention and the cache write in plain torch, one sequence at a time.

No tiles, no online softmax, no programs: gather a sequence's keys and values through its block
table into ordinary tensors, then compute ``softmax(q k^T * scale) v`` in float32 with a causal
mask (and a sliding window, if given). The Triton kernels must agree with these functions on every
input (``tests/test_kernels_*``), and they are what runs when Triton is not installed.
"""

from __future__ import annotations

import math

import torch
from kvlab.kernels.checks import HostMetadata, check_attention, check_cache_write
from kvlab.kernels.fp8 import dequantize_fp8, quantize_fp8

from kvlab.units import cdiv


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's K (or V) made contiguous: ``[seq_len, num_kv_heads, head_size]``.

    Logical token ``t`` lives in physical block ``block_ids[t // block_size]`` at offset
    ``t % block_size``; entries of ``block_ids`` past the last needed block are never read.
    """
    block_size = cache.shape[1]
    used = block_ids[: cdiv(seq_len, block_size)].long()       # [num_used_blocks]
    blocks = cache[used]                                        # [num_used_blocks, block_size, H, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]       # [seq_len, H, D]


def compute_slot_mapping(block_table: torch.Tensor, seq_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, block_size: int) -> torch.Tensor:
    """Where each query token's K and V are written: ``block_id * block_size + offset``.

    The query tokens of sequence ``i`` are its last ``query_len`` tokens, at positions
    ``seq_len - query_len .. seq_len - 1``. Same arithmetic as vLLM V1's
    ``BlockTable.compute_slot_mapping`` (``vllm/v1/worker/block_table.py``).
    """
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()          # [num_seqs]
    seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens), device=block_table.device), query_lens)
    first_pos = (seq_lens.long() - query_lens)[seq_of_token]                    # context length of its sequence
    offset_in_query = torch.arange(len(seq_of_token), device=block_table.device) - \
        query_start_loc.long()[:-1][seq_of_token]
    positions = first_pos + offset_in_query                                     # [num_tokens]
    block_ids = block_table.long()[seq_of_token, positions // block_size]
    return block_ids * block_size + positions % block_size                     # [num_tokens]


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: float = 1.0, v_scale: float = 1.0,
                          slot_mapping_cpu: torch.Tensor | None = None) -> None:
    """Write token ``t``'s K and V into slot ``slot_mapping[t]`` (skipped when -1); FP8 stores value / scale."""
    w = check_cache_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, slot_mapping_cpu)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // w.block_size, slots % w.block_size
    for src, cache, scale in ((key, key_cache, w.k_scale), (value, value_cache, w.v_scale)):
        rows = src[keep]                                         # [num_written, H, D]
        cache[blocks, offsets] = quantize_fp8(rows, scale) if w.fp8 else rows


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                        scale: float | None = None, causal: bool = True, k_scale: float = 1.0,
                        v_scale: float = 1.0, num_kv_splits: int | None = None,
                        out: torch.Tensor | None = None, config: object = None,
                        sliding_window: int | None = None,
                        host_metadata: HostMetadata | None = None) -> torch.Tensor:
    """Attention of every query token over its sequence's cached keys, gathered through ``block_table``.

    Same signature as ``paged_attention``. ``num_kv_splits`` and ``config`` are accepted and
    ignored: splitting the keys and choosing tiles schedule work, and never change the answer.
    Query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)`` (GQA). With
    ``sliding_window`` W, the query at position ``q`` sees keys ``q - W + 1 .. q`` only.
    """
    batch = check_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=scale,
                            causal=causal, k_scale=k_scale, v_scale=v_scale, num_kv_splits=num_kv_splits, out=out,
                            sliding_window=sliding_window, host_metadata=host_metadata)
    out = torch.empty_like(query) if out is None else out
    group = batch.num_queries_per_kv
    starts = batch.query_start_loc
    for i, seq_len in enumerate(batch.seq_lens):
        q = query[starts[i]:starts[i + 1]].float()                          # [q_len, Hq, D]
        k = gather_kv(key_cache, block_table[i], seq_len)                   # [seq_len, Hkv, D]
        v = gather_kv(value_cache, block_table[i], seq_len)
        k = dequantize_fp8(k, batch.k_scale) if batch.fp8 else k.float()
        v = dequantize_fp8(v, batch.v_scale) if batch.fp8 else v.float()
        k = k.repeat_interleave(group, dim=1)                               # [seq_len, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale            # [Hq, q_len, seq_len]
        if causal:
            q_len = q.shape[0]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]  # absolute positions
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            hidden = k_pos > q_pos                                              # [q_len, seq_len]
            if batch.sliding_window is not None:
                hidden |= k_pos <= q_pos - batch.sliding_window                 # slid out of the window
            scores = scores.masked_fill(hidden[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale, masked by visible) v`` in one go: the specification of ``attention_by_tiles``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.float() @ k.float().T * scale).masked_fill(~visible.bool(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.float()
