"""Plausible wrong answers to notebook 03's exercises, each failing for a reason the checker names."""


def _holders(tables, block):
    return sum(t.count(block) for t in tables.values())


def writes_into_shared_block(tables, name, num_tokens, free, block_size):
    """Forgets copy-on-write: writes into the last block even when another sequence shares it."""
    table = list(tables[name])
    if num_tokens % block_size == 0:
        return table + [free[0]], []
    return table, []


def copies_every_shared_block(tables, name, num_tokens, free, block_size):
    """Copies the last block whenever it is shared, even when it is full and nobody will write into it."""
    table = list(tables[name])
    if table and _holders(tables, table[-1]) > 1:
        copies = [(table[-1], free[0])]
        table[-1] = free[0]
        return (table + [free[1]] if num_tokens % block_size == 0 else table), copies
    return (table + [free[0]] if num_tokens % block_size == 0 else table), []


def everything_to_the_tail(queue, table, cached):
    """Treats the free queue as plain FIFO: every freed block joins the tail."""
    return queue + list(reversed(table))


def frees_in_table_order(queue, table, cached):
    """Frees the blocks head first, so the prompt's first cached block would be evicted first."""
    return [b for b in table if b not in cached] + queue + [b for b in table if b in cached]


def prepends_one_at_a_time(queue, table, cached):
    """Frees tail first, but puts each block without a hash in front of the queue on its own."""
    queue = list(queue)
    for block in reversed(table):
        if block in cached:
            queue.append(block)
        else:
            queue.insert(0, block)
    return queue


def _cdiv(a, b):
    return -(-a // b)


def no_sharing(n, prompt_tokens, new_tokens, block_size):
    """Counts every sample's blocks as if forks copied the prompt."""
    copies = n - 1 if new_tokens and prompt_tokens % block_size and n > 1 else 0
    return n * _cdiv(prompt_tokens + new_tokens, block_size), copies


def every_sample_copies(n, prompt_tokens, new_tokens, block_size):
    """Lets every sample copy the shared partial block, the last holder included."""
    full = prompt_tokens // block_size
    blocks = full + n * (_cdiv(prompt_tokens + new_tokens, block_size) - full) if new_tokens else _cdiv(
        prompt_tokens, block_size)
    return blocks, n if new_tokens and prompt_tokens % block_size else 0


WRONG = {
    "03.cow_append": [
        (writes_into_shared_block, "Copy it first"),
        (copies_every_shared_block, "full shared blocks are never copied"),
    ],
    "03.free_queue_order": [
        (everything_to_the_tail, "blocks without a hash go to the head"),
        (frees_in_table_order, "tail first"),
        (prepends_one_at_a_time, "one at a time"),
    ],
    "03.sampling_blocks": [
        (no_sharing, "forked samples share the prompt's blocks"),
        (every_sample_copies, "n - 1 copies, not n"),
    ],
}
