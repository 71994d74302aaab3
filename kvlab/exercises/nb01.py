"""Notebook 01's exercises (bytes per token from a pasted config) and self-test."""

from __future__ import annotations

import random
from typing import Any

from kvlab.capacity.models import ModelSpec, get_model
from kvlab.capacity.sizing import KV_DTYPE_BYTES, blocks_for_tokens, kv_bytes, kv_bytes_per_token, tail_waste
from kvlab.exercises.core import Case, Exercise, ask, register
from kvlab.units import KiB, format_bytes


def _preset_config(name: str) -> dict[str, Any]:
    return {k: v for k, v in get_model(name).config.items() if not k.startswith("_")}


def _random_config(rng: random.Random, sliding: bool = False) -> dict[str, Any]:
    """A plausible decoder config: MHA, GQA, MQA or MLA, head_dim given or implied."""
    layers = rng.choice([2, 12, 24, 32, 40, 61, 80])
    kind = rng.choice(["mha", "gqa", "mqa", "mla"])
    heads = rng.choice([8, 16, 32, 64])
    head_dim = rng.choice([64, 128])
    cfg: dict[str, Any] = {"num_hidden_layers": layers, "num_attention_heads": heads,
                           "hidden_size": heads * head_dim}
    if kind == "mla":
        cfg.update(kv_lora_rank=rng.choice([256, 512]), qk_rope_head_dim=64, num_key_value_heads=heads,
                   qk_nope_head_dim=128, v_head_dim=128)
    elif kind != "mha" or rng.random() < 0.5:
        cfg["num_key_value_heads"] = {"mha": heads, "gqa": rng.choice([2, 4, 8]), "mqa": 1}[kind]
    if rng.random() < 0.5 and kind != "mla":
        cfg["head_dim"] = head_dim
    if sliding and kind != "mla":
        cfg["sliding_window"] = rng.choice([128, 1024, 4096])
        if rng.random() < 0.6:
            cfg["layer_types"] = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]
    return cfg


# ----------------------------------------------------------------- 01.bytes_per_token


def bytes_per_token(config: dict, kv_dtype: str = "bf16") -> int:
    """Reference: bytes of KV one token takes (TP=1), from a raw config.json dict."""
    return kv_bytes_per_token(ModelSpec.from_hf_config(config), kv_dtype)


def _explain_per_token(case: Case, expected: Any, actual: Any) -> str | None:
    config = case.args[0]
    if not isinstance(actual, (int, float)):
        return "return a number of bytes (an int)"
    if config.get("kv_lora_rank") and actual == 2 * expected:
        return "MLA stores one latent per token and layer: f = 1, not 2"
    if config.get("kv_lora_rank"):
        return "for MLA, Hkv = 1 and D = kv_lora_rank + qk_rope_head_dim; num_key_value_heads does not apply"
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if kv_heads != heads and actual * kv_heads == expected * heads:
        return "use num_key_value_heads (the KV heads), not num_attention_heads"
    if "num_key_value_heads" not in config and actual != expected:
        return "a config without num_key_value_heads is MHA: one KV head per query head"
    return None


register(Exercise(
    id="01.bytes_per_token",
    title="bytes per token from a pasted config.json",
    task=(
        "Given a Hugging Face config.json as a dict and a KV dtype, return the bytes one token's "
        "K and V take over all layers on one GPU. Read num_hidden_layers, num_attention_heads, "
        "num_key_value_heads (absent: MHA), head_dim (absent: hidden_size // num_attention_heads). "
        "A config with kv_lora_rank is MLA: it stores one latent of kv_lora_rank + qk_rope_head_dim "
        "values per layer. Bytes per element: kvlab.capacity.sizing.KV_DTYPE_BYTES[kv_dtype]."
    ),
    signature="def bytes_per_token(config: dict, kv_dtype: str = 'bf16') -> int:",
    reference=bytes_per_token,
    edge_cases=[
        Case((_preset_config("llama-2-7b"), "bf16"), probes="MHA written out: f x L x Hkv x D x b"),
        Case((_preset_config("llama-3-70b"), "fp8"), probes="GQA: the KV heads, not the query heads"),
        Case(({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}, "fp16"),
             probes="num_key_value_heads and head_dim absent: MHA with head_dim = hidden_size / heads"),
        Case((_preset_config("deepseek-v3"), "bf16"), probes="MLA: one latent (f = 1, Hkv = 1, D = 512 + 64)"),
        Case((_preset_config("qwen3-8b"), "nvfp4"), probes="nvfp4 costs 0.5625 bytes per element, not 1"),
    ],
    random_case=lambda rng: Case((_random_config(rng), rng.choice(sorted(KV_DTYPE_BYTES))),
                                 probes="a random config and dtype"),
    explain=_explain_per_token,
    hints=[
        "Start from the tensor shapes: each layer stores K and V of shape [Hkv, D] per token.",
        "Hkv = config.get('num_key_value_heads') or config['num_attention_heads']; "
        "D = config.get('head_dim') or config['hidden_size'] // config['num_attention_heads'].",
        "For MLA (config has kv_lora_rank): f = 1, Hkv = 1, D = kv_lora_rank + qk_rope_head_dim. "
        "Multiply by KV_DTYPE_BYTES[kv_dtype] and return int(...).",
    ],
))


# ----------------------------------------------------------------- 01.request_bytes


