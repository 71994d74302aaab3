"""LLMEngine with a CPU tier and preemption by swap: the tokens never change, and the copies really carry the KV.

The tiny model's greedy tokens depend on its early context (``test_engine_generate``), so a
load or swap-in that brought back the wrong bytes would change them; the "teeth" tests
corrupt the CPU tier and see exactly that.
"""

import pytest

from kvlab.engine import LLMEngine
from kvlab.engine.toy import random_token_ids
from kvlab.errors import KvlabValueError

SYSTEM_A, SYSTEM_B = random_token_ids(32, seed=1), random_token_ids(32, seed=2)  # two full blocks each
TURNS = [SYSTEM_A + random_token_ids(6, seed=11), SYSTEM_B + random_token_ids(6, seed=12),
         SYSTEM_A + random_token_ids(6, seed=13), SYSTEM_B + random_token_ids(6, seed=14)]
CROWD = [random_token_ids(30, seed=50 + i) for i in range(3)]
CRAMPED = {"num_gpu_blocks": 7, "block_size": 16, "max_num_batched_tokens": 64}


def _one_at_a_time(engine, prompts, corrupt_after=None):
    out = []
    for i, prompt in enumerate(prompts):
        if corrupt_after is not None and i == corrupt_after:
            for key_cache, value_cache in engine.cpu_kv_caches:
                key_cache.normal_()
                value_cache.normal_()
        out += engine.generate([prompt], max_tokens=4)
    return out


def test_the_cpu_tier_gives_transformers_tokens_and_loads_instead_of_computing(tiny_llama_dir, hf_greedy):
    gpu_only = LLMEngine(tiny_llama_dir, num_gpu_blocks=4, block_size=16)   # 3 usable blocks: each turn evicts
    tiered = LLMEngine(tiny_llama_dir, num_gpu_blocks=4, block_size=16, cpu_offload_blocks=8)
    expected = [hf_greedy(p, 4) for p in TURNS]
    assert _one_at_a_time(gpu_only, TURNS) == _one_at_a_time(tiered, TURNS) == expected
    stats = tiered.connector.stats
    assert (stats.blocks_stored, stats.blocks_loaded, stats.external_prefix_cache_hits) == (4, 4, 64)
    assert (gpu_only.num_computed_tokens, tiered.num_computed_tokens) == (164, 100)
    assert stats.bytes_to_gpu(tiered.bytes_per_block) == 4 * tiered.bytes_per_block
    assert tiered.num_gpu_blocks == gpu_only.num_gpu_blocks                    # the tier adds no GPU blocks
    tiered.connector.cpu.check_invariants()


def test_loads_carry_the_kv_corrupting_the_tier_changes_the_tokens(tiny_llama_dir, hf_greedy):
    tiered = LLMEngine(tiny_llama_dir, num_gpu_blocks=4, block_size=16, cpu_offload_blocks=8)
    out = _one_at_a_time(tiered, TURNS, corrupt_after=2)      # the third turn loads system A from the tier
    assert out[:2] == [hf_greedy(p, 4) for p in TURNS[:2]] and out[2] != hf_greedy(TURNS[2], 4)


def test_swap_and_recompute_give_the_same_tokens_under_a_cramped_pool(tiny_llama_dir, hf_greedy):
    by_recompute = LLMEngine(tiny_llama_dir, **CRAMPED)
    by_swap = LLMEngine(tiny_llama_dir, **CRAMPED, cpu_offload_blocks=16, preemption_mode="swap")
    expected = [hf_greedy(p, 20) for p in CROWD]
    assert by_recompute.generate(CROWD, max_tokens=20, ignore_eos=True) == expected
    assert by_swap.generate(CROWD, max_tokens=20, ignore_eos=True) == expected
    assert by_recompute.scheduler.num_preemptions == by_swap.scheduler.num_preemptions == 2
    assert (by_recompute.scheduler.num_recomputed_tokens, by_swap.scheduler.num_recomputed_tokens) == (47, 0)
    stats = by_swap.connector.stats
    assert (stats.swap_outs, stats.blocks_swapped_out, stats.blocks_swapped_in) == (2, 5, 3)
    assert by_swap.connector.cpu.num_swap_blocks == 0


def test_swap_ins_carry_the_kv_corrupting_swapped_blocks_changes_the_tokens(tiny_llama_dir, hf_greedy):
    engine = LLMEngine(tiny_llama_dir, **CRAMPED, cpu_offload_blocks=16, preemption_mode="swap")
    ids = [engine.add_request(p, max_tokens=20, ignore_eos=True) for p in CROWD]
    corrupted = False
    while engine.has_unfinished_requests():
        engine.step()
        if not corrupted and engine.connector.stats.swap_outs:
            for key_cache, value_cache in engine.cpu_kv_caches:  # after the swap-out copies ran
                key_cache.normal_()
                value_cache.normal_()
            corrupted = True
    assert corrupted and [engine.outputs[i] for i in ids] != [hf_greedy(p, 20) for p in CROWD]


def test_swap_needs_a_cpu_tier_and_the_tier_a_sane_size(tiny_llama_dir):
    with pytest.raises(KvlabValueError, match="cpu_offload_blocks"):
        LLMEngine(tiny_llama_dir, num_gpu_blocks=8, preemption_mode="swap")
    with pytest.raises(KvlabValueError, match="cpu_offload_blocks"):
        LLMEngine(tiny_llama_dir, num_gpu_blocks=8, cpu_offload_blocks=-1)
    with pytest.raises(KvlabValueError, match="preemption_mode"):
        LLMEngine(tiny_llama_dir, num_gpu_blocks=8, cpu_offload_blocks=4, preemption_mode="page-out")


def test_the_engine_records_block_lifetimes_when_asked_as_vllm_does_with_kv_cache_metrics(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, num_gpu_blocks=4, block_size=16, cpu_offload_blocks=8, kv_cache_metrics=True)
    _one_at_a_time(engine, TURNS[:3])
    lifetimes = engine.kv_cache_metrics.histogram("lifetime", "steps")
    assert lifetimes.count > 0 and engine.connector.stats.blocks_stored > 0   # both observers saw the evictions
    text = engine.metrics_text()
    assert "# TYPE vllm:kv_block_lifetime_seconds histogram" in text and "vllm:prefix_cache_hits_total" in text
    assert "vllm:kv_block_lifetime_seconds" not in LLMEngine(tiny_llama_dir, num_gpu_blocks=4).metrics_text()
