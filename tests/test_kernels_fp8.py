"""FP8 KV: quantization, vLLM's calibrated scales, and the error study the notebook plots."""

import pytest
import torch
from kvlab.kernels import paged_attention_ref, reshape_and_cache_ref
from kvlab.kernels.fp8 import (
    E4M3_MAX,
    K_SCALE_CONSTANT,
    calibrated_scale,
    dequantize_fp8,
    e4m3_grid_step,
    quantize_fp8,
    synthetic_kv,
)
from kvlab.kernels.fp8_sweep import fp8_error_sweep

REFERENCE = dict(write=reshape_and_cache_ref, attend=paged_attention_ref)


def test_rounding_error_is_at_most_half_a_step_in_the_normal_range():
    x = torch.empty(5000).uniform_(2**-6, E4M3_MAX) * torch.sign(torch.randn(5000))
    back = dequantize_fp8(quantize_fp8(x, 1.0), 1.0)
    steps = torch.tensor([e4m3_grid_step(abs(v)) for v in x.tolist()])
    assert ((back - x).abs() <= steps / 2 + 1e-12).all()
    assert (back - x).abs().div(x.abs()).max() <= 2**-4                # 3 mantissa bits


def test_scale_moves_values_into_range_and_saturates_outside():
    assert quantize_fp8(torch.tensor([1e-4]), 1.0).float().item() == 0.0         # below 2^-10: flushed
    assert dequantize_fp8(quantize_fp8(torch.tensor([1e-4]), 1e-5), 1e-5).item() == pytest.approx(1e-4, rel=0.07)
    assert quantize_fp8(torch.tensor([1e5]), 1.0).float().item() == E4M3_MAX       # clipped
    assert calibrated_scale(torch.tensor([-600.0, 3.0])) == 600.0 / K_SCALE_CONSTANT


def test_synthetic_activations_have_outlier_channels_and_a_loud_first_token():
    g = torch.Generator().manual_seed(3)
    x = synthetic_kv(256, 2, 64, magnitude=1.0, outlier_channels=4, outlier_factor=20.0, generator=g)
    per_channel = x[1:].abs().mean(dim=0)                                       # [heads, dims]
    assert (per_channel.topk(4, dim=1).values.min() > 5 * per_channel.median()).item()
    assert x[0].abs().mean() > 2 * x[1:].abs().mean()


def test_the_calibrated_scale_keeps_the_error_flat_where_scale_one_fails():
    rows = fp8_error_sweep([1e-4, 1.0, 1000.0], **REFERENCE)
    small, middle, large = rows
    assert all(r["error calibrated"] < 0.05 for r in rows)
    assert middle["error scale 1.0"] < 0.05                                    # activations of order 1: fine
    assert small["error scale 1.0"] > 0.5 and large["error scale 1.0"] > 0.5   # underflow / saturation


def test_the_sweep_measures_the_kernels_the_same_way_as_the_reference():
    kw = dict(num_seqs=1, seq_len=32, num_kv_heads=1, num_queries_per_kv=2, seed=5)
    kernel = fp8_error_sweep([1e-3], **kw)[0]
    reference = fp8_error_sweep([1e-3], **kw, **REFERENCE)[0]
    for key in ("error scale 1.0", "error calibrated"):
        assert kernel[key] == pytest.approx(reference[key], rel=0.1, abs=2e-3)
