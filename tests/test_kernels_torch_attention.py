"""paged_attention_torch (gather + SDPA) gives the reference's answer on every kind of batch, and checks first.

As in test_kernels_attention.py: fresh random inputs each run (the seed is in every failure
message), the output buffer poisoned with NaN, spare blocks and the slots past each sequence
holding NaN, so reading anything the block table does not name for a position fails.
"""

import random

import pytest
import torch
from kvlab.kernels import (
    PACKAGED_BATCHES,
    check_kernel,
    paged_attention_ref,
    paged_attention_torch,
    quantize_fp8,
    reshape_and_cache_ref,
    reshape_and_cache_torch,
)
from kvlab.kernels.batches import FP8_BOUND, TOLERANCE, fresh_seed, make_batch, poisoned_out, relative_error
from kvlab.kernels.torch_attention import visible_keys

from kvlab.errors import KernelInputError


def assert_matches_reference(batch, *, tolerance=None, **kwargs):
    out = poisoned_out(batch)
    returned = paged_attention_torch(*batch.args(), out=out, **kwargs)
    assert returned is out
    ref = paged_attention_ref(*batch.args(), **{k: v for k, v in kwargs.items() if k != "config"})
    error = relative_error(out, ref)
    limit = tolerance or TOLERANCE[batch.query.dtype]
    assert error < limit, f"relative error {error:.3g} >= {limit} (seed {batch.seed})"
    return out


@pytest.mark.parametrize(("seq_lens", "query_lens", "options"), [
    ([1, 15, 16, 17, 150], [1] * 5, dict(group=4)),                 # decodes around the block size
    ([5, 33], [5, 33], dict(group=2)),                               # whole prompts, causal
    ([50, 17, 1, 9], [20, 1, 1, 9], dict(group=4)),                  # a chunk over a cached prefix, decodes, a prompt
    ([23, 40], [3, 1], dict(group=1)),                               # MHA
    ([40, 21], [40, 21], dict(group=3)),                             # a group that is not a power of two
    ([23, 40], [3, 1], dict(group=8, num_kv_heads=1)),               # MQA
    ([70, 3], [2, 1], dict(head_size=128, block_size=64)),
    ([30, 7], [1, 7], dict(head_size=80)),                           # head size not a power of two
    ([64, 40, 35], [1, 5, 1], dict(table="shared")),                 # prefix-cache hit: shared physical blocks
    ([64, 40, 35], [1, 5, 1], dict(table="overlong")),               # columns past the last block point at NaN
    ([20, 5], [2, 5], dict(index_dtype=torch.int64)),
], ids=["decodes", "prefill", "mixed", "mha", "group3", "mqa", "head128-block64", "head80", "shared", "overlong",
        "int64"])
def test_matches_the_reference(seq_lens, query_lens, options):
    assert_matches_reference(make_batch(seq_lens, query_lens, **options))


def test_it_passes_every_packaged_batch_a_learners_kernel_is_checked_on():
    report = check_kernel(paged_attention_torch)
    assert report.passed, str(report)
    assert len(report.results) == len(PACKAGED_BATCHES)


@pytest.mark.parametrize(("window", "seq_lens", "query_lens"), [
    (1, [20, 5], [3, 5]),                         # each query sees itself only
    (10, [50, 17, 1, 9], [20, 1, 1, 9]),          # edge inside a block of 16, chunk + decodes + prompt
    (16, [40, 33], [1, 33]),                      # a window of exactly one block
    (64, [40, 12], [6, 1]),                       # longer than the context: nothing slides out
])
def test_sliding_windows(window, seq_lens, query_lens):
    assert_matches_reference(make_batch(seq_lens, query_lens, group=2), sliding_window=window)


