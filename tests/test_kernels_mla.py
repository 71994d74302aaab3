"""mla_decode (the Triton kernel) agrees with mla_decode_ref on every kind of decode batch over a latent cache.

The batches come from ``kvlab.kernels.batches.make_batch`` with one "KV head" of ``kv_lora_rank +
rope_dim`` values: its key cache is the latent cache, whose spare blocks and the slots past each
sequence hold NaN, so reading anything the block table does not name fails. The query is cut into
its latent and rope parts (strided views, as the engine passes them). Each test poisons the output
with NaN and measures ``‖out − ref‖ / ‖ref‖``. Shapes stay tiny: on CPU every program runs
through Triton's interpreter, one after another.
"""

import pytest
import torch
from kvlab.kernels import KernelConfig, mla_decode, mla_decode_ref, quantize_fp8
from kvlab.kernels.batches import FP8_BOUND, TOLERANCE, make_batch, relative_error

RANK, ROPE = 32, 8
SCALE = 0.25


def mla_batch(seq_lens, *, num_heads=4, rank=RANK, rope=ROPE, **kwargs):
    """``(q_latent, q_pe, kv_cache, block_table, seq_lens, seed)``: one decode token per sequence."""
    b = make_batch(seq_lens, [1] * len(seq_lens), num_kv_heads=1, group=num_heads, head_size=rank + rope, **kwargs)
    kv_cache = b.key_cache[:, :, 0]                                  # [num_blocks, block_size, rank + rope]
    return b.query[..., :rank], b.query[..., rank:], kv_cache, b.block_table, b.seq_lens, b.seed


def assert_decode_matches(batch, *, tolerance=None, **kwargs):
    q_latent, q_pe, kv_cache, block_table, seq_lens, seed = batch
    out = torch.full_like(q_latent, float("nan"))
    mla_decode(q_latent, q_pe, kv_cache, block_table, seq_lens, scale=SCALE, out=out, **kwargs)
    ref = mla_decode_ref(q_latent, q_pe, kv_cache, block_table, seq_lens, scale=SCALE,
                         **{k: v for k, v in kwargs.items() if k != "config"})
    error = relative_error(out, ref)
    limit = tolerance or TOLERANCE[q_latent.dtype]
    assert error < limit, f"relative error {error:.3g} >= {limit} (seed {seed})"
    return out


@pytest.mark.parametrize("tile_n", [16, 32])
def test_lengths_around_block_and_tile_edges(tile_n):
    # blocks of 16: 1, one short of a block, a block, one past it, around two tiles of 16 and 32, and long
    batch = mla_batch([1, 15, 16, 17, 31, 32, 33, 70], block_size=16)
    assert_decode_matches(batch, config=KernelConfig(block_q=1, block_m=16, tile_n=tile_n))


@pytest.mark.parametrize("num_heads", [4, 16, 20])
def test_several_heads_per_program_and_a_partial_head_block(num_heads):
    # 4 heads fill 4 of 16 rows; 16 fill one program exactly; 20 need a second, partial head block
    batch = mla_batch([40, 9], num_heads=num_heads)
    assert_decode_matches(batch, config=KernelConfig(block_q=1, block_m=16, tile_n=16))


def test_split_kv_gives_the_same_answer_as_one_pass():
    # 2, 3 (not a power of two) and 8 splits (more than a short sequence has tiles: empty ranges weigh 0)
    batch = mla_batch([130, 47, 1], num_heads=4)
    config = KernelConfig(block_q=1, block_m=16, tile_n=16)
    one = assert_decode_matches(batch, num_kv_splits=1, config=config)
    for splits in (2, 3, 8):
        split = assert_decode_matches(batch, num_kv_splits=splits, config=config)
        assert relative_error(split, one) < 1e-5, f"{splits} splits differ from one pass (seed {batch[-1]})"


@pytest.mark.parametrize("table", ["shared", "overlong"])
def test_shared_prefix_blocks_and_overlong_tables(table):
    batch = mla_batch([64, 40, 35], table=table)
    assert_decode_matches(batch, config=KernelConfig(block_q=1, block_m=16, tile_n=16))


def test_a_rank_and_rope_that_are_not_powers_of_two_and_int64_indices():
    batch = mla_batch([23, 50], rank=24, rope=6, index_dtype=torch.int64)
    assert_decode_matches(batch)


def test_the_default_tiles_on_larger_blocks():
    batch = mla_batch([100, 64, 3], block_size=64, num_heads=8)
    assert_decode_matches(batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    batch = mla_batch([40, 9], dtype=dtype)
    assert_decode_matches(batch, config=KernelConfig(block_q=1, block_m=16, tile_n=16))


def test_an_fp8_latent_cache_is_dequantized_with_its_scale():
    q_latent, q_pe, kv_cache, block_table, seq_lens, seed = mla_batch([60, 21, 1], dtype=torch.bfloat16)
    k_scale = 0.05
    fp8_cache = quantize_fp8(kv_cache, k_scale)
    batch = (q_latent, q_pe, fp8_cache, block_table, seq_lens, seed)
    out = assert_decode_matches(batch, k_scale=k_scale, config=KernelConfig(block_q=1, block_m=16, tile_n=16))
    unquantized = mla_decode_ref(q_latent, q_pe, kv_cache, block_table, seq_lens, scale=SCALE)
    assert relative_error(out, unquantized) < FP8_BOUND, f"seed {seed}"     # e4m3 rounding of the latents


def test_the_plan_says_which_tiles_each_split_walks_and_some_splits_get_none():
    from kvlab.kernels.mla_checks import check_mla_decode
    from kvlab.kernels.mla_grid import plan_mla_decode

    q_latent, q_pe, kv_cache, block_table, seq_lens, _ = mla_batch([130, 47, 1], num_heads=20)
    batch = check_mla_decode(q_latent, q_pe, kv_cache, block_table, seq_lens, scale=SCALE)
    plan = plan_mla_decode(batch, num_kv_splits=3, config=KernelConfig(block_q=1, block_m=16, tile_n=16))
    assert plan.grid == (3, 2, 3)                                    # sequences x head blocks (16 + 4) x splits
    assert plan.tile_ranges(0) == [range(0, 3), range(3, 6), range(6, 9)]      # 130 latents: 9 tiles of 16
    assert plan.tile_ranges(1) == [range(0, 1), range(1, 2), range(2, 3)]
    assert plan.tile_ranges(2) == [range(0, 1), range(1, 1), range(1, 1)]      # one tile; two empty splits


def test_the_mutant_that_drops_the_rope_part_of_the_score_is_caught():
    # kvlab.kernels.mutants' mla_rope_dropped scores q_latent · c_kv alone: the position part of every score is lost
    from kvlab.kernels import mutants

    batch = mla_batch([17, 40], block_size=16)
    assert_decode_matches(batch)
    q_latent, q_pe, kv_cache, block_table, seq_lens, seed = batch
    broken = mutants.load_mutant("mla_rope_dropped").mla_decode_triton(
        q_latent, q_pe, kv_cache, block_table, seq_lens, scale=SCALE)
    ref = mla_decode_ref(q_latent, q_pe, kv_cache, block_table, seq_lens, scale=SCALE)
    assert relative_error(broken, ref) > 100 * TOLERANCE[q_latent.dtype], f"seed {seed}"
