"""Scripted walks through a block pool, recorded step by step and replayed from the start.

A ``Scenario`` is a pool's parameters and a list of ``Op``s on named sequences. ``record``
runs it on a fresh pool and returns one ``Step`` per operation: a sentence saying what the
step did and why, and a ``PoolSnapshot`` of the pool and every live sequence afterwards.
``step_at(scenario, k)`` replays the first ``k`` operations on a fresh pool, so going back a
step is a replay from the start, never an undo. A refused operation (the pool is out of
blocks, a released sequence is used) becomes a step too: its text quotes the error and its
snapshot shows that nothing changed.

The step-through visualizer (``kvlab.viz.block_pool``) only draws these snapshots; tests and
notebooks assert on them directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as TypingSequence
from types import MappingProxyType

from kvlab._validate import MAX_OBJECTS, checked, non_negative_int, one_of, positive_int
from kvlab.core.block_pool import BlockPool
from kvlab.core.hashing import hash_token_blocks
from kvlab.core.sequence import BlockCopy, Sequence, contents_of
from kvlab.errors import KvlabError, KvlabValueError
from kvlab.sim.block_narration import describe, opening
from kvlab.sim.block_types import OP_KINDS, BlockView, Op, PoolSnapshot, Scenario

__all__ = ["OP_KINDS", "SCENARIOS", "BlockView", "Op", "PoolSnapshot", "Scenario", "Step", "get_scenario",
           "parallel_sampling", "pool_snapshot", "random_workload", "record", "snapshot", "step_at", "walk_fork",
           "walk_free_queue"]

@checked
def snapshot(pool: BlockPool, sequences: Mapping[str, Sequence], block_size: int) -> PoolSnapshot:
    """Freeze ``pool``, its block contents and the live ones of ``sequences`` into plain values."""
    contents = contents_of(pool, block_size)
    live = {name: seq for name, seq in sequences.items() if not seq.released}
    return pool_snapshot(pool, {n: s.block_table for n, s in live.items()},
                         {n: s.token_ids() for n, s in live.items()}, contents.read, contents.block_size)


@checked
def pool_snapshot(pool: BlockPool, tables: Mapping[str, TypingSequence[int]],
                  token_ids: Mapping[str, TypingSequence[int]], read_block: Callable[[int], tuple[int, ...]],
                  block_size: int) -> PoolSnapshot:
    """Freeze ``pool`` with its holders' block ``tables`` and ``token_ids``; ``read_block`` says what a block holds.

    The one place that reads a pool's internals for a picture: ``snapshot`` calls it for
    ``Sequence``s, ``kvlab.sim.lifecycle`` for the requests of a ``KVCacheManager``.
    """
    holders: dict[int, list[str]] = {}
    for name, table in tables.items():
        for block_id in table:
            holders.setdefault(block_id, []).append(name)
    views = tuple(
        BlockView(b.block_id, b.ref_cnt, b.block_hash, b.is_null, len(read_block(b.block_id)),
                  tuple(holders.get(b.block_id, ())), read_block(b.block_id))
        for b in pool.blocks
    )
    return PoolSnapshot(
        block_size=block_size,
        blocks=views,
        free_queue=tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
        tables=MappingProxyType({n: tuple(t) for n, t in tables.items()}),
        num_tokens=MappingProxyType({n: len(t) for n, t in token_ids.items()}),
        token_ids=MappingProxyType({n: tuple(t) for n, t in token_ids.items()}),
        cached_index=MappingProxyType({h: tuple(sorted(d)) for h, d in pool.cached_block_hash_to_block.items()}),
        usage=pool.get_usage(),
        num_usable_blocks=pool.num_usable_blocks,
    )


@dataclasses.dataclass(frozen=True)
class Step:
    """The state after operation ``index`` (0: the fresh pool), with what it did and why."""

    index: int
    total: int  # operations in the scenario
    op: Op | None
    text: str
    snapshot: PoolSnapshot
    copies: tuple[BlockCopy, ...] = ()
    error: str | None = None  # the refusal, when the operation raised


# --------------------------------------------------------------------------- running


def _apply(op: Op, pool: BlockPool, sequences: dict[str, Sequence], block_size: int) -> list[BlockCopy]:
    """Run one operation; raise a ``KvlabError`` (changing nothing) when it is refused."""
    if op.kind in ("start", "fork") and op.seq in sequences and not sequences[op.seq].released:
        raise KvlabValueError(f"a live sequence is already called {op.seq!r}; pick another name")
    if op.kind == "start":
        seq = Sequence(pool, block_size)
        copies = seq.extend(op.tokens)
        sequences[op.seq] = seq  # only once the prompt fitted
        return copies
    if op.kind == "fork":
        sequences[op.seq] = _get(sequences, op.parent).fork()  # type: ignore[arg-type]
        return []
    seq = _get(sequences, op.seq)
    if op.kind in ("append", "extend"):
        return seq.append(op.tokens[0]) if op.kind == "append" else seq.extend(op.tokens)
    if op.kind == "cache":
        hashes = hash_token_blocks(seq.token_ids(), block_size)
        pool.cache_full_blocks(seq.blocks, hashes, 0, seq.num_full_blocks)
        return []
    seq.release()
    return []


def _get(sequences: Mapping[str, Sequence], name: str) -> Sequence:
    if name not in sequences:
        raise KvlabValueError(f"no sequence called {name!r}; known: {', '.join(sorted(sequences)) or 'none'}")
    return sequences[name]


def _run(scenario: Scenario, stop: int | None = None) -> Iterator[Step]:
    """Yield the fresh pool's step, then one step per operation, up to ``stop`` operations."""
    pool = BlockPool(scenario.num_blocks, reserve_null_block=scenario.reserve_null_block)
    sequences: dict[str, Sequence] = {}
    total = len(scenario.ops)
    before = snapshot(pool, sequences, scenario.block_size)
    yield Step(0, total, None, opening(scenario, before), before)
    for index, op in enumerate(scenario.ops[:stop], start=1):
        copies: list[BlockCopy] = []
        error = None
        try:
            copies = _apply(op, pool, sequences, scenario.block_size)
        except KvlabError as exc:
            error = f"{type(exc).__name__}: {exc}"
        after = snapshot(pool, sequences, scenario.block_size)
        text = describe(op, before, after, copies, error)
        yield Step(index, total, op, text, after, tuple(copies), error)
        before = after