def test_non_causal_attention_and_a_custom_scale():
    assert_matches_reference(make_batch([24, 10, 3], [6, 10, 1]), causal=False, scale=0.3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_return_their_dtype(dtype):
    batch = make_batch([40, 9], [4, 1], dtype=dtype, group=4)
    assert assert_matches_reference(batch).dtype == dtype


def test_random_batches_of_decodes_and_prefill_chunks():
    for _ in range(6):
        rng = random.Random(fresh_seed())
        num_seqs = rng.randint(1, 6)
        seq_lens = [rng.randint(1, 90) for _ in range(num_seqs)]
        query_lens = [rng.choice([1, 1, rng.randint(1, n)]) for n in seq_lens]
        options = dict(group=rng.choice([1, 2, 3, 4]), block_size=rng.choice([8, 16, 32]),
                       table=rng.choice(["scattered", "overlong"]))
        assert_matches_reference(make_batch(seq_lens, query_lens, **options))


def test_decodes_and_prefills_interleaved_land_in_their_own_rows():
    # prefill, decode, prefill, decode: the two batched calls must scatter back in token order
    batch = make_batch([12, 30, 7, 45], [12, 1, 7, 1], group=2)
    out = assert_matches_reference(batch)
    assert not out.isnan().any()


def test_fp8_cache_is_dequantized_as_the_reference_does():
    batch = make_batch([60, 21, 1], [1, 3, 1], group=4, dtype=torch.bfloat16)
    k_scale, v_scale = 0.05, 0.02
    key_cache, value_cache = quantize_fp8(batch.key_cache, k_scale), quantize_fp8(batch.value_cache, v_scale)
    rest = (batch.block_table, batch.seq_lens, batch.query_start_loc)
    out = paged_attention_torch(batch.query, key_cache, value_cache, *rest, k_scale=k_scale, v_scale=v_scale)
    ref = paged_attention_ref(batch.query, key_cache, value_cache, *rest, k_scale=k_scale, v_scale=v_scale)
    assert relative_error(out, ref) < 1e-2, f"seed {batch.seed}"
    assert relative_error(out, paged_attention_ref(*batch.args())) < FP8_BOUND, f"seed {batch.seed}"


def test_scheduling_arguments_are_accepted_and_change_nothing():
    batch = make_batch([130, 47, 1], [1, 1, 1], group=4)
    one = paged_attention_torch(*batch.args())
    assert torch.equal(paged_attention_torch(*batch.args(), num_kv_splits=3), one)


def test_table_entries_past_a_sequence_are_never_followed():
    # The checks look at the columns a sequence needs; whatever lies beyond must not be read.
    batch = make_batch([20, 5], [1, 5], block_size=16, table="overlong")
    batch.block_table[1, 1:] = 10**6                              # sequence 1 needs one block
    assert_matches_reference(batch)


def test_bad_input_raises_and_writes_nothing():
    batch = make_batch([20, 5], [1, 5])
    batch.block_table[0, 0] = batch.key_cache.shape[0]            # a block past the cache
    out = poisoned_out(batch)
    with pytest.raises(KernelInputError, match=r"block_table\[0, 0\]"):
        paged_attention_torch(*batch.args(), out=out)
    assert out.isnan().all()


def test_visible_keys_is_causal_with_context_and_stops_at_the_sequence():
    # sequence 0: 5 tokens, the last 2 are queries (positions 3 and 4); sequence 1: one decode over 2 tokens
    visible = visible_keys(torch.tensor([5, 2]), torch.tensor([2, 1]), max_query_len=2, max_seq_len=5, causal=True)
    assert visible[0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert visible[1, 0].int().tolist() == [1, 1, 0, 0, 0]
    assert torch.equal(visible[1, 1], visible[1, 0])              # a padding row copies the last real one: never empty
    window = visible_keys(torch.tensor([5]), torch.tensor([2]), max_query_len=2, max_seq_len=5, causal=True,
                          sliding_window=2)                       # position q sees q - 1 and q
    assert window[0].int().tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    full = visible_keys(torch.tensor([5, 2]), torch.tensor([2, 1]), max_query_len=2, max_seq_len=5, causal=False)
    assert full[0].all() and full[1, 0].int().tolist() == [1, 1, 0, 0, 0]


# ----------------------------------------------------------------- one plan per step, shared by every layer


def test_layers_of_one_step_share_one_plan_and_get_the_answer_they_would_alone():
    batch = make_batch([50, 17, 1, 9], [20, 1, 1, 9], group=2)
    layer2 = (batch.query * 0.5, batch.key_cache.flip(-1).contiguous(), batch.value_cache * 2)  # its own q, K, V
    plans = {}
    first = paged_attention_torch(*batch.args(), plans=plans)
    second = paged_attention_torch(*layer2, *batch.args()[3:], plans=plans)
    assert len(plans) == 1                                                # the second layer reused the first's
    assert torch.equal(first, paged_attention_torch(*batch.args()))      # bit for bit what no plan gives
    assert torch.equal(second, paged_attention_torch(*layer2, *batch.args()[3:]))
    paged_attention_torch(*batch.args(), sliding_window=4, plans=plans)   # another window: a plan of its own
    assert len(plans) == 2


def test_a_shared_plan_still_refuses_a_layer_whose_tensors_differ():
    batch = make_batch([20, 5], [1, 5], group=2)
    plans = {}
    paged_attention_torch(*batch.args(), plans=plans)
    wrong = batch.key_cache[:, :, :, :8]                                  # another head size: checked afresh
    with pytest.raises(KernelInputError):
        paged_attention_torch(batch.query, wrong, wrong, *batch.args()[3:], plans=plans)


def test_the_torch_cache_write_is_the_references_and_checks_its_slots_once():
    batch = make_batch([20, 5], [1, 5])
    key, value = batch.query[:, :2].clone(), batch.query[:, 2:4].clone()  # [6, 2, D] for a cache of 2 KV heads
    slots = torch.tensor([3, 40, 41, 42, 43, 44])
    caches = [(batch.key_cache.clone(), batch.value_cache.clone()) for _ in range(3)]
    reshape_and_cache_ref(key, value, *caches[0], slots)
    plans = {}
    reshape_and_cache_torch(key, value, *caches[1], slots, plans=plans)
    reshape_and_cache_torch(key, value, *caches[2], slots, plans=plans)  # a second layer: the same plan
    assert len(plans) == 1
    for k, v in caches[1:]:
        assert torch.equal(k.nan_to_num(7.0), caches[0][0].nan_to_num(7.0))
        assert torch.equal(v.nan_to_num(7.0), caches[0][1].nan_to_num(7.0))
    with pytest.raises(KernelInputError, match="shares memory"):          # aliasing is checked on every call
        reshape_and_cache_torch(key, value, caches[1][0], caches[1][0], slots, plans=plans)
