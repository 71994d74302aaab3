"""The per-program view (``kvlab.kernels.program_view``): what each program loaded and stored, and nothing else.

It is checked against what a kernel's code says it touches, and against the paged attention
kernel's own record of its reads (its ``TRACE`` switch): the two must name the same elements.
"""

import inspect

import kvlab.kernels as K
import pytest
import torch

pytestmark = pytest.mark.skipif(K.backend() != K.TRITON_INTERPRETER, reason="the view runs Triton's interpreter")

if K.backend() == K.TRITON_INTERPRETER:
    import triton
    import triton.language as tl
    from kvlab.kernels.program_view import traced_launch

    @triton.jit
    def _shifted_copy(src_ptr, dst_ptr, n, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(src_ptr + offsets - SHIFT, mask=offsets < n, other=0.0)
        tl.store(dst_ptr + offsets, values, mask=offsets < n)

    @triton.jit
    def _load_row(ptr, row, WIDTH: tl.constexpr):
        return tl.load(ptr + row * WIDTH + tl.arange(0, WIDTH))

    @triton.jit
    def _row_sums(src_ptr, dst_ptr, WIDTH: tl.constexpr):
        row = tl.program_id(0)
        tl.store(dst_ptr + row, tl.sum(_load_row(src_ptr, row, WIDTH), axis=0))   # the load is in a helper


def test_each_program_loads_and_stores_its_own_block_and_masked_lanes_are_not_accesses():
    src, dst = torch.arange(20, dtype=torch.float32), torch.zeros(20)
    trace = traced_launch(_shifted_copy, (3,), {"src_ptr": src, "dst_ptr": dst}, {"n": 20}, {"SHIFT": 0, "BLOCK": 8})
    assert torch.equal(dst, src)                                             # the launch itself ran as usual
    assert trace.busy() == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert trace.touched((1,), "load", "src_ptr") == {(i,) for i in range(8, 16)}
    assert trace.touched((2,), "store", "dst_ptr") == {(i,) for i in range(16, 20)}   # lanes 20-23 are masked off
    assert trace.touched((2,), "load", "dst_ptr") == set() and not trace.outside
    assert "········████████····" in trace.picture((1,), "src_ptr", rows=0)


def test_an_access_outside_every_tensor_is_counted_not_attributed():
    buffer = torch.zeros(40)
    src, dst = buffer[8:28], torch.zeros(20)                                 # 8 elements of ours before src
    trace = traced_launch(_shifted_copy, (1,), {"src_ptr": src, "dst_ptr": dst}, {"n": 20}, {"SHIFT": 3, "BLOCK": 8})
    assert trace.touched((0,), "load", "src_ptr") == {(i,) for i in range(5)}
    assert trace.outside == {(0, 0, 0): 3}                                   # src[-3..-1]: in no tensor given


def test_loads_inside_a_helper_the_kernel_calls_are_seen():
    src, dst = torch.arange(32, dtype=torch.float32).reshape(2, 16), torch.zeros(2)
    trace = traced_launch(_row_sums, (2,), {"src_ptr": src, "dst_ptr": dst}, {}, {"WIDTH": 16})
    assert trace.touched((1,), "load", "src_ptr") == {(1, c) for c in range(16)}
    assert trace.summary((1,), "load", "src_ptr", 0, 1, ("row", "column")) == "row 1 column 0-15"


def test_the_view_of_the_paged_attention_kernel_agrees_with_its_own_trace():
    from kvlab.kernels.attention import kernel_constants, paged_attention_kernel, trace_reads
    from kvlab.kernels.batches import make_batch

    batch = make_batch([21, 9], [1, 9], num_kv_heads=2, group=2, head_size=16, block_size=4, seed=3, device="cpu")
    config = K.KernelConfig(block_q=8, block_m=16, tile_n=16)
    plan, _, own = trace_reads(*batch.args(), num_kv_splits=1, config=config)
    b, out, unused = plan.batch, torch.empty_like(batch.query), torch.empty(1)    # no split buffers, no trace
    values = [out, unused, unused.clone(), unused.clone(), unused.clone(), batch.query, batch.key_cache,
              batch.value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
              b.scale * 1.4426950408889634, 1.0, 1.0, b.num_seqs,
              *batch.query.stride()[:2], *out.stride()[:2], *batch.key_cache.stride()[:3],
              *batch.value_cache.stride()[:3], batch.block_table.stride(0)]
    names = list(inspect.signature(paged_attention_kernel.fn).parameters)
    args = dict(zip(names, values, strict=False))
    tensors = {n: v for n, v in args.items() if isinstance(v, torch.Tensor)}
    scalars = {n: v for n, v in args.items() if n not in tensors}
    constants = kernel_constants(plan, batch.query.dtype)
    trace = traced_launch(paged_attention_kernel, plan.grid, tensors, scalars, constants)
    checked = 0
    for program in trace.programs():
        x, y, z = program
        reads = own[x, y, z].reshape(-1, 2)
        expected = {(int(blk), int(off)) for blk, off in reads.tolist() if blk >= 0}
        seen = {(blk, slot) for blk, slot, head, _ in trace.touched(program, "load", "key_cache_ptr")}
        heads = {head for _, _, head, _ in trace.touched(program, "load", "key_cache_ptr")}
        assert seen == expected, program
        assert heads <= {y}                                                  # a program reads its own KV head only
        checked += bool(expected)
    assert checked == len([p for p in trace.busy() if trace.touched(p, "load", "key_cache_ptr")]) > 0
