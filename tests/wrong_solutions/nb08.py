"""Plausible wrong answers to notebook 08's exercises, each failing for a reason the checker names."""

from kvlab.units import cdiv


def window_without_the_query(num_computed_tokens, sliding_window, block_size):
    """Lets the next token see W earlier tokens (forgets that the window includes the query itself)."""
    return list(range(max(0, num_computed_tokens - sliding_window) // block_size))


def frees_partly_visible_blocks(num_computed_tokens, sliding_window, block_size):
    """Frees a block as soon as its first token leaves the window."""
    return list(range(cdiv(max(0, num_computed_tokens - sliding_window + 1), block_size)))


def smaller_of_the_two(num_prompt_tokens, sliding_window, block_size, evicted_sliding, evicted_full):
    """Takes each kind's own longest hit and the smaller one, without asking the window again."""
    blocks = num_prompt_tokens // block_size
    full = min([blocks, *evicted_full])
    need = cdiv(sliding_window - 1, block_size)
    sliding = 0
    for end in range(blocks, 0, -1):
        if all(i not in evicted_sliding for i in range(max(0, end - need), end)):
            sliding = end
            break
    return min(full, sliding) * block_size


def window_as_full_attention(num_prompt_tokens, sliding_window, block_size, evicted_sliding, evicted_full):
    """Requires every block from the start in the window's group too."""
    return min([num_prompt_tokens // block_size, *evicted_sliding, *evicted_full]) * block_size


def free_hits_cost_nothing(num_tokens, num_hit_tokens, sliding_window, block_size, hits_are_free):
    """Counts only fresh blocks: a hit taken from the free queue is treated as free of charge."""
    required, hits = cdiv(num_tokens, block_size), num_hit_tokens // block_size
    skipped = max(0, num_hit_tokens - sliding_window + 1) // block_size
    return [max(required - max(skipped, hits), 0), required - hits]


def window_only_during_prefill(num_tokens, num_hit_tokens, sliding_window, block_size, hits_are_free):
    """Gives the window's group only the blocks one token's window needs, as if the chunk freed as it went."""
    required, hits = cdiv(num_tokens, block_size), num_hit_tokens // block_size
    kept = hits - max(0, num_hit_tokens - sliding_window + 1) // block_size if hits else 0
    window = min(required - hits, cdiv(sliding_window - 1, block_size) + 1)
    return [window + (kept if hits_are_free else 0), required - hits + (hits if hits_are_free else 0)]


def chunk_as_window(num_computed_tokens, attention_chunk_size, block_size):
    """Treats the chunk like a sliding window of that size."""
    skipped = max(0, num_computed_tokens - attention_chunk_size + 1)
    return list(range(skipped // block_size))


def keeps_the_last_chunk(num_computed_tokens, attention_chunk_size, block_size):
    """Keeps the chunk before the current one, as if the next token still saw it."""
    skipped = max(0, num_computed_tokens // attention_chunk_size - 1) * attention_chunk_size
    return list(range(skipped // block_size))


def window_of_cdiv_w_blocks(num_prompt_tokens, sliding_window, block_size, evicted_sliding, evicted_full):
    """The agreement rounds right, but a window taken to need cdiv(W, block_size) blocks, not cdiv(W - 1, ...)."""
    need = -(-sliding_window // block_size)
    length = num_prompt_tokens // block_size
    while True:
        full = min([length, *evicted_full])
        run, window = 0, None
        for i in reversed(range(full)):
            run = 0 if i in evicted_sliding else run + 1
            if run == need:
                window = i + need
                break
        window = run if window is None else window
        if window == length:
            return length * block_size
        length = window


def _freed(freed_blocks):
    from kvlab.exercises.nb08 import FREED_PARTS

    return {name: freed_blocks(p, w, 4) for name, (p, w) in FREED_PARTS.items()}


def _chunked(chunked_local_freed):
    from kvlab.exercises.nb08 import CHUNKED_PARTS

    return {name: chunked_local_freed(p, c, 4) for name, (p, c) in CHUNKED_PARTS.items()}


def frees_the_chunk_start_block(num_computed_tokens, attention_chunk_size, block_size):
    """Frees the block that holds the chunk's start too."""
    return list(range(cdiv(num_computed_tokens // attention_chunk_size * attention_chunk_size, block_size)))


WRONG_PREDICTIONS = {
    "08.freed_blocks": [
        (_freed(window_without_the_query), "the window includes the query itself"),
        (_freed(frees_partly_visible_blocks), "a block is freed only when every token in it is outside the window"),
    ],
    "08.chunked_local_freed": [
        (_chunked(chunk_as_window), "not a sliding window"),
        (_chunked(keeps_the_last_chunk), "once a chunk is complete"),
        (_chunked(frees_the_chunk_start_block), "one that holds the start stays"),
    ],
}

WRONG = {
    "08.hybrid_hit": [
        (window_of_cdiv_w_blocks, "not cdiv(W, block_size)"),
        (smaller_of_the_two, "not always a hit"),
        (window_as_full_attention, "needs only the blocks its window reaches"),
    ],
    "08.blocks_per_group": [
        (free_hits_cost_nothing, "costs a free block too"),
        (window_only_during_prefill, "needs a slot for every new token of this allocation"),
    ],
}
