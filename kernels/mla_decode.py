"""Paged MLA decode in Triton: absorbed queries attend directly over the latent cache.

After weight absorption (``mla_absorb.py``) a decode step is multi-*query* attention: every head
of a sequence reads the same cached vectors, ``c_kv`` (``kv_lora_rank`` values) then ``k_pe``
(``qk_rope_head_dim``). ``mla_decode_kernel`` runs one program per (sequence, block of
``BLOCK_H`` heads). It walks the sequence's latents in tiles of ``TILE_N`` positions through the
block table, scores ``q_latent · c_kvᵀ + q_pe · k_peᵀ`` (scaled), folds each tile into an online
softmax (``online_softmax_update``, the paged kernel's), and uses the ``c_kv`` tile it already
loaded as the values: one read of each latent serves both products and every head of the block.
The output stays in latent space, ``[num_seqs, num_heads, kv_lora_rank]``; ``absorb_output``
takes it back to ``v_head_dim``. With ``NUM_SPLITS`` > 1 each program covers one range of the
tiles and ``reduce_splits_kernel`` (``attention.py``) merges the ranges, exactly as for the K/V
kernel.

Modelled on vLLM's Triton MLA backend (``vllm/v1/attention/backends/mla/triton_mla.py``, which
calls ``decode_attention_fwd(..., is_mla=True)`` in ``vllm/v1/attention/ops/triton_decode_attention.py``:
``_fwd_grouped_kernel_stage1`` with ``BLOCK_DMODEL`` 512 + ``BLOCK_DPE`` 64, ``BLOCK_H`` 16,
``BLOCK_N`` 32, then ``_fwd_kernel_stage2``), written again to be read. Two differences: vLLM cuts
each sequence into ``NUM_KV_SPLITS`` ranges of *positions* (``next_power_of_2(max_seq_len // 512)``
of them) and stores each range's normalised output with its log-sum-exp; kvlab cuts ranges of
*tiles* and chooses the count with ``choose_num_kv_splits``, the K/V kernel's rule, so one merge
serves both kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from kvlab.kernels._backend import backend, require_triton
from kvlab.kernels.attention import LOG2E, compute_dtype, dot, num_sms, online_softmax_update, reduce_splits_kernel
from kvlab.kernels.checks import HostMetadata, check_kernel_device
from kvlab.kernels.grid import KernelConfig, next_power_of_2
from kvlab.kernels.mla_checks import check_mla_decode
from kvlab.kernels.mla_grid import MLADecodePlan, plan_mla_decode

require_triton()  # sets TRITON_INTERPRET (or not) before the decorators below run

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def mla_decode_kernel(
    out_ptr,            # [num_seqs, NUM_HEADS, KV_LORA_RANK]             (written when NUM_SPLITS == 1)
    split_acc_ptr,      # [num_seqs, NUM_HEADS, NUM_SPLITS, LATENT_PAD]   float32 (NUM_SPLITS > 1)
    split_max_ptr,      # [num_seqs, NUM_HEADS, NUM_SPLITS]               float32 (NUM_SPLITS > 1)
    split_sum_ptr,      # [num_seqs, NUM_HEADS, NUM_SPLITS]               float32 (NUM_SPLITS > 1)
    q_latent_ptr,       # [num_seqs, NUM_HEADS, KV_LORA_RANK]  q_nope with W_UK absorbed
    q_pe_ptr,           # [num_seqs, NUM_HEADS, ROPE_DIM]      the rotated rope part of the query
    kv_cache_ptr,       # [num_blocks, BLOCK_SIZE, KV_LORA_RANK + ROPE_DIM]  c_kv then k_pe, per slot
    block_table_ptr,    # [num_seqs, max_blocks_per_seq] physical block ids
    seq_lens_ptr,       # [num_seqs] latents each sequence attends to (this step's own included)
    scale,              # softmax scale: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) (x YaRN mscale^2) x log2(e)
    k_scale,            # FP8 cache only: stored * k_scale is the latent
    stride_ql_seq, stride_ql_head, stride_qpe_seq, stride_qpe_head, stride_o_seq, stride_o_head,
    stride_c_blk, stride_c_slot, stride_bt_seq,
    NUM_HEADS: tl.constexpr, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
    LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    KV_FP8: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    # 1. Our heads: BLOCK_H rows, one per query head (rows past NUM_HEADS are padding, never stored).
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)                        # [BLOCK_H]
    head_ok = heads < NUM_HEADS
    lat = tl.arange(0, LATENT_PAD)
    lat_ok = lat < KV_LORA_RANK
    rope = tl.arange(0, ROPE_PAD)
    rope_ok = rope < ROPE_DIM

    # 2. The two parts of each head's query: latent (absorbed) and rope.
    q_lat = tl.load(q_latent_ptr + seq * stride_ql_seq + heads[:, None] * stride_ql_head + lat[None, :],
                    mask=head_ok[:, None] & lat_ok[None, :], other=0.0).to(COMPUTE_DTYPE)   # [BLOCK_H, LATENT_PAD]
    q_pe = tl.load(q_pe_ptr + seq * stride_qpe_seq + heads[:, None] * stride_qpe_head + rope[None, :],
                   mask=head_ok[:, None] & rope_ok[None, :], other=0.0).to(COMPUTE_DTYPE)   # [BLOCK_H, ROPE_PAD]

    # 3. The latents this sequence holds, cut into tiles; 4. this split's range of the tiles.
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    block_row = block_table_ptr + seq * stride_bt_seq
    for tile in range(tile_lo, tile_hi):
        # 5. Read one tile of latents through the block table: c_kv [TILE_N, LATENT_PAD], k_pe [TILE_N, ROPE_PAD].
        pos = tile * TILE_N + offs_n                                            # [TILE_N] logical positions
        pos_ok = pos < seq_len
        physical = tl.load(block_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot_ptr = kv_cache_ptr + physical * stride_c_blk + (pos % BLOCK_SIZE) * stride_c_slot     # [TILE_N]
        c_kv = tl.load(slot_ptr[:, None] + lat[None, :], mask=pos_ok[:, None] & lat_ok[None, :], other=0.0)
        k_pe = tl.load(slot_ptr[:, None] + KV_LORA_RANK + rope[None, :],
                       mask=pos_ok[:, None] & rope_ok[None, :], other=0.0)
        if KV_FP8:                                                              # dequantize on load
            c_kv = c_kv.to(tl.float32) * k_scale
            k_pe = k_pe.to(tl.float32) * k_scale
        c_kv = c_kv.to(COMPUTE_DTYPE)
        k_pe = k_pe.to(COMPUTE_DTYPE)

        # 6. Scores of every head against the tile: the latent part plus the rope part.
        scores = (dot(q_lat, tl.trans(c_kv)) + dot(q_pe, tl.trans(k_pe))) * scale   # [BLOCK_H, TILE_N]
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        # 7. Online softmax, with the same c_kv tile as the values: no V is stored or read.
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, scores, c_kv, BASE2=True)

    # 8. The output, still in latent space (or this split's unnormalised partial).
    out_mask = head_ok[:, None] & lat_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]                       # l > 0: every sequence holds at least one latent
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + lat[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # an empty range stores m = -inf, l = 0, acc = 0, which the merge weighs by 0
        row_split = (seq * NUM_HEADS + heads) * NUM_SPLITS + split                    # [BLOCK_H]
        tl.store(split_acc_ptr + row_split[:, None] * LATENT_PAD + lat[None, :], acc, mask=out_mask)
        tl.store(split_max_ptr + row_split, m_i, mask=head_ok)
        tl.store(split_sum_ptr + row_split, l_i, mask=head_ok)


def mla_kernel_constants(plan: MLADecodePlan, query_dtype: torch.dtype) -> dict[str, Any]:
    """The ``tl.constexpr`` arguments of ``mla_decode_kernel``: model shapes and tiles, never sequence lengths."""
    b, cfg = plan.batch, plan.config
    return dict(
        NUM_HEADS=b.num_heads, KV_LORA_RANK=b.kv_lora_rank, ROPE_DIM=b.rope_dim,
        LATENT_PAD=max(16, next_power_of_2(b.kv_lora_rank)), ROPE_PAD=max(16, next_power_of_2(b.rope_dim)),
        BLOCK_SIZE=b.block_size, BLOCK_H=cfg.block_m, TILE_N=cfg.tile_n, NUM_SPLITS=plan.num_kv_splits,
        KV_FP8=b.fp8, COMPUTE_DTYPE=compute_dtype(query_dtype),
    )


def launch_mla_decode(plan: MLADecodePlan, q_latent, q_pe, kv_cache, block_table, seq_lens,
                      out: torch.Tensor) -> torch.Tensor:
    """Run the kernels of ``plan`` (inputs already checked); returns ``out``."""
    b, cfg, splits = plan.batch, plan.config, plan.num_kv_splits
    constants = mla_kernel_constants(plan, q_latent.dtype)
    latent_pad = constants["LATENT_PAD"]
    if splits > 1:
        split_acc = torch.empty(b.num_seqs, b.num_heads, splits, latent_pad, dtype=torch.float32,
                                device=q_latent.device)
        split_max = torch.empty(b.num_seqs, b.num_heads, splits, dtype=torch.float32, device=q_latent.device)
        split_sum = torch.empty_like(split_max)
    else:
        split_acc = split_max = split_sum = out          # never touched: NUM_SPLITS == 1
    mla_decode_kernel[plan.grid](
        out, split_acc, split_max, split_sum, q_latent, q_pe, kv_cache, block_table, seq_lens,
        b.scale * LOG2E, b.k_scale,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        **constants, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        reduce_splits_kernel[(b.num_seqs, b.num_heads)](
            out, split_acc, split_max, split_sum, out.stride(0), out.stride(1),
            NUM_Q_HEADS=b.num_heads, HEAD_SIZE=b.kv_lora_rank, HEAD_PAD=latent_pad,
            NUM_SPLITS=splits, SPLITS_PAD=next_power_of_2(splits), num_warps=4,
        )
    return out


def mla_decode_triton(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, *, scale: float, k_scale: float = 1.0, num_kv_splits: int | None = None,
                      out: torch.Tensor | None = None, config: KernelConfig | None = None,
                      host_metadata: HostMetadata | None = None) -> torch.Tensor:
    """Check the inputs, plan the launch, run the Triton kernels; returns ``out`` ``[num_seqs, num_heads, L]``."""
    batch = check_mla_decode(q_latent, q_pe, kv_cache, block_table, seq_lens, scale=scale, k_scale=k_scale,
                             num_kv_splits=num_kv_splits, out=out, host_metadata=host_metadata)
    check_kernel_device(backend(), q_latent.device)
    plan = plan_mla_decode(batch, num_kv_splits, config, num_sms(q_latent.device))
    out = torch.empty_like(q_latent) if out is None else out
    return launch_mla_decode(plan, q_latent, q_pe, kv_cache, block_table, seq_lens, out)
