"""Paged attention in Triton: one varlen kernel for prefill chunks and decode steps, plus split-KV.

``paged_attention_kernel`` computes, for a block of query tokens and every query head that shares
one KV head, ``softmax(q k^T * scale) v`` over the sequence's keys, read tile by tile through the
block table with an online softmax (``online_softmax_update``). With ``NUM_SPLITS`` > 1 each
program covers one range of the key tiles and writes an unnormalised partial result; then
``reduce_splits_kernel`` merges the ranges (split-KV, also called flash-decoding). With
``SLIDING_WINDOW`` W a query at position q sees keys q - W + 1 .. q, and a program skips the tiles
that lie wholly before its first query's window. Only the tiles that cross the diagonal or the
window edge are masked; the rest are visible to every row and skip the mask. Scores are kept in
base 2 (log2(e) folded into the scale on the host), so every exponential is an ``exp2``. The grid
and the index arithmetic are described, and mirrored in Python, in ``kvlab.kernels.grid``.

Modelled on vLLM's Triton backend (``vllm/v1/attention/ops/triton_unified_attention.py``:
``kernel_unified_attention_2d/3d``, ``reduce_segments``), written again here to be read.
Two things keep the same source correct in Triton's CPU interpreter and fast on a GPU:
tiles are at least 16 in every ``tl.dot`` dimension, and ``COMPUTE_DTYPE`` is float32 in the
interpreter (which cannot do bf16 arithmetic) but the activations' dtype on a GPU (tensor cores).
"""

from __future__ import annotations

from typing import Any

import torch
from kvlab.kernels._backend import TRITON_INTERPRETER, backend, require_triton
from kvlab.kernels.checks import AttentionBatch, HostMetadata, check_attention, check_kernel_device
from kvlab.kernels.grid import KernelConfig, LaunchPlan, next_power_of_2, plan_launch

require_triton()  # sets TRITON_INTERPRET (or not) before the decorators below run

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

#: log2(e): the kernels compute e**s as 2**(s * log2(e)) and fold the factor into the softmax scale.
LOG2E = 1.4426950408889634


@triton.jit
def find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """Binary search: the last sequence ``i`` whose first query block ``qsl[i] // BLOCK_Q + i`` <= ours."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def dot(a, b):
    """``a @ b`` accumulated in float32; float32 operands use exact products (not TF32 on a GPU)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def online_softmax_update(m_i, l_i, acc, scores, v, BASE2: tl.constexpr = False):
    """Fold one key tile into the running softmax of each row.

    ``m_i`` [M] is the largest score seen so far, ``l_i`` [M] the sum of ``exp(score - m_i)``,
    ``acc`` [M, D] the sum of ``exp(score - m_i) * v``; ``scores`` [M, N] (-inf where masked) and
    ``v`` [N, D] are the new tile. When the maximum grows, what was summed so far is rescaled by
    ``alpha = exp(m_old - m_new)``. A row that has seen no key yet keeps m = -inf, l = 0, acc = 0.
    With ``BASE2`` the scores come in base 2 (the caller folded log2(e) into the softmax scale) and
    ``exp`` is ``exp2``, one instruction on a GPU: ``2**(s * log2(e)) = e**s``, so l and acc are the same.
    """
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))               # [M]
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)          # avoid -inf - -inf = nan
    if BASE2:
        alpha = tl.exp2(m_i - m_ref)                               # [M]  exp2(-inf) = 0 on the first tile
        p = tl.exp2(scores - m_ref[:, None])                       # [M, N]
    else:
        alpha = tl.exp(m_i - m_ref)                                # [M]  exp(-inf) = 0 on the first tile
        p = tl.exp(scores - m_ref[:, None])                        # [M, N]
    l_new = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)             # [M, D]
    return m_new, l_new, acc


