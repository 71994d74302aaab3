"""Notebook 03's exercises (an append with copy-on-write, the free queue after a release) and self-test."""

from __future__ import annotations

import random
from typing import Any

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request
from kvlab.core.sequence import Sequence
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.sim.block_scenarios import parallel_sampling, random_workload, record, walk_free_queue
from kvlab.sim.prefix_sim import admit
from kvlab.units import cdiv

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


def _explain_cow(case: Case, expected: Any, actual: Any) -> str | None:
    try:
        _, copies = actual
        pairs = all(len(tuple(c)) == 2 for c in copies)
    except (TypeError, ValueError):
        pairs = False
    return None if pairs else "return a pair: (the new block table as a list, the list of (src, dst) copies)"


def _cow_with(tables: dict[str, list[int]], name: str, num_tokens: int, free: list[int], block_size: int, *,
              copy_if: str = "shared and partly filled", new_block: int = 0) -> tuple[list[int], list]:
    """cow_append with one rule taken the wrong way: which last block is copied ("never", "shared" even when full,
    "partly filled" even when not shared), or the new block taken from elsewhere than the free queue's head."""
    table, fresh = list(tables[name]), free[new_block]
    last = table[-1] if table else None
    shared = last is not None and sum(t.count(last) for t in tables.values()) > 1
    partly_filled = num_tokens % block_size != 0
    copy = {"never": False, "shared": shared, "partly filled": partly_filled and last is not None,
            "shared and partly filled": shared and partly_filled}[copy_if]
    if copy:
        table[-1] = fresh
        return (table + [free[new_block + 1]] if not partly_filled else table), [(last, fresh)]
    return (table + [fresh] if not partly_filled else table), []


def _cow_last_says(case: Case) -> str:
    tables, name = case.args[0], case.args[1]
    return (f"block {tables[name][-1] if tables[name] else None} is shared and only partly full: writing into it in "
            "place would change what the other sequences read. Copy it first, point the table at the copy and report "
            "(src, dst)")


COW_MISTAKES = (
    Mistake(lambda *args: _cow_with(*args, copy_if="never"), _cow_last_says),
    Mistake(lambda *args: _cow_with(*args, copy_if="shared"),
            "the last block is full: full shared blocks are never copied, a fresh block is taken instead"),
    Mistake(lambda *args: _cow_with(*args, copy_if="partly filled"),
            lambda case: (f"only this sequence holds block {case.args[0][case.args[1]][-1]} (ref_cnt 1): write in "
                          "place, no copy")),
    Mistake(lambda *args: _cow_with(*args, new_block=-1),
            "take the new block from the head of the free queue: free[0]"),
)


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
    explain=_explain_cow,
    mistakes=COW_MISTAKES,
    hints=[
        "Only the last block of name's table matters. Two questions decide everything: is there room left in it "
        "(num_tokens % block_size), and does another table hold it too?",
        "No room, or no block yet: the token needs a fresh block, and fresh blocks come from the head of the free "
        "queue. Nothing is copied.",
        "Room, and the block is this sequence's alone: the token is written in place. Room, but shared: the "
        "table's last entry must move to a fresh block, and the copy is reported as (old block, new block).",
        "A block's ref_cnt here is the number of times it appears across all the tables.",
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
    return "return the free queue as a list of block ids, head first" if type(actual) not in (list, tuple) else None


def _queue_with(queue: list[int], table: list[int], cached: set[int], *, order: str = "tail first",
                one_at_a_time: bool = False, all_to_tail: bool = False) -> list[int]:
    """free_queue_order with one step taken the wrong way (``order`` of the table's blocks, the blocks without a
    hash prepended one by one, or every block appended like a FIFO)."""
    freed = list(reversed(table)) if order == "tail first" else list(table)
    if all_to_tail:
        return list(queue) + freed
    plain = [b for b in freed if b not in cached]
    return (plain[::-1] if one_at_a_time else plain) + list(queue) + [b for b in freed if b in cached]


QUEUE_MISTAKES = (
    Mistake(lambda q, t, c: _queue_with(q, t, c, all_to_tail=True),
            "blocks without a hash go to the head of the queue (they are reused first); only cached blocks go to the "
            "tail"),
    Mistake(lambda q, t, c: _queue_with(q, t, c, one_at_a_time=True),
            "prepend_n puts the blocks without a hash in front as one group, in the order given (tail first); "
            "prepending them one at a time reverses that order"),
    Mistake(lambda q, t, c: _queue_with(q, t, c, order="head first"),
            "free the request's blocks tail first, reversed(table), as KVCacheManager.free does: the cached ones then "
            "reach the tail last block first, so the prompt's first block is evicted last"),
)


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
    shown=plain.free_queue_order,
    edge_cases=[
        Case(([3, 4, 5], [0, 1, 2], {0, 1}), probes="walk 2: block 2 to the head; cached 1 then 0 to the tail"),
        Case(([7], [1, 2, 3, 4], {1, 2}),
             probes="two blocks of each kind: 4 then 3 to the head, 2 then 1 to the tail"),
        Case(([5, 6], [1, 2, 3], set()), probes="no hashes: every block to the head, the last one first (LIFO)"),
        Case(([5, 6], [1, 2, 3], {1, 2, 3}),
             probes="all cached: to the tail in reverse table order, so the prompt's first block is evicted last"),
        Case(([], [0, 1], {0}), probes="an empty queue"),
        Case(([0, 1], [], {0}), probes="a request without blocks changes nothing"),
    ],
    random_case=_random_queue_case,
    explain=_explain_queue,
    mistakes=QUEUE_MISTAKES,
    hints=[
        "KVCacheManager.free hands the request's blocks to the pool tail first: walk reversed(table).",
        "BlockPool.free_blocks sorts them into two groups: blocks without a hash (worthless to anyone else) and "
        "cached blocks (a later prefix hit may want them). One group goes to the head, the other to the tail.",
        "Each group keeps the tail-first order: prepend_n puts its whole group in front at once, it does not "
        "prepend block by block; append_n adds the other group behind the old tail.",
    ],
))


