"""vLLM's start-up log read backwards: the pool its lines imply, planned and checked against them."""

import pytest

from kvlab.capacity.budget import plan_kv_cache
from kvlab.capacity.startup_log import parse_startup_log, reconstruct
from kvlab.errors import KvlabValueError
from kvlab.units import GiB

SOURCE_LOG = ["INFO ... Model loading took 15.2 GiB and 8.34 seconds",  # the source article's (section 8.1)
              "INFO ... GPU KV cache size: 393,216 tokens",
              "INFO ... Maximum concurrency for 8,192 tokens per request: 48.00x"]


def test_both_the_two_line_and_the_one_line_forms_parse():
    log = parse_startup_log(SOURCE_LOG)
    assert (log.weights_gib, log.kv_cache_tokens, log.max_model_len, log.max_concurrency) == (15.2, 393_216, 8192, 48.0)
    one_line = parse_startup_log("GPU KV cache size: 56,320 tokens, Maximum concurrency for 8,192 tokens per "
                                 "request: 6.88x")
    assert one_line.weights_gib is None and one_line.kv_cache_tokens == 56_320 and one_line.max_concurrency == 6.88
    assert (log.form, one_line.form) == ("article", "0.33.0")
    with pytest.raises(KvlabValueError, match="KV cache size"):
        parse_startup_log(["nothing to see"])


def test_the_sources_log_is_a_48_gib_pool_of_llama_3_8b():
    r = reconstruct("llama-3-8b", SOURCE_LOG, gpu="H100-SXM-80GB")
    assert r.pool_bytes == 48 * GiB and r.matches and r.plan.num_blocks == 24_576
    assert r.plan.startup_log(form="article") == [line.removeprefix("INFO ... ") for line in SOURCE_LOG[1:]]
    assert r.plan.startup_log() == ["GPU KV cache size: 393,216 tokens, Maximum concurrency for 8,192 tokens per "
                                    "request: 48.00x"]                  # what 0.33.0 prints for the same pool
    assert 10 * GiB < r.implied_non_kv_bytes < 10.1 * GiB                 # activations and CUDA graphs on an H100
    assert reconstruct("qwen3-8b", SOURCE_LOG).pool_bytes == 54 * GiB     # 36 layers: the same tokens cost more


def test_a_log_that_contradicts_itself_does_not_match():
    lying = [SOURCE_LOG[1], "Maximum concurrency for 8,192 tokens per request: 6.00x"]
    assert not reconstruct("llama-3-8b", lying).matches
    with pytest.raises(KvlabValueError, match="whole number of blocks"):
        reconstruct("llama-3-8b", ["GPU KV cache size: 1,000 tokens", SOURCE_LOG[2]])


def test_fp8_doubles_the_tokens_and_the_concurrency_of_the_same_pool():
    pool = reconstruct("llama-3-8b", SOURCE_LOG).pool_bytes
    fp8 = plan_kv_cache("llama-3-8b", gpu_memory_gib=80, kv_cache_memory_gib=pool / GiB, kv_dtype="fp8",
                        max_model_len=8192)
    assert fp8.startup_log() == ["GPU KV cache size: 786,432 tokens, Maximum concurrency for 8,192 tokens per "
                                 "request: 96.00x"]


def test_reconstruct_reads_vllm_0_33_0s_one_line_even_off_a_block_boundary():
    """0.33.0 logs int(num_blocks / blocks_per_request x max_model_len) tokens: not a whole number of blocks when
    max_model_len is not a multiple of block_size, and still one pool."""
    plan = plan_kv_cache("llama-3-8b", gpu_memory_gib=80, max_model_len=8190)
    weights = f"INFO ... Model loading took {round(plan.weights_bytes / GiB, 2)} GiB memory and 8.340000 seconds"
    r = reconstruct("llama-3-8b", [weights, *plan.startup_log()])
    assert r.log.form == "0.33.0" and r.log.kv_cache_tokens % 16 and r.log.weights_gib == 14.96
    assert r.matches and r.plan.num_blocks == plan.num_blocks and r.pool_bytes == plan.kv_pool_bytes
