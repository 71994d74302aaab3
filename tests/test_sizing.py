"""Bytes per token and per request: f x L x Hkv x D x b, checked against the source table and tensors."""

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab import GiB, KiB, MiB, ModelSpec, get_model, kv_bytes, kv_bytes_per_token
from kvlab.capacity.sizing import (
    KV_DTYPE_BYTES,
    blocks_for_tokens,
    breakdown,
    kv_bytes_per_layer_token,
    kv_cache_tensors,
    kv_heads_per_rank,
    mean_tail_waste,
    mha_ratio,
    page_size_bytes,
    reservation_waste,
    tail_waste,
    vector_bytes,
)
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.units import format_bytes

# model, bf16/token, fp8/token, 128K tokens in bf16, smaller than MHA by (the source material's table)
SOURCE_TABLE = [
    ("llama-2-7b", 512 * KiB, 256 * KiB, 64 * GiB, 1.0),
    ("llama-3-8b", 128 * KiB, 64 * KiB, 16 * GiB, 4.0),
    ("llama-3-70b", 320 * KiB, 160 * KiB, 40 * GiB, 8.0),
    ("deepseek-v3", 68.625 * KiB, 34.3125 * KiB, 8.578 * GiB, 56.9),
]


@pytest.mark.parametrize(("name", "bf16", "fp8", "ctx128k", "ratio"), SOURCE_TABLE)
def test_the_per_token_table_of_the_source_material(name, bf16, fp8, ctx128k, ratio):
    m = get_model(name)
    assert kv_bytes_per_token(m, "bf16") == bf16
    assert kv_bytes_per_token(m, "fp8") == kv_bytes_per_token(m, "fp8_e4m3") == fp8
    assert kv_bytes(m, 131072, "bf16") == pytest.approx(ctx128k, rel=1e-4)
    assert round(mha_ratio(m), 1) == ratio


