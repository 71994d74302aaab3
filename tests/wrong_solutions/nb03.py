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


WRONG = {
    "03.cow_append": [
        (writes_into_shared_block, "Copy it first"),
        (copies_every_shared_block, "full shared blocks are never copied"),
    ],
    "03.free_queue_order": [
        (everything_to_the_tail, "blocks without a hash go to the head"),
        (frees_in_table_order, "tail first"),
    ],
}
