"""Plausible wrong answers to notebook 02's exercises, each failing for a reason the checker names."""

import math


def _ceil_div(a, b):
    return -(-a // b)


def minus_null_block(available_bytes, bytes_per_token, block_size, max_model_len):
    """Subtracts the null block, which vLLM's logged figures do not."""
    blocks = max(available_bytes, 0) // (bytes_per_token * block_size) - 1
    return max(blocks, 0), max(blocks, 0) // _ceil_div(max_model_len, block_size)


def counts_the_null_block(num_blocks, block_size, concurrency):
    """Shares every block, the null block included."""
    return (num_blocks // concurrency) * block_size


def divides_tokens(num_blocks, block_size, concurrency):
    """Shares token slots instead of whole blocks."""
    return (num_blocks - 1) * block_size // concurrency


def _per_gpu_token_bytes(config, kv_dtype, tp, split_latent=False):
    width = {"bf16": 2, "fp8": 1}[kv_dtype]
    if config.get("kv_lora_rank"):
        whole = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * width
        return whole // tp if split_latent else whole
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * max(heads // tp, 1) * dim * width


def _logged(gpu_memory_gib, weights_on_one_gpu_gib, per_token, block_size, max_model_len):
    available = math.ceil(gpu_memory_gib * 2**30 * 0.92) - round(weights_on_one_gpu_gib * 2**30)
    blocks = max(available, 0) // (per_token * block_size)
    return blocks // _ceil_div(max_model_len, block_size)


def whole_weights_on_every_gpu(config, gpu_memory_gib, weights_gib, tp, kv_dtype, block_size, max_model_len):
    """Splits the KV heads but forgets that each GPU holds only 1/tp of the weights."""
    return _logged(gpu_memory_gib, weights_gib, _per_gpu_token_bytes(config, kv_dtype, tp), block_size, max_model_len)


def splits_the_latent(config, gpu_memory_gib, weights_gib, tp, kv_dtype, block_size, max_model_len):
    """Divides every model's KV by tp, MLA's latent included."""
    per_token = _per_gpu_token_bytes(config, kv_dtype, tp, split_latent=True)
    return _logged(gpu_memory_gib, weights_gib / tp, per_token, block_size, max_model_len)


def in_gigabytes(config, gpu_memory_gib, weights_gib, tp, kv_dtype, block_size, max_model_len):
    """Reads gpu_memory_gib and weights_gib as GB (10**9 bytes), not GiB."""
    available = math.ceil(gpu_memory_gib * 10**9 * 0.92) - round(weights_gib / tp * 10**9)
    blocks = max(available, 0) // (_per_gpu_token_bytes(config, kv_dtype, tp) * block_size)
    return blocks // _ceil_div(max_model_len, block_size)


def floor_blocks_per_request(config, gpu_memory_gib, weights_gib, tp, kv_dtype, block_size, max_model_len):
    """Takes max_model_len // block_size blocks per request, dropping the partly filled last one."""
    available = math.ceil(gpu_memory_gib * 2**30 * 0.92) - round(weights_gib / tp * 2**30)
    blocks = max(available, 0) // (_per_gpu_token_bytes(config, kv_dtype, tp) * block_size)
    return blocks // (max_model_len // block_size)


def _line(num_blocks_and_concurrency, unit=2**30, tokens_as_slots=False):
    """The learner's KV line for 02.num_blocks's deployment (Llama-3-8B, 20 GiB, blocks of 16, 9,000 tokens)."""
    blocks, _ = num_blocks_and_concurrency(20 * unit, 128 * 1024, 16, 9000)
    x = blocks / _ceil_div(9000, 16)
    tokens = blocks * 16 if tokens_as_slots else int(x * 9000)
    return f"GPU KV cache size: {tokens:,} tokens, Maximum concurrency for 9,000 tokens per request: {x:.2f}x"


def _right(available_bytes, bytes_per_token, block_size, max_model_len):
    blocks = max(available_bytes, 0) // (bytes_per_token * block_size)
    return blocks, blocks // _ceil_div(max_model_len, block_size)


WRONG_PREDICTIONS = {
    "02.num_blocks": [
        (_line(_right, unit=10**9), "in GiB (2**30 bytes), not GB"),
        (_line(minus_null_block), "the null block included"),
        (_line(_right, tokens_as_slots=True), "int(X x max_model_len)"),
        ("GPU KV cache size: 163,985 tokens, Maximum concurrency for 9,000 tokens per request: 18.22x",
         "ceil(9000 / 16) = 563"),  # 562 blocks per request: the partly filled last block dropped
        ("GPU KV cache size: 163,840 tokens", "write the whole line"),
    ],
}

WRONG = {
    "02.max_model_len_for": [
        (counts_the_null_block, "null block"),
        (divides_tokens, "multiple of block_size"),
    ],
    "02.tp_concurrency": [
        (whole_weights_on_every_gpu, "each GPU holds 1/tp of the weights"),
        (splits_the_latent, "MLA's latent is not split"),
        (in_gigabytes, "GB for GiB"),
        (floor_blocks_per_request, "floor for ceil"),
    ],
}


def head_dim_from_hidden_size(config, gpu_memory_gib, weights_gib, tp, kv_dtype, block_size, max_model_len):
    """Takes a head's size as hidden_size // num_attention_heads, whatever the config's head_dim says."""
    implied = {**config, "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    per_token = _per_gpu_token_bytes(implied, kv_dtype, tp)
    return _logged(gpu_memory_gib, weights_gib / tp, per_token, block_size, max_model_len)


WRONG["02.tp_concurrency"].append((head_dim_from_hidden_size, "this config gives head_dim = 256"))