def toy(kv_heads):
    return ModelSpec.from_hf_config(
        {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": kv_heads, "hidden_size": 4096})


def test_mha_gqa_mqa_worked_example():
    assert kv_bytes(toy(32), 4096, "fp16") == 2048 * MiB
    assert kv_bytes(toy(8), 4096, "fp16") == 512 * MiB
    assert kv_bytes(toy(1), 4096, "fp16") == 64 * MiB
    assert kv_bytes(toy(8), 4096, "fp16", requests=8) == 4 * GiB


def test_tensor_parallelism_splits_gqa_heads_and_replicates_mla():
    assert kv_bytes_per_token(get_model("llama-3-70b"), "bf16", tp=8) == 40 * KiB
    assert kv_heads_per_rank(get_model("llama-3-70b"), 16) == 1  # more ranks than heads: replicas
    ds = get_model("deepseek-v3")
    assert kv_bytes_per_token(ds, tp=8) == kv_bytes_per_token(ds, tp=1)


def test_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(KvlabValueError, match="tp=3"):
        kv_bytes_per_token(get_model("llama-3-8b"), tp=3)
    with pytest.raises(KvlabValueError, match="tp=12"):
        kv_bytes_per_token(get_model("llama-3-8b"), tp=12)


def test_nvfp4_costs_nine_sixteenths_of_a_byte_never_rounded():
    assert KV_DTYPE_BYTES["nvfp4"] == 0.5625
    assert vector_bytes(128, "nvfp4") == 64 + 8
    assert vector_bytes(576, "nvfp4") == 324
    assert vector_bytes(20, "nvfp4") == 10 + 2  # a started group of 16 still needs its scale
    m = get_model("llama-3-8b")
    assert kv_bytes_per_token(m, "nvfp4") == kv_bytes_per_token(m, "bf16") * 9 // 32


def test_sliding_windows_cap_what_a_layer_holds():
    mistral = get_model("mistral-7b-v0.1")
    assert kv_bytes(mistral, 4096) == kv_bytes(mistral, 100_000)
    assert kv_bytes(mistral, 100) == 100 * kv_bytes_per_token(mistral)
    oss = get_model("gpt-oss-20b")
    per_layer = kv_bytes_per_token(oss) // oss.num_layers
    assert kv_bytes(oss, 1000) == per_layer * (12 * 1000 + 12 * 128)


@pytest.mark.parametrize("name", ["llama-3-8b", "deepseek-v3", "gpt-oss-20b", "mistral-7b-v0.1"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp32", "nvfp4", "int8"])
def test_the_formula_agrees_with_the_bytes_of_real_tensors(name, dtype):
    m = get_model(name)
    for tokens in (1, 127, 5000):
        assert sum(t.nbytes for t in kv_cache_tensors(m, tokens, dtype)) == kv_bytes(m, tokens, dtype)


@given(
    layers=st.integers(1, 128), heads_pow=st.integers(0, 7), group_pow=st.integers(0, 7),
    head_dim=st.sampled_from([64, 80, 96, 128, 256]), tokens=st.integers(1, 1 << 20),
    requests=st.integers(1, 64), dtype=st.sampled_from(sorted(KV_DTYPE_BYTES)),
)
def test_request_bytes_are_linear_in_tokens_and_requests(layers, heads_pow, group_pow, head_dim, tokens,
                                                         requests, dtype):
    kv_heads = 2**heads_pow
    m = ModelSpec.from_hf_config({"num_hidden_layers": layers, "num_attention_heads": kv_heads * 2**group_pow,
                                  "num_key_value_heads": kv_heads, "head_dim": head_dim})
    per_token = kv_bytes_per_token(m, dtype)
    assert per_token == 2 * layers * kv_heads * vector_bytes(head_dim, dtype)
    assert kv_bytes(m, tokens, dtype, requests) == per_token * tokens * requests


def test_breakdown_lists_the_factors_in_order():
    b = breakdown(get_model("llama-3-70b"), "fp8", tp=8)
    assert list(b)[2:] == ["f", "L", "Hkv", "D", "b", "bytes_per_token"]
    assert math.prod(b[k] for k in ("f", "L", "Hkv", "D", "b")) == b["bytes_per_token"] == 20 * KiB


def test_block_arithmetic_of_the_self_test():
    assert blocks_for_tokens(2050, 16) == 129 and tail_waste(2050, 16) == 14
    assert blocks_for_tokens(4100, 16) == 257 and tail_waste(4100, 16) == 12
    assert blocks_for_tokens(2000, 16) == 125 and tail_waste(2000, 16) == 0


def test_unknown_dtype_lists_the_known_ones():
    with pytest.raises(UnknownNameError) as info:
        kv_bytes_per_token(get_model("llama-3-8b"), "fp4")
    assert isinstance(info.value, ValueError) and "nvfp4" in str(info.value) and "kv_dtype" in str(info.value)


@pytest.mark.parametrize("bad", [0, -5, 1.5, "8", None])
def test_bad_sizes_name_the_parameter(bad):
    m = get_model("llama-3-8b")
    with pytest.raises(KvlabValueError, match="tokens"):
        kv_bytes(m, bad)
    with pytest.raises(KvlabValueError, match="requests"):
        kv_bytes(m, 10, requests=bad)
    with pytest.raises(KvlabValueError, match="tp"):
        kv_bytes_per_token(m, tp=bad)


def test_format_bytes_uses_binary_units():
    assert format_bytes(320 * KiB) == "320 KiB"
    assert format_bytes(68.625 * KiB) == "68.625 KiB"
    assert format_bytes(1.25 * GiB) == "1.25 GiB"
    assert format_bytes(12) == "12 B"


def test_one_layers_page_is_vllms_page_size_bytes():
    llama8b, deepseek = get_model("llama-3-8b"), get_model("deepseek-v3")
    # block 16, fp16: K 8 heads x 16 tokens x 128 x 2 B = 32 KiB, and V as much
    assert page_size_bytes(llama8b, 16, "fp16") == 64 * KiB == 2 * 8 * 16 * 128 * 2
    logical_block = page_size_bytes(llama8b, 16, "fp16") * llama8b.num_layers
    assert logical_block == 2 * MiB == 16 * kv_bytes_per_token(llama8b, "fp16")
    assert kv_bytes_per_layer_token(deepseek) == 576 * 2                  # one latent: head_size_v = 0
    assert kv_bytes_per_layer_token(get_model("llama-3-70b"), tp=8) == 2 * 128 * 2


def test_a_contiguous_reservation_wastes_what_the_request_never_reaches():
    assert reservation_waste(500, 2048) == 1548 and reservation_waste(2048, 2048) == 0
    with pytest.raises(KvlabValueError, match="reserved"):
        reservation_waste(2049, 2048)


def test_the_mean_tail_waste_is_block_size_minus_one_over_two():
    assert [mean_tail_waste(b) for b in (8, 16, 128)] == [Fraction(7, 2), Fraction(15, 2), Fraction(127, 2)]
    assert mean_tail_waste(16, range(1, 1601)) == Fraction(15, 2)          # every residue equally often
    assert mean_tail_waste(16, [16, 32]) == 0 and mean_tail_waste(16, [1]) == 15
    with pytest.raises(KvlabValueError, match="lengths"):
        mean_tail_waste(16, [])
