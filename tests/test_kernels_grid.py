"""The launch plan: tile choices, the split-KV rule, and the Python mirror of the kernel's reads."""

import itertools

import pytest
import torch
from kvlab.kernels import KernelConfig, check_attention, choose_config, choose_num_kv_splits, plan_launch
from kvlab.kernels.attention import kernel_constants, trace_reads
from kvlab.kernels.batches import make_batch
from kvlab.kernels.grid import MAX_KV_SPLITS, find_seq_idx, program_reads, trace_from_reads, visible_keys

from kvlab.errors import KernelInputError


@pytest.mark.parametrize(("group", "max_query_len", "head_size"),
                         list(itertools.product([1, 3, 4, 8, 16, 32], [1, 7, 512], [64, 80, 128, 256])))
def test_every_config_fits_the_gpu_rules(group, max_query_len, head_size):
    cfg = choose_config(group, max_query_len, head_size)
    assert cfg.block_m >= 16 and cfg.tile_n >= 16                      # tl.dot's minimum on a GPU
    assert cfg.block_q * group <= cfg.block_m                          # every packed row is real
    if max_query_len == 1:                                             # decode: rows are one token's heads
        assert cfg.block_m == max(16, 1 << (group - 1).bit_length())


def test_config_refuses_tiles_a_gpu_cannot_compile():
    with pytest.raises(KernelInputError, match="tile_n >= 16"):
        KernelConfig(block_q=1, block_m=16, tile_n=8)
    with pytest.raises(KernelInputError, match="power of two"):
        KernelConfig(block_q=3, block_m=16, tile_n=16)


def test_split_kv_only_for_decode_batches_that_leave_the_gpu_idle():
    sms = 132                                                          # an H100/H200
    # Llama-3-8B heads (8 KV): 64 decodes x 8 heads = 512 programs already fill 2 waves of 132 SMs
    assert choose_num_kv_splits(64, 8, 1, 8192, 64, sms) == 1
    assert choose_num_kv_splits(1, 8, 1, 8192, 64, sms) == MAX_KV_SPLITS        # 8 programs: split a lot
    assert choose_num_kv_splits(16, 8, 1, 8192, 64, sms) == 2                   # 128 programs -> 256
    assert choose_num_kv_splits(1, 8, 1, 1024, 64, sms) == 4                    # 16 tiles, >= 4 per split
    assert choose_num_kv_splits(1, 8, 1, 100, 64, sms) == 1                     # too short to split
    assert choose_num_kv_splits(1, 8, 2, 8192, 64, sms) == 1                    # not decode-only
    assert choose_num_kv_splits(1, 8, 1, 8192, 64, 1) == 1                      # CPU: one program at a time


def test_find_seq_idx_agrees_with_a_linear_scan():
    qsl = [0, 1, 2, 40, 41, 77]
    block_q = 16
    firsts = [qsl[i] // block_q + i for i in range(len(qsl) - 1)]
    for q_block in range(qsl[-1] // block_q + len(qsl) - 1):
        expected = max(i for i, first in enumerate(firsts) if first <= q_block)
        assert find_seq_idx(qsl, q_block, block_q) == expected


def test_programs_cover_every_query_row_once_and_read_only_their_own_blocks():
    batch = make_batch([50, 17, 1, 9], [20, 1, 1, 9], group=4, num_kv_heads=2)
    info = check_attention(*batch.args())
    plan = plan_launch(info, num_kv_splits=2, config=KernelConfig(block_q=4, block_m=16, tile_n=16))
    reads = program_reads(plan, batch.block_table.tolist())
    rows = sorted((r.seq, t, r.program[1]) for r in reads if r.program[2] == 0 for t in r.query_tokens)
    expected = sorted((s, t, h) for s, q in enumerate(info.query_lens) for t in range(q) for h in range(2))
    assert rows == expected
    for r in reads:
        needed = batch.block_table[r.seq, : -(-info.seq_lens[r.seq] // info.block_size)].tolist()
        assert set(r.blocks_in_order()) <= set(needed)


@pytest.mark.parametrize("splits", [1, 3])
def test_the_kernel_reads_exactly_what_the_mirror_says(splits):
    batch = make_batch([50, 17, 1, 9], [20, 1, 1, 9], group=2, table="overlong")
    config = KernelConfig(block_q=8, block_m=16, tile_n=32)
    plan, out, trace = trace_reads(*batch.args(), num_kv_splits=splits, config=config)
    reads = program_reads(plan, batch.block_table.tolist())
    assert trace.tolist() == trace_from_reads(plan, reads)
    assert not torch.isnan(out).any()
    for r in reads:                                      # (block, offset) of each key, in the order it is read
        mine = trace[r.program].reshape(-1, 2)
        assert r.key_reads() == [tuple(p) for p in mine[mine[:, 0] >= 0].tolist()]
        table = batch.block_table[r.seq].tolist()
        positions = [p for t in range(*r.tile_range) for p in range(t * 32, (t + 1) * 32)]
        assert r.key_reads() == [(table[p // 16], p % 16) for p in positions if p < info_kv_len(plan, r)]


def info_kv_len(plan, r):
    """The keys query block ``r.q_block`` of ``r.seq`` may see, by causality (no window here)."""
    return visible_keys(plan.batch, r.seq, r.q_block, plan.config.block_q)[1]


def test_compile_time_constants_do_not_follow_the_sequence_lengths():
    # On a GPU each distinct set of constexprs is one more compilation: an engine whose contexts grow
    # every step must keep hitting the same compiled kernel (the trace alone needs its size baked in).
    short, long = (make_batch([n, n // 2], [1, 1], seed=0) for n in (40, 900))
    plans = [plan_launch(check_attention(*b.args()), num_kv_splits=1) for b in (short, long)]
    assert plans[0].max_tiles != plans[1].max_tiles
    assert kernel_constants(plans[0], torch.float32) == kernel_constants(plans[1], torch.float32)
    traced = [kernel_constants(p, torch.float32, trace=True)["MAX_TILES"] for p in plans]
    assert traced == [p.max_tiles for p in plans]