@checked
def record(scenario: Scenario) -> list[Step]:
    """Every step of ``scenario``: ``record(s)[k]`` is the state after ``k`` operations."""
    return list(_run(scenario))


@checked
def step_at(scenario: Scenario, index: int) -> Step:
    """The state after the first ``index`` operations, replayed from a fresh pool."""
    index = non_negative_int("index", index)
    if index > len(scenario.ops):
        raise KvlabValueError(f"index must be between 0 and {len(scenario.ops)} for {scenario.name!r}, got {index}")
    *_, last = _run(scenario, index)
    return last


# --------------------------------------------------------------------------- the scenarios


@checked
def walk_fork() -> Scenario:
    """The source's tiny allocator: A holds tokens 0–5, B forks, B appends 6, A then B released."""
    return Scenario(
        "walk 1: fork and copy-on-write",
        "Block size 4, no null block. A holds 6 tokens; B forks from A and writes one more token.",
        num_blocks=8, block_size=4, reserve_null_block=False,
        ops=(
            Op("start", "A", tuple(range(6))),
            Op("fork", "B", parent="A",
               note="Two tables, two physical blocks: sharing costs nothing until someone writes."),
            Op("append", "B", (6,), note="A still reads 0–5 from block 1; B reads 0–6 through block 2."),
            Op("release", "A"),
            Op("release", "B", note="No block is in use any more."),
        ),
    )


@checked
def walk_free_queue() -> Scenario:
    """Walk 2: A's cached full blocks go to the tail, its partial block to the head; C evicts block 1."""
    return Scenario(
        "walk 2: free queue and eviction",
        "A pool of 6 blocks of 4 slots, no null block. A finishes; C then needs 5 blocks.",
        num_blocks=6, block_size=4, reserve_null_block=False,
        ops=(
            Op("start", "A", tuple(range(10))),
            Op("cache", "A"),
            Op("release", "A", note="Read the queue from the head: the partial block first, the cached ones last."),
            Op("start", "C", tuple(range(100, 118)),
               note="Only block 0 is left in the queue, still cached for a prefix hit (notebook 04)."),
        ),
    )


