"""Plausible wrong answers to notebook 01's exercises, each failing for a reason the checker names."""

from kvlab.capacity.sizing import KV_DTYPE_BYTES


def _heads_and_dim(config):
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return heads, dim


def query_heads(config, kv_dtype="bf16"):
    """Counts query heads instead of KV heads."""
    if config.get("kv_lora_rank"):
        return int(config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
                   * KV_DTYPE_BYTES[kv_dtype])
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(2 * config["num_hidden_layers"] * config["num_attention_heads"] * dim * KV_DTYPE_BYTES[kv_dtype])


def _right_per_token(config, kv_dtype):
    if config.get("kv_lora_rank"):
        return int(config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
                   * KV_DTYPE_BYTES[kv_dtype])
    heads, dim = _heads_and_dim(config)
    return int(2 * config["num_hidden_layers"] * heads * dim * KV_DTYPE_BYTES[kv_dtype])


def ignores_window(config, tokens, kv_dtype="bf16"):
    """Forgets that sliding layers stop growing at the window."""
    return _right_per_token(config, kv_dtype) * tokens


def window_everywhere(config, tokens, kv_dtype="bf16"):
    """Applies the window to every layer even when layer_types marks some as full attention."""
    window = config.get("sliding_window")
    held = min(tokens, window) if window else tokens
    return _right_per_token(config, kv_dtype) * held


def forgets_v(config, kv_dtype="bf16"):
    """Counts the keys only: f = 1 for every model."""
    return _right_per_token(config, kv_dtype) // (1 if config.get("kv_lora_rank") else 2)


def implied_head_dim(config, kv_dtype="bf16"):
    """Always derives D from hidden_size, even where the config gives its own head_dim."""
    if config.get("kv_lora_rank"):
        return _right_per_token(config, kv_dtype)
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    dim = config["hidden_size"] // config["num_attention_heads"]
    return int(2 * config["num_hidden_layers"] * heads * dim * KV_DTYPE_BYTES[kv_dtype])


def _kv_heads_on_one_gpu(config, tp):
    if config.get("kv_lora_rank"):
        return 1
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return max(heads // tp, 1)


def splits_everything(config, kv_dtype, tp):
    """Assumes tensor parallelism always splits the KV: the group holds what one GPU held at TP=1."""
    return _right_per_token(config, kv_dtype)


def one_gpu_only(config, kv_dtype, tp):
    """Answers for one GPU of the group, not for all of them."""
    return _right_per_token(config, kv_dtype) * _kv_heads_on_one_gpu(config, tp) // _kv_heads_on_one_gpu(config, 1)


def _predicted(per_token):
    """A learner's prediction for 01.bytes_per_token's three models, worked out with ``per_token``."""
    from kvlab.capacity.models import get_model
    from kvlab.exercises.nb01 import PER_TOKEN_PARTS

    return {f"{name}, {dtype}": per_token(dict(get_model(name).config), dtype) for name, dtype in PER_TOKEN_PARTS}


def nvfp4_as_half_a_byte(config, kv_dtype="bf16"):
    """Takes nvfp4 at its 4 bits, forgetting the scales."""
    heads, dim = _heads_and_dim(config)
    b = 0.5 if kv_dtype == "nvfp4" else KV_DTYPE_BYTES[kv_dtype]
    return int(2 * config["num_hidden_layers"] * heads * dim * b)


# Predictions: (what a learner predicts, text the verdict must hold). The quoted mistakes: head_dim taken
# as hidden_size // num_attention_heads (gemma-2-9b 224, gpt-oss-20b 45), K only, query heads, nvfp4 as 0.5 bytes.
WRONG_PREDICTIONS = {
    "01.bytes_per_token": [
        (_predicted(implied_head_dim), "D is head_dim when the config gives one"),
        (_predicted(forgets_v), "a K *and* a V"),
        (_predicted(query_heads), "not the query heads"),
        (_predicted(nvfp4_as_half_a_byte), "nvfp4 is not half a byte"),
    ],
}


WRONG = {
    "01.request_bytes": [
        (ignores_window, "sliding-window layers keep only the last sliding_window tokens"),
        (window_everywhere, "layer_types lists which layers slide"),
    ],
    "01.tp_group_bytes": [
        (splits_everything, "a GPU never holds less than one whole KV head"),
        (one_gpu_only, "that is what one GPU holds"),
    ],
}


def _layers_that_slide_by_the_letter(config):
    """Reads the task's first sentences only: layer_types if given, else a sliding_window means every layer."""
    if config.get("layer_types"):
        return [kind == "sliding_attention" for kind in config["layer_types"]]
    return [bool(config.get("sliding_window"))] * config["num_hidden_layers"]


def window_in_every_layer_without_layer_types(config, tokens, kv_dtype="bf16"):
    """Gemma-2-9B at 200K tokens: 1.41 GB, where kvlab says 35.1 GB (the family's alternation missed)."""
    per_layer = _right_per_token(config, kv_dtype) // config["num_hidden_layers"]
    window = config.get("sliding_window")
    return per_layer * sum(min(tokens, window) if s else tokens for s in _layers_that_slide_by_the_letter(config))


def window_plus_one(config, tokens, kv_dtype="bf16"):
    """Keeps the window and the token that just left it: min(tokens, sliding_window + 1)."""
    from kvlab.capacity.models import ModelSpec

    spec = ModelSpec.from_hf_config(config)
    per_layer = _right_per_token(config, kv_dtype) // config["num_hidden_layers"]
    return per_layer * sum(min(tokens, spec.sliding_window + 1) if kind == "sliding_attention" else tokens
                           for kind in spec.layer_types)


WRONG["01.request_bytes"] += [
    (window_in_every_layer_without_layer_types, "model_type 'gemma2' alternates"),
    (window_plus_one, "a window off by one"),
]


def group_with_head_dim_from_hidden_size(config, kv_dtype, tp):
    """Splits the heads right, but takes a head's size as hidden_size // num_attention_heads (Gemma: 224, not 256)."""
    if config.get("kv_lora_rank"):
        return tp * _right_per_token(config, kv_dtype)
    dim = config["hidden_size"] // config["num_attention_heads"]
    return int(tp * 2 * config["num_hidden_layers"] * _kv_heads_on_one_gpu(config, tp) * dim * KV_DTYPE_BYTES[kv_dtype])


WRONG["01.tp_group_bytes"].append((group_with_head_dim_from_hidden_size, "this config gives head_dim = 256"))
