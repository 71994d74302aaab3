"""The legacy CUDA kernel's thread layout, as ``attention_kernels.cuh`` (vLLM v0.6.6) computes it.

The worked examples are the source article's (002 §4.2) and its K-layout section's FP8 case; the
invariants are what the kernel relies on: every key of a block has its thread group, every KV block
its warp, every head dimension its lane, and a thread group loads 16 bytes at a time.
"""

import itertools

import pytest
from kvlab.kernels import compare_work_division, cuda_thread_layout
from kvlab.kernels.legacy_layout import COMPILED_BLOCK_SIZES, COMPILED_HEAD_SIZES

from kvlab.errors import KernelInputError, KvlabValueError

COMPILED = [cuda_thread_layout(h, b, d, cache_dtype_bytes=c)
            for h, b, d in itertools.product(COMPILED_HEAD_SIZES, COMPILED_BLOCK_SIZES, (2, 4))
            for c in sorted({d, 1}) if h % (16 // c) == 0]


def test_bf16_head_128_block_16_every_value():
    layout = cuda_thread_layout(head_size=128, block_size=16, dtype_bytes=2)
    assert (layout.THREAD_GROUP_SIZE, layout.NUM_THREAD_GROUPS, layout.NUM_TOKENS_PER_THREAD_GROUP,
            layout.NUM_WARPS) == (2, 64, 1, 4)
    assert (layout.VEC_SIZE, layout.NUM_ELEMS_PER_THREAD, layout.NUM_VECS_PER_THREAD, layout.x) == (4, 64, 16, 8)
    assert (layout.V_VEC_SIZE, layout.NUM_V_VECS_PER_ROW, layout.NUM_ROWS_PER_ITER,
            layout.NUM_ROWS_PER_THREAD) == (8, 2, 16, 8)
    assert layout.compiled
    assert layout.article_rows_per_thread == 4 != layout.NUM_ROWS_PER_THREAD      # the article's 128 / 32


def test_block_8_is_where_the_article_s_four_rows_hold():
    layout = cuda_thread_layout(128, 8, 2)
    assert (layout.THREAD_GROUP_SIZE, layout.VEC_SIZE, layout.NUM_V_VECS_PER_ROW, layout.NUM_ROWS_PER_ITER) == \
        (4, 2, 1, 32)
    assert layout.NUM_ROWS_PER_THREAD == layout.article_rows_per_thread == 4


def test_head_size_over_warp_size_holds_exactly_when_one_v_vector_spans_a_block_row():
    whole = [layout for layout in COMPILED if layout.head_size % 32 == 0]     # where HEAD_SIZE / WARP_SIZE is whole
    for layout in whole:
        one_vector = layout.block_size <= 16 // layout.dtype_bytes
        assert (layout.article_rows_per_thread == layout.NUM_ROWS_PER_THREAD) == one_vector, layout
        assert -(-layout.head_size * layout.NUM_V_VECS_PER_ROW // 32) == layout.NUM_ROWS_PER_THREAD
    holds = {(layout.block_size, layout.dtype_bytes) for layout in whole
             if layout.article_rows_per_thread == layout.NUM_ROWS_PER_THREAD}
    assert holds == {(8, 2)}                            # of the compiled block sizes, only fp16/bf16 at 8


def test_fp8_cache_widens_x_but_not_the_vectors_which_follow_the_query_dtype():
    fp8 = cuda_thread_layout(128, 16, 2, cache_dtype_bytes=1)
    bf16 = cuda_thread_layout(128, 16, 2)
    assert fp8.x == 16 and bf16.x == 8
    assert fp8.VEC_SIZE == bf16.VEC_SIZE == 4 and fp8.V_VEC_SIZE == bf16.V_VEC_SIZE == 8
    assert fp8.THREAD_GROUP_SIZE * fp8.VEC_SIZE == 8 != fp8.x           # the source's "x == TGS * VEC_SIZE": kAuto only
    assert fp8.NUM_ROWS_PER_THREAD == 8


def test_six_blocks_over_four_warps():
    layout = cuda_thread_layout(128, 16, 2)
    assert layout.warp_blocks(6) == ((0, 4), (1, 5), (2,), (3,))


@pytest.mark.parametrize("num_blocks", [1, 3, 4, 6, 17, 64])
def test_each_kv_block_has_exactly_one_warp(num_blocks):
    layout = cuda_thread_layout(128, 16, 2)
    blocks = [b for warp in layout.warp_blocks(num_blocks) for b in warp]
    assert sorted(blocks) == list(range(num_blocks))
    assert all(b % layout.NUM_WARPS == w for w, warp in enumerate(layout.warp_blocks(num_blocks)) for b in warp)


def test_invariants_of_every_compiled_instantiation():
    for layout in COMPILED:
        assert layout.VEC_SIZE * layout.THREAD_GROUP_SIZE * layout.dtype_bytes == 16      # one 16-byte load per group
        assert layout.head_size == layout.NUM_VECS_PER_THREAD * layout.VEC_SIZE * layout.THREAD_GROUP_SIZE
        assert layout.x * layout.cache_dtype_bytes == 16
        assert layout.block_size == layout.V_VEC_SIZE * layout.NUM_V_VECS_PER_ROW
        assert layout.warp_size == layout.NUM_ROWS_PER_ITER * layout.NUM_V_VECS_PER_ROW
        warp_groups = layout.warp_size // layout.THREAD_GROUP_SIZE
        for w in range(layout.NUM_WARPS):                    # each warp's groups cover its block's keys once
            tokens = [t for g in range(w * warp_groups, (w + 1) * warp_groups) for t in layout.group_tokens(g)]
            assert sorted(tokens) == list(range(layout.block_size)), layout
        leaders = [lane for lane in range(layout.warp_size) if lane % layout.NUM_V_VECS_PER_ROW == 0]
        rows = [r for lane in leaders for r in layout.lane_rows(lane)]
        assert sorted(rows) == list(range(layout.head_size)), layout   # every output row written once


def test_larger_blocks_give_a_group_several_tokens():
    layout = cuda_thread_layout(128, 64, 2)                          # not compiled, but the arithmetic holds
    assert not layout.compiled
    assert (layout.THREAD_GROUP_SIZE, layout.NUM_TOKENS_PER_THREAD_GROUP) == (1, 2)
    assert layout.group_tokens(33) == (33, 1)
    assert layout.NUM_ROWS_PER_THREAD == 32


@pytest.mark.parametrize("kwargs, names", [
    (dict(head_size=0, block_size=16, dtype_bytes=2), "head_size"),
    (dict(head_size=128, block_size=True, dtype_bytes=2), "block_size"),
    (dict(head_size=128, block_size=16, dtype_bytes=1), "dtype_bytes"),
    (dict(head_size=128, block_size=16, dtype_bytes=2, cache_dtype_bytes=4), "cache_dtype_bytes"),
    (dict(head_size=128, block_size=16, dtype_bytes=2, num_threads=100), "num_threads"),
    (dict(head_size=128, block_size=12, dtype_bytes=2), "block_size"),
    (dict(head_size=100, block_size=16, dtype_bytes=2), "head_size"),
    (dict(head_size=72, block_size=16, dtype_bytes=2, cache_dtype_bytes=1), "head_size"),
    (dict(head_size=128, block_size=16, dtype_bytes="2"), "dtype_bytes"),
])
def test_refused_inputs_name_the_parameter(kwargs, names):
    with pytest.raises(KernelInputError, match=names) as info:
        cuda_thread_layout(**kwargs)
    assert isinstance(info.value, KvlabValueError)


def test_refused_indices():
    layout = cuda_thread_layout(128, 16, 2)
    with pytest.raises(KernelInputError, match="num_blocks"):
        layout.warp_blocks(0)
    with pytest.raises(KernelInputError, match="lane"):
        layout.lane_rows(32)
    with pytest.raises(KernelInputError, match="thread_group_idx"):
        layout.group_tokens(64)


def test_work_division_against_kvlab_s_triton_kernel():
    cuda, triton = compare_work_division(num_seqs=1, num_q_heads=32, num_kv_heads=8, head_size=128,
                                         block_size=16, seq_len=96)
    assert (cuda.grid, cuda.programs, cuda.query_heads_per_program) == ((32, 1, 1), 32, 1)
    assert (cuda.keys_per_step, cuda.steps) == (64, 2)               # 4 warps x one 16-token block
    assert (triton.grid, triton.programs, triton.query_heads_per_program) == ((1, 8, 1), 8, 4)
    assert (triton.keys_per_step, triton.steps) == (64, 2)           # TILE_N = 64 keys = 4 blocks of 16
    assert cuda.kv_block_reads == 32 * 6 and triton.kv_block_reads == 8 * 6   # GQA packing reads 4x fewer
    with pytest.raises(KernelInputError, match="num_kv_heads"):
        compare_work_division(1, 32, 6, 128, 16, 96)
