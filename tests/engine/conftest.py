"""Fixtures of the engine tests: one tiny seeded Llama checkpoint per session, and its transformers twin."""

import pytest
import torch

from kvlab.engine import save_tiny_llama


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

    def generate(prompt, max_tokens):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        tokens = out[0, len(prompt):].tolist()
        eos = hf_model.generation_config.eos_token_id
        return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens  # drop the padding after EOS

    return generate

