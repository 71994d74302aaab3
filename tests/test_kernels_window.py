"""Sliding windows: a query at position q sees keys q - W + 1 .. q, as in vLLM 0.33.0 and transformers.

The kernel masks the keys outside the window and never visits a tile that lies wholly before it,
so a decode with a window of W reads W keys whatever the context length (the read trace shows
it). Checked against the reference on fresh random batches: windows shorter and longer than the
context, windows whose edge falls inside a block, prefill, chunked prefill, decode and split-KV.
"""

import dataclasses
import random

import pytest
import torch
from kvlab.kernels import (
    AttentionBatch,
    KernelConfig,
    check_attention,
    paged_attention,
    paged_attention_ref,
    plan_launch,
)
from kvlab.kernels.attention import trace_reads
from kvlab.kernels.batches import TOLERANCE, make_batch, poisoned_out, relative_error
from kvlab.kernels.grid import MAX_KV_SPLITS, program_reads, trace_from_reads

from kvlab.errors import KernelInputError

SMALL = KernelConfig(block_q=8, block_m=16, tile_n=16)          # 8 tokens x 2 heads per program


def assert_window_matches_reference(batch, window, **kwargs):
    out = paged_attention(*batch.args(), sliding_window=window, out=poisoned_out(batch), **kwargs)
    ref = paged_attention_ref(*batch.args(), sliding_window=window)
    error = relative_error(out, ref)
    assert error < TOLERANCE[torch.float32], f"window {window}: relative error {error:.3g} (seed {batch.seed})"
    return out, ref


def test_the_window_is_transformers_sliding_window_mask():
    # transformers builds Mistral's and Gemma-2's sliding layers' masks from this function.
    masking = pytest.importorskip("transformers.masking_utils")
    seq_len, q_len, window = 29, 7, 5
    batch = make_batch([seq_len], [q_len], num_kv_heads=1, group=2, head_size=32)
    mask_function = masking.sliding_window_causal_mask_function(window)
    q_idx, kv_idx = torch.arange(seq_len - q_len, seq_len)[:, None], torch.arange(seq_len)[None, :]
    visible = mask_function(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)   # [q_len, seq_len]
    assert visible.sum(dim=1).tolist() == [window] * q_len              # W keys, the query's own included
    q = batch.query.transpose(0, 1).float()                                  # [Hq, q_len, D]
    k = batch.key_cache[batch.block_table[0].long()].reshape(-1, 1, 32)[:seq_len].transpose(0, 1)  # [1, seq, D]
    v = batch.value_cache[batch.block_table[0].long()].reshape(-1, 1, 32)[:seq_len].transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k.expand(2, -1, -1), v.expand(2, -1, -1),
                                                             attn_mask=visible.to(q.device))
    out, ref = assert_window_matches_reference(batch, window, config=SMALL)
    assert relative_error(ref, dense.transpose(0, 1)) < 1e-5


@pytest.mark.parametrize("draw", range(4))
def test_random_batches_with_windows_shorter_and_longer_than_the_context(draw):
    rng = random.Random()
    num_seqs = rng.randint(1, 3)
    seq_lens = [rng.randint(1, 70) for _ in range(num_seqs)]
    query_lens = [rng.choice([1, s, rng.randint(1, s)]) for s in seq_lens]
    block_size = rng.choice([4, 8, 16, 32])
    window = rng.choice([1, 3, 16, 17, 40, 200])
    group = rng.choice([1, 2, 3])
    batch = make_batch(seq_lens, query_lens, group=group, head_size=32, block_size=block_size)
    splits = rng.choice([1, 2, 3])
    note = (f"seq_lens={seq_lens} query_lens={query_lens} group={group} block_size={block_size} window={window} "
            f"splits={splits}")
    try:
        assert_window_matches_reference(batch, window, num_kv_splits=splits,
                                        config=KernelConfig(block_q=16 // (1 << (group - 1).bit_length()),
                                                            block_m=16, tile_n=16))
    except AssertionError as failure:
        raise AssertionError(f"{failure}; {note}") from None


@pytest.mark.parametrize("window", [1, 6, 16, 25])
def test_window_edges_inside_and_on_block_boundaries(window):
    # blocks of 8: windows of 6 and 25 end inside a block, 16 on its boundary; the chunk of 12
    # tokens after 30 cached ones has queries whose windows start in different blocks.
    batch = make_batch([42, 30 + 12, 9], [1, 12, 9], block_size=8, group=2, head_size=32)
    assert_window_matches_reference(batch, window, config=SMALL)
    assert_window_matches_reference(batch, window, config=SMALL, num_kv_splits=2)


