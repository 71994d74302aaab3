"""Notebook 03's exercises (an append with copy-on-write, the free queue after a release) and self-test."""

from __future__ import annotations

import random
from typing import Any

from kvlab.core.block_pool import BlockPool
from kvlab.core.sequence import compute_slot_mapping
from kvlab.exercises.core import Case, Exercise, ask, register
from kvlab.sim.block_scenarios import parallel_sampling, random_workload, record, walk_free_queue

# ----------------------------------------------------------------- 03.cow_append


def cow_append(
    tables: dict[str, list[int]], name: str, num_tokens: int, free: list[int], block_size: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Reference: sequence ``name`` writes its next token; its new block table and the copies that needs."""
    table = list(tables[name])
    if num_tokens % block_size == 0:  # no block yet, or the last one is full: take a fresh block
        return table + [free[0]], []
    last = table[-1]
    ref_cnt = sum(t.count(last) for t in tables.values())
    if ref_cnt == 1:  # the partly filled last block is ours alone: write in place
        return table, []
    table[-1] = free[0]  # shared and partly filled: copy it first, then write into the copy
    return table, [(last, free[0])]


def _same_append(expected: Any, actual: Any) -> bool:
    try:
        table, copies = actual
        return (list(table), [tuple(c) for c in copies]) == (list(expected[0]), list(expected[1]))
    except (TypeError, ValueError):
        return False


def _explain_cow(case: Case, expected: Any, actual: Any) -> str | None:
    tables, name, num_tokens, free, block_size = case.args
    try:
        table, copies = actual
        copies = [tuple(c) for c in copies]
    except (TypeError, ValueError):
        return "return a pair: (the new block table as a list, the list of (src, dst) copies)"
    last = tables[name][-1] if tables[name] else None
    if expected[1] and not copies:
        return (f"block {last} is shared and only partly full: writing into it in place would change what the "
                "other sequences read. Copy it first, point the table at the copy and report (src, dst)")
    if copies and num_tokens % block_size == 0:
        return "the last block is full: full shared blocks are never copied, a fresh block is taken instead"
    if copies and not expected[1]:
        return f"only this sequence holds block {last} (ref_cnt 1): write in place, no copy"
    if list(table) != list(expected[0]) and free and free[0] not in table:
        return "take the new block from the head of the free queue: free[0]"
    return None


def _random_cow_case(rng: random.Random) -> Case:
    """A state drawn from a real random workload, and one of its live sequences as the writer."""
    while True:
        steps = record(random_workload(rng.randrange(10**6), num_ops=rng.randint(4, 24),
                                       block_size=rng.randint(2, 5)))
        snap = rng.choice(steps).snapshot
        if snap.tables and snap.free_queue:
            name = rng.choice(sorted(snap.tables))
            tables = {n: list(t) for n, t in snap.tables.items()}
            return Case((tables, name, snap.num_tokens[name], list(snap.free_queue), snap.block_size),
                        probes="a state reached by a random workload")


_WALK_1 = {"A": [0, 1], "B": [0, 1]}

register(Exercise(
    id="03.cow_append",
    title="append one token, with copy-on-write",
    task=(
        "Sequence `name` writes its next token. `tables` maps every live sequence to its block table "
        "(a block's ref_cnt is how many tables hold it), `num_tokens` is how many tokens `name` holds already, "
        "`free` is the free queue from head to tail and `block_size` the slots per block. Return the pair "
        "(`name`'s new block table, the copies [(src_block_id, dst_block_id)] the write needs). A new block "
        "always comes from the head of the free queue. A shared, partly filled last block is copied before the "
        "write; a full block is never copied."
    ),
    signature=("def cow_append(tables: dict[str, list[int]], name: str, num_tokens: int, free: list[int], "
               "block_size: int) -> tuple[list[int], list[tuple[int, int]]]:"),
    reference=cow_append,
    edge_cases=[
        Case((_WALK_1, "B", 6, [2, 3, 4], 4), probes="walk 1: B writes token 6 into block 1, which A shares"),
        Case((_WALK_1, "B", 8, [2, 3, 4], 4),
             probes="a full shared last block: a fresh block for the new token, nothing copied"),
        Case(({"A": [0, 1]}, "A", 6, [5, 2], 4), probes="the partly filled last block is A's alone: write in place"),
        Case(({"A": []}, "A", 0, [7, 3], 16), probes="the very first token takes the head of the free queue"),
        Case(({"S0": [1, 2, 4], "S1": [1, 2, 5], "S2": [1, 2, 6], "S3": [1, 2, 3]}, "S3", 40, [7, 8], 16),
             probes="the last holder of a once-shared block (the others copied it away) writes in place"),
        Case(({"A": [0, 1], "B": [0, 3]}, "A", 6, [4], 4), probes="sharing an earlier block does not matter"),
    ],
    random_case=_random_cow_case,
    num_random=20,
    compare=_same_append,
    explain=_explain_cow,
    hints=[
        "Three cases, decided by the last block: is there room in it (num_tokens % block_size), and is it "
        "shared (does another table hold it)?",
        "No room (or no block yet): append free[0] to the table, no copy. Room, and only this table holds it: "
        "nothing changes. Room, but shared: replace the last entry with free[0] and report (old, free[0]).",
        "Count a block's ref_cnt as sum(t.count(block) for t in tables.values()).",
    ],
))


# ----------------------------------------------------------------- 03.free_queue_order


def free_queue_order(queue: list[int], table: list[int], cached: set[int]) -> list[int]:
    """Reference: the free queue (head to tail) after a request holding ``table`` is released.

    Built on kvlab's own BlockPool: blocks arranged into ``queue``, ``table`` held once each,
    ``cached`` ones given a hash; then the request is freed as KVCacheManager does, tail first.
    """
    pool = BlockPool(max([*queue, *table], default=0) + 1, reserve_null_block=False)
    everything = pool.get_new_blocks(pool.get_num_free_blocks())
    pool.free_blocks([everything[i] for i in queue])  # the queue was empty: it now reads as `queue`
    held = [everything[i] for i in table]
    for block in held:
        if block.block_id in cached:
            pool.cache_full_blocks([block], [("hash of", block.block_id)], 0, 1)
    pool.free_blocks(reversed(held))
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def _explain_queue(case: Case, expected: Any, actual: Any) -> str | None:
    queue, table, cached = case.args
    actual = list(actual) if isinstance(actual, (list, tuple)) else actual
    if not isinstance(actual, list):
        return "return the free queue as a list of block ids, head first"
    plain = [b for b in reversed(table) if b not in cached]
    hashed = [b for b in reversed(table) if b in cached]
    if actual == queue + list(reversed(table)) and plain:
        return ("blocks without a hash go to the head of the queue (they are reused first); only cached blocks "
                "go to the tail")
    if actual == [b for b in table if b not in cached] + queue + [b for b in table if b in cached]:
        return "free the request's blocks tail first, reversed(table), as KVCacheManager.free does"
    if actual == list(reversed(plain)) + queue + hashed:
        return "prepend_n keeps the order it is given: the freed blocks keep their tail-first order at the head"
    return None


def _random_queue_case(rng: random.Random) -> Case:
    ids = list(range(rng.randint(1, 12)))
    rng.shuffle(ids)
    split = rng.randint(0, len(ids))
    table, queue = ids[:split], ids[split:]
    cached = {b for b in ids if rng.random() < 0.5}
    return Case((queue, table, cached), probes="a random queue, table and set of cached blocks")


register(Exercise(
    id="03.free_queue_order",
    title="the free queue after a request is released",
    task=(
        "A request holding the blocks `table` (in table order, each held by this request only) is released. "
        "`queue` is the free queue from head (allocated next) to tail, and `cached` the block ids that carry a "
        "hash. Return the free queue afterwards, head to tail, as vLLM's BlockPool.free_blocks leaves it when "
        "KVCacheManager.free hands it the request's blocks."
    ),
    signature="def free_queue_order(queue: list[int], table: list[int], cached: set[int]) -> list[int]:",
    reference=free_queue_order,
    edge_cases=[
        Case(([3, 4, 5], [0, 1, 2], {0, 1}), probes="walk 2: block 2 to the head; cached 1 then 0 to the tail"),
        Case(([5, 6], [1, 2, 3], set()), probes="no hashes: every block to the head, the last one first (LIFO)"),
        Case(([5, 6], [1, 2, 3], {1, 2, 3}),
             probes="all cached: to the tail in reverse table order, so the prompt's first block is evicted last"),
        Case(([], [0, 1], {0}), probes="an empty queue"),
        Case(([0, 1], [], {0}), probes="a request without blocks changes nothing"),
    ],
    random_case=_random_queue_case,
    explain=_explain_queue,
    hints=[
        "KVCacheManager.free hands the blocks over tail first: walk reversed(table).",
        "Each freed block without a hash goes in front of the old head, each cached block after the old tail; "
        "both groups keep the tail-first order.",
        "In one line: [b for b in reversed(table) if b not in cached] + queue + "
        "[b for b in reversed(table) if b in cached].",
    ],
))


# ----------------------------------------------------------------- self-test


def _sampling_question() -> dict[str, Any]:
    steps = record(parallel_sampling())
    return {"blocks_after_fork": steps[4].snapshot.num_live_blocks,
            "blocks_without_sharing": sum(len(t) for t in steps[4].snapshot.tables.values()),
            "blocks_after_one_token_each": steps[8].snapshot.num_live_blocks,
            "copies": sum(len(s.copies) for s in steps)}


ask(
    "03.q1",
    ("Four samples fork from a 40-token prompt (block size 16), then each writes one token. How many "
     "physical blocks are in use right after the fork, and after every sample has written its token? "
     "How many copies did copy-on-write make?"),
    _sampling_question,
    lambda v: (
        f"{v['blocks_after_fork']} blocks after the fork (not {v['blocks_without_sharing']}): all four tables point "
        f"at the same two full blocks and the partly filled third. After one token each: "
        f"{v['blocks_after_one_token_each']} blocks, from {v['copies']} copies. Only the partly filled block is "
        "copied, and only by the first three writers: by the time the fourth writes, it is that block's last "
        "holder (ref_cnt 1) and writes in place. The two full blocks stay shared until the samples finish."
    ),
)


def _slot_question() -> dict[str, Any]:
    table, block_size, newest = [7, 3, 12], 16, 44
    return {"logical": newest // block_size, "physical": table[newest // block_size], "offset": newest % block_size,
            "newest": compute_slot_mapping(table, block_size, [newest])[0],
            "first_of_block_1": compute_slot_mapping(table, block_size, [block_size])[0]}


ask(
    "03.q2",
    ("A request holds 45 tokens in blocks [7, 3, 12] of 16 slots. At which slot of the KV cache does its "
     "newest token (position 44) live, and where does position 16 live?"),
    _slot_question,
    lambda v: (
        f"Position 44 is in logical block 44 // 16 = {v['logical']}, physical block {v['physical']}, at offset "
        f"44 % 16 = {v['offset']}: slot {v['physical']} × 16 + {v['offset']} = {v['newest']}. Position 16 opens "
        f"logical block 1, physical block 3: slot {v['first_of_block_1']}. Logically adjacent tokens can live far "
        "apart; the kernel only ever sees these slot numbers."
    ),
)


def _queue_question() -> dict[str, Any]:
    steps = record(walk_free_queue())
    return {"queue": steps[3].snapshot.free_queue_labels, "table_c": list(steps[4].snapshot.tables["C"])}


ask(
    "03.q3",
    ("Walk 2: request A held blocks [0, 1, 2] (0 and 1 full and cached) and finishes; then C needs 5 blocks "
     "from a 6-block pool. What is the free queue after A, which blocks does C get, and what is lost?"),
    _queue_question,
    lambda v: (
        f"Queue after A, head to tail: {', '.join(v['queue'])} (* = still cached). The partial block goes to the "
        "head (nothing to reuse in it), the cached ones to the tail, 1 before 0 because A is freed tail first. "
        f"C gets {v['table_c']}: reaching block 1 evicts its hash, and only block 0, the start of A's prompt, "
        "survives for a later prefix hit."
    ),
)
