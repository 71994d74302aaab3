"""EngineConfig: every LLMEngine keyword checked once, before a weight is read, with one home for each rule."""

import dataclasses
import json
import shutil

import pytest

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from kvlab.core.sched.scheduler import Scheduler
from kvlab.engine import LLMEngine, llm_engine
from kvlab.engine.config import DecoderConfig
from kvlab.engine.engine_config import EngineConfig, derived_max_model_len
from kvlab.errors import KvlabValueError, UnknownNameError


def test_the_engine_and_the_scheduler_share_one_token_budget_default_and_one_preemption_check(tiny_llama_dir):
    config = EngineConfig.create(tiny_llama_dir, num_gpu_blocks=8)
    scheduler = Scheduler(KVCacheManager(8, 16))
    assert config.max_num_batched_tokens == scheduler.max_num_scheduled_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert config.scheduler_config == SchedulerConfig(max_model_len=512)
    messages = []
    for make in (lambda: EngineConfig.create(tiny_llama_dir, preemption_mode="page-out"),
                 lambda: Scheduler(KVCacheManager(8, 16), preemption_mode="page-out")):
        with pytest.raises(UnknownNameError) as refused:
            make()
        messages.append(str(refused.value))
    assert messages[0] == messages[1] == "preemption_mode='page-out' is not known; choose one of: recompute, swap"


def test_a_config_is_checked_before_any_weight_is_loaded(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    for kwargs, words in [({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
                          ({"max_num_seqs": -1}, "max_num_seqs"),
                          ({"block_size": 0}, "block_size"),
                          ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
                          ({"kv_cache_metrics_sample": 0}, "kv_cache_metrics_sample"),
                          ({"kv_cache_memory_gib": -1.0}, "kv_cache_memory_gib"),
                          ({"preemption_mode": "swap"}, "set cpu_offload_blocks"),
                          ({"max_model_len": 1024}, "max_model_len=1024 is longer than the checkpoint supports"),
                          ({"num_gpu_block": 8}, r"LLMEngine keyword='num_gpu_block' is not known")]:
        with pytest.raises(KvlabValueError, match=words):
            LLMEngine(tiny_llama_dir, **kwargs)


def test_an_engine_is_built_from_an_engine_config_as_from_its_keywords(tiny_llama_dir):
    config = EngineConfig.create(tiny_llama_dir, num_gpu_blocks=8, block_size=8, max_model_len=64)
    eng = LLMEngine(config)
    assert eng.engine_config is config and (eng.num_gpu_blocks, eng.block_size, eng.max_model_len) == (8, 8, 64)
    assert eng.scheduler.scheduler_config == config.scheduler_config
    with pytest.raises(KvlabValueError, match="not both"):
        LLMEngine(config, block_size=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32  # type: ignore[misc]


def test_max_model_len_may_not_pass_what_the_checkpoint_supports(tiny_llama_dir, tmp_path):
    assert LLMEngine(tiny_llama_dir, num_gpu_blocks=8).max_model_len == 512       # the config's own length
    assert LLMEngine(tiny_llama_dir, num_gpu_blocks=8, max_model_len=512).max_model_len == 512
    with pytest.raises(KvlabValueError, match="max_position_embeddings=512 and rope_type='default', so at most 512"):
        LLMEngine(tiny_llama_dir, num_gpu_blocks=8, max_model_len=513)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert LLMEngine(tmp_path, num_gpu_blocks=8).max_model_len == 2048            # vLLM's fallback
    assert LLMEngine(tmp_path, num_gpu_blocks=8, max_model_len=4096).max_model_len == 4096  # nothing to pass


def test_a_llama3_context_is_already_scaled_so_vllm_does_not_multiply_it(tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    llama3 = DecoderConfig.from_dict({**config, "max_position_embeddings": 131072, "rope_parameters": rope})
    assert derived_max_model_len(llama3) == 131072                           # not 8 x 131072
    assert derived_max_model_len(DecoderConfig.from_dict(config)) == 512


def test_generate_takes_any_iterable_of_prompts_but_never_one_prompt_bare(tiny_llama_dir):
    eng = LLMEngine(tiny_llama_dir, num_gpu_blocks=16)
    prompts = [[5, 6, 7], [8, 9]]
    expected = eng.generate(prompts, max_tokens=2)
    assert eng.generate(tuple(prompts), max_tokens=2) == eng.generate((p for p in prompts), max_tokens=2) == expected
    assert eng.generate([], max_tokens=2) == []
    for bare in ([5, 6, 7], (5, 6, 7), "hello", 5, range(3)):
        with pytest.raises(KvlabValueError, match="prompts must be a list of prompts"):
            eng.generate(bare, max_tokens=2)
    with pytest.raises(KvlabValueError, match="a prompt must be a string or a sequence of token ids"):
        eng.generate([[5, 6], 7], max_tokens=2)
    assert not eng.has_unfinished_requests()
