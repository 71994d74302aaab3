"""Plausible wrong answers to notebook 05's exercises, each failing for a reason the checker names.

The kernel puzzles' wrong answers are the reference kernel with one edit, made here (``_edit``) so
that they are functions of this module, as a learner's would be of the notebook: the checker runs
them in its own process and explains them (which batch, which outputs, what the program touched).
"""

import inspect
import linecache
import textwrap

import kvlab.kernels  # noqa: F401  (sets Triton up before triton.language is imported below)
import triton.language as tl
from kvlab.kernels.attention import find_seq_idx, online_softmax_update  # noqa: F401  (the edited kernels call them)

from kvlab.exercises import nb05_puzzles as puzzles

puzzles._kernels()


def no_rescale(m_i, l_i, acc, scores, v):
    """Keeps the old sums as they were when the maximum grows."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_ref[:, None])
    return m_new, l_i + tl.sum(p, axis=1), acc + tl.dot(p, v)


def no_inf_guard(m_i, l_i, acc, scores, v):
    """Subtracts m_new even while it is still -inf."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p, v)


def slots_from_zero(block_tables, seq_lens, query_lens, block_size):
    """Numbers each sequence's query tokens from position 0, ignoring the cached context."""
    return [t[p // block_size] * block_size + p % block_size
            for t, q in zip(block_tables, query_lens, strict=True) for p in range(q)]


def slots_in_blocks(block_tables, seq_lens, query_lens, block_size):
    """Adds the offset to the block id without multiplying by block_size."""
    return [t[p // block_size] + p % block_size
            for t, s, q in zip(block_tables, seq_lens, query_lens, strict=True) for p in range(s - q, s)]


def flash_layout(slot, kv_head, dim, num_kv_heads, head_size, block_size, dtype):
    """Indexes both caches as vLLM V1's flash layout, [num_blocks, block_size, num_kv_heads, head_size]."""
    index = (slot * num_kv_heads + kv_head) * head_size + dim
    return index, index


def x_always_8(slot, kv_head, dim, num_kv_heads, head_size, block_size, dtype):
    """Cuts K into pieces of 8 elements whatever the dtype (right for fp16 and bf16 only)."""
    x = 8
    block, t = divmod(slot, block_size)
    base = (block * num_kv_heads + kv_head) * head_size * block_size
    return base + (dim // x) * block_size * x + t * x + dim % x, base + dim * block_size + t


def _edit(reference, name, *changes):
    """``reference``'s source with each ``(old, new)`` replaced, defined here as ``name``."""
    source = textwrap.dedent(inspect.getsource(reference)).replace(f"def {reference.__name__}(", f"def {name}(", 1)
    for old, new in changes:
        assert source.count(old) == 1, (name, old)
        source = source.replace(old, new)
    filename = f"<tests/wrong_solutions/nb05.py: {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)  # Triton reads it
    exec(compile(source, filename, "exec"), globals())
    function = globals()[name]
    function.__module__ = __name__
    return function


no_padding_check = _edit(puzzles.write_kv, "no_padding_check", ("    if slot < 0:", "    if False:"))
head_major_cache = _edit(puzzles.write_kv, "head_major_cache",
                         ("dst = ((block * BLOCK_SIZE + offset) * NUM_KV_HEADS + heads)",
                          "dst = ((block * NUM_KV_HEADS + heads) * BLOCK_SIZE + offset)"))
unmasked_scores = _edit(puzzles.one_block, "unmasked_scores",
                        ('    scores = tl.where(valid, scores, float("-inf"))\n', ""))
no_max_subtracted = _edit(puzzles.one_block, "no_max_subtracted",
                          ("p = tl.exp(scores - tl.max(scores, axis=0))", "p = tl.exp(scores)"))
logical_blocks = _edit(puzzles.through_table, "logical_blocks", (
    "physical = tl.load(block_table_ptr + seq * max_blocks + pos // BLOCK_SIZE, mask=valid, other=0)",
    "physical = pos // BLOCK_SIZE"))
no_offset_in_block = _edit(puzzles.through_table, "no_offset_in_block", (
    "slot = physical * BLOCK_SIZE + pos % BLOCK_SIZE", "slot = physical * BLOCK_SIZE + pos"))
no_causal_mask = _edit(puzzles.causal_tiles, "no_causal_mask", (" & (keys[None, :] <= q_pos[:, None])", ""))
window_one_wider = _edit(puzzles.causal_tiles, "window_one_wider", (
    "(q_pos[:, None] - keys[None, :] < WINDOW)", "(q_pos[:, None] - keys[None, :] <= WINDOW)"))
interleaved_heads = _edit(puzzles.gqa, "interleaved_heads", (
    "q_head = kv_head * GROUP + rows % GROUP", "q_head = kv_head + rows % GROUP * NUM_KV_HEADS"))
blocks_from_seq_index = _edit(puzzles.gqa, "blocks_from_seq_index", (
    "q_block = q_block_global - (q_start // BLOCK_Q + seq)", "q_block = q_block_global - seq"))
floor_tiles_per_split = _edit(puzzles.split_kv, "floor_tiles_per_split", (
    "tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)", "tiles_per_split = num_tiles // NUM_SPLITS"))
normalised_partial = _edit(puzzles.split_kv, "normalised_partial", (
    "dims[None, :], acc, mask", "dims[None, :], acc / l_i[:, None], mask"))
unweighted_sums = _edit(puzzles.reduce_splits, "unweighted_sums",
                        ("/ tl.sum(l_s * weight, axis=0)", "/ tl.sum(l_s, axis=0)"))
padding_lanes_zero = _edit(puzzles.reduce_splits, "padding_lanes_zero",
                           ('mask=ok, other=float("-inf"))', "mask=ok, other=0.0)"))
WRONG = {
    "05.online_softmax": [
        (no_rescale, "rescale what was summed before"),
        (no_inf_guard, "-inf - (-inf) is nan"),
    ],
    "05.slot_mapping": [
        (slots_from_zero, "positions run from seq_len - query_len"),
        (slots_in_blocks, "slot = block_id * block_size + offset"),
    ],
    "05.legacy_offsets": [
        (flash_layout, "that is the flash layout's index"),
        (x_always_8, "x is 16 bytes divided by the element size"),
    ],
    # the puzzles: each failure names its batch
    "05.write_kv": [(no_padding_check, "padding slot -1"), (head_major_cache, "one decode token")],
    "05.one_block": [(unmasked_scores, "one key"), (no_max_subtracted, "loud scores")],
    "05.through_table": [(logical_blocks, "blocks out of order"), (no_offset_in_block, "blocks out of order")],
    "05.causal_tiles": [(no_causal_mask, "prompt from position 0"), (window_one_wider, "window inside a block")],
    "05.gqa": [(interleaved_heads, "group 2"), (blocks_from_seq_index, "group 2")],
    "05.split_kv": [(floor_tiles_per_split, "4 tiles in 3 splits"), (normalised_partial, "one split")],
    "05.reduce_splits": [(unweighted_sums, "3 splits, one empty"), (padding_lanes_zero, "scores far below zero")],
}
