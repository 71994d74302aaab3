"""Plausible wrong answers to notebook 11 part 2's exercises, each failing for a reason the checker names."""


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
