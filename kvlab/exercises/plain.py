"""Reference solutions as plain lines: what ``show_solution`` prints where the checked reference calls into kvlab.

Each function here has the name and signature of its exercise's stub and passes that exercise's check
(``tests/test_exercises.py``); it reads the inputs the way a learner would, with no kvlab helper beyond
the tables the task names.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvlab.capacity.sizing import KV_DTYPE_BYTES

if TYPE_CHECKING:
    from kvlab.capacity.cost_model import CostModel


def request_bytes(config: dict, tokens: int, kv_dtype: str = "bf16") -> int:
    """Which layers slide, how many tokens each keeps, times one token's bytes in one layer."""
    layers, window, b = config["num_hidden_layers"], config.get("sliding_window"), KV_DTYPE_BYTES[kv_dtype]
    if config.get("kv_lora_rank"):  # MLA: one latent per layer and token, no separate V
        per_layer = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b
    else:  # f x Hkv x D x b: a K and a V per KV head
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_layer = 2 * (config.get("num_key_value_heads") or config["num_attention_heads"]) * head_dim * b
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
    return int(per_layer) * sum(min(tokens, window) if slides else tokens for slides in sliding)


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


def tp_group_bytes(config: dict, kv_dtype: str, tp: int) -> int:
    """One rank's share of the KV heads (never less than a whole head), times the tp ranks of the group."""
    b, layers = KV_DTYPE_BYTES[kv_dtype], config["num_hidden_layers"]
    if config.get("kv_lora_rank"):  # MLA: the latent serves every head, so every rank keeps all of it
        return tp * int(layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b)
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads_per_rank = max(kv_heads // tp, 1)  # past tp = kv_heads, heads are copied, not cut
    return tp * int(2 * layers * heads_per_rank * head_dim * b)


def free_queue_order(queue: list[int], table: list[int], cached: set[int]) -> list[int]:
    """KVCacheManager.free hands the blocks over tail first; BlockPool.free_blocks sorts them into two groups."""
    to_head, to_tail = [], []
    for block in reversed(table):  # tail first: the prompt's first block comes last
        (to_tail if block in cached else to_head).append(block)  # a hash may still serve a hit: keep it longest
    return to_head + list(queue) + to_tail  # prepend_n puts its group in front as is; append_n adds behind the tail


def sampling_blocks(n: int, prompt_tokens: int, new_tokens: int, block_size: int) -> tuple[int, int]:
    """The full prompt blocks stay shared; the partly filled one is copied by every writer but the last."""
    full, partial = divmod(prompt_tokens, block_size)
    if new_tokens == 0:  # right after the fork: everything shared, nothing copied
        return full + (1 if partial else 0), 0
    copies = n - 1 if partial else 0  # the last writer finds the partial block its own (ref_cnt 1)
    own = -(-(prompt_tokens + new_tokens) // block_size) - full  # each sample's blocks past the shared full ones
    return full + n * own, copies


def longest_cached_prefix(block_hashes: list[bytes], cached: set[bytes], num_tokens: int, block_size: int) -> int:
    """Walk the hashes from the start, stop at the first miss, and never reach the last token."""
    max_blocks = (num_tokens - 1) // block_size  # the last token is always computed: it gives the next logits
    hits = 0
    for block_hash in block_hashes[:max_blocks]:
        if block_hash not in cached:  # a miss: every later hash chains through this block
            break
        hits += 1
    return hits * block_size


def chat_turn_hits(cached_tokens: list[int], prompt: list[int], block_size: int) -> int:
    """Compare block by block from the start: equal blocks after an equal prefix have equal chained hashes."""
    cached_blocks = len(cached_tokens) // block_size  # the earlier request cached its full blocks only
    max_blocks = (len(prompt) - 1) // block_size  # at most len(prompt) - 1 tokens may hit
    hits = 0
    while hits < min(cached_blocks, max_blocks):
        block = slice(hits * block_size, (hits + 1) * block_size)
        if cached_tokens[block] != prompt[block]:  # this block's hash differs, and so does every later one's
            break
        hits += 1
    return hits * block_size


def blocks_per_group(num_tokens: int, num_hit_tokens: int, sliding_window: int, block_size: int,
                     hits_are_free: bool) -> list[int]:
    """New blocks for what the hit does not cover, plus, for hits sitting in the free queue, the ones kept."""
    required = -(-num_tokens // block_size)  # blocks the chunk ends at, in both groups
    hits = num_hit_tokens // block_size  # blocks the prefix cache supplies
    skipped = max(0, num_hit_tokens - sliding_window + 1) // block_size  # hit blocks wholly before the window
    kept = [hits - skipped, hits]  # the hit blocks each group takes: [window group, full attention]
    return [required - hits + (k if hits_are_free else 0) for k in kept]  # a hit in the free queue costs a block


def pool_too_small(reuse_gaps: list[float], idle_before_evict: list[float]) -> bool:
    """Blocks are evicted sooner than they are asked for again: the p90 reuse gap beats the median idle time."""
    if not reuse_gaps or not idle_before_evict:  # nothing reused, or nothing evicted: nothing to compare
        return False
    gaps, idle = sorted(reuse_gaps), sorted(idle_before_evict)
    p90 = gaps[-(-9 * len(gaps) // 10) - 1]  # nearest rank: the smallest value with 90 % at or below it
    p50 = idle[-(-len(idle) // 2) - 1]
    return p90 > p50


def kv_bytes_per_gpu(config: dict, tp: int, kv_dtype: str) -> int:
    """f x L x Hkv x D x b with the KV heads one GPU of the tp ranks keeps (MLA: the whole latent)."""
    b, layers = KV_DTYPE_BYTES[kv_dtype], config["num_hidden_layers"]
    if config.get("kv_lora_rank"):  # one latent per layer and token, on every rank
        return int(layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b)
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(2 * layers * max(kv_heads // tp, 1) * head_dim * b)


def latent_and_mha_bytes(config: dict, kv_dtype: str) -> tuple[int, int]:
    """One latent of kv_lora_rank + qk_rope_head_dim per layer, against a K and a V for every head."""
    b, layers, heads = KV_DTYPE_BYTES[kv_dtype], config["num_hidden_layers"], config["num_attention_heads"]
    latent = layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b  # f = 1, Hkv = 1
    mha = 2 * layers * heads * config["v_head_dim"] * b  # the MHA form: a K and a V of v_head_dim per head
    return int(latent), int(mha)


def legacy_offsets(slot: int, kv_head: int, dim: int, num_kv_heads: int, head_size: int, block_size: int,
                   dtype: str) -> tuple[int, int]:
    """Split the slot, then index each contiguous layout from its outermost axis in."""
    x = 16 // {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}[dtype]          # elements in one 16-byte vector
    block, offset = divmod(slot, block_size)
    base = (block * num_kv_heads + kv_head) * head_size * block_size      # the (block, head) slice both share
    key = base + ((dim // x) * block_size + offset) * x + dim % x          # K: [..., head_size // x, block_size, x]
    value = base + dim * block_size + offset                               # V: [..., head_size, block_size]
    return key, value


def tp_concurrency(config: dict, gpu_memory_gib: float, weights_gib: float, tp: int, kv_dtype: str,
                   block_size: int, max_model_len: int) -> int:
    """One GPU: its budget less its share of the weights, in blocks of its own bytes per token, per request."""
    b, layers = KV_DTYPE_BYTES[kv_dtype], config["num_hidden_layers"]
    if config.get("kv_lora_rank"):  # MLA: every GPU keeps the whole latent
        per_token = layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b
    else:  # this GPU's share of the KV heads, never less than one whole head (every layer as full attention)
        kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_token = 2 * layers * max(kv_heads // tp, 1) * head_dim * b
    gib = 2**30  # the sizes count GiB, not GB (10**9)
    available = math.ceil(gpu_memory_gib * gib * 0.92) - round(weights_gib / tp * gib)  # 1/tp of the weights
    num_blocks = max(available, 0) // int(per_token * block_size)  # nothing left: no blocks
    return num_blocks // -(-max_model_len // block_size)  # ceil: a request's last block is partly filled, but whole


def recompute_tokens(num_tokens: int, block_size: int, enable_prefix_caching: bool, num_evicted_blocks: int = 0) -> int:
    """Everything but the full blocks that kept their hashes, counted from the start, never the last token."""
    if not enable_prefix_caching:  # nothing survives a preemption
        return num_tokens
    full = num_tokens // block_size  # only full blocks got a hash
    surviving = max(full - num_evicted_blocks, 0)  # freed tail first: the last full blocks are evicted first
    hits = min(surviving, (num_tokens - 1) // block_size)  # at most num_tokens - 1 tokens may hit
    return num_tokens - hits * block_size


def first_token_steps(prompt_lens: list[int], max_tokens: int, max_num_batched_tokens: int) -> list[int]:
    """Step by step, the requests in vLLM V1's order, each taking what is left of the step's token budget."""
    held = list(prompt_lens)  # the tokens each request holds: its prompt, then every token it samples
    computed, first = [0] * len(held), [0] * len(held)  # tokens computed; the step of its first token
    unfinished, step = list(range(len(held))), 0  # RUNNING, then WAITING: with no preemption, arrival order
    while unfinished:
        step, left = step + 1, max_num_batched_tokens
        for r in list(unfinished):
            take = min(held[r] - computed[r], left)  # a decode needs 1 token, a prompt its rest (or what is left)
            if take == 0:  # the budget is spent
                break
            left, computed[r] = left - take, computed[r] + take
            if computed[r] == held[r]:  # everything it holds is computed: it samples a token
                first[r], held[r] = first[r] or step, held[r] + 1
                if held[r] - prompt_lens[r] == max_tokens:  # its last token: it finishes
                    unfinished.remove(r)
    return first


def swap_or_recompute(model: CostModel, computed_tokens: int, hit_tokens: int) -> str:
    """Price both ways in the model's seconds; swap only when it is strictly cheaper."""
    missing = computed_tokens - hit_tokens  # the tokens the GPU prefix cache no longer holds
    recompute = model.prefill_seconds(missing, hit_tokens)  # prefilled again, attending to the cached ones
    swap = model.copy_seconds(computed_tokens) + model.copy_seconds(missing)  # all out at preemption, the missing back
    return "swap" if swap < recompute else "recompute"  # a tie goes to recompute, vLLM V1's way


def fewer_bytes_read(query_len: int, context_len: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                     qk_rope_head_dim: int, v_head_dim: int) -> str:
    """Both paths read every latent and the same weights once: compare what each writes and then reads back."""
    naive = (query_len + context_len) * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)  # K and V of every latent
    absorbed = 2 * query_len * kv_lora_rank  # q_latent and o_latent of every query token
    return "naive" if naive <= absorbed else "absorbed"  # per head and per byte alike; a tie is naive


def pool_too_small_from_buckets(bounds: list[float], reuse_gap_counts: list[int], idle_counts: list[int]) -> bool:
    """07.pool_too_small's rule, each quantile read off its histogram as Prometheus' histogram_quantile does."""
    def quantile(counts: list[int], q: float) -> float:
        rank, lower, below = q * counts[-1], 0.0, 0  # the rank; the bucket's lower bound and the values below it
        for upper, count in zip(bounds, counts[:-1], strict=True):  # cumulative: count holds every value to upper
            if count >= rank:  # the first bucket that reaches the rank: go the rest of the way inside it
                return lower + (upper - lower) * (rank - below) / (count - below)
            lower, below = upper, count
        return bounds[-1]  # the rank is in the +Inf bucket: the largest finite bound
    if not reuse_gap_counts[-1] or not idle_counts[-1]:  # an empty histogram: nothing to compare
        return False
    return quantile(reuse_gap_counts, 0.9) > quantile(idle_counts, 0.5)


def rank_kv_cache(config: dict, tp: int, num_blocks: int, block_size: int,
                  kv_dtype: str) -> tuple[tuple[int, ...], int]:
    """Every rank keeps every layer and every block; only its share of the KV heads differs (MLA: the whole latent)."""
    b, layers, slots = KV_DTYPE_BYTES[kv_dtype], config["num_hidden_layers"], num_blocks * block_size
    if config.get("kv_lora_rank"):  # MLA: one latent tensor per layer, never split across ranks
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        return (num_blocks, block_size, latent), int(slots * layers * latent * b)
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = max(kv_heads // tp, 1)  # a head is never cut: past tp = kv_heads, each rank keeps one whole head
    return (num_blocks, block_size, heads, head_dim), int(slots * 2 * layers * heads * head_dim * b)  # K and V


def k_proj_rows(num_attention_heads: int, num_kv_heads: int, head_dim: int, tp: int, rank: int) -> tuple[int, int]:
    """The rank's shard of the KV heads; with fewer heads than ranks, consecutive ranks share one."""
    heads_per_rank = max(num_kv_heads // tp, 1)  # never less than one whole head
    replicas = max(tp // num_kv_heads, 1)  # how many ranks keep each head
    shard = rank // replicas  # consecutive ranks' query heads read the same KV head
    start = shard * heads_per_rank * head_dim  # the rows run head after head, head_dim rows each
    return start, start + heads_per_rank * head_dim


def replication(num_attention_heads: int, num_kv_heads: int, num_gpus: int,
                kv_bytes_per_token: int) -> tuple[int, int, int]:
    """Try every size up to num_gpus; at the largest vLLM accepts, count what all ranks keep beyond one copy."""
    accepted = [t for t in range(1, num_gpus + 1)  # query heads split evenly; KV heads split, or are copied evenly
                if num_attention_heads % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)]
    no_copies = max(t for t in accepted if num_kv_heads % t == 0)  # every KV head on one rank only
    largest = max(accepted)
    per_rank = kv_bytes_per_token // num_kv_heads * max(num_kv_heads // largest, 1)  # a rank's heads, one at least
    return no_copies, largest, largest * per_rank - kv_bytes_per_token  # every rank's bytes, less one copy


def move_or_recompute(cost: CostModel, prompt_tokens: int, cached_tokens: int) -> str:
    """Only the tokens the decode side lacks: their bytes over the link against their FLOPs after the cached ones."""
    missing = prompt_tokens - cached_tokens
    move = cost.copy_seconds(missing)  # their KV across cost.link
    recompute = cost.prefill_seconds(missing, cached_tokens)  # FLOPs only: the decode step reads the weights anyway
    return "move" if move < recompute else "recompute"  # a tie recomputes
