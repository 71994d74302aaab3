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


def _simulate(prompt_lens, max_tokens, budget, *, waiting_first=False, free_decodes=False):
    n = len(prompt_lens)
    computed, generated, first = [0] * n, [0] * n, [0] * n
    waiting, running, step = list(range(n)), [], 0
    while waiting or running:
        step, left, chosen = step + 1, budget, {}
        for group in ((waiting, running) if waiting_first else (running, waiting)):
            for r in list(group):
                need = prompt_lens[r] + generated[r] - computed[r]
                decode = free_decodes and r in running and need == 1
                take = 1 if decode else min(need, left)
                if take <= 0:
                    break
                chosen[r] = take
                left -= 0 if decode else take
                if r in waiting:
                    waiting.remove(r)
                    running.append(r)
        for r, take in chosen.items():
            computed[r] += take
            if computed[r] == prompt_lens[r] + generated[r]:
                generated[r] += 1
                first[r] = first[r] or step
                if generated[r] == max_tokens:
                    running.remove(r)
    return first


def decodes_cost_nothing(prompt_lens, max_tokens, max_num_batched_tokens):
    """Gives the whole budget to prompts, as if decode tokens were free."""
    return _simulate(prompt_lens, max_tokens, max_num_batched_tokens, free_decodes=True)


def new_prompts_first(prompt_lens, max_tokens, max_num_batched_tokens):
    """Admits waiting prompts before serving the running requests."""
    return _simulate(prompt_lens, max_tokens, max_num_batched_tokens, waiting_first=True)


WRONG = {
    "06.preemption_victim": [
        (oldest_first, "not the oldest request"),
        (never_itself, "it is the victim"),
    ],
    "06.recompute_tokens": [
        (every_token_may_hit, "the last token must be computed"),
        (evicts_the_prompt_start, "last* full blocks are evicted first"),
    ],
    "06.first_token_steps": [
        (decodes_cost_nothing, "a running request's decode token takes one token"),
        (new_prompts_first, "every step serves the RUNNING requests first"),
    ],
}
