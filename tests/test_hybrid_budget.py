"""KV cache groups and the hybrid pool's budget, as vLLM 0.33.0 plans them, against the all-full-attention plan."""

from __future__ import annotations

import dataclasses

import pytest

from kvlab.capacity.budget import plan_kv_cache
from kvlab.capacity.hybrid import describe_groups, get_kv_cache_groups, layer_specs, plan_hybrid_kv_cache
from kvlab.capacity.models import get_model
from kvlab.capacity.sizing import page_size_bytes
from kvlab.errors import KvlabValueError
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.units import GiB, cdiv

BUDGET = dict(gpu_memory_gib=80, kv_cache_memory_gib=40)


def test_gpt_oss_20b_gets_one_group_per_kind_and_blocks_half_the_size():
    model = get_model("gpt-oss-20b")
    plan = plan_hybrid_kv_cache(model, max_model_len=131072, **BUDGET)
    sliding, full = plan.kv_cache_groups
    assert isinstance(sliding.kv_cache_spec, SlidingWindowSpec) and sliding.kv_cache_spec.sliding_window == 128
    assert isinstance(full.kv_cache_spec, FullAttentionSpec)
    assert [int(n.split(".")[2]) for n in sliding.layer_names] == list(range(0, 24, 2))
    assert [int(n.split(".")[2]) for n in full.layer_names] == list(range(1, 24, 2))
    page = page_size_bytes(model, 16, "bf16")
    assert plan.layers_per_group == 12 and plan.bytes_per_block == 12 * page and plan.num_padding_layers == 0
    assert plan.num_blocks == 40 * GiB // (12 * page) and plan.full_attention.num_blocks == 40 * GiB // (24 * page)
    # A request of 131,072 tokens: every block in the full group; in the window's, W - 1 plus two batches of
    # 8,192 tokens in flight (async scheduling), plus one for a window that starts inside a block.
    assert plan.max_in_flight_tokens == 2 * 8192
    assert plan.blocks_per_request == (cdiv(127 + 16384, 16) + 1, 131072 // 16) == (1033, 8192)
    assert plan.max_concurrency == plan.num_blocks / (1033 + 8192)
    assert plan.kv_cache_size_tokens == int(plan.max_concurrency * 131072)
    assert plan.concurrency_gain == pytest.approx(2 * 8192 / 9225, rel=1e-4)
    assert plan.startup_log() == [f"GPU KV cache size: {plan.kv_cache_size_tokens:,} tokens, Maximum concurrency "
                                  f"for 131,072 tokens per request: {plan.max_concurrency:.2f}x"]
    assert plan.fits


def test_gemma_2_at_its_own_context_gains_nothing_unless_little_is_in_flight():
    """A window of 4,096 in an 8,192 context: with 16,384 tokens in flight the window holds the whole context."""
    default = plan_hybrid_kv_cache("gemma-2-9b", max_model_len=8192, **BUDGET)
    assert [len(g.layer_names) for g in default.kv_cache_groups] == [21, 21]
    assert default.blocks_per_request == (8192 // 16 + 1, 512)  # the window's cap exceeds the context: 513
    assert default.concurrency_gain < 1
    lean = plan_hybrid_kv_cache("gemma-2-9b", max_model_len=8192, max_num_batched_tokens=512, async_scheduling=False,
                                **BUDGET)
    assert lean.blocks_per_request == (cdiv(4095 + 512, 16) + 1, 512)
    assert lean.concurrency_gain > 1.25
    rows = describe_groups(lean)
    assert [r["kind"] for r in rows] == ["sliding_attention", "full_attention"] and rows[0]["sliding_window"] == 4096


def test_a_model_of_one_kind_is_one_group_and_the_full_attention_plan():
    plan = plan_hybrid_kv_cache("llama-3-8b", max_model_len=8192, **BUDGET)
    assert len(plan.kv_cache_groups) == 1 and plan.layers_per_group == 32
    assert plan.num_blocks == plan.full_attention.num_blocks
    assert plan.max_concurrency == plan.full_attention.max_concurrency
    assert plan.kv_cache_size_tokens == plan.full_attention.num_blocks * 16  # 8192 is a multiple of the block


def test_groups_follow_the_one_and_a_half_rule():
    shape = {"num_kv_heads": 1, "head_size": 2, "dtype": "fp8"}       # a page of 16 x 1 x (2 + 2) x 1 = 64 bytes
    sw, full = SlidingWindowSpec(16, **shape, sliding_window=512), FullAttentionSpec(16, **shape)
    assert sw.page_size_bytes == full.page_size_bytes == 64
    five_to_one = {f"l{i}": (full if i % 6 == 5 else sw) for i in range(12)}  # Gemma 3: 10 sliding, 2 full
    groups = get_kv_cache_groups(five_to_one)
    assert [len(g.layer_names) for g in groups] == [2] * 6 and sum(g.kv_cache_spec == sw for g in groups) == 5
    assert groups[0].layer_names == ("l0", "l6")  # every fifth sliding layer: pipeline stages see the pattern
    twelve_and_thirteen = {f"l{i}": (sw if i < 12 else full) for i in range(25)}  # gpt-oss with an EAGLE head
    groups = get_kv_cache_groups(twelve_and_thirteen)
    assert [len(g.layer_names) for g in groups] == [12, 13]  # one padding layer, not 12 + 2 x 12
    with pytest.raises(KvlabValueError, match="page sizes"):
        get_kv_cache_groups({"a": sw, "b": FullAttentionSpec(16, **{**shape, "head_size": 4})})


def test_the_hybrid_plan_uses_the_same_budget_as_plan_kv_cache():
    full = plan_kv_cache("gpt-oss-20b", max_model_len=4096, gpu_memory_gib=24, weights_gib=13)
    plan = plan_hybrid_kv_cache("gpt-oss-20b", max_model_len=4096, gpu_memory_gib=24, weights_gib=13)
    assert plan.full_attention == full
    assert plan.num_blocks == full.available_bytes // plan.bytes_per_block
    with pytest.raises(KvlabValueError, match="max_num_batched_tokens"):
        plan_hybrid_kv_cache("gpt-oss-20b", max_model_len=4096, max_num_batched_tokens=0, **BUDGET)
    specs = layer_specs(get_model("gpt-oss-20b"), 16)
    assert len(specs) == 24 and dataclasses.replace(specs["model.layers.0.self_attn.attn"]).sliding_window == 128


def test_the_offline_llm_class_gets_16384_batched_tokens_on_an_h100_and_the_window_reserves_for_them():
    """vLLM 0.33.0's EngineArgs.get_batch_defaults: 16,384 for the LLM class on a >= 70 GiB GPU that is not an A100
    (the API server 8,192); 8,192 on the A100 and smaller GPUs."""
    from kvlab.capacity.hybrid import default_max_num_batched_tokens

    assert [default_max_num_batched_tokens(g) for g in ("L4", "A100-80GB", "H100-SXM-80GB", "H200-SXM-141GB")] == [
        8192, 8192, 16384, 16384]
    assert default_max_num_batched_tokens("H100-SXM-80GB", api_server=True) == 8192
    plan = plan_hybrid_kv_cache("gpt-oss-20b", max_model_len=131072, gpu_memory_gib=80, kv_cache_memory_gib=40,
                                max_num_batched_tokens=default_max_num_batched_tokens("H100-SXM-80GB"))
    assert plan.blocks_per_request == (cdiv(127 + 2 * 16384, 16) + 1, 8192) == (2057, 8192)
    assert round(plan.concurrency_gain, 2) == 1.60
