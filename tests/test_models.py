"""ModelSpec from real config.json files: the fields a KV cache depends on, read as vLLM reads them."""

import json

import pytest

from kvlab import GiB, ModelSpec, get_model, list_models
from kvlab.capacity.models import (
    MODELS_DIR,
    PARAMETER_PARTS,
    count_parameters,
    parameter_parts,
    params_bytes,
    weights_bytes,
)
from kvlab.errors import KvlabValueError, MissingConfigKeyError, UnknownNameError

REQUIRED_PRESETS = {"llama-2-7b", "llama-3-8b", "llama-3-70b", "deepseek-v3", "qwen3-8b", "mistral-7b-v0.1"}


def test_the_required_presets_ship_and_one_mixes_sliding_and_full_layers():
    names = set(list_models())
    assert names >= REQUIRED_PRESETS
    mixed = [n for n in names if 0 < get_model(n).num_sliding_layers < get_model(n).num_layers]
    assert mixed, "one preset must mix sliding-window and full-attention layers"


@pytest.mark.parametrize(
    ("name", "attention", "layers", "kv_heads", "head_dim", "f"),
    [
        ("llama-2-7b", "mha", 32, 32, 128, 2),
        ("llama-3-8b", "gqa", 32, 8, 128, 2),
        ("llama-3-70b", "gqa", 80, 8, 128, 2),
        ("qwen3-8b", "gqa", 36, 8, 128, 2),
        ("mistral-7b-v0.1", "gqa", 32, 8, 128, 2),
        ("deepseek-v3", "mla", 61, 1, 576, 1),
        ("gpt-oss-20b", "gqa", 24, 8, 64, 2),
        ("gemma-2-9b", "gqa", 42, 8, 256, 2),
    ],
)
def test_presets_read_the_shape_of_their_attention(name, attention, layers, kv_heads, head_dim, f):
    m = get_model(name)
    assert (m.attention, m.num_layers, m.num_kv_heads, m.head_dim, m.kv_factor) == (
        attention, layers, kv_heads, head_dim, f)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("llama-2-7b", 6_738_415_616),
        ("llama-3-8b", 8_030_261_248),
        ("llama-3-70b", 70_553_706_496),
        ("mistral-7b-v0.1", 7_241_732_096),
        ("qwen3-8b", 8_190_735_360),
        ("gemma-2-9b", 9_241_705_984),
    ],
)
def test_parameter_counts_match_the_published_sizes(name, params):
    assert get_model(name).num_params == params


def test_moe_parameter_counts_are_the_advertised_totals():
    assert round(get_model("deepseek-v3").num_params / 1e9) == 671  # without the MTP layer
    assert round(get_model("gpt-oss-20b").num_params / 1e9, 1) == 20.9


def test_mla_is_recognised_by_its_latent_not_its_head_count():
    cfg = json.loads((MODELS_DIR / "deepseek-v3.json").read_text())
    assert cfg["num_key_value_heads"] == 128  # what the file says ...
    m = ModelSpec.from_hf_config(cfg)
    assert (m.num_kv_heads, m.head_dim) == (1, 512 + 64)  # ... and what the cache holds
    assert m.mha_equivalent().num_kv_heads == 128 and m.mha_equivalent().head_dim == 128


def test_absent_kv_heads_means_mha_and_absent_head_dim_is_hidden_over_heads():
    m = ModelSpec.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512})
    assert (m.attention, m.num_kv_heads, m.head_dim) == ("mha", 8, 64)
    assert ModelSpec.from_hf_config(
        {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 1, "hidden_size": 512}
    ).attention == "mqa"


def test_sliding_window_rules_per_family():
    assert get_model("mistral-7b-v0.1").num_sliding_layers == 32  # every layer slides
    gemma = get_model("gemma-2-9b")
    assert gemma.layer_types[:2] == ("sliding_attention", "full_attention") and gemma.num_sliding_layers == 21
    assert get_model("gpt-oss-20b").layer_types == ("sliding_attention", "full_attention") * 12
    assert get_model("qwen3-8b").num_sliding_layers == 0  # use_sliding_window is false
    qwen_window = {"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64,
                   "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 2}
    assert ModelSpec.from_hf_config(qwen_window).layer_types == (
        "full_attention", "full_attention", "sliding_attention", "sliding_attention")


def test_multimodal_configs_are_read_through_text_config():
    cfg = {"model_type": "llava", "text_config": {"num_hidden_layers": 4, "num_attention_heads": 8,
                                                   "num_key_value_heads": 2, "hidden_size": 256}}
    assert ModelSpec.from_hf_config(cfg).num_kv_heads == 2


def test_weights_dtype_comes_from_quantization_then_torch_dtype():
    assert get_model("deepseek-v3").weights_dtype == "fp8"
    assert get_model("llama-3-70b").weights_dtype == "bf16"
    assert get_model("llama-2-7b").weights_dtype == "fp16"
    assert weights_bytes(get_model("llama-3-70b")) == 2 * 70_553_706_496
    assert weights_bytes(get_model("llama-3-70b"), "fp8") == 70_553_706_496


@pytest.mark.parametrize("missing", ["num_hidden_layers", "num_attention_heads", "hidden_size"])
def test_a_missing_required_key_is_named(missing):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512}
    del cfg[missing]
    with pytest.raises(MissingConfigKeyError, match=missing):
        ModelSpec.from_hf_config(cfg)


