"""kvlab's decoder: it reads real checkpoints and computes what transformers computes, on the paged cache."""

import json
import shutil

import pytest
import torch
from kvlab.kernels import default_device
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvlab.engine import AttentionMetadata, DecoderConfig, load_model
from kvlab.engine.config import rope_config
from kvlab.engine.evaluation import relative_error
from kvlab.engine.rope import rope_inv_freq
from kvlab.engine.toy import random_token_ids
from kvlab.errors import KvlabValueError, MissingConfigKeyError, UnknownNameError

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def paged_forward(model, token_ids, block_ids, block_size=16, chunks=None):
    """Run one sequence through the model on a fresh paged cache, chunk by chunk; logits of every token.

    Runs where the kernels run (``default_device()``: the GPU with native Triton, else the CPU).
    """
    cfg, device = model.config, default_device()
    model.to(device)
    shape = (max(block_ids) + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
              for _ in range(cfg.num_hidden_layers)]
    table = torch.tensor([block_ids], dtype=torch.int32, device=device)
    logits, done = [], 0
    for size in chunks or [len(token_ids)]:
        pos = torch.arange(done, done + size, device=device)
        slots = table[0, pos // block_size].long() * block_size + pos % block_size
        meta = AttentionMetadata(slots, table, torch.tensor([done + size], dtype=torch.int32, device=device),
                                 torch.tensor([0, size], dtype=torch.int32, device=device))
        with torch.no_grad():
            ids = torch.tensor(token_ids[done:done + size], device=device)
            logits.append(model.compute_logits(model(ids, pos, caches, meta)).cpu())
        done += size
    return torch.cat(logits)


# ----------------------------------------------------------------- config.json


def test_rope_parameters_are_read_from_both_spellings():
    new = {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}}
    old = {"rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE, "type": "llama3"}}
    assert rope_config(new) == rope_config(old)
    assert rope_config({}).rope_type == "default" and rope_config({}).rope_theta == 10000.0


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0},
                                  {**LLAMA3_ROPE, "rope_theta": 500000.0}])
def test_rotary_frequencies_equal_transformers(rope):
    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=dict(rope))
    expected = LlamaRotaryEmbedding(hf_config).inv_freq
    ours = rope_inv_freq(rope_config(hf_config.to_dict()), 64)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("change, error, words", [
    ({"model_type": "gpt2"}, UnknownNameError, "model_type"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, UnknownNameError, "rope_type"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6}}, MissingConfigKeyError, "factor"),
    ({"hidden_act": "gelu"}, KvlabValueError, "hidden_act"),
    ({"sliding_window": 4096}, KvlabValueError, "sliding_window"),  # a Llama has no window in transformers
])
def test_architectures_kvlab_cannot_run_are_refused_by_name(tiny_llama_dir, change, error, words):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(error, match=words):
        DecoderConfig.from_dict({**config, **change})


def test_mistral_and_ministral_windows_are_read_layer_by_layer(tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    mistral = DecoderConfig.from_dict({**config, "model_type": "mistral", "sliding_window": 64})
    assert mistral.layer_types == ("sliding_attention",) * 2 and mistral.layer_sliding_window(1) == 64
    ministral = DecoderConfig.from_dict({**config, "model_type": "ministral", "sliding_window": 8,
                                         "layer_types": ["sliding_attention", "full_attention"]})
    assert (ministral.layer_sliding_window(0), ministral.layer_sliding_window(1)) == (8, None)


def test_a_qwen2_config_with_its_window_switched_off_is_accepted(tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg = DecoderConfig.from_dict({**config, "model_type": "qwen2", "use_sliding_window": False,
                                   "sliding_window": 32768})
    assert cfg.num_queries_per_kv == 2 and not cfg.qk_norm


# ----------------------------------------------------------------- loading


def test_a_sharded_checkpoint_loads_the_same_weights(tiny_llama_dir, hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    one, sharded = load_model(tiny_llama_dir).state_dict(), load_model(tmp_path).state_dict()
    assert one.keys() == sharded.keys() and all(torch.equal(one[k], sharded[k]) for k in one)


def test_a_missing_tensor_or_weight_file_is_named(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(tiny_llama_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(KvlabValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(KvlabValueError, match="safetensors"):
        load_model(tmp_path)


def test_tied_embeddings_are_one_matrix(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


# ----------------------------------------------------------------- the forward on the paged cache


def test_logits_match_transformers_on_a_scattered_block_table(tiny_llama_dir, hf_model):
    prompt = random_token_ids(40, seed=1)
    ours = paged_forward(load_model(tiny_llama_dir), prompt, block_ids=[7, 2, 5])  # 40 tokens: 3 blocks of 16
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0]
    assert relative_error(ours, reference) < 1e-5


def test_a_prefill_in_chunks_gives_the_logits_of_one_pass(tiny_llama_dir):
    model, prompt = load_model(tiny_llama_dir), random_token_ids(40, seed=2)
    whole = paged_forward(model, prompt, block_ids=[3, 1, 4])
    chunked = paged_forward(model, prompt, block_ids=[3, 1, 4], chunks=[13, 16, 1, 10])  # chunks cross blocks
    assert relative_error(chunked, whole) < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_biases_and_qk_norms_match_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    config_cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    config = config_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random biases and norms, so a model that ignored them would fail
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                p.copy_(torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert hasattr(model.model.layers[0].self_attn, "q_norm") == (family == "qwen3")
    assert (model.model.layers[0].self_attn.q_proj.bias is not None) == (family == "qwen2")
    prompt = random_token_ids(20, seed=3)
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0]
    assert relative_error(paged_forward(model, prompt, block_ids=[2, 1]), reference) < 1e-5