@triton.jit
def paged_attention_kernel(
    out_ptr,            # [num_tokens, num_q_heads, head_size]           (written when NUM_SPLITS == 1)
    split_acc_ptr,      # [num_tokens, num_q_heads, NUM_SPLITS, HEAD_PAD] float32 (NUM_SPLITS > 1)
    split_max_ptr,      # [num_tokens, num_q_heads, NUM_SPLITS]          float32 (NUM_SPLITS > 1)
    split_sum_ptr,      # [num_tokens, num_q_heads, NUM_SPLITS]          float32 (NUM_SPLITS > 1)
    trace_ptr,          # [q_blocks, num_kv_heads, NUM_SPLITS, MAX_TILES, TILE_N, 2] int32 (TRACE)
    query_ptr,          # [num_tokens, num_q_heads, head_size]
    key_cache_ptr,      # [num_blocks, BLOCK_SIZE, num_kv_heads, head_size]
    value_cache_ptr,    # [num_blocks, BLOCK_SIZE, num_kv_heads, head_size]
    block_table_ptr,    # [num_seqs, max_blocks_per_seq] physical block ids
    seq_lens_ptr,       # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    scale,              # float: the softmax scale (1/sqrt(head_size) unless the model says otherwise) x log2(e)
    k_scale, v_scale,   # float: an FP8 cache holds x / scale, so loads multiply by these (1.0 otherwise)
    num_seqs,           # int: sequences in the batch (the binary search's range)
    stride_q_tok, stride_q_head,                  # query: elements between tokens, between heads
    stride_o_tok, stride_o_head,                  # out: the same (head_size is contiguous in both)
    stride_k_blk, stride_k_slot, stride_k_head,   # key cache: between blocks, slots of a block, KV heads
    stride_v_blk, stride_v_slot, stride_v_head,   # value cache: the same
    stride_bt_seq,      # block table: elements between rows (its columns are contiguous)
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr, SLIDING_WINDOW: tl.constexpr, KV_FP8: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    TRACE: tl.constexpr, MAX_TILES: tl.constexpr,
):
    # The rules the host checks (KernelConfig, plan_launch), again at compile time.
    tl.static_assert(BLOCK_M >= 16, "BLOCK_M < 16: tl.dot needs at least 16 rows")
    tl.static_assert(TILE_N >= 16, "TILE_N < 16: tl.dot needs at least 16 keys")
    tl.static_assert(HEAD_PAD >= 16, "HEAD_PAD < 16: tl.dot needs at least 16 head dimensions")
    tl.static_assert(BLOCK_Q * GROUP <= BLOCK_M, "BLOCK_Q query tokens x GROUP heads must fit in BLOCK_M rows")
    tl.static_assert(NUM_Q_HEADS == NUM_KV_HEADS * GROUP, "every KV head serves GROUP query heads")
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # 1. Which sequence, and which of its query blocks, is ours? (vLLM: find_seq_idx)
    seq = find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return                                   # the grid is an upper bound: nothing to do here
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len                # tokens already cached before this step's queries

    # 2. GQA packing: row r is query token r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_pos = q_block * BLOCK_Q + rows // GROUP                       # [BLOCK_M] position in the query
    q_head = kv_head * GROUP + rows % GROUP                         # [BLOCK_M]
    row_ok = (q_pos < q_len) & (rows < BLOCK_Q * GROUP)
    q_abs = context_len + q_pos                                     # [BLOCK_M] position in the sequence
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q_tok = (q_start + q_pos).to(tl.int64)
    q = tl.load(query_ptr + q_tok[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(COMPUTE_DTYPE)   # [BLOCK_M, HEAD_PAD]

    # 3. The keys this block may see, [first_key, kv_len): causal, up to its last query's position;
    #    with a sliding window, from its first query's window start. Tiles before that are skipped.
    q_first = context_len + q_block * BLOCK_Q
    kv_len = tl.minimum(seq_len, q_first + BLOCK_Q) if CAUSAL else seq_len
    first_key = tl.maximum(q_first - SLIDING_WINDOW + 1, 0) if SLIDING_WINDOW > 0 else 0
    tile_start = first_key // TILE_N
    num_tiles = tl.cdiv(kv_len, TILE_N)
    # Tiles [full_lo, full_hi) are visible to every row of the block: wholly at or before its first
    # query (causal) and at or after its last query's window start. Only the tiles that cross the
    # diagonal or the window edge are masked (as the stages of Triton's fused-attention tutorial).
    q_last = tl.minimum(q_first + BLOCK_Q, seq_len) - 1
    full_lo = tl.cdiv(tl.maximum(q_last - SLIDING_WINDOW + 1, 0), TILE_N) if SLIDING_WINDOW > 0 else 0
    full_hi = (q_first + 1) // TILE_N if CAUSAL else kv_len // TILE_N

    # 4. This split's range of those tiles (one range of all of them when NUM_SPLITS == 1).
    tiles_per_split = tl.cdiv(num_tiles - tile_start, NUM_SPLITS)
    tile_lo = tile_start + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile in range(tile_lo, tile_hi):                          # 5. walk the tiles through the block table
        key_pos = tile * TILE_N + offs_n                                       # [TILE_N] logical positions
        key_ok = (key_pos >= first_key) & (key_pos < kv_len)                   # the keys this program reads
        physical = tl.load(block_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = key_pos % BLOCK_SIZE
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + physical[:, None] * stride_k_blk + offset[:, None] * stride_k_slot
                    + kv_head * stride_k_head + dims[None, :], mask=kv_mask, other=0.0)   # [TILE_N, HEAD_PAD]
        v = tl.load(value_cache_ptr + physical[:, None] * stride_v_blk + offset[:, None] * stride_v_slot
                    + kv_head * stride_v_head + dims[None, :], mask=kv_mask, other=0.0)   # [TILE_N, HEAD_PAD]
        if KV_FP8:                                                             # dequantize on load
            k = k.to(tl.float32) * k_scale
            v = v.to(tl.float32) * v_scale
        k = k.to(COMPUTE_DTYPE)
        v = v.to(COMPUTE_DTYPE)

        scores = dot(q, tl.trans(k)) * scale                       # [BLOCK_M, TILE_N], base 2
        if (tile < full_lo) | (tile >= full_hi):                   # a tile on the diagonal or the window edge
            visible = row_ok[:, None] & key_ok[None, :]
            if CAUSAL:
                visible = visible & (key_pos[None, :] <= q_abs[:, None])
            if SLIDING_WINDOW > 0:                                             # keys q - W + 1 .. q
                visible = visible & (q_abs[:, None] - key_pos[None, :] < SLIDING_WINDOW)
            scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, scores, v, BASE2=True)

        if TRACE:  # record the (physical block, offset) of every key read (tests, notebook)
            program = (q_block_global * NUM_KV_HEADS + kv_head) * NUM_SPLITS + split
            where = ((program.to(tl.int64) * MAX_TILES + (tile - tile_lo)) * TILE_N + offs_n) * 2
            tl.store(trace_ptr + where, tl.where(key_ok, physical, -1).to(tl.int32))
            tl.store(trace_ptr + where + 1, tl.where(key_ok, offset, -1).to(tl.int32))

    # 6. Write the result: normalised, or this split's unnormalised partial for the merge.
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]        # l = 0 only on padding rows
        tl.store(out_ptr + q_tok[:, None] * stride_o_tok + q_head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # a range a row sees nothing of (or an empty range) stores m = -inf, l = 0, acc = 0
        row_split = (q_tok * NUM_Q_HEADS + q_head) * NUM_SPLITS + split         # [BLOCK_M]
        tl.store(split_acc_ptr + row_split[:, None] * HEAD_PAD + dims[None, :], acc, mask=out_mask)
        tl.store(split_max_ptr + row_split, m_i, mask=row_ok)
        tl.store(split_sum_ptr + row_split, l_i, mask=row_ok)


@triton.jit
def reduce_splits_kernel(
    out_ptr,            # [num_tokens, num_q_heads, head_size]
    split_acc_ptr,      # [num_tokens, num_q_heads, NUM_SPLITS, HEAD_PAD] float32
    split_max_ptr,      # [num_tokens, num_q_heads, NUM_SPLITS]          float32
    split_sum_ptr,      # [num_tokens, num_q_heads, NUM_SPLITS]          float32
    stride_o_tok, stride_o_head,
    NUM_Q_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """One program per (token, query head): merge the split partials with their log-sum-exp weights.

    The partials' maxima are in base 2 (both kernels fold log2(e) into their scale), so the weights are ``exp2``.
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_PAD)
    row = (token * NUM_Q_HEADS + head) * NUM_SPLITS + splits                  # [SPLITS_PAD]
    m = tl.load(split_max_ptr + row, mask=split_ok, other=float("-inf"))
    l_s = tl.load(split_sum_ptr + row, mask=split_ok, other=0.0)
    acc = tl.load(split_acc_ptr + row[:, None] * HEAD_PAD + dims[None, :],
                  mask=split_ok[:, None], other=0.0)                           # [SPLITS_PAD, HEAD_PAD]
    m_all = tl.max(m, axis=0)              # finite: some split holds the row's own position, which it sees
    weight = tl.exp2(m - m_all)            # [SPLITS_PAD]; 0 for an empty split (m = -inf)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)


def compute_dtype(dtype: torch.dtype):
    """float32 in the interpreter (no bf16 arithmetic there); the activations' dtype on a GPU."""
    if backend() == TRITON_INTERPRETER:
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs one program at a time)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def kernel_constants(plan: LaunchPlan, query_dtype: torch.dtype, trace: bool = False) -> dict[str, Any]:
    """The compile-time (``tl.constexpr``) arguments of ``paged_attention_kernel`` for ``plan``.

    On a GPU each distinct set is compiled once (about a second) and cached, so nothing here may
    follow the sequence lengths: an engine's contexts grow every step. ``MAX_TILES`` does, so it is
    passed only when the trace is on, and 1 otherwise. ``SLIDING_WINDOW`` (0: none) is a property of
    the model's layer, fixed for its life, as in vLLM.
    """
    b, cfg = plan.batch, plan.config
    return dict(
        NUM_Q_HEADS=b.num_q_heads, NUM_KV_HEADS=b.num_kv_heads, GROUP=b.num_queries_per_kv,
        HEAD_SIZE=b.head_size, HEAD_PAD=max(16, next_power_of_2(b.head_size)), BLOCK_SIZE=b.block_size,
        BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n, NUM_SPLITS=plan.num_kv_splits,
        CAUSAL=b.causal, SLIDING_WINDOW=b.sliding_window or 0, KV_FP8=b.fp8,
        COMPUTE_DTYPE=compute_dtype(query_dtype),
        TRACE=trace, MAX_TILES=plan.max_tiles if trace else 1,
    )


def launch(plan: LaunchPlan, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
           out: torch.Tensor, trace: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernels of ``plan`` (inputs already checked). ``trace``, if given, receives the read trace."""
    b, cfg, splits = plan.batch, plan.config, plan.num_kv_splits
    constants = kernel_constants(plan, query.dtype, trace is not None)
    head_pad = constants["HEAD_PAD"]
    device = query.device
    if splits > 1:
        split_acc = torch.empty(b.num_tokens, b.num_q_heads, splits, head_pad, dtype=torch.float32, device=device)
        split_max = torch.empty(b.num_tokens, b.num_q_heads, splits, dtype=torch.float32, device=device)
        split_sum = torch.empty_like(split_max)
    else:
        split_acc = split_max = split_sum = out          # never touched: NUM_SPLITS == 1
    paged_attention_kernel[plan.grid](
        out, split_acc, split_max, split_sum, trace if trace is not None else out,
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        b.scale * LOG2E, b.k_scale, b.v_scale, b.num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        **constants, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        reduce_splits_kernel[(b.num_tokens, b.num_q_heads)](
            out, split_acc, split_max, split_sum, out.stride(0), out.stride(1),
            NUM_Q_HEADS=b.num_q_heads, HEAD_SIZE=b.head_size, HEAD_PAD=head_pad,
            NUM_SPLITS=splits, SPLITS_PAD=next_power_of_2(splits), num_warps=4,
        )
    return out


def paged_attention_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                           scale: float | None = None, causal: bool = True, k_scale: float = 1.0,
                           v_scale: float = 1.0, num_kv_splits: int | None = None,
                           out: torch.Tensor | None = None, config: KernelConfig | None = None,
                           sliding_window: int | None = None,
                           host_metadata: HostMetadata | None = None) -> torch.Tensor:
    """Check the inputs, plan the launch, run the Triton kernels; returns ``out`` ``[num_tokens, Hq, D]``."""
    batch = check_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=scale,
                            causal=causal, k_scale=k_scale, v_scale=v_scale, num_kv_splits=num_kv_splits, out=out,
                            sliding_window=sliding_window, host_metadata=host_metadata)
    check_kernel_device(backend(), query.device)
    plan = plan_launch(batch, num_kv_splits, config, num_sms(query.device))
    out = torch.empty_like(query) if out is None else out
    return launch(plan, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out)


def trace_reads(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *,
                causal: bool = True, num_kv_splits: int | None = None, config: KernelConfig | None = None,
                sliding_window: int | None = None) -> tuple[LaunchPlan, torch.Tensor, torch.Tensor]:
    """Run the kernel with its trace on: ``(plan, out, trace)``, trace ``[q_blocks, Hkv, splits, tiles, TILE_N, 2]``.

    ``trace[b, h, s, i, n]`` is the ``(physical block, offset)`` program ``(b, h, s)`` read for key
    ``n`` of its ``i``-th tile: (-1, -1) for a position it did not read, (-2, -2) for a tile it never reached.
    """
    batch: AttentionBatch = check_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                                            causal=causal, num_kv_splits=num_kv_splits,
                                            sliding_window=sliding_window)
    check_kernel_device(backend(), query.device)
    plan = plan_launch(batch, num_kv_splits, config, num_sms(query.device))
    trace = torch.full((*plan.grid, plan.max_tiles, plan.config.tile_n, 2), -2, dtype=torch.int32,
                       device=query.device)
    out = launch(plan, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                 torch.empty_like(query), trace)
    return plan, out, trace