def test_an_mla_config_without_its_rope_dim_is_named():
    with pytest.raises(MissingConfigKeyError, match="qk_rope_head_dim"):
        ModelSpec.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 8, "kv_lora_rank": 64})


@pytest.mark.parametrize("bad", [0, -1, 2.5, "32", True])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(KvlabValueError, match="num_hidden_layers"):
        ModelSpec.from_hf_config({"num_hidden_layers": bad, "num_attention_heads": 8, "hidden_size": 512})


def test_unknown_preset_lists_the_presets():
    with pytest.raises(UnknownNameError) as info:
        get_model("llama-9")
    assert isinstance(info.value, ValueError)
    assert "llama-3-8b" in str(info.value)


def test_unknown_layer_type_is_refused_with_its_name():
    with pytest.raises(KvlabValueError, match="linear_attention"):
        ModelSpec.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512,
                                  "layer_types": ["linear_attention", "full_attention"]})


def test_unknown_families_have_no_parameter_count():
    assert count_parameters({"model_type": "mamba", "hidden_size": 1, "vocab_size": 1,
                             "num_hidden_layers": 1, "num_attention_heads": 1}) is None


def test_nominal_parameter_counts_are_priced_like_counted_ones():
    llama70 = get_model("llama-3-70b")
    assert round(params_bytes(70e9, "bf16") / GiB, 2) == 130.39          # the source's "130 GiB"
    assert round(weights_bytes(llama70) / GiB, 1) == 131.4                # counted from config.json
    assert weights_bytes(llama70, "fp8") == params_bytes(llama70.num_params, "fp8")
    with pytest.raises(UnknownNameError, match="weights_dtype"):
        params_bytes(70e9, "fp7")
    with pytest.raises(KvlabValueError, match="num_params"):
        params_bytes(-1, "bf16")


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_deepseek_counts_equal_transformers_model_with_or_without_a_query_latent(q_lora_rank):
    # without q_lora_rank (DeepSeek-V2-Lite's style) the query is one q_proj of H x heads x (nope + rope)
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from kvlab.engine.toy_mla import TINY_DEEPSEEK

    config = DeepseekV3Config(**{**TINY_DEEPSEEK, "q_lora_rank": q_lora_rank})
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    counted = sum(p.numel() for p in model.parameters())
    bias = sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    assert count_parameters(config.to_dict()) == counted + bias      # transformers keeps the router's bias a buffer
    parts = parameter_parts(config.to_dict())
    assert sum(parts.values()) == count_parameters(config.to_dict())
    assert parts["routed_experts"] == sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)


def test_a_deepseek_config_without_a_latent_or_a_field_has_no_count_rather_than_an_error():
    config = dict(get_model("deepseek-v3").config)
    assert count_parameters({**config, "kv_lora_rank": None}) is None
    assert count_parameters({k: v for k, v in config.items() if k != "moe_intermediate_size"}) is None
    H, heads, r_q = config["hidden_size"], config["num_attention_heads"], config["q_lora_rank"]
    q_proj, latent_path = H * heads * 192, H * r_q + r_q + r_q * heads * 192    # 192 = nope 128 + rope 64
    no_latent = count_parameters({**config, "q_lora_rank": None})
    assert no_latent - count_parameters(config) == config["num_hidden_layers"] * (q_proj - latent_path)


def test_expert_parallelism_splits_the_routed_experts_only_and_they_are_most_of_deepseek_v3():
    parts = parameter_parts(get_model("deepseek-v3").config)
    assert set(parts) == set(PARAMETER_PARTS) and sum(parts.values()) == get_model("deepseek-v3").num_params
    assert 0.95 < parts["routed_experts"] / sum(parts.values()) < 0.99
