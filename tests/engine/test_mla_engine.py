"""LLMEngine serves the tiny DeepSeek-V3 through its latent cache, token for token with transformers.

The same engine as for the Llama: the registry picks DeepSeek's config, model and KV spec by
``model_type``; each layer's cache is one latent tensor ``[num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim]``; decodes go through the absorbed Triton kernel, prefills decompress. Every scenario
that moves latents around (batches, prefix hits, chunked prefill, preemption, forks with copy-on-write,
the CPU tier, contexts of many tiles with split decodes) must leave the greedy tokens unchanged, and the
first tests prove that the comparison can fail.
"""

import kvlab.kernels
import pytest
import torch

from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.engine import LLMEngine, load_model, mla
from kvlab.engine.deepseek import DeepseekV2ForCausalLM
from kvlab.engine.evaluation import hf_greedy
from kvlab.engine.hard_paths import MLA_HARD_PATH_CONFIG, compare_hard_paths
from kvlab.engine.registry import supported_model_types
from kvlab.engine.toy import random_token_ids
from kvlab.errors import CheckpointError, KvlabValueError
from kvlab.kv_cache_interface import MLAAttentionSpec
from kvlab.units import cdiv


def engine(model_dir, **kwargs):
    return LLMEngine(model_dir, **{"num_gpu_blocks": 48, **kwargs})


# ----------------------------------------------------------------- the pool


def test_the_pool_holds_one_latent_per_token_and_layer_exactly_as_planned(tiny_deepseek_dir):
    eng = engine(tiny_deepseek_dir, num_gpu_blocks=40)
    cfg = eng.config
    assert isinstance(eng.model, DeepseekV2ForCausalLM) and cfg.model_type == "deepseek_v3"
    assert eng.kv_cache_specs == [MLAAttentionSpec(block_size=16, head_size=32 + 8, dtype=torch.float32)] * 2
    spec = eng.kv_cache_specs[0]
    assert (spec.num_kv_heads, spec.head_size_v, spec.max_tp_shards) == (1, 0, 1)     # no V; replicated under TP
    assert all(isinstance(c, torch.Tensor) and tuple(c.shape) == (40, 16, 40) for c in eng.kv_caches)
    per_token = kv_bytes_per_token(cfg.spec, "fp32")
    assert per_token == 2 * 1 * 40 * 4 == 320                                          # f = 1, one head of L + R
    assert eng.plan.bytes_per_block == sum(s.page_size_bytes for s in eng.kv_cache_specs) == 16 * per_token
    assert eng.kv_cache_bytes == eng.plan.kv_pool_bytes == 40 * 16 * per_token
    assert eng.startup_log()[1:] == ["GPU KV cache size: 640 tokens, Maximum concurrency for 512 tokens per "
                                     "request: 1.25x"]


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_for_either_family_the_allocated_pool_is_the_planned_pool(family, tiny_llama_dir, tiny_deepseek_dir):
    eng = LLMEngine(tiny_llama_dir if family == "llama" else tiny_deepseek_dir, kv_cache_memory_gib=0.001)
    assert eng.kv_cache_bytes == eng.plan.kv_pool_bytes == eng.num_gpu_blocks * eng.plan.bytes_per_block
    assert eng.plan.kv_bytes_per_token * eng.block_size == sum(s.page_size_bytes for s in eng.kv_cache_specs)


def test_an_fp8_latent_cache_is_a_quarter_of_float32_and_still_serves(tiny_deepseek_dir, hf_deepseek):
    prompts = [random_token_ids(n, seed=40 + n) for n in (9, 30)]
    fp8, full = engine(tiny_deepseek_dir, kv_cache_dtype="fp8"), engine(tiny_deepseek_dir)
    assert fp8.kv_caches[0].dtype == torch.float8_e4m3fn and 4 * fp8.kv_cache_bytes == full.kv_cache_bytes
    out = fp8.generate(prompts, max_tokens=4)
    assert [o[0] for o in out] == [hf_greedy(hf_deepseek, p, 1)[0] for p in prompts]  # the prefill reads e4m3 too


def test_the_registry_reads_deepseek_and_llama_alike_and_names_every_supported_type(tiny_deepseek_dir, tmp_path):
    assert type(load_model(tiny_deepseek_dir)).__name__ == "DeepseekV2ForCausalLM"
    assert {"llama", "ministral", "qwen3", "deepseek_v3"} <= set(supported_model_types())
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match="deepseek_v3") as info:
        LLMEngine(tmp_path)
    assert "llama" in str(info.value) and "config.json" in str(info.value)


