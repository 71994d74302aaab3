"""Qwen2 / Qwen3 sliding windows served by LLMEngine, token for token against transformers.

transformers' ``Qwen3Config`` slides where ``use_sliding_window`` is true: in ``layer_types``' sliding
layers, or else in layers ``max_window_layers`` and up. Tiny checkpoints written by transformers
(Qwen3 with its q/k norms, Qwen2 with its q/k/v biases; attention sharpened so the window matters)
run in the three pool settings of notebook 08: roomy, preempting and chunked.
"""

from __future__ import annotations

import functools
import json

import pytest

from kvlab.engine import LLMEngine
from kvlab.engine.evaluation import hf_greedy
from kvlab.engine.hybrid import without_sliding_window
from kvlab.engine.toy import random_token_ids, save_tiny_qwen

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
