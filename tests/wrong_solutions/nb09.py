"""Plausible wrong answers to notebook 09's exercises, each failing for a reason the checker names."""

import torch

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def latent_with_a_v(config, kv_dtype):
    """Counts MLA like MHA: a K and a V, f = 2."""
    b, layers = _BYTES[kv_dtype], config["num_hidden_layers"]
    latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    return 2 * layers * latent * b, 2 * layers * config["num_attention_heads"] * config["v_head_dim"] * b


def mha_keys_with_rope(config, kv_dtype):
    """Gives the MHA keys their nope and rope parts (192 values), not the source's v_head_dim."""
    b, layers, heads = _BYTES[kv_dtype], config["num_hidden_layers"], config["num_attention_heads"]
    keys = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    return (layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b,
            layers * heads * (keys + config["v_head_dim"]) * b)


def padded_query(q_nope, w_uk):
    """Forgets W_UK: puts q_nope into the latent's first dimensions."""
    return torch.nn.functional.pad(q_nope, (0, w_uk.shape[0] - q_nope.shape[1]))


def scaled_query(q_nope, w_uk):
    """Applies the softmax scale while absorbing, so the kernel scales twice."""
    return (q_nope @ w_uk.T) * q_nope.shape[1] ** -0.5


def by_flops(query_len, context_len, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim):
    """Answers with the path of fewer FLOPs."""
    from kvlab.capacity.mla import MLADims, mla_attention_cost

    dims = MLADims(num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    return mla_attention_cost(dims, query_len, context_len).fewer_flops


def by_query_length(query_len, context_len, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                    v_head_dim):
    """vLLM's batch split taken for a byte count: one query token absorbs, more decompress."""
    return "absorbed" if query_len == 1 else "naive"


def tie_to_absorbed(query_len, context_len, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                    v_head_dim):
    """Counts both paths right but lets absorbed win a tie."""
    naive = (query_len + context_len) * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)
    return "naive" if naive < 2 * query_len * kv_lora_rank else "absorbed"


def _head_dim(config):
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def latent_split_by_tp(config, tp, kv_dtype):
    """Divides MLA's latent by tp as if it were KV heads."""
    b = _BYTES[kv_dtype]
    if config.get("kv_lora_rank"):
        return config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b // tp
    heads = max(config["num_key_value_heads"] // tp, 1)
    return 2 * config["num_hidden_layers"] * heads * _head_dim(config) * b


def heads_divided_past_one(config, tp, kv_dtype):
    """Lets GQA's KV heads per rank fall below one."""
    b = _BYTES[kv_dtype]
    if config.get("kv_lora_rank"):
        return config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b
    return int(2 * config["num_hidden_layers"] * config["num_key_value_heads"] / tp * _head_dim(config) * b)


WRONG = {
    "09.latent_bytes": [
        (latent_with_a_v, "f = 1, no separate V"),
        (mha_keys_with_rope, "v_head_dim values for K and for V"),
    ],
    "09.absorbed_query": [
        (padded_query, "multiply by W_UK"),
        (scaled_query, "the softmax scale is applied once"),
    ],
    "09.fewer_bytes": [
        (by_flops, "the path with fewer FLOPs"),
        (by_query_length, "the query length alone does not decide"),
        (tie_to_absorbed, 'a tie goes to "naive"'),
    ],
    "09.kv_per_gpu": [
        (latent_split_by_tp, "cannot be split across ranks"),
        (heads_divided_past_one, "each rank keeps a whole copy of one KV head"),
    ],
}


def head_dim_from_hidden_size(config, tp, kv_dtype):
    """Always takes a head's size as hidden_size // num_attention_heads, ignoring the config's head_dim."""
    b = _BYTES[kv_dtype]
    if config.get("kv_lora_rank"):
        return config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b
    heads = max(config["num_key_value_heads"] // tp, 1)
    return 2 * config["num_hidden_layers"] * heads * (config["hidden_size"] // config["num_attention_heads"]) * b


WRONG["09.kv_per_gpu"].append((head_dim_from_hidden_size, "this config gives head_dim = 256"))
