"""Plausible wrong answers to notebook 01's exercises, each failing for a reason the checker names."""

from kvlab.capacity.sizing import KV_DTYPE_BYTES


def _heads_and_dim(config):
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return heads, dim


def mla_as_gqa(config, kv_dtype="bf16"):
    """Treats every model as MHA/GQA: misses MLA's single latent."""
    heads, dim = _heads_and_dim(config)
    return int(2 * config["num_hidden_layers"] * heads * dim * KV_DTYPE_BYTES[kv_dtype])


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


WRONG = {
    "01.bytes_per_token": [
        (mla_as_gqa, "MLA"),
        (query_heads, "use num_key_value_heads"),
    ],
    "01.request_bytes": [
        (ignores_window, "sliding-window layers keep only the last sliding_window tokens"),
        (window_everywhere, "half the layers slide"),
    ],
}
