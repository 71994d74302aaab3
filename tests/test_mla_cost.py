"""Counting MLA's two paths on DeepSeek-V3's real shapes: why decode absorbs the weights and prefill does not."""

import pytest

from kvlab import get_model, kv_bytes_per_token
from kvlab.capacity.mla import MLADims, absorb_crossover, causal_pairs, mla_attention_cost, mla_dims
from kvlab.errors import KvlabValueError

DSV3 = get_model("deepseek-v3")
N, L, P, R, V = 128, 512, 128, 64, 128            # DeepSeek-V3's config.json, spelled out for the hand counts


def test_the_dims_come_from_the_real_config():
    dims = mla_dims(DSV3)
    assert (dims.num_heads, dims.kv_lora_rank, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim,
            dims.q_lora_rank) == (N, L, P, R, V, 1536)
    assert dims.latent_size == DSV3.head_dim == 576 and dims.qk_head_dim == 192
    assert mla_dims(DSV3, tp=8).num_heads == 16       # the heads split across GPUs; the latent does not


def test_only_mla_models_and_dividing_tp_are_accepted():
    with pytest.raises(KvlabValueError, match="GQA attention, not MLA"):
        mla_dims(get_model("llama-3-8b"))
    with pytest.raises(KvlabValueError, match="tp=3 does not divide"):
        mla_dims(DSV3, tp=3)
    with pytest.raises(KvlabValueError, match="query_len"):
        mla_attention_cost(DSV3, 0)
    with pytest.raises(KvlabValueError, match="context_len"):
        mla_attention_cost(DSV3, 1, -1)


def test_one_decode_token_counted_by_hand():
    # one query token after 4095 cached: 4096 latents, every pair visible
    s = 4096
    cost = mla_attention_cost(DSV3, 1, 4095)
    assert cost.naive.flops == 2 * s * L * N * (P + V) + 2 * s * N * (P + R) + 2 * s * N * V
    assert cost.absorbed.flops == 2 * N * P * L + 2 * s * N * (L + R) + 2 * s * N * L + 2 * N * L * V
    b = 2                                                                          # bf16
    weights = L * N * (P + V) * b
    assert cost.naive.bytes_read == s * (L + R) * b + weights + N * (P + R) * b + s * N * (P + R + V) * b
    assert cost.absorbed.bytes_read == weights + N * P * b + N * (L + R) * b + s * (L + R) * b + N * L * b


@pytest.mark.parametrize("context", [1024, 4095, 32767, 131071])
def test_decode_absorbs_fewer_flops_and_fewer_bytes_at_every_context(context):
    cost = mla_attention_cost(DSV3, 1, context)
    assert cost.fewer_flops == "absorbed"
    assert cost.flops_ratio > 100 and cost.bytes_read_ratio > 3
    batched = mla_attention_cost(DSV3, 1, context, num_seqs=64)       # the weights' read is shared by the batch
    assert batched.bytes_read_ratio > 40


def test_the_bytes_ratio_tends_to_what_one_token_stores_each_way():
    # long contexts, big batches: naive reads the latent and every head's K and V, absorbed the latent alone
    limit = ((L + R) * 2 + N * (P + R + V) * 2) / ((L + R) * 2)
    assert 72 < limit < 72.2
    assert mla_attention_cost(DSV3, 1, 131071, num_seqs=1024).bytes_read_ratio == pytest.approx(limit, rel=0.01)


@pytest.mark.parametrize("prompt", [64, 1024, 4096])
def test_a_prefill_decompresses_fewer_flops(prompt):
    cost = mla_attention_cost(DSV3, prompt, 0)
    assert cost.fewer_flops == "naive" and cost.flops_ratio < 1
    # the absorbed attention is MQA with head size L + R and values of size L: 2L + R per pair against P + R + V
    assert mla_attention_cost(DSV3, 4096, 0).flops_ratio < 1 / 2.5


def test_the_crossover_is_where_the_pairs_pay_for_the_decompression():
    # absorbed - naive = 2N [pairs (2L - P - V) - context L (P + V)]: solve it by brute force here
    for context in (0, 4096, 10**6):
        expected = next(sq for sq in range(1, 10**4)
                        if causal_pairs(sq, context) * (2 * L - P - V) >= context * L * (P + V))
        assert absorb_crossover(DSV3, context) == expected
    assert absorb_crossover(DSV3, 10**6) == 171          # -> L (P + V) / (2L - P - V) = 170.7 for long contexts


def test_the_cache_term_is_the_bytes_per_token_sizing_computes():
    # one layer's latent per token is kv_bytes_per_token / num_layers; only that term follows kv_dtype
    s = 4096
    bf16, fp8 = (mla_attention_cost(DSV3, 1, s - 1, kv_dtype=d) for d in ("bf16", "fp8"))
    per_layer = {d: kv_bytes_per_token(DSV3, d) // DSV3.num_layers for d in ("bf16", "fp8")}
    for path in ("naive", "absorbed"):
        saved = getattr(bf16, path).bytes_read - getattr(fp8, path).bytes_read
        assert saved == s * (per_layer["bf16"] - per_layer["fp8"])
        assert getattr(bf16, path).flops == getattr(fp8, path).flops


def test_the_weights_are_read_once_per_step_whatever_the_batch():
    one, two = (mla_attention_cost(DSV3, 1, 999, num_seqs=n) for n in (1, 2))
    weights = L * N * (P + V) * 2
    for path in ("naive", "absorbed"):
        assert getattr(two, path).bytes_read == 2 * getattr(one, path).bytes_read - weights
        assert getattr(two, path).flops == 2 * getattr(one, path).flops


def test_dims_can_be_given_directly_and_are_checked():
    dims = MLADims(num_heads=16, kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V)
    from_config = mla_attention_cost(DSV3, 1, 10, tp=8)
    assert mla_attention_cost(dims, 1, 10).naive == from_config.naive
    assert mla_attention_cost(dims, 1, 10).absorbed == from_config.absorbed
    with pytest.raises(KvlabValueError, match="kv_lora_rank"):
        MLADims(num_heads=16, kv_lora_rank=0, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V)


@pytest.mark.parametrize(("query_len", "context_len"), [(1, 0), (1, 4095), (64, 0), (64, 4096), (64, 140), (64, 141)])
def test_absorbing_reads_fewer_bytes_exactly_when_the_cached_k_and_v_outweigh_two_latent_queries(query_len,
                                                                                                 context_len):
    cost = mla_attention_cost(DSV3, query_len, context_len, kv_dtype="fp8")
    s = query_len + context_len
    assert cost.fewer_bytes_read == ("absorbed" if s * (P + R + V) > 2 * L * query_len else "naive")
    assert cost.fewer_bytes_read == ("absorbed" if cost.bytes_read_ratio > 1 else "naive")
