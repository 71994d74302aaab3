"""A hybrid model (sliding windows beside full attention) served by LLMEngine, token for token against transformers.

The tiny Ministral alternates a window of 8 tokens with full attention, and its attention is
sharpened so the window matters: the same weights without the window generate other tokens.
Contexts are several windows long, prompts are chunked across window and block edges, share
prefixes (hits in both groups) and are preempted; every run must match transformers exactly.
The pool's bytes in use are read after every step, against the same model with every layer
allocated as full attention.
"""

from __future__ import annotations

import pytest

from kvlab.engine import LLMEngine
from kvlab.engine.hybrid import bytes_in_use, compare_allocations, without_sliding_window
from kvlab.engine.toy import random_token_ids
from kvlab.errors import KvlabValueError
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

WINDOW = 8


def engine(model_dir, **kwargs):
    return LLMEngine(model_dir, **{"num_gpu_blocks": 64, "block_size": 4, "max_num_batched_tokens": 12, **kwargs})


def test_the_window_is_part_of_the_model(tiny_ministral_dir, hf_ministral_greedy, tmp_path):
    from transformers import AutoModelForCausalLM

    from kvlab.engine.evaluation import hf_greedy

    prompt = random_token_ids(3 * WINDOW + 5, seed=20)
    full = AutoModelForCausalLM.from_pretrained(without_sliding_window(tiny_ministral_dir, tmp_path / "full")).eval()
    assert hf_greedy(full, prompt, 6) != hf_ministral_greedy(prompt, 6)


def test_the_engine_groups_layers_and_shares_tensors_across_groups(tiny_ministral_dir):
    eng = engine(tiny_ministral_dir)
    sliding, full = eng.kv_cache_groups
    assert isinstance(sliding.kv_cache_spec, SlidingWindowSpec) and sliding.kv_cache_spec.sliding_window == WINDOW
    assert isinstance(full.kv_cache_spec, FullAttentionSpec)
    assert eng.kv_caches[0] is eng.kv_caches[1] and eng.kv_caches[2] is eng.kv_caches[3]  # layer j of each group
    assert eng.kv_caches[0] is not eng.kv_caches[2]
    assert eng.bytes_per_block == 2 * sliding.kv_cache_spec.page_size_bytes  # two layers per group
    assert eng.kv_cache_bytes == eng.num_gpu_blocks * eng.bytes_per_block
    windows = [layer.self_attn.attn.sliding_window for layer in eng.model.model.layers]
    assert windows == [WINDOW, None, WINDOW, None]
    flat = engine(tiny_ministral_dir, disable_hybrid_kv_cache_manager=True)
    assert len(flat.kv_cache_groups) == 1 and flat.bytes_per_block == 2 * eng.bytes_per_block
    assert [layer.self_attn.attn.sliding_window for layer in flat.model.model.layers] == windows  # still windowed


def test_long_chunked_prompts_with_prefix_hits_and_preemption_match_transformers(tiny_ministral_dir,
                                                                                 hf_ministral_greedy):
    shared = random_token_ids(2 * WINDOW + 2, seed=21)  # a prefix of more than two windows
    prompts = [shared + random_token_ids(9, seed=22 + i) for i in range(3)]
    # 17 usable blocks; a request of 33 tokens holds up to 9 + 6: the three cannot all run, so some are preempted
    # (each prompt fits when admitted, as vLLM's admission asks, but their decodes do not: 20 blocks never preempt)
    eng = engine(tiny_ministral_dir, num_gpu_blocks=18, max_num_batched_tokens=10)
    ids = [eng.add_request(p, max_tokens=7) for p in prompts]
    saw_nulls = False
    while eng.has_unfinished_requests():
        eng.step()
        for request_id in eng.scheduler.requests:
            if request_id in eng.kv_cache_manager.req_to_blocks:
                sliding, full = eng.kv_cache_manager.get_block_ids(request_id)
                saw_nulls |= 0 in sliding
                assert 0 not in full  # full attention keeps every block
    assert [eng.outputs[i] for i in ids] == [hf_ministral_greedy(p, 7) for p in prompts]
    assert eng.metrics.num_preemptions > 0, "the pool was meant to preempt"
    assert sum(h.prefix_cache_stats.hits for h in eng.history) > 0, "the shared prefix was meant to hit"
    assert saw_nulls, "the sliding group was meant to free blocks that slid out"


def test_sliding_blocks_are_freed_while_full_attention_keeps_all(tiny_ministral_dir, hf_ministral_greedy):
    prompts = [random_token_ids(4 * WINDOW, seed=30), random_token_ids(3 * WINDOW + 3, seed=31)]
    hybrid, full = compare_allocations(tiny_ministral_dir, prompts, 10, num_gpu_blocks=64, block_size=4,
                                       max_num_batched_tokens=12)
    assert hybrid.outputs == full.outputs == [hf_ministral_greedy(p, 10) for p in prompts]
    assert hybrid.bytes_per_block * 2 == full.bytes_per_block
    # Full attention holds every token of both requests in all four layers; the windows' group only the last
    # few blocks: the peak is measured on the pool, step by step.
    assert hybrid.peak_bytes < 0.75 * full.peak_bytes
    assert len(hybrid.bytes_in_use) == len(full.bytes_in_use) and hybrid.bytes_in_use[-1] == full.bytes_in_use[-1] == 0


def test_what_the_hybrid_engine_refuses(tiny_ministral_dir):
    eng = engine(tiny_ministral_dir)
    with pytest.raises(KvlabValueError, match="several KV cache groups"):
        eng.add_request(random_token_ids(8, seed=1), n=2)
    with pytest.raises(KvlabValueError, match="disable_hybrid_kv_cache_manager"):
        engine(tiny_ministral_dir, cpu_offload_blocks=8)
    assert bytes_in_use(eng) == 0
