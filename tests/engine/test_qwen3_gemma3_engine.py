"""Qwen2 / Qwen3 and Gemma 3 sliding windows served by LLMEngine, token for token against transformers.

transformers' ``Qwen3Config`` slides where ``use_sliding_window`` is true: in ``layer_types``' sliding
layers, or else in layers ``max_window_layers`` and up. Tiny checkpoints written by transformers
(Qwen3 with its q/k norms, Qwen2 with its q/k/v biases; attention sharpened so the window matters)
run in the three pool settings of notebook 08: roomy, preempting and chunked.

Gemma 3 (``gemma3_text``) slides as ``Gemma3TextConfig`` says: ``layer_types``, or else every layer but each
``sliding_window_pattern``-th. Its tiny checkpoint has six layers (two sliding, one full, twice: three KV cache
groups), a scale from ``query_pre_attn_scalar``, a rotary base per layer type and norms offset from 1; it runs
in the same three pools on the torch backend, and its logits, soft-capped, equal transformers' to float32
rounding. (The Triton kernels take the same scale and window as arguments; run through the interpreter they
match too, at several seconds a pool, so they are left to the kernel tests.)
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from kvlab.capacity.hybrid import get_kv_cache_groups, layer_specs
from kvlab.capacity.models import ModelSpec, count_parameters
from kvlab.engine import LLMEngine
from kvlab.engine.config import DecoderConfig, RopeConfig, gemma3_rope_configs
from kvlab.engine.evaluation import hf_greedy, relative_error
from kvlab.engine.hybrid import without_sliding_window
from kvlab.engine.registry import model_config_from_dict
from kvlab.engine.toy import random_token_ids, save_tiny_gemma3, save_tiny_qwen
from kvlab.errors import ConfigFieldError, KvlabValueError, UnknownNameError

WINDOW = 8
#: notebook 08's pool settings: nothing in the way; a pool that must preempt; prompts chunked across steps.
POOLS = {"roomy": dict(num_gpu_blocks=64, max_num_batched_tokens=256),
         "preempting": dict(num_gpu_blocks=18, max_num_batched_tokens=10),
         "chunked": dict(num_gpu_blocks=64, max_num_batched_tokens=6)}


@functools.cache
def _checkpoint(root, model_type, layer_types):
    from transformers import AutoModelForCausalLM

    path = save_tiny_qwen(root / f"{model_type}-{bool(layer_types)}", model_type=model_type, sliding_window=WINDOW,
                          layer_types=layer_types)
    return path, functools.partial(hf_greedy, AutoModelForCausalLM.from_pretrained(path).eval())


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    return lambda model_type, layer_types=None: _checkpoint(root, model_type, layer_types)


def test_transformers_rule_picks_the_sliding_layers(qwen):
    path, _ = qwen("qwen3")
    config = json.loads((path / "config.json").read_text())
    assert config["use_sliding_window"] and config["max_window_layers"] == 2
    eng = LLMEngine(path, num_gpu_blocks=16, block_size=4)
    assert [layer.self_attn.attn.sliding_window for layer in eng.model.model.layers] == [None, None, WINDOW, WINDOW]
    assert len(eng.kv_cache_groups) == 2


def test_the_window_is_part_of_the_qwen_model(qwen, tmp_path):
    from transformers import AutoModelForCausalLM

    path, greedy = qwen("qwen3")
    prompt = random_token_ids(3 * WINDOW + 5, seed=20)
    full = AutoModelForCausalLM.from_pretrained(without_sliding_window(path, tmp_path / "full")).eval()
    assert hf_greedy(full, prompt, 6) != greedy(prompt, 6)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize(("model_type", "layer_types"), [
    ("qwen3", None), ("qwen2", None), ("qwen3", ("sliding_attention", "full_attention") * 2)])
def test_qwen_hybrids_match_transformers_in_every_pool_setting(qwen, model_type, layer_types, pool):
    path, greedy = qwen(model_type, layer_types)
    shared = random_token_ids(2 * WINDOW + 2, seed=21)
    prompts = [shared + random_token_ids(9, seed=22 + i) for i in range(3)]
    eng = LLMEngine(path, block_size=4, **POOLS[pool])
    assert eng.engine_config.hybrid_kv_cache
    assert eng.generate(prompts, max_tokens=7) == [greedy(p, 7) for p in prompts]
    if pool == "preempting":
        assert eng.metrics.num_preemptions > 0, "the pool was meant to preempt"
    if pool == "chunked":
        assert max(h.num_scheduled_tokens for h in eng.history) == 6


def test_a_qwen_checkpoint_with_use_sliding_window_false_attends_fully_as_transformers_does(qwen, tmp_path):
    import shutil

    path, _ = qwen("qwen3", ("sliding_attention", "full_attention") * 2)
    copy = shutil.copytree(path, tmp_path / "off")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "use_sliding_window": False}))
    eng = LLMEngine(copy, num_gpu_blocks=16, block_size=4)
    assert [layer.self_attn.attn.sliding_window for layer in eng.model.model.layers] == [None] * 4
    assert len(eng.kv_cache_groups) == 1


# ----------------------------------------------------------------- Gemma 3

#: The tiny Gemma 3's layers, as transformers' rule (sliding_window_pattern 3) makes them.
GEMMA3_LAYERS = ("sliding_attention", "sliding_attention", "full_attention") * 2
#: notebook 08's pool settings for the Gemma 3: its three groups take more blocks a request than the Qwen's two.
GEMMA3_POOLS = {**POOLS, "preempting": dict(num_gpu_blocks=26, max_num_batched_tokens=10)}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The tiny Gemma 3 written by transformers, and transformers' greedy on it."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3", sliding_window=WINDOW)
    return path, AutoModelForCausalLM.from_pretrained(path).eval()


def gemma3_prompts():
    shared = random_token_ids(2 * WINDOW + 2, seed=21)
    return [shared + random_token_ids(9, seed=22 + i) for i in range(3)]


def test_gemma3_slides_where_transformers_does_and_capacity_agrees(gemma3):
    path, hf = gemma3
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and hf.config.layer_types == list(GEMMA3_LAYERS)
    eng = LLMEngine(path, num_gpu_blocks=16, block_size=4)
    windows = [layer.self_attn.attn.sliding_window for layer in eng.model.model.layers]
    assert windows == [hf.model.layers[i].self_attn.sliding_window for i in range(6)] == [WINDOW, WINDOW, None] * 2
    spec = ModelSpec.from_hf_config(config)  # the capacity side reads the same file
    assert spec.layer_types == GEMMA3_LAYERS and spec.sliding_window == WINDOW
    assert eng.kv_cache_groups == get_kv_cache_groups(layer_specs(spec, 4, "fp32"))
    assert [len(g.layer_names) for g in eng.kv_cache_groups] == [2, 2, 2]  # two sliding groups and a full one
    rotations = [layer.self_attn.rotary_emb.inv_freq[1].item() for layer in eng.model.model.layers]
    assert rotations[0] != rotations[2] and rotations[0] == rotations[3]  # a base per layer type
    assert count_parameters(config) == hf.num_parameters()


@pytest.mark.parametrize("fields", [
    {"num_hidden_layers": 13},                                     # sliding_window_pattern absent: 6, five local
    {"num_hidden_layers": 7, "sliding_window_pattern": 3},
    {"num_hidden_layers": 4, "layer_types": ["full_attention", "sliding_attention"] * 2},
    {"num_hidden_layers": 6, "sliding_window": None},              # absent: transformers' default window, 4,096
])
def test_a_gemma3_config_without_layer_types_slides_by_transformers_rule(fields):
    from transformers import Gemma3TextConfig

    config = {"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8, **fields}
    config = {k: v for k, v in config.items() if v is not None}
    theirs = Gemma3TextConfig(**config)
    ours = DecoderConfig.from_dict(config)
    assert ours.layer_types == ModelSpec.from_hf_config(config).layer_types == tuple(theirs.layer_types)
    assert [ours.layer_sliding_window(i) for i in range(theirs.num_hidden_layers)] == [
        theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types]


@pytest.mark.parametrize("rope", [
    {"rope_theta": 50_000.0, "rope_local_base_freq": 500.0},       # transformers 4's spelling
    {},                                                            # neither: Gemma3TextConfig's default bases
    {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 2e5}}},  # one type named
    {"rope_theta": 3e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
])
def test_gemma3_rotations_are_read_as_transformers_reads_them(rope):
    from transformers import Gemma3TextConfig

    theirs = Gemma3TextConfig(**rope).rope_parameters
    ours = gemma3_rope_configs(rope)
    for layer_type in ("sliding_attention", "full_attention"):
        params = {k: v for k, v in theirs[layer_type].items() if k in RopeConfig.__dataclass_fields__}
        assert ours[layer_type] == RopeConfig(**params)


def test_the_window_is_part_of_the_gemma3_model(gemma3, tmp_path):
    from transformers import AutoModelForCausalLM

    path, hf = gemma3
    prompt = random_token_ids(3 * WINDOW + 5, seed=20)
    full = AutoModelForCausalLM.from_pretrained(without_sliding_window(path, tmp_path / "full")).eval()
    assert hf_greedy(full, prompt, 6) != hf_greedy(hf, prompt, 6)


@pytest.mark.parametrize("pool", GEMMA3_POOLS)
def test_gemma3_matches_transformers_in_every_pool_setting(gemma3, pool):
    path, hf = gemma3
    prompts = gemma3_prompts()
    eng = LLMEngine(path, block_size=4, attention_backend="torch", **GEMMA3_POOLS[pool])
    assert eng.engine_config.hybrid_kv_cache
    assert eng.generate(prompts, max_tokens=7) == [hf_greedy(hf, p, 7) for p in prompts]
    assert sum(h.prefix_cache_stats.hits for h in eng.history) > 0, "the shared prefix was meant to hit"
    if pool == "preempting":
        assert eng.metrics.num_preemptions > 0, "the pool was meant to preempt"
    if pool == "chunked":
        assert max(h.num_scheduled_tokens for h in eng.history) == 6


def test_gemma3_logits_soft_capped_equal_transformers(gemma3, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = gemma3
    capped = shutil.copytree(path, tmp_path / "capped")
    config = json.loads((capped / "config.json").read_text())
    (capped / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 3.0}))
    hf = AutoModelForCausalLM.from_pretrained(capped).eval()
    prompt = random_token_ids(3 * WINDOW + 1, seed=40)
    eng = LLMEngine(capped, num_gpu_blocks=32, block_size=4, max_num_batched_tokens=10, keep_logits=True)
    (tokens,) = eng.generate([prompt], max_tokens=4)
    ours = torch.stack(eng.model_runner.logits[next(iter(eng.model_runner.logits))])  # [4, vocab]
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]  # [4, vocab]
    assert ours.abs().max() < 3.0 and relative_error(ours, theirs) < 1e-5


@pytest.mark.parametrize(("change", "error", "words"), [
    ({"query_pre_attn_scalar": "256"}, ConfigFieldError, "query_pre_attn_scalar"),
    ({"query_pre_attn_scalar": 0}, ConfigFieldError, "query_pre_attn_scalar"),
    ({"query_pre_attn_scalar": None}, ConfigFieldError, "query_pre_attn_scalar"),
    ({"final_logit_softcapping": -30.0}, ConfigFieldError, "final_logit_softcapping"),
    ({"attn_logit_softcapping": "50"}, ConfigFieldError, "attn_logit_softcapping"),
    ({"rope_local_base_freq": None}, ConfigFieldError, "rope_local_base_freq"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 0}}}, ConfigFieldError,
     "rope_parameters.sliding_attention.rope_theta"),
    ({"rope_parameters": {"full_attention": "default"}}, ConfigFieldError, "rope_parameters.full_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0}}}, UnknownNameError,
     "rope_type"),
    ({"sliding_window_pattern": 0, "layer_types": None}, ConfigFieldError, "sliding_window_pattern"),
    ({"use_bidirectional_attention": "no"}, ConfigFieldError, "use_bidirectional_attention"),
    ({"use_bidirectional_attention": True}, KvlabValueError, "use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, KvlabValueError, "hidden_activation"),
    ({"sliding_window": None}, KvlabValueError, "sliding_window"),  # sliding layers and no window
    ({"layer_types": ["sliding_attention"] * 5}, KvlabValueError, "layer_types"),
    ({"layer_types": ["local_attention"] * 6}, KvlabValueError, "layer_types"),
])
def test_malformed_gemma3_fields_are_refused_by_name(gemma3, change, error, words):
    path, _ = gemma3
    config = {**json.loads((path / "config.json").read_text()), **change}
    with pytest.raises(error, match=words):
        model_config_from_dict(config)


def test_the_multimodal_gemma3_wrapper_is_refused_by_name_and_still_sized(gemma3):
    path, _ = gemma3
    text = json.loads((path / "config.json").read_text())
    wrapper = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}
    with pytest.raises(KvlabValueError, match="model_type='gemma3'.*'gemma3_text'"):
        model_config_from_dict(wrapper)
    assert ModelSpec.from_hf_config(wrapper).layer_types == GEMMA3_LAYERS


def test_a_sharded_gemma3_is_refused_by_name_before_any_rank_starts(gemma3):
    """kvlab shards the Llama family and DeepSeek-V3; its Gemma 3 decoder is one rank, and says so at the door."""
    from kvlab.engine.engine_config import EngineConfig

    path, _ = gemma3
    with pytest.raises(KvlabValueError, match="tensor_parallel_size=2.*Gemma 3"):
        EngineConfig.create(path, tensor_parallel_size=2, num_gpu_blocks=32)
