"""Notebook 01's exercises (bytes per token from a pasted config) and self-test."""

from __future__ import annotations

import random
from typing import Any

from kvlab.capacity.models import ModelSpec, get_model
from kvlab.capacity.sizing import KV_DTYPE_BYTES, blocks_for_tokens, kv_bytes, kv_bytes_per_token, tail_waste
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.exercises.predictions import Prediction, register_prediction
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


# ----------------------------------------------------------------- 01.bytes_per_token (a prediction)

PER_TOKEN_PARTS = (("gemma-2-9b", "bf16"), ("gpt-oss-20b", "fp8"), ("qwen3-8b", "nvfp4"))


def _per_token_parts(per_token: Any) -> dict[str, int]:
    """{"model, dtype": bytes} for each part, from ``per_token(config, kv_dtype)``."""
    return {f"{name}, {dtype}": int(per_token(_preset_config(name), dtype)) for name, dtype in PER_TOKEN_PARTS}


def _per_token_with(config: dict, kv_dtype: str, *, f: int = 2, heads: str = "num_key_value_heads",
                    implied_head_dim: bool = False, b: float | None = None) -> float:
    """f x L x Hkv x D x b with one factor read the wrong way."""
    head_dim = (config["hidden_size"] // config["num_attention_heads"] if implied_head_dim
                else config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return f * config["num_hidden_layers"] * config[heads] * head_dim * (b or KV_DTYPE_BYTES[kv_dtype])


PER_TOKEN_MISTAKES = (
    Mistake(lambda: _per_token_parts(lambda c, d: _per_token_with(c, d, implied_head_dim=True)),
            "D is head_dim when the config gives one (gemma-2-9b: 256, gpt-oss-20b: 64); hidden_size // "
            "num_attention_heads is only the fallback when it does not"),
    Mistake(lambda: _per_token_parts(lambda c, d: _per_token_with(c, d, f=1)),
            "every layer stores a K *and* a V for each KV head: f = 2 (only MLA's latent has f = 1)"),
    Mistake(lambda: _per_token_parts(lambda c, d: _per_token_with(c, d, heads="num_attention_heads")),
            "the cache holds the KV heads (num_key_value_heads), not the query heads"),
    Mistake(lambda: _per_token_parts(lambda c, d: _per_token_with(c, d, b=0.5 if d == "nvfp4" else None)),
            "nvfp4 is not half a byte: two 4-bit values per byte plus one 1-byte scale per 16 values, 0.5625"),
)

register_prediction(Prediction(
    id="01.bytes_per_token",
    title="bytes per token of three models this notebook did not compute",
    question=(
        "Before running anything, predict the bytes of KV one token costs on one GPU (TP=1) for gemma-2-9b in bf16, "
        "gpt-oss-20b in fp8 and qwen3-8b in nvfp4, from the config fields printed above (sliding windows do not "
        "change the cost of one token). Then run the cell: kvlab computes the same from the same files."
    ),
    form='{"gemma-2-9b, bf16": 123, "gpt-oss-20b, fp8": 456, "qwen3-8b, nvfp4": 789}: one int per model',
    run=lambda: {f"{name}, {dtype}": kv_bytes_per_token(get_model(name), dtype) for name, dtype in PER_TOKEN_PARTS},
    runs="kv_bytes_per_token(get_model(name), kv_dtype), for each model",
    mistakes=PER_TOKEN_MISTAKES,
    hints=[
        "Write f, L, Hkv, D and b for each model before multiplying: which config field gives each?",
        "Two of these configs give a head_dim that is not hidden_size / num_attention_heads. Which one counts?",
        "b comes from the dtype: bf16 2 bytes, fp8 1, and nvfp4 a little more than half a byte (section 4).",
    ],
))


# ----------------------------------------------------------------- 01.request_bytes


def request_bytes(config: dict, tokens: int, kv_dtype: str = "bf16") -> int:
    """Reference: bytes of KV for one request of ``tokens`` tokens, sliding windows included."""
    return kv_bytes(ModelSpec.from_hf_config(config), tokens, kv_dtype)


def _request_with(config: dict, tokens: int, kv_dtype: str, *, sliding: list[bool] | None = None,
                  keep: int = 0) -> int:
    """request_bytes with one step taken the wrong way: the layers that slide forced, or ``keep`` more tokens kept."""
    spec = ModelSpec.from_hf_config(config)
    kinds = spec.layer_types if sliding is None else ["sliding_attention" if s else "full_attention" for s in sliding]
    window = config.get("sliding_window") or 0
    held = sum(min(tokens, window + keep) if k == "sliding_attention" else tokens for k in kinds)
    return kv_bytes_per_token(spec, kv_dtype) // spec.num_layers * held


def _every_layer_slides(config: dict, tokens: int, kv_dtype: str = "bf16") -> int:
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    sliding = ([k == "sliding_attention" for k in types] if types else [bool(config.get("sliding_window"))] * layers)
    return _request_with(config, tokens, kv_dtype, sliding=sliding)


def _family_rule_missed(case: Case) -> str:
    config = case.args[0]
    if config.get("use_sliding_window") is False:
        return ("this config carries a sliding_window but sets use_sliding_window: false (as Qwen2.5's files do): "
                "the window is switched off and every layer keeps all the tokens")
    if config.get("model_type") == "gemma2":
        return ("Gemma 2's config has no layer_types, and its window is not in every layer: model_type 'gemma2' "
                "alternates, the even layers slide and the odd ones keep every token")
    return "without layer_types, which layers slide follows the model family's rule (see the task)"


REQUEST_MISTAKES = (
    Mistake(lambda config, tokens, kv_dtype="bf16": _request_with(
        config, tokens, kv_dtype, sliding=[False] * config["num_hidden_layers"]),
        "sliding-window layers keep only the last sliding_window tokens"),
    Mistake(lambda config, tokens, kv_dtype="bf16": _request_with(
        config, tokens, kv_dtype, sliding=[bool(config.get("sliding_window"))] * config["num_hidden_layers"]),
        "layer_types lists which layers slide: only those marked 'sliding_attention' keep the last sliding_window "
        "tokens, the 'full_attention' ones keep them all"),
    Mistake(_every_layer_slides, _family_rule_missed),
    Mistake(lambda config, tokens, kv_dtype="bf16": _request_with(config, tokens, kv_dtype, keep=1),
            "a window off by one: a sliding layer keeps min(tokens, sliding_window) tokens, not sliding_window + 1"),
    Mistake(lambda config, tokens, kv_dtype="bf16": _request_with(config, tokens, kv_dtype, keep=-1),
            "a window off by one: a sliding layer keeps min(tokens, sliding_window) tokens, not sliding_window - 1"),
)


register(Exercise(
    id="01.request_bytes",
    title="KV bytes of one request, with sliding-window layers",
    task=(
        "Return the bytes of KV one request of `tokens` tokens holds. A layer that slides keeps "
        "only the last `sliding_window` tokens. If the config lists `layer_types`, the layers marked "
        "'sliding_attention' slide. Without `layer_types`, a non-null `sliding_window` follows the model "
        "family's rule, as `ModelSpec.from_hf_config` reads it: Gemma 2 (`model_type` 'gemma2') alternates, "
        "even layers sliding; Qwen2/Qwen3 slide only with `use_sliding_window: true` (Qwen2.5's files carry "
        "a window but set it false), from layer `max_window_layers` on; any other family slides in every "
        "layer (as in Mistral-7B-v0.1)."
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
        Case((_preset_config("mistral-7b-v0.1"), 4097, "bf16"),
             probes="one token past the window: a sliding layer keeps exactly sliding_window tokens"),
        Case((_preset_config("gemma-2-9b"), 200_000, "bf16"),
             probes="Gemma 2 without layer_types: even layers slide (window 4096), odd layers keep all 200K"),
        Case((_preset_config("qwen2.5-32b-instruct"), 200_000, "bf16"),
             probes="Qwen2.5 carries a sliding_window but use_sliding_window: false, so no layer slides"),
    ],
    random_case=lambda rng: Case((_random_config(rng, sliding=True), rng.randint(1, 20000),
                                  rng.choice(["bf16", "fp8", "fp32"])), probes="a random config with a window"),
    mistakes=REQUEST_MISTAKES,
    shown=plain.request_bytes,
    hints=[
        "Count, layer by layer, how many tokens the layer keeps; then multiply by the bytes one "
        "token takes in one layer.",
        "Which layers slide? Those marked 'sliding_attention' in layer_types; without layer_types, Gemma 2 "
        "alternates, Qwen2/Qwen3 follow use_sliding_window, and any other config with a sliding_window slides "
        "in every layer.",
        "A sliding layer keeps min(tokens, sliding_window) tokens; a full-attention layer keeps all of them.",
        "One token in one layer costs f x Hkv x D x b: section 2's formula without the L.",
    ],
))


# ----------------------------------------------------------------- 01.tp_group_bytes (transfer)


def tp_group_bytes(config: dict, kv_dtype: str, tp: int) -> int:
    """Reference: one token's KV summed over all ``tp`` GPUs of a tensor-parallel group."""
    return tp * kv_bytes_per_token(ModelSpec.from_hf_config(config), kv_dtype, tp)


def _explain_group(case: Case, expected: Any, actual: Any) -> str | None:
    return "return a number of bytes (an int)" if type(actual) not in (int, float) else None


def _group_with(config: dict, kv_dtype: str, tp: int, *, one_gpu: bool = False, split: bool = False,
                implied_head_dim: bool = False) -> int:
    """tp_group_bytes with one step taken the wrong way: one GPU's share only, everything split by tp (a head or a
    latent cut into pieces), or D taken as hidden_size // num_attention_heads."""
    if implied_head_dim:
        config = {**config, "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    spec = ModelSpec.from_hf_config(config)
    if split:
        return kv_bytes_per_token(spec, kv_dtype)  # tp ranks of 1/tp each: what TP=1 holds
    return kv_bytes_per_token(spec, kv_dtype, tp) * (1 if one_gpu else tp)


def _split_says(case: Case) -> str:
    config, _, tp = case.args
    if config.get("kv_lora_rank"):
        return ("MLA's latent serves every head, so it cannot be split by heads: each of the tp GPUs keeps the whole "
                "latent")
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return (f"a GPU never holds less than one whole KV head: with tp = {tp} ranks and {kv_heads} KV heads each head "
            f"is stored on {max(tp // kv_heads, 1)} GPUs")


def _implied_says(case: Case) -> str:
    config = case.args[0]
    return (f"this config gives head_dim = {config.get('head_dim')}, not hidden_size // num_attention_heads = "
            f"{config['hidden_size'] // config['num_attention_heads']}: when head_dim is there, use it")


GROUP_MISTAKES = (
    Mistake(lambda config, kv_dtype, tp: _group_with(config, kv_dtype, tp, one_gpu=True),
            "that is what one GPU holds; the question asks for all tp GPUs together"),
    Mistake(lambda config, kv_dtype, tp: _group_with(config, kv_dtype, tp, split=True), _split_says),
    Mistake(lambda config, kv_dtype, tp: _group_with(config, kv_dtype, tp, implied_head_dim=True), _implied_says),
)


def _random_group_case(rng: random.Random) -> Case:
    config = _random_config(rng)
    kv_heads = 1 if config.get("kv_lora_rank") else config.get("num_key_value_heads", config["num_attention_heads"])
    tps = [t for t in (1, 2, 4, 8, 16, 32) if kv_heads % t == 0 or t % kv_heads == 0 or config.get("kv_lora_rank")]
    return Case((config, rng.choice(["bf16", "fp8", "fp32"]), rng.choice(tps)), probes="a random config and TP size")


register(Exercise(
    id="01.tp_group_bytes",
    title="one token's KV on a whole tensor-parallel group",
    task=(
        "A model runs with tensor parallelism over `tp` GPUs. Return the bytes of KV one token costs on all "
        "`tp` GPUs together (the sum over the ranks). MHA and GQA models split their KV heads across the ranks, "
        "but a rank never holds less than one whole head; MLA's latent is not split by heads at all. `tp` "
        "divides num_key_value_heads or is a multiple of it. (Notebook 01 asked what *one* GPU holds; this "
        "asks what the group pays, which is where tensor parallelism stops saving memory.)"
    ),
    signature="def tp_group_bytes(config: dict, kv_dtype: str, tp: int) -> int:",
    reference=tp_group_bytes,
    shown=plain.tp_group_bytes,
    edge_cases=[
        Case((_preset_config("llama-3-70b"), "bf16", 8),
             probes="8 KV heads over 8 GPUs: one head each, so the group holds what TP=1 did"),
        Case((_preset_config("llama-3-70b"), "bf16", 16),
             probes="16 GPUs for 8 KV heads: every head is stored on two of them"),
        Case((_preset_config("deepseek-v3"), "bf16", 8), probes="MLA at TP=8: all eight GPUs keep the whole latent"),
        Case((_preset_config("gemma-2-9b"), "fp8", 4),
             probes="another model: 8 KV heads of head_dim 256 (not hidden_size // heads) over 4 GPUs"),
        Case((_preset_config("qwen3-8b"), "nvfp4", 32), probes="32 GPUs, 8 KV heads: each head four times"),
        Case((_preset_config("llama-2-7b"), "fp16", 2), probes="MHA's 32 KV heads split over 2 GPUs"),
        Case((_preset_config("gpt-oss-20b"), "bf16", 1), probes="TP=1: the group is one GPU"),
    ],
    random_case=_random_group_case,
    explain=_explain_group,
    mistakes=GROUP_MISTAKES,
    transfer=True,
    hints=[
        "Work out one GPU first, then multiply by tp: how many KV heads does each rank keep?",
        "While tp <= num_key_value_heads, each rank keeps num_key_value_heads // tp heads. Past that, a head "
        "cannot be cut in pieces: each rank keeps one head, and the heads are copied.",
        "MLA is the extreme case of the same rule: one latent per layer that every rank needs whole.",
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
    ("Block size 16, Llama-3-70B with TP=8 (bf16 KV): how big is one block on one GPU, how many "
     "blocks does a 2,050-token request take, and how many slots of its last block stay empty?"),
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
    ("Llama-3-70B goes from MHA (64 KV heads) to GQA (8 KV heads), then to an FP8 KV cache. "
     "How many bytes per token at each step, and which layer of the problem does each step change?"),
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


def _gemma_question() -> dict[str, Any]:
    gemma = get_model("gemma-2-9b")
    per_token = kv_bytes_per_token(gemma, "bf16")
    return {"layers": gemma.num_layers, "sliding_layers": gemma.num_sliding_layers, "window": gemma.sliding_window,
            "head_dim": gemma.head_dim, "per_token": per_token, "held": kv_bytes(gemma, 32768, "bf16"),
            "all_full": per_token * 32768}


ask(
    "01.q4",
    ("Gemma-2-9B (a model this notebook did not work through) serves one request of 32,768 tokens with a bf16 "
     "cache. Its config says head_dim 256 and gives every other layer a 4,096-token window. How much KV does the "
     "request hold, and how much would it hold if every layer attended to the whole context?"),
    _gemma_question,
    lambda v: (
        f"{format_bytes(v['per_token'])} per token (head_dim {v['head_dim']}, not hidden_size / heads = 224). The "
        f"{v['layers'] - v['sliding_layers']} full layers keep all 32,768 tokens; the {v['sliding_layers']} sliding "
        f"layers keep only the last {v['window']:,}. In all {format_bytes(v['held'])}, against "
        f"{format_bytes(v['all_full'])} if every layer were full attention: the windows save "
        f"{100 * (1 - v['held'] / v['all_full']):.0f} %, and the saving grows with the context."
    ),
    transfer=True,
)
