"""Notebook 08's exercises (what a window frees, the hybrid hit, blocks per group, chunked layers) and self-test."""

from __future__ import annotations

import random
from typing import Any

from kvlab.capacity.hybrid import plan_hybrid_kv_cache
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.exercises.predictions import Prediction, register_prediction
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.sim.hybrid_hits import hit_walkthrough
from kvlab.units import cdiv

# ----------------------------------------------------------------- 08.freed_blocks (a prediction)

FREED_PARTS = {"token 6, W = 4": (6, 4), "token 7, W = 4": (7, 4), "token 40, W = 8": (40, 8)}  # blocks of 4


def freed_blocks(num_computed_tokens: int, sliding_window: int, block_size: int) -> list[int]:
    """kvlab's SlidingWindowManager: compute the tokens, allocate the next one, read which entries are null."""
    manager = KVCacheManager(cdiv(num_computed_tokens + 1, block_size) + 2, block_size, hash_seed="08",
                             kv_cache_groups=[SlidingWindowSpec(block_size, sliding_window=sliding_window)])
    request = Request("r", [5] * (num_computed_tokens + 1))
    if num_computed_tokens:
        manager.allocate_slots(request, num_computed_tokens)
        request.num_computed_tokens = num_computed_tokens
    manager.allocate_slots(request, 1)  # frees what the next token's window no longer reaches, then adds its slot
    return [i for i, block in enumerate(manager.get_blocks("r")) if block.is_null]