@pytest.mark.parametrize("family", ["llama", "ministral", "deepseek"])
def test_one_registry_shapes_every_family_and_its_groups_page_what_each_layer_allocates(
        family, tiny_llama_dir, tiny_ministral_dir, tiny_deepseek_dir):
    """The manager's KV cache groups (page bytes) and the engine's per-layer specs (tensors) tell one story."""
    model_dir = {"llama": tiny_llama_dir, "ministral": tiny_ministral_dir, "deepseek": tiny_deepseek_dir}[family]
    eng = engine(model_dir)
    expected = {"llama": "LlamaForCausalLM", "ministral": "LlamaForCausalLM", "deepseek": "DeepseekV2ForCausalLM"}
    assert type(eng.model).__name__ == expected[family]
    assert len(eng.kv_cache_groups) == (2 if family == "ministral" else 1)        # sliding layers apart
    for group in eng.kv_cache_groups:
        for name in group.layer_names:
            layer = int(name.split(".")[2])
            assert group.kv_cache_spec.page_size_bytes == eng.kv_cache_specs[layer].page_size_bytes
    assert isinstance(eng.kv_caches[0], torch.Tensor) == (family == "deepseek")     # a latent, or (K, V)
    assert eng.kv_cache_bytes == eng.num_gpu_blocks * eng.plan.bytes_per_block


def test_a_kernel_config_the_mla_decode_cannot_run_is_refused_and_changes_nothing(tiny_deepseek_dir):
    eng = engine(tiny_deepseek_dir)
    with pytest.raises(KvlabValueError, match="block_q must be 1"):
        eng.model_runner.kernel_config = kvlab.kernels.KernelConfig(block_q=32, block_m=64, tile_n=16)
    assert eng.model_runner.kernel_config is None
    eng.model_runner.kernel_config = MLA_HARD_PATH_CONFIG
    layers = eng.model_runner._attention_layers()
    assert len(layers) == 2 and all(m.kernel_config is MLA_HARD_PATH_CONFIG for m in layers)


# ----------------------------------------------------------------- the comparison can fail


def test_zeroing_the_latents_after_the_prefill_changes_the_tokens(tiny_deepseek_dir, hf_deepseek):
    prompt = random_token_ids(24, seed=41)
    eng = engine(tiny_deepseek_dir)
    eng.add_request(prompt, max_tokens=6, request_id="r")
    eng.step()                                                  # the prefill wrote 24 latents per layer
    for latent in eng.kv_caches:
        latent.zero_()
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.outputs["r"][0] == hf_greedy(hf_deepseek, prompt, 1)[0]
    assert eng.outputs["r"] != hf_greedy(hf_deepseek, prompt, 6)


def test_a_decode_whose_score_drops_the_rope_part_changes_the_tokens(tiny_deepseek_dir, hf_deepseek, monkeypatch):
    real = kvlab.kernels.mla_decode

    def rope_dropped(q_latent, q_pe, *args, **kwargs):          # score = q_latent . c_kv only
        return real(q_latent, torch.zeros_like(q_pe), *args, **kwargs)

    monkeypatch.setattr(kvlab.kernels, "mla_decode", rope_dropped)
    prompts = [random_token_ids(n, seed=42 + n) for n in (12, 33)]
    assert engine(tiny_deepseek_dir).generate(prompts, max_tokens=6) != [hf_greedy(hf_deepseek, p, 6)
                                                                          for p in prompts]


def test_a_decode_whose_query_skips_w_uk_changes_the_tokens(tiny_deepseek_dir, hf_deepseek, monkeypatch):
    def without_w_uk(q_nope, w_uk):                              # q_nope padded into latent space, W_UK forgotten
        return torch.nn.functional.pad(q_nope, (0, w_uk.shape[0] - q_nope.shape[-1]))

    monkeypatch.setattr(mla, "absorb_query", without_w_uk)
    prompts = [random_token_ids(n, seed=42 + n) for n in (12, 33)]
    out = engine(tiny_deepseek_dir).generate(prompts, max_tokens=6)
    reference = [hf_greedy(hf_deepseek, p, 6) for p in prompts]
    assert [o[0] for o in out] == [r[0] for r in reference]     # the prefill decompresses: its token is right
    assert out != reference


# ----------------------------------------------------------------- token for token


def test_a_batch_of_lengths_around_block_edges_matches_transformers(tiny_deepseek_dir, hf_deepseek):
    prompts = [random_token_ids(n, seed=50 + n) for n in (3, 16, 17, 33)]
    eng = engine(tiny_deepseek_dir)
    assert eng.generate(prompts, max_tokens=6) == [hf_greedy(hf_deepseek, p, 6) for p in prompts]
    assert max(h.num_running_reqs for h in eng.history) == 4


def test_prefix_hits_read_latents_other_requests_wrote(tiny_deepseek_dir, hf_deepseek):
    system = random_token_ids(32, seed=60)                      # two full blocks
    prompts = [system + random_token_ids(5, seed=61 + i) for i in range(3)]
    eng = engine(tiny_deepseek_dir)
    out = eng.generate(prompts[:1], max_tokens=4) + eng.generate(prompts[1:], max_tokens=4)
    assert out == [hf_greedy(hf_deepseek, p, 4) for p in prompts]
    assert eng.metrics.prefix_cache_hits == 2 * 32


