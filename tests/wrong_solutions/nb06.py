"""Plausible wrong answers to notebook 06's exercises, each failing for a reason the checker names."""


def oldest_first(running, blocks_held, request_id, blocks_needed, free_blocks):
    """Preempts the oldest running request first (FIFO instead of the most recent)."""
    victims, queue = [], list(running)
    while free_blocks < blocks_needed:
        victim = queue.pop(0)
        victims.append(victim)
        free_blocks += blocks_held[victim]
        if victim == request_id:
            break
    return victims


def never_itself(running, blocks_held, request_id, blocks_needed, free_blocks):
    """Skips the request that needs the blocks, preempting older ones instead."""
    victims = []
    for victim in reversed([r for r in running if r != request_id]):
        if free_blocks >= blocks_needed:
            break
        victims.append(victim)
        free_blocks += blocks_held[victim]
    return victims


def every_token_may_hit(num_tokens, block_size, enable_prefix_caching, num_evicted_blocks=0):
    """Lets a block-aligned request hit all its blocks (forgets that the last token is always computed)."""
    if not enable_prefix_caching:
        return num_tokens
    full = num_tokens // block_size
    return num_tokens - max(full - num_evicted_blocks, 0) * block_size


def evicts_the_prompt_start(num_tokens, block_size, enable_prefix_caching, num_evicted_blocks=0):
    """Evicts a request's first blocks first, so any eviction breaks the hash chain at block 0."""
    if not enable_prefix_caching or (num_evicted_blocks and num_tokens >= block_size):
        return num_tokens
    return num_tokens - (num_tokens - 1) // block_size * block_size


WRONG = {
    "06.preemption_victim": [
        (oldest_first, "not the oldest request"),
        (never_itself, "it is the victim"),
    ],
    "06.recompute_tokens": [
        (every_token_may_hit, "the last token must be computed"),
        (evicts_the_prompt_start, "last* full blocks are evicted first"),
    ],
}