# ----------------------------------------------------------------- 03.sampling_blocks (transfer)


def sampling_blocks(n: int, prompt_tokens: int, new_tokens: int, block_size: int) -> tuple[int, int]:
    """Reference, run on kvlab's Sequence: fork ``n - 1`` times, then the samples write in turn, a token each."""
    num_blocks = n * cdiv(prompt_tokens + new_tokens, block_size) + 1
    pool = BlockPool(num_blocks, reserve_null_block=False)
    samples = [Sequence(pool, block_size)]
    samples[0].extend(range(prompt_tokens))
    samples += [samples[0].fork() for _ in range(n - 1)]
    copies = 0
    for token in range(new_tokens):
        for i, sample in enumerate(samples):
            copies += len(sample.append(10_000 * (i + 1) + token))
    return num_blocks - pool.get_num_free_blocks(), copies


def _explain_sampling(case: Case, expected: Any, actual: Any) -> str | None:
    if not (type(actual) in (list, tuple) and len(actual) == 2 and all(type(x) is int for x in actual)):
        return "return a pair of ints: (physical blocks in use, copies made)"
    return None


def _sampling_with(n: int, prompt: int, new: int, block_size: int, *, shared: bool = True,
                   copiers: str = "all but the last", copy_full: bool = False, copy_at_fork: bool = False
                   ) -> tuple[int, int]:
    """sampling_blocks with one rule taken the wrong way: nothing shared, every sample copying the partly filled
    block (``copiers="all"``), a full last block copied too, or the copies made at the fork."""
    full, partial = divmod(prompt, block_size)
    copies = (n - 1 if copiers == "all but the last" else n) if n > 1 and (new or copy_at_fork) and (
        partial or copy_full) else 0
    if not shared:
        return n * -(-(prompt + new) // block_size), copies
    if not new:
        return full + (1 if partial else 0) + (copies if copy_at_fork else 0), copies
    return full + n * (-(-(prompt + new) // block_size) - full), copies


SAMPLING_MISTAKES = (
    Mistake(lambda *args: _sampling_with(*args, shared=False),
            "forked samples share the prompt's blocks: each full prompt block is held once, by all the samples (its "
            "ref_cnt is n)"),
    Mistake(lambda *args: _sampling_with(*args, copiers="all"),
            "the last sample to write finds the partly filled block held by itself alone (ref_cnt 1) and writes in "
            "place: n - 1 copies, not n"),
    Mistake(lambda *args: _sampling_with(*args, copy_full=True),
            "a prompt that fills its last block leaves nothing partly filled to share: the first new token of each "
            "sample takes a fresh block, and nothing is copied"),
    Mistake(lambda *args: _sampling_with(*args, copy_at_fork=True),
            "copy-on-write copies only when a sample writes: right after the fork, everything is shared"),
)


def _random_sampling_case(rng: random.Random) -> Case:
    block_size = rng.choice([2, 4, 8, 16])
    return Case((rng.randint(1, 6), rng.randint(1, 5 * block_size), rng.choice([0, 1, 2, rng.randint(1, 40)]),
                 block_size), probes="a random fork: samples, prompt, tokens written and block size")


register(Exercise(
    id="03.sampling_blocks",
    title="blocks and copies of a parallel-sampling fork",
    task=(
        "`n` samples fork from one prompt of `prompt_tokens` tokens, as kvlab's `Sequence.fork` does: the children "
        "share every block of the parent's table, the partly filled last block included. Then the samples write "
        "`new_tokens` tokens each, taking turns one token at a time (sample 0, 1, ..., n - 1, then again). Return "
        "`(physical blocks in use, copies made)` once every sample has written its tokens, with `block_size` "
        "slots per block. Section 6 worked one case (n = 4, 40 tokens, one token each); answer any."
    ),
    signature="def sampling_blocks(n: int, prompt_tokens: int, new_tokens: int, block_size: int) -> tuple[int, int]:",
    reference=sampling_blocks,
    shown=plain.sampling_blocks,
    edge_cases=[
        Case((4, 40, 1, 16), probes="section 6's case: 3 prompt blocks, the partly filled one copied by 3 samples"),
        Case((3, 32, 1, 16), probes="a prompt that fills its last block: nothing partly filled, nothing copied"),
        Case((4, 40, 0, 16), probes="right after the fork: everything shared, nothing copied"),
        Case((1, 40, 20, 16), probes="a single sample: no fork, no copy"),
        Case((5, 30, 40, 8), probes="40 tokens each: only a sample's first write can copy"),
        Case((2, 1, 3, 4), probes="a one-token prompt: the shared block is almost empty, and still copied once"),
    ],
    random_case=_random_sampling_case,
    explain=_explain_sampling,
    mistakes=SAMPLING_MISTAKES,
    transfer=True,
    hints=[
        "Split the prompt into its full blocks and, if prompt_tokens % block_size, one partly filled block. "
        "The full blocks are shared by every sample to the end: count them once.",
        "The partly filled block is copied by a sample that writes into it while others still hold it. Who "
        "finds it shared, and who is its last holder when it writes?",
        "After that, every block a sample fills with its own tokens is its own. Count, for one sample, the blocks "
        "from its first token after the shared full blocks to its last token, and multiply by n.",
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


def _v1_sampling_question() -> dict[str, Any]:
    """n = 4 as vLLM V1 runs it: four requests, sharing only full, hashed blocks through the prefix cache."""
    manager = KVCacheManager(32, 16, hash_seed="03")
    prompt = list(range(40))
    hits = [admit(manager, Request(f"sample{i}", prompt + [1000 * (i + 1)])) for i in range(4)]
    steps = record(parallel_sampling(n=4, prompt_tokens=40, block_size=16))
    return {"blocks_v1": manager.block_pool.num_gpu_blocks - 1 - manager.block_pool.get_num_free_blocks(),
            "hits_v1": hits, "computed_v1": sum(41 - h for h in hits),
            "blocks_cow": steps[8].snapshot.num_live_blocks, "copies_cow": sum(len(s.copies) for s in steps[:9]),
            "computed_cow": 40 + 4}


ask(
    "03.q2",
    ("vLLM V1 does not fork: it runs n = 4 as four requests that share only full, hashed blocks through the prefix "
     "cache. Same 40-token prompt, block size 16, one sampled token each: how many blocks are in use, how many "
     "tokens are computed, and how does that compare with kvlab's fork and copy-on-write?"),
    _v1_sampling_question,
    lambda v: (
        f"{v['blocks_v1']} blocks, the same as the fork ({v['blocks_cow']}): the two full prompt blocks are shared "
        f"either way (the later requests hit {v['hits_v1'][1]} tokens each), and each sample ends with a third block "
        f"of its own. The price differs: V1 computes {v['computed_v1']} tokens, because each later request "
        f"recomputes the 8 prompt tokens of the partly filled block, while the fork computes {v['computed_cow']} "
        f"and makes {v['copies_cow']} block copies instead. With vLLM's default prefix_match_unit (the block size), "
        "a partly filled block has no hash, so V1 never shares it."
    ),
    transfer=True,
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
