"""paged_attention (the Triton kernel) agrees with paged_attention_ref on every kind of batch.

Each test draws fresh random inputs, poisons the output with NaN and measures
``‖out − ref‖ / ‖ref‖``: float32 under 1e-4, fp16/bf16 under 1e-2, FP8 against the unquantized
reference under ``FP8_BOUND``. Spare blocks and the slots past each sequence hold NaN, so reading
anything the block table does not name for a position fails too. Shapes stay tiny: on CPU every
program runs through Triton's interpreter, one after another.
"""

import pytest
import torch
from kvlab.kernels import KernelConfig, paged_attention, paged_attention_ref, quantize_fp8
from kvlab.kernels.batches import FP8_BOUND, TOLERANCE, make_batch, poisoned_out, relative_error


def assert_matches_reference(batch, *, tolerance=None, **kwargs):
    out = paged_attention(*batch.args(), out=poisoned_out(batch), **kwargs)
    ref = paged_attention_ref(*batch.args(), **{k: v for k, v in kwargs.items() if k != "config"})
    error = relative_error(out, ref)
    limit = tolerance or TOLERANCE[batch.query.dtype]
    assert error < limit, f"relative error {error:.3g} >= {limit} (seed {batch.seed})"
    return out


def test_decode_over_lengths_around_the_block_size():
    # 1, block_size - 1, block_size, block_size + 1 and a long one, one decode token each.
    batch = make_batch([1, 15, 16, 17, 150], [1] * 5, block_size=16, group=4)
    assert_matches_reference(batch)


def test_prefill_of_whole_prompts_is_causal():
    batch = make_batch([5, 33], [5, 33], group=2)
    assert_matches_reference(batch)


def test_mixed_batch_chunked_prefill_over_a_cached_prefix_and_decodes():
    # a 20-token chunk after 30 cached tokens, two decodes, a fresh 9-token prompt
    batch = make_batch([50, 17, 1, 9], [20, 1, 1, 9], group=4)
    assert_matches_reference(batch)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_ratios(group):
    batch = make_batch([23, 40], [3, 1], num_kv_heads=2, group=group)
    assert_matches_reference(batch)


def test_a_group_that_does_not_divide_the_rows():
    # 3 query heads per KV head: 16 query tokens x 3 heads fill 48 of 64 rows; the other 16 rows
    # must not be mistaken for the next tokens.
    batch = make_batch([40, 21], [40, 21], num_kv_heads=2, group=3)
    assert_matches_reference(batch)


@pytest.mark.parametrize(("head_size", "block_size"), [(64, 64), (128, 16), (128, 64)])
def test_head_sizes_and_block_sizes(head_size, block_size):
    batch = make_batch([70, 3], [2, 1], head_size=head_size, block_size=block_size, num_kv_heads=1, group=4)
    assert_matches_reference(batch)


def test_head_size_that_is_not_a_power_of_two():
    batch = make_batch([30, 7], [1, 7], head_size=80, group=2)
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    batch = make_batch([40, 9], [4, 1], dtype=dtype, group=4)
    assert_matches_reference(batch)


@pytest.mark.parametrize("table", ["shared", "overlong"])
def test_shared_prefix_blocks_and_overlong_tables(table):
    # shared: every sequence starts with the same physical blocks (a prefix-cache hit);
    # overlong: columns past the last needed block point at NaN blocks and must never be read.
    batch = make_batch([64, 40, 35], [1, 5, 1], table=table, group=2)
    if table == "shared":
        assert torch.equal(batch.block_table[0, :1], batch.block_table[1, :1])
    assert_matches_reference(batch)


def test_int64_index_tensors():
    batch = make_batch([20, 5], [2, 5], index_dtype=torch.int64)
    assert_matches_reference(batch)


def test_non_causal_attention_and_a_custom_scale():
    batch = make_batch([24, 10], [6, 10])
    assert_matches_reference(batch, causal=False, scale=0.3)


def test_split_kv_gives_the_same_answer_as_one_pass():
    # decode batch: 1, 2 (auto would pick 1 on CPU), 3 (not a power of two) and 16 splits (more
    # splits than tiles: some ranges are empty and must merge as weight 0)
    batch = make_batch([130, 47, 1], [1, 1, 1], group=4)
    one = assert_matches_reference(batch, num_kv_splits=1)
    for splits in (2, 3, 16):
        split = assert_matches_reference(batch, num_kv_splits=splits)
        assert relative_error(split, one) < 1e-5, f"{splits} splits differ from one pass (seed {batch.seed})"


def test_split_kv_on_a_mixed_batch():
    # A fresh 40-token prompt in blocks of 32 queries and tiles of 16 keys: the second split holds
    # keys 16..31, which the first 16 queries of the block may not see (their partial is empty).
    batch = make_batch([40, 18], [40, 1], group=2)
    assert_matches_reference(batch, num_kv_splits=2, config=KernelConfig(block_q=32, block_m=64, tile_n=16))


@pytest.mark.parametrize("config", [
    KernelConfig(block_q=16, block_m=16, tile_n=16),    # one query head per KV head: 16 tokens per program
    KernelConfig(block_q=2, block_m=16, tile_n=128),    # a tile spans 8 blocks of 16
])
def test_other_tile_shapes(config):
    batch = make_batch([45, 20], [19, 1], num_kv_heads=2, group=1 if config.block_q == 16 else 4)
    assert_matches_reference(batch, config=config)


def test_tiles_smaller_than_a_block():
    batch = make_batch([100, 64], [1, 3], block_size=64, group=2)
    assert_matches_reference(batch, config=KernelConfig(block_q=8, block_m=16, tile_n=16))


def test_fp8_cache_matches_the_reference_and_stays_close_to_the_unquantized_answer():
    batch = make_batch([60, 21, 1], [1, 3, 1], group=4, dtype=torch.bfloat16)
    k_scale, v_scale = 0.05, 0.02
    fp8 = dict(key_cache=quantize_fp8(batch.key_cache, k_scale), value_cache=quantize_fp8(batch.value_cache, v_scale))
    rest = (batch.block_table, batch.seq_lens, batch.query_start_loc)
    out = paged_attention(batch.query, fp8["key_cache"], fp8["value_cache"], *rest,
                          k_scale=k_scale, v_scale=v_scale, out=poisoned_out(batch))
    ref_fp8 = paged_attention_ref(batch.query, fp8["key_cache"], fp8["value_cache"], *rest,
                                  k_scale=k_scale, v_scale=v_scale)
    assert relative_error(out, ref_fp8) < 1e-2, f"seed {batch.seed}"
    unquantized = paged_attention_ref(*batch.args())
    assert relative_error(out, unquantized) < FP8_BOUND, f"seed {batch.seed}"


def test_fp8_error_bound_is_what_was_measured():
    # The bound FP8_BOUND states: e4m3 with scale 1.0 on standard-normal K/V, 40 fresh batches.
    worst = 0.0
    for _ in range(40):
        batch = make_batch([48, 40, 33, 10], [1, 1, 1, 1], group=4)
        kq, vq = quantize_fp8(batch.key_cache, 1.0), quantize_fp8(batch.value_cache, 1.0)
        rest = batch.args()[3:]
        worst = max(worst, relative_error(paged_attention_ref(batch.query, kq, vq, *rest),
                                          paged_attention_ref(*batch.args())))
    assert 0.01 < worst < FP8_BOUND
