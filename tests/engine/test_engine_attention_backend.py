"""``attention_backend``: the Triton kernels and the torch path (gather + SDPA) serve the same tokens.

Both read one paged cache through the same block tables and slot mappings; only the kernels the
attention layer calls differ (``kvlab.engine.attention.BACKEND_KERNELS``). Greedy in float32, the
two must agree token for token on the tiny random model (prompts over several blocks, a prefix
hit, a chunked prefill) and on the committed trained model with text prompts. The interpreter is
slow: the prompts are short.
"""

import pytest
import torch

from kvlab import kernels
from kvlab.data import TINY_MODEL_DIR, TINY_MODEL_SYSTEM_PROMPT, chat_prompt
from kvlab.engine import EngineConfig, LLMEngine
from kvlab.engine.attention import BACKEND_KERNELS
from kvlab.engine.engine_config import ATTENTION_BACKENDS, default_attention_backend
from kvlab.engine.toy import random_token_ids
from kvlab.errors import UnknownNameError


def serve(model_dir, backend, prompts, max_tokens, **kwargs):
    engine = LLMEngine(model_dir, attention_backend=backend, keep_logits=True, **kwargs)
    tokens = engine.generate(prompts, max_tokens=max_tokens, use_tqdm=False)
    return engine, tokens


def test_the_default_backend_is_triton_where_it_compiles_natively_and_torch_elsewhere(tiny_llama_dir):
    expected = "triton" if kernels.backend() == kernels.TRITON_CUDA else "torch"
    assert default_attention_backend() == expected
    assert EngineConfig.create(tiny_llama_dir).attention_backend == expected
    assert set(ATTENTION_BACKENDS) == set(BACKEND_KERNELS)


def test_an_unknown_backend_is_refused_by_name_before_anything_loads(tmp_path):
    # tmp_path holds no checkpoint: the name is checked first, so that is not what fails
    with pytest.raises(UnknownNameError, match="attention_backend.*flash"):
        EngineConfig.create(tmp_path, attention_backend="flash")


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_every_attention_layer_calls_its_backends_kernels(tiny_llama_dir, backend, monkeypatch):
    calls = []
    for name in {n for pair in BACKEND_KERNELS.values() for n in pair}:
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    engine, _ = serve(tiny_llama_dir, backend, [random_token_ids(10, seed=3)], 2, num_gpu_blocks=8)
    layers = engine.config.num_hidden_layers
    assert sorted(set(calls)) == sorted(BACKEND_KERNELS[backend])
    assert len(calls) == 2 * 2 * layers                                    # 2 steps x (write, attend) x layers


def test_both_backends_give_identical_tokens_on_the_tiny_model(tiny_llama_dir):
    system = random_token_ids(40, seed=20)                                 # shared: the second prompt hits it
    prompts = [system + random_token_ids(9, seed=21), system + random_token_ids(30, seed=22),
               random_token_ids(5, seed=23)]
    runs = {b: serve(tiny_llama_dir, b, prompts, 6, num_gpu_blocks=24, block_size=16, max_num_batched_tokens=48)
            for b in ATTENTION_BACKENDS}
    (triton_engine, triton_tokens), (torch_engine, torch_tokens) = runs["triton"], runs["torch"]
    assert triton_tokens == torch_tokens
    assert torch_engine.metrics.prefix_cache_hits == triton_engine.metrics.prefix_cache_hits >= 32  # 2 blocks hit
    assert max(s.num_scheduled_tokens for s in torch_engine.history) == 48                           # chunked
    for request_id, rows in triton_engine.model_runner.logits.items():
        torch.testing.assert_close(torch.stack(torch_engine.model_runner.logits[request_id]), torch.stack(rows),
                                   rtol=1e-4, atol=1e-4)


def test_both_backends_give_identical_tokens_on_the_trained_model_with_text():
    prompts = [chat_prompt('What does the documentation say about the "for" statement?'),
               chat_prompt("Tell me about the import statement.")]
    assert TINY_MODEL_SYSTEM_PROMPT in prompts[0]
    # float32 on both: "auto" would serve this bf16 checkpoint in bf16 on torch, in float32 under the interpreter
    runs = {b: serve(TINY_MODEL_DIR, b, prompts, 8, num_gpu_blocks=16, max_model_len=512, dtype="float32")[1]
            for b in ATTENTION_BACKENDS}
    assert runs["triton"] == runs["torch"]
    assert all(len(t) == 8 for t in runs["torch"])


def test_chat_prompt_is_what_the_checkpoints_chat_template_writes():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    messages = [{"role": "system", "content": TINY_MODEL_SYSTEM_PROMPT}, {"role": "user", "content": "What is a list?"}]
    assert chat_prompt("What is a list?") == tokenizer.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)


def test_both_backends_give_identical_tokens_on_the_hybrid_model_past_its_window(tiny_ministral_dir,
                                                                                 hf_ministral_greedy):
    # windows of 8 in blocks of 4: blocks that slid out are the null block in the table, which neither may read
    prompts = [random_token_ids(29, seed=30), random_token_ids(13, seed=31)]
    runs = {b: serve(tiny_ministral_dir, b, prompts, 6, num_gpu_blocks=64, block_size=4, max_num_batched_tokens=12)
            for b in ATTENTION_BACKENDS}
    assert runs["triton"][1] == runs["torch"][1] == [hf_ministral_greedy(p, 6) for p in prompts]


def test_an_mla_model_keeps_its_own_kernels_under_either_backend(tiny_deepseek_dir):
    # MLA layers read a latent cache through kvlab.kernels.mla_decode; attention_backend names the K/V kernels only
    prompts = [random_token_ids(12, seed=40)]
    runs = {b: serve(tiny_deepseek_dir, b, prompts, 3, num_gpu_blocks=16) for b in ATTENTION_BACKENDS}
    assert runs["triton"][1] == runs["torch"][1]
    engine = runs["torch"][0]
    assert engine.engine_config.attention_backend == "torch"
    assert not [m for m in engine.model.modules() if hasattr(m, "attention_backend")]