def test_chunked_prefill_and_preemption_by_recompute_leave_the_tokens_unchanged(tiny_deepseek_dir, hf_deepseek):
    prompts = [random_token_ids(n, seed=70 + n) for n in (40, 37, 29)]
    # 8 blocks of 16 for three requests of 45 to 52 tokens: the scheduler must preempt; 20-token chunks
    eng = engine(tiny_deepseek_dir, num_gpu_blocks=9, max_num_batched_tokens=20, enable_prefix_caching=False)
    out = eng.generate(prompts, max_tokens=12)
    assert out == [hf_greedy(hf_deepseek, p, 12) for p in prompts]
    assert eng.metrics.num_preemptions > 0
    assert max(h.num_prefill_tokens for h in eng.history) <= 20


def test_parallel_samples_share_the_prompts_latents_and_copy_the_last_block(tiny_deepseek_dir):
    prompt = random_token_ids(40, seed=80)                      # two full blocks and 8 tokens of a third
    forked = engine(tiny_deepseek_dir, enable_prefix_caching=False)
    samples = forked.generate([prompt], max_tokens=5, n=3, temperature=1.0, seed=0)[0]
    assert sum(h.num_block_copies for h in forked.history) == 2   # two copy the half-full block, one keeps it
    alone = engine(tiny_deepseek_dir, enable_prefix_caching=False)
    ids = [alone.add_request(prompt, max_tokens=5, temperature=1.0, seed=i) for i in range(3)]
    while alone.has_unfinished_requests():
        alone.step()
    # sample i of the fork draws with seed 0 + i, as the independent request i does: any wrong byte copied shows
    assert samples == [alone.outputs[i] for i in ids] and len({tuple(s) for s in samples}) > 1


def test_swapping_latents_to_the_cpu_tier_and_back_matches_transformers(tiny_deepseek_dir, hf_deepseek):
    prompts = [random_token_ids(n, seed=90 + n) for n in (40, 37, 29)]
    eng = engine(tiny_deepseek_dir, num_gpu_blocks=9, cpu_offload_blocks=16, preemption_mode="swap",
                 enable_prefix_caching=False)
    assert all(isinstance(c, torch.Tensor) and c.shape[0] == 16 for c in eng.cpu_kv_caches)
    assert eng.generate(prompts, max_tokens=12) == [hf_greedy(hf_deepseek, p, 12) for p in prompts]
    assert eng.metrics.num_preemptions > 0


def test_contexts_of_many_tiles_split_decodes_and_chunk_edges_inside_a_tile(tiny_deepseek_dir, hf_deepseek):
    run = compare_hard_paths(tiny_deepseek_dir, hf_deepseek)
    assert run.equal, (run.kvlab, run.transformers)
    assert run.tile_n == MLA_HARD_PATH_CONFIG.tile_n == 16
    assert run.max_context >= 150 and run.max_tiles == cdiv(run.max_context, 16) >= 10
    assert run.split_decode_steps > 0 and run.decode_kv_splits == 2
    assert run.chunk_boundaries[:3] == [44, 88, 132] == run.boundaries_inside_a_tile[:3]


def test_the_throughput_measurement_times_the_mla_kernels(tiny_deepseek_dir):
    from kvlab.engine.evaluation import measure_throughput

    prompts = [random_token_ids(n, seed=95 + n) for n in (6, 11)]
    speed = measure_throughput(tiny_deepseek_dir, prompts, max_tokens=3, num_gpu_blocks=16)
    assert speed["kvlab_tokens"] == speed["hf_tokens"] == 6
    assert speed["reshape_and_cache_seconds"] == speed["paged_attention_seconds"] == 0   # no K/V kernel runs
    assert speed["mla_kernel_seconds"] == speed["kernel_seconds"] > 0
    # per layer: a latent write every step, a decode launch every step but the prefill
    assert speed["kernel_calls"] == 2 * speed["steps"] + 2 * (speed["steps"] - 1)


def test_the_engine_allocates_from_the_same_spec_classes():
    """``page_size_bytes`` is a property of the spec, and the engine's tensors hold exactly that many bytes."""
    from kvlab.engine.kv_cache_interface import allocate_kv_cache, layer_tensors
    from kvlab.kv_cache_interface import AttentionSpec, FullAttentionSpec, SlidingWindowSpec

    assert isinstance(AttentionSpec.page_size_bytes, property)
    for spec in (FullAttentionSpec(16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16),
                 SlidingWindowSpec(16, num_kv_heads=2, head_size=8, dtype="fp8", sliding_window=32),
                 MLAAttentionSpec(block_size=16, head_size=24, dtype="fp32")):
        tensors = layer_tensors(allocate_kv_cache(spec, 3, device="meta"))
        assert sum(t.numel() * t.element_size() for t in tensors) == 3 * spec.page_size_bytes
