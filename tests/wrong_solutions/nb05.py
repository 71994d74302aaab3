"""Plausible wrong answers to notebook 05's exercises, each failing for a reason the checker names."""

import kvlab.kernels  # noqa: F401  (sets Triton up before triton.language is imported below)
import triton.language as tl


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
}