def test_a_window_at_least_the_context_changes_nothing():
    batch = make_batch([40, 17], [5, 17], head_size=32)
    full = paged_attention(*batch.args(), config=SMALL)
    for window in (40, 41, 1000):
        out, _ = assert_window_matches_reference(batch, window, config=SMALL)
        assert torch.equal(out, full)


def test_a_window_of_one_returns_each_tokens_own_value():
    batch = make_batch([20, 9], [20, 1], num_kv_heads=1, group=1, head_size=32, block_size=8)
    out, _ = assert_window_matches_reference(batch, 1, config=SMALL)
    own = [batch.value_cache[batch.block_table[s, p // 8].long(), p % 8, 0]
           for s, (n, q) in enumerate([(20, 20), (9, 1)]) for p in range(n - q, n)]
    assert torch.allclose(out[:, 0], torch.stack(own), atol=1e-6)


@pytest.mark.parametrize("context", [64, 200, 1000])
def test_a_decode_reads_the_window_whatever_the_context(context):
    window, tile = 40, 16
    batch = make_batch([context], [1], num_kv_heads=1, group=4, head_size=16, block_size=16)
    plan, out, trace = trace_reads(*batch.args(), sliding_window=window, num_kv_splits=1,
                                   config=KernelConfig(block_q=4, block_m=16, tile_n=tile))
    reads = program_reads(plan, batch.block_table.tolist())
    assert trace.tolist() == trace_from_reads(plan, reads)
    (program,) = reads
    assert program.keys_read() == int((trace[..., 0] >= 0).sum()) == window
    assert len(program.tiles) <= -(-window // tile) + 1                        # tiles before the window: skipped
    read = trace[0, 0, 0][..., 1][trace[0, 0, 0][..., 0] >= 0]               # the offsets of the keys read
    first = context - window
    assert read.tolist() == [p % 16 for p in range(first, context)]
    assert relative_error(out, paged_attention_ref(*batch.args(), sliding_window=window)) < 1e-4


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_the_kernel_reads_what_the_mirror_says_with_a_window(splits):
    batch = make_batch([70, 33, 5], [1, 13, 5], group=2, head_size=32, block_size=8, table="overlong")
    plan, out, trace = trace_reads(*batch.args(), sliding_window=12, num_kv_splits=splits, config=SMALL)
    reads = program_reads(plan, batch.block_table.tolist())
    assert trace.tolist() == trace_from_reads(plan, reads)
    per_program = {}
    for r in reads:                                      # summed over splits: what one (query block, head) reads
        key = (r.program[0], r.program[1])
        per_program[key] = per_program.get(key, 0) + r.keys_read()
    assert max(per_program.values()) == 12 + SMALL.block_q - 1               # a query block of 8 reads W + 7 keys
    assert sum(r.keys_read() for r in reads if r.seq == 0) == 12 * 2          # the decode: W keys per KV head
    assert not torch.isnan(out).any()


def test_split_count_follows_the_keys_a_window_leaves():
    # One 8K decode with 8 KV heads on a 132-SM GPU: the whole context would be cut into 32 ranges;
    # a window of 64 leaves one tile to read, which is not worth splitting.
    batch = AttentionBatch(num_tokens=1, num_q_heads=32, num_kv_heads=8, head_size=128, num_blocks=512,
                           block_size=16, query_start_loc=(0, 1), seq_lens=(8192,), fp8=False, scale=1.0,
                           k_scale=1.0, v_scale=1.0, causal=True)
    assert plan_launch(batch, num_sms=132).num_kv_splits == MAX_KV_SPLITS
    windowed = dataclasses.replace(batch, sliding_window=64)
    assert plan_launch(windowed, num_sms=132).num_kv_splits == 1


@pytest.mark.parametrize(("window", "message"), [
    (0, "sliding_window must be a positive integer"),
    (-3, "sliding_window must be a positive integer"),
    (2.5, "sliding_window must be a positive integer"),
    (True, "sliding_window must be a positive integer"),
])
def test_bad_windows_are_refused(window, message):
    batch = make_batch([20, 5], [2, 5], head_size=32)
    out = poisoned_out(batch)
    for fn in (paged_attention, paged_attention_ref):
        with pytest.raises(KernelInputError, match=message):
            fn(*batch.args(), sliding_window=window, out=out)
    assert torch.isnan(out).all()


def test_a_window_on_non_causal_attention_is_refused():
    batch = make_batch([20, 5], [2, 5], head_size=32)
    with pytest.raises(KernelInputError, match="sliding_window needs causal=True"):
        paged_attention(*batch.args(), sliding_window=4, causal=False)
    with pytest.raises(KernelInputError, match="sliding_window needs causal=True"):
        plan_launch(check_attention(*batch.args(), sliding_window=4, causal=False))
