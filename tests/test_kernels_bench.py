"""The benchmark measures what it says: the issue's shapes, the bytes it counts, and a run that works on CPU."""

import dataclasses
import json

import pytest
from kvlab.kernels import TRITON_CUDA, backend, bench
from kvlab.kernels.bench import (
    GOAL_COPY_FRACTION,
    GOAL_SHAPE,
    Shape,
    gpu_shapes,
    run,
    smoke_shapes,
    verdict,
    verdict_line,
)

from kvlab.errors import KernelInputError

GiB = 1024**3


def test_the_gpu_shapes_are_the_issues_grid():
    shapes = gpu_shapes()
    decode = [s for s in shapes if s.kind == "decode" and s.sliding_window is None]
    assert {(s.batch, s.context, s.block_size) for s in decode} == {
        (b, c, bs) for b in (1, 16, 64, 256) for c in (1024, 8192, 32768) for bs in (16, 64)}
    assert all((s.num_q_heads, s.num_kv_heads, s.head_size, str(s.dtype)) == (32, 8, 128, "torch.bfloat16")
               for s in shapes)
    assert [s.kind for s in shapes].count("prefill") == 1


def test_bytes_moved_count_kv_once_plus_query_and_output():
    goal = Shape(64, 8192, 16)                                    # the goal shape: batch 64 x 8K, bf16
    assert goal.kv_bytes == 2 * GiB                               # K and V: 64 x 8192 x 8 heads x 128 x 2 B x 2
    assert goal.bytes_moved == goal.kv_bytes + 2 * 64 * 32 * 128 * 2


def test_windowed_decodes_count_only_the_window_and_compare_with_sdpa_on_it():
    windowed = [s for s in gpu_shapes() if s.sliding_window]
    assert {(s.batch, s.context, s.sliding_window) for s in windowed} == {(1, 32768, 4096), (64, 32768, 4096)}
    w = Shape(64, 32768, 16, sliding_window=4096)
    assert w.kv_bytes == Shape(64, 4096, 16).kv_bytes and w.cache_bytes == Shape(64, 32768, 16).kv_bytes
    assert w.flops == Shape(64, 4096, 16).flops and "window4096" in w.name
    with pytest.raises(KernelInputError, match="decode shapes only"):
        Shape(4, 2048, 16, query_len=2048, sliding_window=512)


def test_a_smoke_run_agrees_with_sdpa_and_does_not_call_itself_performance():
    results = run(smoke_shapes())
    assert [r["sliding_window"] for r in results["rows"]] == [None, 24]
    for row in results["rows"]:
        assert row["rel_error_vs_sdpa"] < 1e-4, row
    assert results["performance"] == (backend() == TRITON_CUDA)


def test_the_goal_shape_runs_first_so_a_run_cut_short_still_has_it():
    assert gpu_shapes()[0] == GOAL_SHAPE == Shape(64, 8192, 16)
    assert len(set(gpu_shapes())) == len(gpu_shapes())


def test_a_shape_that_fails_is_recorded_and_the_rest_still_run(monkeypatch):
    real = bench.bench_shape

    def flaky(shape, *args, **kwargs):
        if shape.batch == 3:
            raise RuntimeError("out of resources: shared memory")
        return real(shape, *args, **kwargs)

    monkeypatch.setattr(bench, "bench_shape", flaky)
    tiny = smoke_shapes()[0]
    results = run([dataclasses.replace(tiny, batch=3), tiny])
    failed, ok = results["rows"]
    assert failed == {"shape": "decode b3 ctx64 bs16", "error": "RuntimeError: out of resources: shared memory"}
    assert ok["rel_error_vs_sdpa"] < 1e-4
    assert results["verdict"]["failed"] == ["decode b3 ctx64 bs16"]


def test_the_verdict_reads_both_goals_off_the_rows():
    def row(shape, fraction, speedup, graph_speedup=None):
        r = {"shape": shape, "kernel_us": 1.0, "copy_fraction": fraction, "speedup_vs_sdpa": speedup,
             "rel_error_vs_sdpa": 3e-3}
        return r if graph_speedup is None else {**r, "speedup_vs_sdpa_graph": graph_speedup}

    rows = [row(GOAL_SHAPE.name, 0.83, 1.4, 1.3), row("decode b1 ctx1024 bs16", 0.05, 0.7, 1.1),
            {"shape": "decode b256 ctx32768 bs64", "skipped": "does not fit in free GPU memory"}]
    v = verdict({"rows": rows})
    assert v["goal_met"] and v["goal_copy_fraction"] == 0.83
    assert v["slower_than_sdpa"] == ["decode b1 ctx1024 bs16"] and v["slower_than_sdpa_in_graphs"] == []
    assert v["failed"] == ["decode b256 ctx32768 bs64"] and v["wrong"] == []
    rows[0]["copy_fraction"] = GOAL_COPY_FRACTION - 0.01
    assert not verdict({"rows": rows})["goal_met"]
    assert verdict({"rows": rows[1:]})["goal_copy_fraction"] is None     # the goal shape never ran
    assert verdict_line(v) == (
        "goal shape decode b64 ctx8192 bs16: 83% of copy bandwidth (goal 80%), met; slower than SDPA at decode "
        "b1 ctx1024 bs16 (kernels alone, in CUDA graphs: no shape); failed: decode b256 ctx32768 bs64; "
        "wrong output: none")
    assert verdict_line(verdict({"rows": []})) == ("goal shape decode b64 ctx8192 bs16: not measured; slower than "
                                                   "SDPA at no shape (kernels alone, in CUDA graphs: not timed)")


def test_rows_are_kept_as_they_land_so_a_run_stopped_by_a_time_limit_keeps_them(tmp_path, capsys):
    rows_file = tmp_path / "rows.jsonl"
    results = bench.main(["--smoke", "--rows-to", str(rows_file)])
    lines = rows_file.read_text().splitlines()
    assert [json.loads(line) for line in lines] == results["rows"] and len(lines) == len(smoke_shapes())
    assert "not performance figures" in capsys.readouterr().out
