"""The benchmark measures what it says: the issue's shapes, the bytes it counts, and a run that works on CPU."""

from kvlab.kernels import TRITON_CUDA, backend
from kvlab.kernels.bench import Shape, gpu_shapes, run, smoke_shapes

GiB = 1024**3


def test_the_gpu_shapes_are_the_issues_grid():
    shapes = gpu_shapes()
    decode = [s for s in shapes if s.kind == "decode"]
    assert {(s.batch, s.context, s.block_size) for s in decode} == {
        (b, c, bs) for b in (1, 16, 64, 256) for c in (1024, 8192, 32768) for bs in (16, 64)}
    assert all((s.num_q_heads, s.num_kv_heads, s.head_size, str(s.dtype)) == (32, 8, 128, "torch.bfloat16")
               for s in shapes)
    assert [s.kind for s in shapes].count("prefill") == 1


def test_bytes_moved_count_kv_once_plus_query_and_output():
    goal = Shape(64, 8192, 16)                                    # the goal shape: batch 64 x 8K, bf16
    assert goal.kv_bytes == 2 * GiB                               # K and V: 64 x 8192 x 8 heads x 128 x 2 B x 2
    assert goal.bytes_moved == goal.kv_bytes + 2 * 64 * 32 * 128 * 2


def test_a_smoke_run_agrees_with_sdpa_and_does_not_call_itself_performance():
    results = run(smoke_shapes())
    (row,) = results["rows"]
    assert row["rel_error_vs_sdpa"] < 1e-4
    assert results["performance"] == (backend() == TRITON_CUDA)
