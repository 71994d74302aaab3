"""Fixtures of the engine tests: one tiny seeded Llama checkpoint per session, and its transformers twin."""

import functools

import pytest

from kvlab.engine import evaluation, save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer GQA Llama written by transformers' save_pretrained (config.json + model.safetensors)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hf_model(tiny_llama_dir):
    """The same checkpoint loaded by transformers: the reference every engine test compares with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """``hf_greedy(prompt, max_tokens)``: transformers' own greedy generate, with its regular contiguous cache."""
    return functools.partial(evaluation.hf_greedy, hf_model)


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory):
    """A 2-layer DeepSeek-V3-style checkpoint (MLA, one dense and one MoE layer) written by save_pretrained."""
    from kvlab.engine.toy_mla import save_tiny_deepseek

    return save_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"))


@pytest.fixture(scope="session")
def hf_deepseek(tiny_deepseek_dir):
    """The same checkpoint loaded by transformers' DeepseekV3ForCausalLM: the reference for the MLA tests."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_deepseek_dir).eval()


@pytest.fixture(scope="session")
def tiny_ministral_dir(tmp_path_factory):
    """A 4-layer Ministral (sliding window of 8 and full attention in turn) written by save_pretrained."""
    from kvlab.engine.toy import save_tiny_ministral

    return save_tiny_ministral(tmp_path_factory.mktemp("tiny-ministral"), sliding_window=8)


@pytest.fixture(scope="session")
def hf_ministral_greedy(tiny_ministral_dir):
    """transformers' greedy generate on the tiny Ministral: the reference of the hybrid engine tests."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_ministral_dir).eval()
    return functools.partial(evaluation.hf_greedy, model)
