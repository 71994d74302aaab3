"""The MLA benchmark measures what it says: DeepSeek-V3's shapes, both paths agreeing, and the bytes it counts."""

import importlib.util
from pathlib import Path

import pytest
import torch
from kvlab.kernels import TRITON_CUDA, backend, mla_bench

from kvlab.capacity.mla import mla_attention_cost
from kvlab.capacity.models import get_model

ROOT = Path(__file__).resolve().parents[1]


def bench_script():
    spec = importlib.util.spec_from_file_location("bench_mla", ROOT / "benchmarks" / "bench_mla.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_shapes_are_deepseek_v3s_attention():
    shapes = mla_bench.gpu_shapes()
    assert {(s.kv_lora_rank, s.rope_dim, s.nope_dim, s.v_dim, s.dtype) for s in shapes} == {
        (512, 64, 128, 128, torch.bfloat16)}
    assert {s.num_heads for s in shapes} == {16, 128}                   # one GPU of TP 8, and all heads
    assert len({s.name for s in shapes}) == len(shapes)


def test_a_smoke_run_agrees_with_the_naive_path_and_does_not_call_itself_performance():
    results = mla_bench.run(mla_bench.smoke_shapes())
    (row,) = results["rows"]
    assert row["rel_error_vs_naive"] < 1e-4
    assert results["performance"] == (backend() == TRITON_CUDA)


def test_the_counts_added_to_a_row_are_kvlab_capacitys_for_deepseek_v3_at_tp8():
    shape = mla_bench.MLAShape(16, 4096)
    row = bench_script().with_counts(shape, {"shape": shape.name, "dtype": "bfloat16", "absorbed_us": 100.0})
    cost = mla_attention_cost(get_model("deepseek-v3"), 1, 4095, num_seqs=16, tp=8)
    assert row["bytes_read_ratio"] == cost.bytes_read_ratio > 9       # 16 heads of K and V against one latent
    assert row["absorbed_GBps"] == pytest.approx(cost.absorbed.bytes_read / 100e-6 / 1e9)
