"""Reference solutions as plain lines: what ``show_solution`` prints where the checked reference calls into kvlab.

Each function here has the name and signature of its exercise's stub and passes that exercise's check
(``tests/test_exercises.py``); it reads the inputs the way a learner would, with no kvlab helper beyond
the tables the task names.
"""

from __future__ import annotations

from kvlab.capacity.sizing import KV_DTYPE_BYTES


def bytes_per_token(config: dict, kv_dtype: str = "bf16") -> int:
    """f x L x Hkv x D x b, read straight from the config."""
    b, layers = KV_DTYPE_BYTES[kv_dtype], config["num_hidden_layers"]
    if config.get("kv_lora_rank"):  # MLA: one latent per layer and token, no separate V
        return int(1 * layers * 1 * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b)
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(2 * layers * kv_heads * head_dim * b)


def request_bytes(config: dict, tokens: int, kv_dtype: str = "bf16") -> int:
    """Which layers slide, how many tokens each keeps, times one token's bytes in one layer."""
    layers, window = config["num_hidden_layers"], config.get("sliding_window")
    if config.get("layer_types"):  # the config says, layer by layer
        sliding = [kind == "sliding_attention" for kind in config["layer_types"]]
    elif not window or config.get("use_sliding_window") is False:  # no window, or one switched off (Qwen2.5)
        sliding = [False] * layers
    elif config.get("model_type") == "gemma2":  # Gemma 2: even layers slide, odd layers see everything
        sliding = [i % 2 == 0 for i in range(layers)]
    elif config.get("model_type") in ("qwen2", "qwen3"):  # Qwen: from max_window_layers on
        sliding = [i >= config.get("max_window_layers", layers) for i in range(layers)]
    else:  # Mistral-style: every layer
        sliding = [True] * layers
    held = sum(min(tokens, window) if slides else tokens for slides in sliding)
    return bytes_per_token(config, kv_dtype) // layers * held


def hybrid_hit(num_prompt_tokens: int, sliding_window: int, block_size: int, evicted_sliding: list,
               evicted_full: list, *, window_blocks: int | None = None) -> int:
    """Each group answers at the length the other offered, until both agree (vLLM's hybrid coordinator)."""
    need = window_blocks or -(-(sliding_window - 1) // block_size)  # blocks a window of W reaches: cdiv(W - 1, bs)
    length = num_prompt_tokens // block_size  # B's length minus one, in whole blocks
    while True:
        full = min([length, *evicted_full])  # full attention: every block before the end
        window, run = None, 0  # the window: `need` cached blocks in a row, found from the right
        for i in range(full - 1, -1, -1):
            run = 0 if i in evicted_sliding else run + 1
            if run == need:
                window = i + need
                break
        window = run if window is None else window  # none found: the cached blocks from the start
        if window == length:
            return length * block_size
        length = window


def num_blocks_and_concurrency(available_bytes: int, bytes_per_token: int, block_size: int,
                               max_model_len: int) -> tuple[int, int]:
    """The pool in whole blocks; a request of max_model_len tokens in whole blocks; how many such requests fit."""
    block_bytes = bytes_per_token * block_size  # one block: block_size tokens of KV
    num_blocks = max(available_bytes, 0) // block_bytes  # nothing left: no blocks (never a negative count)
    blocks_per_request = -(-max_model_len // block_size)  # ceil: the last block is partly filled
    return num_blocks, num_blocks // blocks_per_request  # the null block counted, as vLLM's log counts it


def max_model_len_for(num_blocks: int, block_size: int, concurrency: int) -> int:
    """Share the usable blocks among the requests, in whole blocks, and turn each share back into tokens."""
    usable = max(num_blocks - 1, 0)  # block 0 is the null block: it never holds KV
    blocks_each = usable // concurrency  # whole blocks per request
    return blocks_each * block_size  # a multiple of block_size


def legacy_offsets(slot: int, kv_head: int, dim: int, num_kv_heads: int, head_size: int, block_size: int,
                   dtype: str) -> tuple[int, int]:
    """Split the slot, then index each contiguous layout from its outermost axis in."""
    x = 16 // {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}[dtype]          # elements in one 16-byte vector
    block, offset = divmod(slot, block_size)
    base = (block * num_kv_heads + kv_head) * head_size * block_size      # the (block, head) slice both share
    key = base + ((dim // x) * block_size + offset) * x + dim % x          # K: [..., head_size // x, block_size, x]
    value = base + dim * block_size + offset                               # V: [..., head_size, block_size]
    return key, value
