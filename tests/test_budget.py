"""The KV cache budget as vLLM V1 computes it: the source table row by row, the start-up log, invariants."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab import GiB, KiB, MiB, ModelSpec, get_model
from kvlab.capacity.budget import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    PRESETS,
    SOURCE_REVISION_BLOCK_SIZE,
    max_concurrency,
    max_model_len_for,
    num_gpu_blocks,
    plan_kv_cache,
    plan_preset,
    resolved_gpu_memory_utilization,
)
from kvlab.capacity.models import weights_bytes
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.errors import KvlabValueError, UnknownNameError

# scenario, plan_kv_cache arguments, budget GiB (as the table rounds it), KV per request GiB, concurrency
SOURCE_TABLE = [
    ("Llama-3-8B, bf16 KV",
     dict(model="llama-3-8b", gpu_memory_gib=80, weights_gib=15, max_model_len=8192), 58.6, 1, 58),
    ("Llama-3-70B, bf16 KV",
     dict(model="llama-3-70b", gpu_memory_gib=160, weights_gib=130, max_model_len=8192), 17.2, 2.5, 6),
    ("Llama-3-70B, fp8 KV, bf16 weights",
     dict(model="llama-3-70b", gpu_memory_gib=160, weights_gib=130, kv_dtype="fp8", max_model_len=8192),
     17.2, 1.25, 13),
    ("Llama-3-70B, fp8 KV + fp8 weights (70e9 B)",
     dict(model="llama-3-70b", gpu_memory_gib=160, weights_gib=70e9 / GiB, kv_dtype="fp8", max_model_len=8192),
     82.0, 1.25, 65),
    ("DeepSeek-V3, one GPU of TP=8",
     dict(model="deepseek-v3", gpu_memory_gib=141, weights_gib=78.125, max_model_len=32768, tp=8),
     51.595, 2.14453125, 24),
    ("DeepSeek-V3, 8 x 141 GiB pooled",
     dict(model="deepseek-v3", gpu_memory_gib=1128, weights_gib=625, max_model_len=32768), 412.76, 2.14453125, 192),
]


@pytest.mark.parametrize(("scenario", "kwargs", "budget_gib", "per_request_gib", "concurrency"), SOURCE_TABLE,
                         ids=[row[0] for row in SOURCE_TABLE])
def test_every_row_of_the_source_table(scenario, kwargs, budget_gib, per_request_gib, concurrency):
    kwargs = dict(kwargs)
    plan = plan_kv_cache(kwargs.pop("model"), **kwargs)
    digits = len(str(budget_gib).split(".")[1])
    assert round(plan.available_bytes / GiB, digits) == budget_gib
    assert plan.kv_bytes_per_request == per_request_gib * GiB
    assert plan.concurrency == concurrency == math.floor(plan.available_bytes / plan.kv_bytes_per_request)
    assert plan.warnings == ()


def test_the_worked_example_of_preset_a():
    plan = plan_preset("A")
    assert plan.requested_bytes == math.ceil(160 * GiB * 0.92)
    assert plan.bytes_per_block == 20 * MiB
    assert (plan.num_blocks, plan.num_usable_blocks, plan.usable_tokens) == (880, 879, 56_256)
    assert (plan.blocks_per_request, plan.max_concurrency, plan.concurrency) == (128, 6.875, 6)
    assert plan.startup_log() == [  # vLLM 0.33.0's one line (update_kv_cache_capacity)
        "GPU KV cache size: 56,320 tokens, Maximum concurrency for 8,192 tokens per request: 6.88x"]
    assert plan.startup_log(form="article") == [  # the source article's two lines
        "GPU KV cache size: 56,320 tokens", "Maximum concurrency for 8,192 tokens per request: 6.88x"]


def test_the_logged_tokens_are_max_concurrency_times_max_model_len_not_the_pool():
    """0.33.0's get_kv_cache_capacity: int(max_concurrency x max_model_len), which is not num_blocks x block_size
    when max_model_len is not a multiple of block_size."""
    plan = plan_kv_cache("llama-3-8b", gpu_memory_gib=80, max_model_len=8190)
    assert (plan.num_blocks, plan.blocks_per_request) == (30_024, 512)
    assert plan.kv_cache_size_tokens == int(30_024 / 512 * 8190) == 480_266 != 30_024 * 16
    assert plan.startup_log() == [
        "GPU KV cache size: 480,266 tokens, Maximum concurrency for 8,190 tokens per request: 58.64x"]


def test_fp8_weights_from_the_parameter_count_still_give_65():
    plan = plan_kv_cache("llama-3-70b", gpu_memory_gib=160, weights_dtype="fp8", kv_dtype="fp8", max_model_len=8192)
    assert plan.weights_bytes == weights_bytes(get_model("llama-3-70b"), "fp8") == 70_553_706_496
    assert plan.concurrency == 65


def toy_llama3_8b():
    return ModelSpec.from_hf_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                     "hidden_size": 4096}, name="Llama-3-8B-shaped")


def test_eight_gib_holds_sixteen_requests_of_4096_tokens_by_bytes_but_only_fifteen_whole():
    short = plan_kv_cache(toy_llama3_8b(), gpu_memory_gib=24, kv_cache_memory_gib=8, kv_dtype="fp16", block_size=16,
                          max_model_len=4096)
    assert short.kv_bytes_per_token == 128 * KiB and short.num_blocks == 4096
    assert short.max_concurrency == 16.0 and short.concurrency == 16 and short.usable_concurrency == 15
    assert short.startup_log()[0].endswith("Maximum concurrency for 4,096 tokens per request: 16.00x")
    longer = plan_kv_cache(toy_llama3_8b(), gpu_memory_gib=24, kv_cache_memory_gib=8, kv_dtype="fp16",
                           block_size=16, max_model_len=4096 + 128)
    assert longer.concurrency == longer.usable_concurrency == 15 == (8 * GiB) // (4224 * 128 * KiB)


def test_kv_cache_memory_replaces_the_whole_budget():
    plan = plan_kv_cache("llama-3-8b", gpu_memory_gib=80, weights_gib=70, non_kv_peak_gib=5,
                         kv_cache_memory_gib=8, max_model_len=8192)
    assert plan.available_bytes == 8 * GiB and plan.kv_cache_memory_bytes == 8 * GiB
    too_big = plan_kv_cache("llama-3-8b", gpu_memory_gib=24, weights_gib=15, kv_cache_memory_gib=16,
                            max_model_len=8192)
    assert any("could not be allocated" in w for w in too_big.warnings)


def test_preset_c_does_not_fit_and_says_why():
    plan = plan_preset("C")
    assert plan.concurrency == 0 and not plan.fits
    (warning,) = plan.warnings
    assert "131,072" in warning and "2,048 blocks" in warning and "56,256" in warning
    assert plan.startup_log() == [  # vLLM 0.33.0's _check_enough_kv_cache_memory, word for word
        "ValueError: To serve at least one request with the model's max seq len (131072), (40.0 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (17.2 GiB). Based on the available memory, the "
        "estimated maximum model length is 56320. Try increasing `gpu_memory_utilization` (which also controls CPU "
        "memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."]


def test_weights_over_budget_warn_instead_of_raising():
    plan = plan_kv_cache("llama-3-70b", gpu_memory_gib=80, max_model_len=8192)  # ~131 GiB of bf16 weights
    assert plan.available_bytes < 0 and plan.num_blocks == 0 and plan.concurrency == 0
    assert "nothing is left for the KV cache" in plan.warnings[0]
    assert plan.startup_log() == [
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its "
        "name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."]


def test_a_pool_of_exactly_one_request_starts_but_cannot_hold_it():
    per_block = kv_bytes_per_token(get_model("llama-3-8b")) * 64
    plan = plan_kv_cache("llama-3-8b", gpu_memory_gib=80, kv_cache_memory_gib=128 * per_block / GiB,
                         max_model_len=8192)
    assert plan.concurrency == 1 and plan.usable_concurrency == 0
    assert "null block" in plan.warnings[0]


def test_sliding_window_models_are_sized_as_full_attention_and_say_so():
    plan = plan_kv_cache("gpt-oss-20b", gpu_memory_gib=80, max_model_len=8192)
    assert plan.kv_bytes_per_token == kv_bytes_per_token(get_model("gpt-oss-20b"))
    assert any("sliding-window" in w for w in plan.warnings)


def test_automatic_weights_divide_by_tp():
    model = get_model("llama-3-70b")
    plan = plan_kv_cache(model, gpu_memory_gib=80, max_model_len=8192, tp=8)
    assert plan.weights_bytes == weights_bytes(model) // 8
    assert plan.kv_bytes_per_token == 40 * KiB


def test_mla_pooled_arithmetic_is_eight_times_one_gpu_but_the_latent_is_replicated():
    ds = get_model("deepseek-v3")
    assert kv_bytes_per_token(ds, tp=8) == kv_bytes_per_token(ds, tp=1)
    per_gpu = plan_preset("B")
    pooled = plan_kv_cache(ds, gpu_memory_gib=8 * 141, weights_gib=8 * 78.125, max_model_len=32768)
    assert per_gpu.concurrency == 24 and pooled.concurrency == 192
    assert pooled.concurrency // 8 == per_gpu.concurrency


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_larger_block_never_raises_concurrency(preset):
    settings = dict(PRESETS[preset])
    model = settings.pop("model")
    settings.pop("block_size")
    plans = [plan_kv_cache(model, block_size=b, **settings) for b in (16, 32, 64, 128, 256)]
    for small, large in zip(plans, plans[1:], strict=False):
        assert large.max_concurrency <= small.max_concurrency
        assert large.usable_concurrency <= small.usable_concurrency
        assert large.usable_tokens <= small.usable_tokens


@given(
    gpu=st.floats(1, 2000), util=st.floats(0.01, 1), weights=st.floats(0, 500), non_kv=st.floats(0, 50),
    block=st.sampled_from([1, 16, 32, 64, 128]), length=st.integers(1, 300_000),
    dtype=st.sampled_from(["bf16", "fp8", "nvfp4", "fp32"]),
)
def test_plan_invariants(gpu, util, weights, non_kv, block, length, dtype):
    plan = plan_kv_cache("llama-3-8b", gpu_memory_gib=gpu, gpu_memory_utilization=util, weights_gib=weights,
                         non_kv_peak_gib=non_kv, block_size=block, max_model_len=length, kv_dtype=dtype)
    assert plan.requested_bytes <= plan.gpu_memory_bytes
    assert plan.kv_pool_bytes <= max(plan.available_bytes, 0) < plan.kv_pool_bytes + plan.bytes_per_block
    assert plan.num_usable_blocks == max(plan.num_blocks - 1, 0)
    assert plan.concurrency == math.floor(plan.max_concurrency) >= plan.usable_concurrency
    assert plan.usable_concurrency * plan.blocks_per_request <= plan.num_usable_blocks
    if not plan.fits or plan.usable_concurrency == 0:
        assert plan.warnings  # a plan that cannot hold one request says why
    else:
        assert plan.warnings == ()
    # max_model_len_for inverts the concurrency: the current length fits, one more request does not
    if plan.usable_concurrency:
        assert plan.max_model_len_for(plan.usable_concurrency) >= plan.max_model_len
    assert plan.max_model_len_for(plan.usable_concurrency + 1) < plan.max_model_len


@given(gpu=st.floats(20, 400), more=st.floats(0, 100), length=st.integers(1, 200_000), longer=st.integers(0, 100_000),
       block=st.sampled_from([16, 64, 256]))
def test_more_memory_never_fewer_blocks_and_longer_contexts_never_more_requests(gpu, more, length, longer, block):
    def plan(gpu_gib, max_model_len):
        return plan_kv_cache("llama-3-8b", gpu_memory_gib=gpu_gib, weights_gib=15, block_size=block,
                             max_model_len=max_model_len)

    assert plan(gpu + more, length).num_blocks >= plan(gpu, length).num_blocks
    assert plan(gpu, length + longer).max_concurrency <= plan(gpu, length).max_concurrency


def test_max_model_len_for_counts_usable_whole_blocks():
    assert max_model_len_for(880, 64, 6) == 146 * 64
    assert max_model_len_for(4096, 16, 16) == 4080  # the null block costs the 16th request one block
    assert max_model_len_for(880, 64, 1000) == 0
    assert max_model_len_for(0, 16, 1) == 0
    assert num_gpu_blocks(0, 10) == 0 and num_gpu_blocks(99, 10) == 9
    with pytest.raises(KvlabValueError, match="available_bytes"):  # a negative budget is the caller's mistake
        num_gpu_blocks(-5, 10)
    assert max_concurrency(880, 8200, 64) == 880 / 129


@pytest.mark.parametrize(("kwargs", "parameter"), [
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.2), "gpu_memory_utilization"),
    (dict(gpu_memory_gib=-1), "gpu_memory_gib"),
    (dict(gpu_memory_gib=0), "gpu_memory_gib"),
    (dict(weights_gib=-3), "weights_gib"),
    (dict(non_kv_peak_gib=-1), "non_kv_peak_gib"),
    (dict(cudagraph_gib=float("nan")), "cudagraph_gib"),
    (dict(kv_cache_memory_gib=-1), "kv_cache_memory_gib"),
    (dict(block_size=0), "block_size"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(tp=3), "tp=3"),
    (dict(weights_gib=10, weights_dtype="fp8"), "weights_dtype"),
])
def test_invalid_input_names_the_parameter(kwargs, parameter):
    args = dict(gpu_memory_gib=80, max_model_len=8192) | kwargs
    with pytest.raises(KvlabValueError, match=parameter):
        plan_kv_cache("llama-3-8b", **args)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UnknownNameError, match="fp8"):
        plan_kv_cache("llama-3-8b", gpu_memory_gib=80, max_model_len=8192, kv_dtype="fp4")
    with pytest.raises(UnknownNameError, match="mxfp4"):
        plan_kv_cache("llama-3-8b", gpu_memory_gib=80, max_model_len=8192, weights_dtype="int3")
    with pytest.raises(UnknownNameError, match="A, B, C"):
        plan_preset("D")


def test_the_default_block_size_is_vllm_0_33_0s_and_the_presets_keep_the_sources():
    assert DEFAULT_BLOCK_SIZE == 16 and SOURCE_REVISION_BLOCK_SIZE == 64
    assert plan_kv_cache("llama-3-8b", gpu_memory_gib=80, max_model_len=8192).block_size == 16
    assert {p["block_size"] for p in PRESETS.values()} == {64}


def test_an_extensible_kv_cache_resolves_an_unset_utilization_to_one_in_the_sources_revision():
    assert resolved_gpu_memory_utilization() == DEFAULT_GPU_MEMORY_UTILIZATION == 0.92
    assert resolved_gpu_memory_utilization(extensible_kv_cache=True) == 1.0
    assert resolved_gpu_memory_utilization(0.8, extensible_kv_cache=True) == 0.8       # a value given wins
    with pytest.raises(KvlabValueError, match="extensible_kv_cache"):
        resolved_gpu_memory_utilization(extensible_kv_cache="yes")
    with pytest.raises(KvlabValueError, match="gpu_memory_utilization"):
        resolved_gpu_memory_utilization(1.5)