def _freed_parts(skipped: Any, rounding: Any = lambda s: s // 4) -> dict[str, list[int]]:
    """Each part's freed blocks when the next token is taken to skip ``skipped(p, W)`` tokens."""
    return {name: list(range(rounding(max(skipped(p, w), 0)))) for name, (p, w) in FREED_PARTS.items()}


FREED_MISTAKES = (
    Mistake(lambda: _freed_parts(lambda p, w: p - w),
            "the window includes the query itself: the token at position p sees p - W + 1 .. p (W tokens, itself "
            "among them), so everything before p - W + 1 is skipped, not only what is before p - W"),
    Mistake(lambda: _freed_parts(lambda p, w: p - w + 1, lambda s: cdiv(s, 4)),
            "a block is freed only when every token in it is outside the window; one still partly inside stays"),
)

register_prediction(Prediction(
    id="08.freed_blocks",
    title="which blocks a sliding-window layer frees",
    question=(
        "A request in a sliding-window group (blocks of 4 tokens) has computed p tokens, and allocate_slots now "
        "makes room for the next one, at position p. Which logical blocks of its table has the window's manager "
        "replaced by the null block? Predict for p = 6 and p = 7 with a window W of 4, and p = 40 with W = 8."
    ),
    form='{"token 6, W = 4": [...], "token 7, W = 4": [...], "token 40, W = 8": [...]}: logical block indices',
    run=lambda: {name: freed_blocks(p, w, 4) for name, (p, w) in FREED_PARTS.items()},
    runs="KVCacheManager(..., kv_cache_groups=[SlidingWindowSpec(4, sliding_window=W)]): allocate_slots for p tokens, "
         "then for one more, and read which entries of get_blocks('r') are the null block",
    mistakes=FREED_MISTAKES,
    hints=[
        "Which keys does the query at position p see? Count them: the window holds W tokens, the query among them.",
        "Every token before the window's first position is skipped. Which blocks hold only skipped tokens?",
    ],
))


# ----------------------------------------------------------------- 08.hybrid_hit


def hybrid_hit(num_prompt_tokens: int, sliding_window: int, block_size: int, evicted_sliding: list[int],
               evicted_full: list[int]) -> int:
    """Reference, kvlab's HybridKVCacheCoordinator: the tokens B hits after A's evictions (``hit_walkthrough``)."""
    return hit_walkthrough(num_prompt_tokens, sliding_window, block_size, tuple(evicted_sliding),
                           tuple(evicted_full)).hit_tokens


def _min_of_alone(num_prompt_tokens, sliding_window, block_size, evicted_sliding, evicted_full) -> int:
    walk = hit_walkthrough(num_prompt_tokens, sliding_window, block_size, tuple(evicted_sliding), tuple(evicted_full))
    return min(walk.alone)


def _explain_hybrid_hit(case: Case, expected: Any, actual: Any) -> str | None:
    return "return a number of tokens (an int)" if type(actual) is not int else None


def _window_as_full(num_prompt_tokens: int, sliding_window: int, block_size: int, evicted_sliding: list[int],
                    evicted_full: list[int]) -> int:
    """Every block from the start required in the window's group too (a known mistake)."""
    return min([num_prompt_tokens // block_size, *evicted_sliding, *evicted_full]) * block_size


def _window_of_w_blocks(case: Case) -> str:
    window, block_size = case.args[1], case.args[2]
    return (f"a window of {window} tokens reaches cdiv(W - 1, block_size) = {-(-(window - 1) // block_size)} blocks "
            f"before the hit's end, not cdiv(W, block_size) = {-(-window // block_size)}: the newest token is one "
            "of the W it attends to")


HIT_MISTAKES = (
    Mistake(_min_of_alone,
            "the smaller of the two kinds' own hits is not always a hit: a window's hit is not downward-closed, at a "
            "shorter length it needs other blocks, which may be gone. Ask the window again at full attention's length"),
    Mistake(_window_as_full,
            "a sliding window needs only the blocks its window reaches, not every block from the start"),
    Mistake(lambda n, w, bs, es, ef: plain.hybrid_hit(n, w, bs, es, ef, window_blocks=-(-w // bs)),
            _window_of_w_blocks),
)


def _random_hit_case(rng: random.Random) -> Case:
    block_size = rng.choice([2, 4])
    tokens = rng.randint(3, 16) * block_size + rng.choice([0, 1])
    blocks = tokens // block_size
    evicted_sliding = sorted(rng.sample(range(blocks), rng.randint(0, 3)))
    evicted_full = sorted(rng.sample(range(blocks), rng.randint(0, 1)))
    return Case((tokens, rng.randint(2, 5 * block_size), block_size, evicted_sliding, evicted_full),
                probes="a random prompt and evictions")


register(Exercise(
    id="08.hybrid_hit",
    title="the hybrid prefix hit",
    task=(
        "A model has one sliding-window group (window `sliding_window`) and one full-attention group, `block_size` "
        "tokens per block. Request A computed a prompt of `num_prompt_tokens` tokens; then its logical blocks "
        "`evicted_sliding` (in the window's group) and `evicted_full` (in full attention's) lost their place in the "
        "prefix cache. Request B is A's prompt plus one token. How many tokens does B hit? Hits are whole blocks, "
        "at most B's length minus one, and must be served by both groups."
    ),
    signature=("def hybrid_hit(num_prompt_tokens: int, sliding_window: int, block_size: int, evicted_sliding: list, "
               "evicted_full: list) -> int:"),
    reference=hybrid_hit,
    edge_cases=[
        Case((40, 8, 4, [], []), probes="nothing evicted: B hits A's whole prompt, 40 tokens"),
        Case((40, 8, 4, [8], []), probes="the window's block 8 is gone: the window needs blocks 6 and 7 at 32"),
        Case((40, 8, 4, [], [5]), probes="full attention stops at block 5; the window must serve 20 tokens"),
        Case((40, 8, 4, [8, 3], [6]), probes="full attention offers 24; at 24 the window needs blocks 4 and 5"),
        Case((40, 8, 4, [4], [6]), probes="at 24 the window's block 4 is gone: it offers blocks 2 and 3, 16 tokens"),
        Case((41, 20, 4, [1, 7], []), probes="a window of 20 needs 5 blocks in a row; block 7 is gone: 2..6, 28"),
        Case((12, 3, 4, [0, 1], [2]), probes="full attention offers 8; at 8 the window needs block 1, gone: nothing"),
    ],
    random_case=_random_hit_case,
    explain=_explain_hybrid_hit,
    mistakes=HIT_MISTAKES,
    shown=plain.hybrid_hit,
    hints=[
        "Each kind has its own rule: full attention needs every block before the hit's end; a window of W needs only "
        "the cdiv(W - 1, block_size) blocks just before it (or every block, when the hit is shorter than that).",
        "Start from the longest length B may hit, and let full attention answer first: it can only lower it.",
        "Then ask the window at that length. If it cannot serve it, it offers a shorter one, which full attention "
        "accepts too: a full-attention hit stays a hit at any shorter length.",
    ],
))


# ----------------------------------------------------------------- 08.blocks_per_group


def blocks_per_group(num_tokens: int, num_hit_tokens: int, sliding_window: int, block_size: int,
                     hits_are_free: bool) -> list[int]:
    """Reference, kvlab's managers: free blocks a new request's first allocation takes, [window group, full group]."""
    specs = [SlidingWindowSpec(block_size, sliding_window=sliding_window), FullAttentionSpec(block_size)]
    manager = KVCacheManager(2 * cdiv(num_tokens, block_size) + 4, block_size, hash_seed="08", kv_cache_groups=specs)
    prompt = [(3 * t + 1) % 97 for t in range(num_tokens)]
    if num_hit_tokens:
        first = Request("first", prompt[:num_hit_tokens] + [99])
        manager.allocate_slots(first, num_hit_tokens + 1)
        if hits_are_free:
            manager.free(first)
    request = Request("new", prompt)
    hits, n, _ = manager.get_computed_blocks(request, max_cache_hit_length=num_hit_tokens)
    assert n == num_hit_tokens
    return [m.get_num_blocks_to_allocate("new", num_tokens, hits.blocks[g], n, n)
            for g, m in enumerate(manager.coordinator.single_type_managers)]


def _explain_blocks(case: Case, expected: Any, actual: Any) -> str | None:
    if type(actual) not in (list, tuple) or len(actual) != 2:
        return "return two numbers: [blocks for the sliding-window group, blocks for the full-attention group]"
    return None


def _window_only_for_one_token(num_tokens: int, num_hit_tokens: int, sliding_window: int, block_size: int,
                               hits_are_free: bool) -> list[int]:
    """The window's group given only the blocks one token's window needs, as if the chunk freed as it went."""
    required, hits = cdiv(num_tokens, block_size), num_hit_tokens // block_size
    kept = hits - max(0, num_hit_tokens - sliding_window + 1) // block_size if hits else 0
    window = min(required - hits, cdiv(sliding_window - 1, block_size) + 1)
    return [window + (kept if hits_are_free else 0), required - hits + (hits if hits_are_free else 0)]


BLOCK_MISTAKES = (
    Mistake(lambda n, hit, w, bs, free: plain.blocks_per_group(n, hit, w, bs, False),
            "a hit block that sits in the free queue (nobody holds it) costs a free block too: taking it out of the "
            "queue is what keeps it from being evicted"),
    Mistake(_window_only_for_one_token,
            "the window's group needs a slot for every new token of this allocation: blocks are freed only behind "
            "what is computed, so a prefill in one chunk holds the whole chunk"),
)


def _random_blocks_case(rng: random.Random) -> Case:
    block_size = rng.choice([2, 4, 8])
    num_tokens = rng.randint(2, 20) * block_size + rng.randint(0, block_size - 1)
    hit = rng.randint(0, (num_tokens - 1) // block_size) * block_size
    return Case((num_tokens, hit, rng.randint(2, 6 * block_size), block_size, rng.random() < 0.5),
                probes="a random prompt, hit, window and block size")


register(Exercise(
    id="08.blocks_per_group",
    title="the blocks a new request takes in each group",
    task=(
        "A new request of `num_tokens` prompt tokens hits its first `num_hit_tokens` tokens (a multiple of "
        "`block_size`) in a model with one sliding-window group (window `sliding_window`) and one full-attention "
        "group, and asks for slots for its whole prompt in one chunk. The hit blocks are held by a running request, "
        "or, if `hits_are_free`, sit in the free queue. How many free blocks does its allocation take in each group, "
        "as vLLM's `get_num_blocks_to_allocate` counts them? Return [window group, full-attention group]."
    ),
    signature=("def blocks_per_group(num_tokens: int, num_hit_tokens: int, sliding_window: int, block_size: int, "
               "hits_are_free: bool) -> list:"),
    reference=blocks_per_group,
    shown=plain.blocks_per_group,
    edge_cases=[
        Case((40, 0, 8, 4, False), probes="no hit: both groups need all ten blocks for this chunk"),
        Case((40, 32, 8, 4, False), probes="32 hit tokens held by another request: two new blocks each"),
        Case((40, 32, 8, 4, True), probes="the same hit from the free queue: each hit block the group keeps costs one"),
        Case((41, 24, 4, 4, True), probes="a window of 4 keeps one hit block: it costs one, the others are skipped"),
        Case((16, 8, 32, 4, True), probes="a window longer than the request keeps every hit block"),
    ],
    random_case=_random_blocks_case,
    explain=_explain_blocks,
    mistakes=BLOCK_MISTAKES,
    hints=[
        "Both groups need a block for every block of tokens the chunk ends at that the hit does not cover.",
        "Hit blocks that nobody holds sit in the free queue: taking them costs free blocks too. Which hit blocks does "
        "each group actually take?",
        "The window's group skips the hit blocks wholly before the next token's window: get_num_skipped_tokens of "
        "the hit tokens, in whole blocks.",
    ],
))


# ----------------------------------------------------------------- 08.chunked_local_freed (a prediction, transfer)

CHUNKED_PARTS = {"token 13, chunk 8": (13, 8), "token 8, chunk 8": (8, 8), "token 30, chunk 10": (30, 10)}


def chunked_local_freed(num_computed_tokens: int, attention_chunk_size: int, block_size: int) -> list[int]:
    """vLLM's ``ChunkedLocalAttentionManager.get_num_skipped_tokens``, in whole blocks (kvlab does not model the
    manager itself: this is its rule as 0.33.0 writes it)."""
    skipped = num_computed_tokens // attention_chunk_size * attention_chunk_size  # the next token's chunk starts here
    return list(range(skipped // block_size))


def _chunked_parts(skipped: Any, rounding: Any = lambda s: s // 4) -> dict[str, list[int]]:
    return {name: list(range(rounding(max(skipped(p, c), 0)))) for name, (p, c) in CHUNKED_PARTS.items()}


CHUNKED_MISTAKES = (
    Mistake(lambda: _chunked_parts(lambda p, c: p - c + 1),
            "a chunked layer is not a sliding window: the next token sees the tokens of its own chunk only, from the "
            "chunk's start, however few they are"),
    Mistake(lambda: _chunked_parts(lambda p, c: (p // c - 1) * c),
            "once a chunk is complete, the next token starts a new chunk and sees none of the old one"),
    Mistake(lambda: _chunked_parts(lambda p, c: p // c * c, lambda s: cdiv(s, 4)),
            "a block is freed only when every token in it is before the chunk's start; one that holds the start "
            "stays"),
)

register_prediction(Prediction(
    id="08.chunked_local_freed",
    title="what a chunked local attention layer frees",
    question=(
        "Llama 4 alternates full attention with chunked local attention: the sequence is cut into chunks of "
        "attention_chunk_size tokens, and a token attends only to the tokens of its own chunk up to itself. vLLM "
        "manages such layers like a sliding window (a ChunkedLocalAttentionManager, null blocks for what is "
        "skipped). A request has computed p tokens (blocks of 4); which logical blocks can go before the token at "
        "position p is computed? Predict for p = 13 and p = 8 with chunks of 8, and p = 30 with chunks of 10."
    ),
    form='{"token 13, chunk 8": [...], "token 8, chunk 8": [...], "token 30, chunk 10": [...]}: block indices',
    run=lambda: {name: chunked_local_freed(p, c, 4) for name, (p, c) in CHUNKED_PARTS.items()},
    runs="vLLM 0.33.0's rule, ChunkedLocalAttentionManager.get_num_skipped_tokens (p // chunk * chunk tokens), "
         "in whole blocks",
    mistakes=CHUNKED_MISTAKES,
    transfer=True,
    hints=[
        "Where does the chunk of the token at position p start?",
        "Every token before that start is invisible to this token and to every later one.",
        "As for a sliding window, only whole blocks are freed.",
    ],
))


# ----------------------------------------------------------------- self-test


def _gpt_oss_question() -> dict[str, Any]:
    plan = plan_hybrid_kv_cache("gpt-oss-20b", max_model_len=131072, gpu_memory_gib=80, kv_cache_memory_gib=40)
    return {"groups": [len(g.layer_names) for g in plan.kv_cache_groups], "gain": plan.concurrency_gain,
            "blocks": plan.blocks_per_request, "concurrency": plan.max_concurrency,
            "full_concurrency": plan.full_attention.max_concurrency}


ask(
    "08.q1",
    ("gpt-oss-20b (12 layers with a 128-token window, 12 full ones) gets 40 GiB of KV cache, max_model_len 131,072. "
     "How many more requests of that length fit with vLLM 0.33.0's hybrid manager than with every layer as full "
     "attention, and why not twice as many?"),
    _gpt_oss_question,
    lambda v: (
        f"{v['gain']:.2f}x ({v['concurrency']:.2f} against {v['full_concurrency']:.2f}). The layers form two groups "
        f"of {v['groups'][0]}, so a block holds 12 layers' pages, not 24: twice the blocks. A request holds "
        f"{v['blocks'][1]:,} blocks in the full group, but {v['blocks'][0]:,} in the window's, not 9: vLLM reserves "
        "for the tokens in flight too (two batches of 8,192 with async scheduling)."),
)


def _gemma_question() -> dict[str, Any]:
    default = plan_hybrid_kv_cache("gemma-2-9b", max_model_len=8192, gpu_memory_gib=80, kv_cache_memory_gib=40)
    return {"gain": default.concurrency_gain, "blocks": default.blocks_per_request}


ask(
    "08.q2",
    "And Gemma 2 9B (window 4,096, max_model_len 8,192) under the same defaults?",
    _gemma_question,
    lambda v: (
        f"{v['gain']:.3f}x: nothing gained, slightly worse. The window plus 16,384 tokens in flight exceeds the "
        f"context, so a request is counted at {v['blocks'][0]} blocks in the window's group, one more than the "
        f"{v['blocks'][1]} of full attention. A window pays when it is short next to max_model_len."),
)


def _hit_question() -> dict[str, Any]:
    walk = hit_walkthrough(40, 8, 4, evict_sliding=(4,), evict_full=(6,))
    return {"alone": walk.alone, "hit": walk.hit_tokens, "rounds": walk.rounds}


ask(
    "08.q3",
    ("A 40-token prompt is cached (block size 4) in a window-8 group and a full-attention group; then the window's "
     "block 4 and full attention's block 6 are evicted. What does each kind hit alone, and what is the hybrid hit?"),
    _hit_question,
    lambda v: (
        f"The window alone {v['alone'][0]} tokens, full attention alone {v['alone'][1]}, together {v['hit']}: at "
        f"{v['alone'][1]} tokens the window needs blocks 4 and 5, and block 4 is gone, so the window offers "
        f"{v['hit']} instead, which full attention accepts. The smaller of the two alone would be wrong."),
    transfer=True,
)


def _freed_question() -> dict[str, Any]:
    return {"gpt_oss": len(freed_blocks(4096, 128, 16)), "total": 4096 // 16}


ask(
    "08.q4",
    "A gpt-oss request has computed 4,096 tokens (block size 16). How many of its blocks has a sliding layer freed?",
    _freed_question,
    lambda v: (
        f"{v['gpt_oss']} of its {v['total']}: token 4,096 sees 3,969..4,096, so every block ending at or before "
        "3,969 is gone and only the last 9 hold KV. A full-attention layer keeps all 256."),
)