@checked(at_most={"n": 10**4, "prompt_tokens": MAX_OBJECTS, "new_tokens": MAX_OBJECTS})
def parallel_sampling(n: int = 4, prompt_tokens: int = 40, block_size: int = 16, new_tokens: int = 12) -> Scenario:
    """``n`` samples forked from one prompt; each writes ``1 + new_tokens`` tokens, then all finish."""
    n = positive_int("n", n)
    names = [f"S{i}" for i in range(n)]
    ops = [Op("start", names[0], tuple(range(prompt_tokens)),
              note=f"The prompt is written once, as sample {names[0]}.")]
    ops += [Op("fork", name, parent=names[0]) for name in names[1:]]
    ops += [Op("append", name, (1000 * (i + 1),)) for i, name in enumerate(names)]
    ops += [Op("extend", name, tuple(range(1000 * (i + 1) + 1, 1000 * (i + 1) + 1 + new_tokens)))
            for i, name in enumerate(names)]
    ops += [Op("release", name) for name in names]
    return Scenario(
        f"parallel sampling (n = {n})",
        f"{n} samples from one {prompt_tokens}-token prompt, block size {block_size}.",
        num_blocks=16, block_size=block_size, ops=tuple(ops),
    )


@checked(at_most={"num_ops": 10**5, "num_blocks": MAX_OBJECTS, "block_size": MAX_OBJECTS})
def random_workload(seed: int = 0, num_ops: int = 30, num_blocks: int = 12, block_size: int = 4) -> Scenario:
    """A seeded random mix of starts, writes, forks, caching and releases, a few of them refused.

    Each operation is drawn against the state the earlier ones left (run on a pool as they are
    drawn), so the mix stays plausible: a nearly full pool mostly releases, a sequence is
    cached only when it has an unhashed full block, and now and then a released sequence is
    used again, to show the refusal.
    """
    rng = random.Random(non_negative_int("seed", seed))
    pool = BlockPool(positive_int("num_blocks", num_blocks))
    sequences: dict[str, Sequence] = {}
    names = (f"{letter}{round_ or ''}" for round_ in range(10**6) for letter in "ABCDEFGHJKLMNPQRSTUVWXYZ")
    tokens = itertools.count()
    ops: list[Op] = []
    for _ in range(positive_int("num_ops", num_ops)):
        live = [n for n, s in sequences.items() if not s.released]
        released = [n for n, s in sequences.items() if s.released]
        cacheable = [n for n in live if _has_unhashed_full_block(sequences[n])]
        kinds = ["append", "append", "extend", "release"] + ["cache"] * bool(cacheable)
        kinds += ["start", "fork"] * (len(live) < 4)
        if not live:
            kinds = ["start"]
        elif pool.get_num_free_blocks() < 3 and rng.random() < 0.6:
            kinds = ["release"]
        kind = rng.choice(kinds)
        if kind == "start":
            op = Op(kind, next(names), tuple(itertools.islice(tokens, rng.randint(1, 3 * block_size))))
        elif kind == "fork":
            op = Op(kind, next(names), parent=rng.choice(live))
        elif kind in ("append", "extend"):
            count = 1 if kind == "append" else rng.randint(2, 2 * block_size)
            name = rng.choice(released) if released and rng.random() < 0.04 else rng.choice(live)
            op = Op(kind, name, tuple(itertools.islice(tokens, count)))
        else:
            op = Op(kind, rng.choice(cacheable if kind == "cache" else live))
        with contextlib.suppress(KvlabError):  # a refused operation stays in the list: the replay shows it
            _apply(op, pool, sequences, block_size)
        ops.append(op)
    return Scenario(f"random workload (seed {seed})",
                    f"{num_ops} random operations on a pool of {num_blocks} blocks of {block_size} slots.",
                    num_blocks=num_blocks, block_size=block_size, ops=tuple(ops))


def _has_unhashed_full_block(seq: Sequence) -> bool:
    return any(block.block_hash is None for block in seq.blocks[:seq.num_full_blocks])


SCENARIOS: Mapping[str, Callable[..., Scenario]] = MappingProxyType({
    "walk 1: fork and copy-on-write": walk_fork,
    "walk 2: free queue and eviction": walk_free_queue,
    "parallel sampling (n = 4)": parallel_sampling,
    "random workload": random_workload,
})


@checked
def get_scenario(name: str, seed: int = 0) -> Scenario:
    """A scenario by its name in ``SCENARIOS`` (``seed`` is used by the random workload only)."""
    builder = SCENARIOS[one_of("name", name, SCENARIOS)]
    return builder(seed) if builder is random_workload else builder()
