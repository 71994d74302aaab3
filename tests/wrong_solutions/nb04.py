"""Plausible wrong answers to notebook 04's exercises, each failing for a reason the checker names."""

from kvlab.core.hashing import hash_block_tokens, sha256


def _blocks(token_ids, block_size):
    return [token_ids[i:i + block_size] for i in range(0, len(token_ids) - block_size + 1, block_size)]


def unchained(token_ids, block_size, none_hash):
    """Hashes every block on its own, as if a block's identity were its own tokens."""
    return [hash_block_tokens(sha256, none_hash, block) for block in _blocks(token_ids, block_size)]


def hashes_partial_block(token_ids, block_size, none_hash):
    """Hashes the trailing partial block too."""
    hashes, parent = [], none_hash
    for start in range(0, len(token_ids), block_size):
        parent = hash_block_tokens(sha256, parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def no_last_token_rule(block_hashes, cached, num_tokens, block_size):
    """Lets every cached leading block hit, even when that covers the prompt's last token."""
    n = 0
    for h in block_hashes:
        if h not in cached:
            break
        n += 1
    return n * block_size


def does_not_stop_at_miss(block_hashes, cached, num_tokens, block_size):
    """Counts every cached block, as if hits did not have to be a prefix."""
    return sum(h in cached for h in block_hashes[: (num_tokens - 1) // block_size]) * block_size


def common_prefix_in_tokens(cached_tokens, prompt, block_size):
    """Counts matching tokens one by one, as if a cache hit could end inside a block."""
    n = 0
    for a, b in zip(cached_tokens, prompt, strict=False):
        if a != b:
            break
        n += 1
    return min(n, len(prompt) - 1)


def every_matching_block(cached_tokens, prompt, block_size):
    """Compares whole full blocks, but forgets that the prompt's last token must be computed."""
    n = 0
    while (n + 1) * block_size <= min(len(cached_tokens), len(prompt)) and (
            cached_tokens[n * block_size:(n + 1) * block_size] == prompt[n * block_size:(n + 1) * block_size]):
        n += 1
    return n * block_size


def _shared(hashes_of):
    """A learner's prediction for 04.chained_hashes, worked out with ``hashes_of(token_ids, block_size, seed)``."""
    from kvlab.exercises.nb04 import CHAIN_PARTS

    a = set(hashes_of(list(range(70)), 16, b"seed"))
    return {name: [i for i, h in enumerate(hashes_of(tokens, 16, b"seed")) if h in a]
            for name, tokens in CHAIN_PARTS.items()}


WRONG_PREDICTIONS = {
    "04.chained_hashes": [
        (_shared(unchained), "folds in its parent's hash"),
        (_shared(hashes_partial_block), "only full blocks are hashed"),
        ({"A again": [0, 1, 2, 3], "B: token 20 changed": [], "D: A without its first 16 tokens": []},
         "leaves block 0 alone"),
    ],
}

WRONG = {
    "04.longest_cached_prefix": [
        (no_last_token_rule, "at most num_tokens - 1 tokens may hit"),
        (does_not_stop_at_miss, "stop at the first miss"),
    ],
    "04.chat_turn_hits": [
        (common_prefix_in_tokens, "a block that matches only in part is not a hit"),
        (every_matching_block, "at most len(prompt) - 1 tokens may hit"),
    ],
}
