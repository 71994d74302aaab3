"""Tenants of one engine: without a salt one can read another's prompt off vllm:prefix_cache_hits; with salts not."""

import pytest

from kvlab.engine import LLMEngine
from kvlab.engine.tenants import guess_token, probe_hits
from kvlab.engine.toy import random_token_ids
from kvlab.errors import KvlabValueError


def shared_engine(model_dir):
    return LLMEngine(model_dir, num_gpu_blocks=64, block_size=4)


def test_only_requests_with_the_same_salt_share_cached_blocks(tiny_llama_dir):
    eng = shared_engine(tiny_llama_dir)
    prompt = random_token_ids(9, seed=1)                      # two full blocks of 4
    eng.generate([prompt], max_tokens=1, cache_salt="tenant-a")
    assert probe_hits(eng, prompt) == 0                       # no salt is another tenant
    assert probe_hits(eng, prompt, cache_salt="tenant-b") == 0
    assert probe_hits(eng, prompt, cache_salt="tenant-a") == 8


def test_without_salts_a_tenant_confirms_another_tenants_prompt_token_by_token(tiny_llama_dir):
    secret = random_token_ids(8, seed=2)                      # tenant A's prompt: blocks [0..3], [4..7]
    eng = shared_engine(tiny_llama_dir)
    eng.generate([secret], max_tokens=1)
    candidates = [secret[3], 11, 12, 13]
    token, hits = guess_token(eng, secret[:3], candidates)
    assert token == secret[3] and hits == {secret[3]: 4, 11: 0, 12: 0, 13: 0}
    token, hits = guess_token(eng, secret[:7], [20, secret[7], 21])
    assert token == secret[7] and hits == {20: 4, secret[7]: 8, 21: 4}   # block 0 is known now: 4 for all


def test_with_a_salt_per_tenant_the_counter_tells_nothing(tiny_llama_dir):
    secret = random_token_ids(8, seed=2)
    eng = shared_engine(tiny_llama_dir)
    eng.generate([secret], max_tokens=1, cache_salt="tenant-a")
    token, hits = guess_token(eng, secret[:3], [secret[3], 11, 12, 13], cache_salt="tenant-b")
    assert token is None and set(hits.values()) == {0}


def test_a_lora_name_is_refused_because_the_engine_has_no_adapters(tiny_llama_dir):
    eng = shared_engine(tiny_llama_dir)
    with pytest.raises(KvlabValueError, match="no LoRA adapters"):
        eng.add_request([5, 6, 7], lora_name="sql-adapter")
    with pytest.raises(KvlabValueError, match="cache_salt"):
        eng.add_request([5, 6, 7], cache_salt="")
    with pytest.raises(KvlabValueError, match="multiple of the block size 4"):
        guess_token(eng, [5, 6], [1, 2])
    assert not eng.has_unfinished_requests()
