"""Plausible wrong answers to notebook 11's exercises (both parts), each failing for a reason the checker names."""

_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}


def _head_dim(config):
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def heads_cut_into_pieces(config, tp, num_blocks, block_size, kv_dtype):
    """Divides the KV heads by tp whatever their number: fewer heads than ranks gives zero heads per rank."""
    b, layers = _BYTES[kv_dtype], config["num_hidden_layers"]
    if "kv_lora_rank" in config:
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        return (num_blocks, block_size, latent), num_blocks * block_size * layers * latent * b
    heads = config["num_key_value_heads"] // tp
    return ((num_blocks, block_size, heads, _head_dim(config)),
            num_blocks * block_size * 2 * layers * heads * _head_dim(config) * b)


def latent_split(config, tp, num_blocks, block_size, kv_dtype):
    """Splits MLA's latent across the ranks like a head dimension."""
    b, layers = _BYTES[kv_dtype], config["num_hidden_layers"]
    if "kv_lora_rank" in config:
        latent = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) // tp
        return (num_blocks, block_size, latent), num_blocks * block_size * layers * latent * b
    heads = max(1, config["num_key_value_heads"] // tp)
    return ((num_blocks, block_size, heads, _head_dim(config)),
            num_blocks * block_size * 2 * layers * heads * _head_dim(config) * b)


def interleaved_heads(num_attention_heads, num_kv_heads, head_dim, tp, rank):
    """Deals the KV heads out round-robin: rank r loads head r % num_kv_heads."""
    per = max(1, num_kv_heads // tp)
    shard = rank % num_kv_heads if tp > num_kv_heads else rank
    return shard * per * head_dim, (shard + 1) * per * head_dim


def shard_is_rank(num_attention_heads, num_kv_heads, head_dim, tp, rank):
    """Loads shard r on rank r, as for the query heads, forgetting the replicas."""
    per = max(1, num_kv_heads // tp)
    return rank * per * head_dim, (rank + 1) * per * head_dim


def _sizes(heads, kv, gpus, query_heads_too=True):
    return [t for t in range(1, gpus + 1)
            if (heads % t == 0 or not query_heads_too) and (kv % t == 0 or t % kv == 0)]


def total_not_extra(num_attention_heads, num_kv_heads, num_gpus, kv_bytes_per_token):
    """Returns everything the GPUs store, not what they store beyond one copy."""
    sizes = _sizes(num_attention_heads, num_kv_heads, num_gpus)
    largest = max(sizes)
    return (max(t for t in sizes if num_kv_heads % t == 0), largest,
            largest * max(1, num_kv_heads // largest) * kv_bytes_per_token // num_kv_heads)


def kv_heads_only(num_attention_heads, num_kv_heads, num_gpus, kv_bytes_per_token):
    """Lets the KV heads alone decide which sizes are allowed."""
    sizes = _sizes(num_attention_heads, num_kv_heads, num_gpus, query_heads_too=False)
    largest = max(sizes)
    extra = largest * max(1, num_kv_heads // largest) * kv_bytes_per_token // num_kv_heads - kv_bytes_per_token
    return max(t for t in sizes if num_kv_heads % t == 0), largest, extra


def aligns_the_whole_prompt(prompt, stored, block_size, num_computed_tokens):
    """Names the folder by the prompt's whole blocks before its last token, forgetting the extra - 1."""
    aligned = (len(prompt) - 1) // block_size * block_size
    if aligned <= 0 or prompt[:aligned] not in stored:
        return 0
    return max(aligned - num_computed_tokens, 0)


def ignores_the_local_hit(prompt, stored, block_size, num_computed_tokens):
    """Returns what the folder holds, as if nothing were cached locally."""
    aligned = (len(prompt) - 2) // block_size * block_size
    return aligned if aligned > 0 and prompt[:aligned] in stored else 0


def counts_tokens_not_blocks(num_layers, num_kv_heads, head_dim, dtype_bytes, block_size, prompt_tokens,
                             cached_tokens):
    """Counts the missing tokens' bytes, as if blocks moved by the token."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * (prompt_tokens - cached_tokens)


def forgets_v(num_layers, num_kv_heads, head_dim, dtype_bytes, block_size, prompt_tokens, cached_tokens):
    """Moves K only."""
    blocks = -(-prompt_tokens // block_size) - min(cached_tokens, prompt_tokens) // block_size
    return blocks * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def ignores_the_hit(cost, prompt_tokens, cached_tokens):
    """Decides for the whole prompt, as if the decode side held nothing."""
    return "move" if cost.copy_seconds(prompt_tokens) < cost.prefill_seconds(prompt_tokens) else "recompute"


def recompute_pays_the_roofline(cost, prompt_tokens, cached_tokens):
    """Charges recompute a whole forward's roofline, the weights' read included."""
    n = prompt_tokens - cached_tokens
    return "move" if cost.copy_seconds(n) < cost.forward_seconds(n, cached_tokens) else "recompute"


WRONG = {
    "11.rank_kv_cache": [
        (heads_cut_into_pieces, "one whole head"),
        (latent_split, "never split"),
    ],
    "11.k_proj_rows": [
        (interleaved_heads, "rank // replicas"),
        (shard_is_rank, "replicated on"),
    ],
    "11.replication": [
        (total_not_extra, "beyond one copy"),
        (kv_heads_only, "query heads"),
    ],
    "11.matched_tokens": [
        (aligns_the_whole_prompt, "align_to_block_size(len(prompt) - 1)"),
        (ignores_the_local_hit, "beyond num_computed_tokens"),
    ],
    "11.bytes_moved": [
        (counts_tokens_not_blocks, "blocks move whole"),
        (forgets_v, "both K and V"),
    ],
    "11.move_or_recompute": [
        (ignores_the_hit, "cached_tokens"),
        (recompute_pays_the_roofline, "roofline"),
    ],
}


def head_dim_from_hidden_size(config, tp, num_blocks, block_size, kv_dtype):
    """Takes a head's size as hidden_size // num_attention_heads, whatever the config's head_dim says."""
    b, layers = _BYTES[kv_dtype], config["num_hidden_layers"]
    if "kv_lora_rank" in config:
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        return (num_blocks, block_size, latent), num_blocks * block_size * layers * latent * b
    heads, dim = max(1, config["num_key_value_heads"] // tp), config["hidden_size"] // config["num_attention_heads"]
    return (num_blocks, block_size, heads, dim), num_blocks * block_size * 2 * layers * heads * dim * b


WRONG["11.rank_kv_cache"].append((head_dim_from_hidden_size, "this config gives head_dim = "))