def request_bytes(config: dict, tokens: int, kv_dtype: str = "bf16") -> int:
    """Reference: bytes of KV for one request of ``tokens`` tokens, sliding windows included."""
    return kv_bytes(ModelSpec.from_hf_config(config), tokens, kv_dtype)


def _explain_request(case: Case, expected: Any, actual: Any) -> str | None:
    config, tokens = case.args[0], case.args[1]
    full = kv_bytes_per_token(ModelSpec.from_hf_config(config), case.args[2]) * tokens
    if config.get("sliding_window") and actual == full != expected:
        return "sliding-window layers keep only the last sliding_window tokens"
    return None


register(Exercise(
    id="01.request_bytes",
    title="KV bytes of one request, with sliding-window layers",
    task=(
        "Return the bytes of KV one request of `tokens` tokens holds. A layer that slides keeps "
        "only the last `sliding_window` tokens. If the config lists `layer_types`, the layers marked "
        "'sliding_attention' slide; without `layer_types`, a non-null `sliding_window` applies to "
        "every layer (as in Mistral-7B-v0.1)."
    ),
    signature="def request_bytes(config: dict, tokens: int, kv_dtype: str = 'bf16') -> int:",
    reference=request_bytes,
    edge_cases=[
        Case((_preset_config("llama-3-8b"), 4096, "fp16"), probes="a full-attention model: tokens x bytes per token"),
        Case((_preset_config("mistral-7b-v0.1"), 3000, "bf16"), probes="a context shorter than the window"),
        Case((_preset_config("mistral-7b-v0.1"), 32768, "bf16"),
             probes="every layer slides: beyond 4096 tokens nothing more is kept"),
        Case((_preset_config("gpt-oss-20b"), 131072, "bf16"),
             probes="half the layers slide (window 128), half keep everything"),
        Case((_preset_config("deepseek-v3"), 32768, "bf16"), probes="MLA at 32K tokens"),
    ],
    random_case=lambda rng: Case((_random_config(rng, sliding=True), rng.randint(1, 20000),
                                  rng.choice(["bf16", "fp8", "fp32"])), probes="a random config with a window"),
    explain=_explain_request,
    hints=[
        "Count, layer by layer, how many tokens the layer keeps; then multiply by the bytes one "
        "token takes in one layer.",
        "A sliding layer keeps min(tokens, sliding_window) tokens.",
        "Reuse your bytes_per_token: per-layer bytes = bytes_per_token(config, kv_dtype) // num_hidden_layers.",
    ],
))


# ----------------------------------------------------------------- self-test


def _block_question() -> dict[str, Any]:
    model = get_model("llama-3-70b")
    per_token = kv_bytes_per_token(model, "bf16", tp=8)
    return {"bytes_per_token": per_token, "block_bytes": per_token * 16,
            "blocks": blocks_for_tokens(2050, 16), "wasted_slots": tail_waste(2050, 16)}


ask(
    "01.q1",
    "Block size 16, Llama-3-70B with TP=8 (bf16 KV): how big is one block on one GPU, how many "
          "blocks does a 2,050-token request take, and how many slots of its last block stay empty?",
    _block_question,
    lambda v: (
        f"Each GPU holds 1 of the 8 KV heads: {format_bytes(v['bytes_per_token'])} per token, so a block "
        f"of 16 tokens is {format_bytes(v['block_bytes'])}. 2,050 tokens need ceil(2050/16) = {v['blocks']} "
        f"blocks; the last holds 2 tokens and leaves {v['wasted_slots']} of 16 slots empty. Paging wastes "
        "at most one partial block per request, never the whole maximum length."),
)


def _shrink_question() -> dict[str, Any]:
    model = get_model("llama-3-70b")
    return {"mha_bf16": kv_bytes_per_token(model.mha_equivalent(), "bf16"),
            "gqa_bf16": kv_bytes_per_token(model, "bf16"), "gqa_fp8": kv_bytes_per_token(model, "fp8")}


ask(
    "01.q2",
    "Llama-3-70B goes from MHA (64 KV heads) to GQA (8 KV heads), then to an FP8 KV cache. "
          "How many bytes per token at each step, and which layer of the problem does each step change?",
    _shrink_question,
    lambda v: (
        f"MHA bf16: {format_bytes(v['mha_bf16'])} → GQA-8 bf16: {format_bytes(v['gqa_bf16'])} → GQA-8 fp8: "
        f"{format_bytes(v['gqa_fp8'])}, {v['mha_bf16'] // v['gqa_fp8']}× smaller in all. GQA is architecture "
        "(fixed when the model is trained), FP8 is numerics (a serving flag, with an accuracy cost); paging, the "
        "third layer, changes neither number, only how the bytes are placed and shared."),
)


def _mla_tp_question() -> dict[str, Any]:
    model = get_model("deepseek-v3")
    return {"tp1": kv_bytes_per_token(model, "bf16", 1), "tp8": kv_bytes_per_token(model, "bf16", 8)}


ask(
    "01.q3",
    "DeepSeek-V3 (MLA) moves from TP=1 to TP=8. How much KV does one token take on each GPU?",
    _mla_tp_question,
    lambda v: (
        f"Still {format_bytes(v['tp8'])} on every GPU (TP=1: {format_bytes(v['tp1'])}). MLA's latent cannot "
        "be split by heads, so each rank keeps a full copy; GQA models, by contrast, divide their KV heads "
        f"across ranks (Llama-3-70B: {kv_bytes_per_token(get_model('llama-3-70b'), 'bf16', 8) // KiB} KiB "
        "per GPU at TP=8)."),
)
