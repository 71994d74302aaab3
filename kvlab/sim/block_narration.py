"""What each step of a block scenario says: one or two sentences, the operation and the rule behind it.

``kvlab.sim.block_scenarios`` records the steps; this module writes their text from the snapshots
before and after, so the stepper's sentences are computed from the pool, never typed in.
"""

from __future__ import annotations

from kvlab._validate import checked
from kvlab.core.sequence import BlockCopy
from kvlab.sim.block_types import Op, PoolSnapshot, Scenario


def _ids(block_ids: list[int] | tuple[int, ...]) -> str:
    return ", ".join(str(i) for i in block_ids) if block_ids else "none"


def _blocks(block_ids: list[int], singular: str = "", plural: str = "") -> str:
    """``block 1 has`` / ``blocks 2, 0 have``: a block list with its verb in agreement."""
    one = len(block_ids) == 1
    verb = (singular if one else plural) and f" {singular if one else plural}"
    return f"{'block' if one else 'blocks'} {_ids(block_ids)}{verb}"


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def opening(scenario: Scenario, snap: PoolSnapshot) -> str:
    null = " Block 0 is the null block: reserved at start, never handed out." if scenario.reserve_null_block else ""
    return (f"A fresh pool of {scenario.num_blocks} blocks of {scenario.block_size} token slots; the free queue holds "
            f"{len(snap.free_queue)} of them, in id order.{null}")


@checked
def describe(op: Op, before: PoolSnapshot, after: PoolSnapshot, copies: list[BlockCopy], error: str | None) -> str:
    """One or two sentences: what ``op`` did to the pool, and the rule that made it so."""
    if error is not None:
        text = (f"{op.kind} {op.seq} is refused ({error}). Nothing changed: the pool and every block table are "
                "exactly as before.")
    elif op.kind in ("start", "append", "extend"):
        text = _describe_write(op, before, after, copies)
    elif op.kind == "fork":
        table = after.tables[op.seq]
        refs = ", ".join(f"block {i}: {after.blocks[i].ref_cnt}" for i in dict.fromkeys(table))
        text = (f"{op.seq} forks from {op.parent}: it gets a copy of the block table [{_ids(table)}] and no KV is "
                f"copied; each block gains a reference (ref_cnt now {refs or 'unchanged: the table is empty'}).")
    elif op.kind == "cache":
        new = [i for i in after.tables[op.seq] if after.blocks[i].block_hash is not None
               and before.blocks[i].block_hash is None]
        text = (f"{op.seq}'s full blocks get their hashes and enter the prefix-cache index: "
                f"{_blocks(new) if new else 'no new block'}. A partly filled block is never hashed: "
                "its content will still change.")
    else:
        text = _describe_release(op, before, after)
    return f"{text} {op.note}".strip()


def _describe_write(op: Op, before: PoolSnapshot, after: PoolSnapshot, copies: list[BlockCopy]) -> str:
    start = before.num_tokens.get(op.seq, 0)
    count = len(op.tokens)
    where = f"position {start}" if count == 1 else f"positions {start}–{start + count - 1}"
    verb = "starts with a prompt of" if op.kind == "start" else "writes"
    parts = [f"{op.seq} {verb} {_tokens(count)} at {where}."]
    for src, dst in copies:
        parts.append(
            f"Its last block {src} was shared (ref_cnt {before.blocks[src].ref_cnt}) and only partly full, so it is "
            f"copied to block {dst} before the write (copy-on-write); block {src} drops to ref_cnt "
            f"{after.blocks[src].ref_cnt}."
        )
    old = before.tables.get(op.seq, ())
    fresh = list(after.tables[op.seq][len(old):])
    if fresh:
        parts.append(f"It takes {_blocks(fresh)} from the head of the free queue.")
    elif not copies and old:
        parts.append(f"The {'token fits' if count == 1 else 'tokens fit'} in its last block {old[-1]}, which only "
                     f"{op.seq} holds: written in place.")
    evicted = [i for i in fresh + [d for _, d in copies] if before.blocks[i].block_hash is not None]
    if evicted:
        parts.append(f"{_blocks(evicted).capitalize()} still carried a hash: handing "
                     f"{'it' if len(evicted) == 1 else 'them'} out evicts that cached content (eviction is just "
                     "allocation reaching a cached block).")
    table, held = after.tables[op.seq], after.num_tokens[op.seq] % after.block_size
    partial = f" Its last block {table[-1]} holds {held} of {after.block_size} slots." if held else ""
    parts.append(f"Table {op.seq}: [{_ids(table)}].{partial}")
    return " ".join(parts)


def _describe_release(op: Op, before: PoolSnapshot, after: PoolSnapshot) -> str:
    order = list(reversed(before.tables[op.seq]))
    freed = [i for i in dict.fromkeys(order) if after.blocks[i].ref_cnt == 0]
    to_head = [i for i in freed if after.blocks[i].block_hash is None]
    to_tail = [i for i in freed if after.blocks[i].block_hash is not None]
    shared = [i for i in dict.fromkeys(order) if after.blocks[i].ref_cnt > 0]
    parts = [f"{op.seq} is released: its blocks are freed tail first ({_ids(order)})."]
    if to_head:
        parts.append(f"{_blocks(to_head, 'has', 'have').capitalize()} no hash: to the head of the free queue, "
                     "reused first.")
    if to_tail:
        last = " (the block nearest the prompt's start goes last of all)" if len(to_tail) > 1 else ""
        parts.append(f"{_blocks(to_tail, 'is', 'are').capitalize()} cached: to the tail, evicted last{last}.")
    if shared:
        parts.append(f"{_blocks(shared, 'is', 'are').capitalize()} still referenced by another table and "
                     f"{'stays' if len(shared) == 1 else 'stay'} in use.")
    return " ".join(parts)
