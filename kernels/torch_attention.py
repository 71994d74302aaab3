"""Paged attention in plain torch for CPUs: one batched gather, then ``scaled_dot_product_attention``.

``paged_attention_torch`` has ``paged_attention``'s signature and answer. It reads the same paged
cache through the same block table, but instead of walking blocks in tiles it copies every
token's K and V from its slot into a padded ``[num_seqs, max_seq_len, num_kv_heads, head_size]``
tensor with one index operation and hands the whole batch to torch's fused SDPA with a boolean
mask (causal with context, varlen keys). Query heads are packed per KV head, ``[num_seqs, num_kv_heads,
group * max_query_len, head_size]``, so GQA never repeats K or V. Decode steps (one query token)
and longer queries (prefill chunks) run as two batches, so a long prompt does not pad every
decode to its length. FP8 caches are dequantized after the gather; everything is computed in
float32, as in the reference and the Triton kernel, then cast to the query's dtype. What every layer
of a step shares (the checks, the gather indices, the masks: ``plan_attention``) is computed once per
step when the caller keeps a ``plans`` dict for the step (the engine does), and each layer then only
gathers its own K and V and calls SDPA; ``reshape_and_cache_torch`` writes the cache the same way.

vLLM runs on CPUs with ``CPU_ATTN`` (``vllm/v1/attention/backends/cpu_attn.py``), a C++ kernel
(``ops.cpu_attention_with_kv_cache``) that this function does not imitate. It reads the cache in
place, block by block, with micro-kernels per instruction set (AMX, AVX-512, NEON, VSX, RVV, a
16-wide fallback) and never copies or pads; it splits the work over threads with a scheduler
plan built once per step (``cpu_attn_get_scheduler_metadata``, optional KV splits); its cache is
head-major with K and V in one tensor (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
block sizes a multiple of 32, or 16 on the fallback), where ours is vLLM's flash layout; and it
supports ALiBi, logit soft-capping, attention sinks, encoder and cross attention, and FP8 (e4m3
and e5m2) only on AVX-512 or AMX machines. Here the gather costs memory proportional to
``num_seqs x longest sequence`` per group, and a sliding window is a term of the mask, not a
shorter gather.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from kvlab.kernels.checks import AttentionBatch, HostMetadata, check_attention, check_cache_write, check_no_aliasing
from kvlab.kernels.fp8 import dequantize_fp8, quantize_fp8
from kvlab.kernels.grid import KernelConfig


def visible_keys(seq_lens: torch.Tensor | np.ndarray, query_lens: torch.Tensor | np.ndarray, max_query_len: int,
                 max_seq_len: int, causal: bool, sliding_window: int | None = None) -> torch.Tensor:
    """``[num_seqs, max_query_len, max_seq_len]`` (a host tensor): may query row ``r`` of sequence ``s`` read key ``j``?

    Key ``j`` exists if ``j < seq_lens[s]``; with ``causal`` it must also not lie after the query,
    whose absolute position is ``seq_lens[s] - query_lens[s] + r`` (the queries are the last
    tokens), and with a ``sliding_window`` W not lie W or more before it. Rows past
    ``query_lens[s]`` are padding and copy the last real row, so no row is empty. Host arithmetic
    (numpy) on host lengths: a step's masks are computed once, before any layer runs.
    """
    visible = _visible_keys(np.asarray(seq_lens, dtype=np.int64), np.asarray(query_lens, dtype=np.int64),
                            max_query_len, max_seq_len, causal, sliding_window)
    return torch.from_numpy(np.require(visible, requirements=("C", "W")))


def _visible_keys(seq_lens: np.ndarray, query_lens: np.ndarray, max_query_len: int, max_seq_len: int, causal: bool,
                  sliding_window: int | None) -> np.ndarray:
    rows = np.arange(max_query_len)                                           # [Lq]
    keys = np.arange(max_seq_len)[None, None, :]                              # [1, 1, Lk]
    visible = np.broadcast_to(keys < seq_lens[:, None, None], (len(seq_lens), max_query_len, max_seq_len))
    if causal:
        rows = np.minimum(rows[None, :], query_lens[:, None] - 1)             # [S, Lq]: padding -> last row
        q_pos = (seq_lens - query_lens)[:, None, None] + rows[:, :, None]     # [S, Lq, 1] absolute positions
        visible = visible & (keys <= q_pos)
        if sliding_window is not None:
            visible = visible & (keys > q_pos - sliding_window)
    return visible                                                            # [S, Lq, Lk] (maybe a read-only view)


def slot_positions(block_table: torch.Tensor | np.ndarray, seq_lens: torch.Tensor | np.ndarray, max_seq_len: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block ids, offsets)``, each ``[num_seqs, max_seq_len]`` (host tensors): where token ``j`` of sequence ``s``
    lives, read from the host copy of the block table.

    Token ``j`` is at ``block_table[s, j // block_size]``, offset ``j % block_size``. Positions past
    ``seq_lens[s]`` are padding; they read token 0's slot, which the checks saw and the mask hides,
    so no table entry past a sequence is followed and no slot past it is read.
    """
    blocks, offsets = _slot_positions(np.asarray(block_table), np.asarray(seq_lens, dtype=np.int64), max_seq_len,
                                      block_size)
    return torch.from_numpy(blocks), torch.from_numpy(offsets)


def _slot_positions(block_table: np.ndarray, seq_lens: np.ndarray, max_seq_len: int, block_size: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    positions = np.arange(max_seq_len)[None, :]                               # [1, Lk]
    positions = np.where(positions < seq_lens[:, None], positions, 0)         # [S, Lk]
    return np.take_along_axis(block_table.astype(np.int64), positions // block_size, axis=1), positions % block_size


def gather_padded(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                  scale: float | None, flat: torch.Tensor | None = None) -> torch.Tensor:
    """K (or V) at those slots, ``[num_seqs, max_seq_len, num_kv_heads, head_size]`` float32, in one gather.

    ``scale`` is the FP8 dequantization scale, or None for a float cache. ``flat``, if given, is
    ``(blocks * block_size + offsets).flatten()`` computed once for every layer of a step.
    """
    if cache.stride(0) == cache.shape[1] * cache.stride(1):   # slots flatten as a view: copy whole [H, D] rows
        flat = (blocks * cache.shape[1] + offsets).flatten() if flat is None else flat
        rows = cache.flatten(0, 1).index_select(0, flat)
        kv = rows.view(*blocks.shape, *cache.shape[2:])                                  # [S, Lk, H, D]
    else:
        kv = cache[blocks, offsets]                                                      # [S, Lk, H, D]
    if scale is not None:
        return dequantize_fp8(kv, scale)
    return kv if kv.dtype == torch.float32 else kv.float()


@dataclasses.dataclass(frozen=True, eq=False)
class SDPACall:
    """One padded SDPA call's layout: which query tokens it serves, where its keys live, what each row sees."""

    seqs: int                       # S: sequences in the call
    max_query_len: int              # Lq
    tokens: torch.Tensor            # [n]: the query tokens, sequence by sequence
    real: torch.Tensor | None       # [S, Lq]: rows that are not padding (None: every row is real)
    blocks: torch.Tensor            # [S, Lk]: the block of each key
    offsets: torch.Tensor           # [S, Lk]: its offset in the block
    flat: torch.Tensor              # [S * Lk]: blocks * block_size + offsets
    mask: torch.Tensor              # [S, 1, G * Lq, Lk] (decodes: [S, 1, 1, Lk]): 0 where the row reads the key, -inf
                                    # where it may not (float32, the boolean mask as SDPA itself would turn it)


@dataclasses.dataclass(frozen=True, eq=False)
class TorchAttentionPlan:
    """A checked batch and its SDPA calls (decodes, then longer queries): what every layer of a step shares.

    Built once per step by ``plan_attention`` (the checks, the gather indices, the masks); each layer
    then only gathers its own K and V and runs SDPA (``attend``).
    """

    batch: AttentionBatch
    calls: tuple[SDPACall, ...]


def plan_call(batch: AttentionBatch, block_table: np.ndarray, seqs: list[int], device: torch.device) -> SDPACall:
    """The layout of one padded SDPA call over the sequences ``seqs`` (indices into the batch; queries of two or more
    tokens, decodes go to ``plan_decodes``), computed on the host from the checked batch and the block table's host
    copy, then put on ``device``."""
    index = np.asarray(seqs)
    query_start_loc = np.asarray(batch.query_start_loc, dtype=np.int64)
    starts = query_start_loc[:-1][index]                                      # [S]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1])[index]
    lens = np.asarray(batch.seq_lens, dtype=np.int64)[index]
    num_seqs, max_q, max_k = len(seqs), int(q_lens.max()), int(lens.max())
    group = batch.num_queries_per_kv
    rows = np.arange(max_q)
    real = rows[None, :] < q_lens[:, None]                                    # [S, Lq]: not padding
    tokens = (starts[:, None] + rows[None, :])[real]                          # [n]
    blocks, offsets = _slot_positions(block_table[index], lens, max_k, batch.block_size)
    mask = _visible_keys(lens, q_lens, max_q, max_k, batch.causal, batch.sliding_window)   # [S, Lq, Lk]
    mask = np.broadcast_to(mask[:, None, None], (num_seqs, 1, group, max_q, max_k)).reshape(
        num_seqs, 1, group * max_q, max_k)                                    # [S, 1, G * Lq, Lk]
    mask = np.where(mask, np.float32(0), np.float32(-np.inf))  # added to the scores: what SDPA makes of a boolean mask
    tokens_t, real_t, blocks_t, offsets_t, flat_t, mask_t = _on_device(
        device, tokens, real, blocks, offsets, (blocks * batch.block_size + offsets).reshape(-1), mask)
    return SDPACall(num_seqs, max_q, tokens_t, None if len(tokens) == num_seqs * max_q else real_t, blocks_t,
                    offsets_t, flat_t, mask_t)


def _on_device(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Host arrays as tensors on ``device``: each is a fresh result (contiguous, writable), so on the CPU the tensor
    shares its memory, and only another device gets a copy."""
    return [torch.from_numpy(a) if device.type == "cpu" else torch.from_numpy(a).to(device) for a in arrays]


def plan_decodes(batch: AttentionBatch, block_table: np.ndarray, seqs: list[int], device: torch.device) -> SDPACall:
    """``plan_call`` for sequences of one query token each (decodes), in a third of its host arithmetic: no padded
    query rows, and the one row's mask is the sequence's keys (within the window)."""
    block_size = batch.block_size
    lens = np.array([batch.seq_lens[i] for i in seqs], dtype=np.int64)         # [S]
    keys = np.arange(int(lens.max()))                                         # [Lk]
    inside = keys < lens[:, None]                                             # [S, Lk]: not padding
    positions = np.where(inside, keys, 0)                                     # padding reads token 0's slot
    blocks = np.take_along_axis(block_table[seqs].astype(np.int64), positions // block_size, axis=1)
    offsets = positions % block_size
    visible = inside if batch.sliding_window is None else inside & (keys > (lens - 1 - batch.sliding_window)[:, None])
    mask = np.where(visible, np.float32(0), np.float32(-np.inf)).reshape(len(seqs), 1, 1, -1)   # [S, 1, 1, Lk]
    tokens = np.array([batch.query_start_loc[i] for i in seqs], dtype=np.int64)  # [S]: each one's query token
    tokens_t, blocks_t, offsets_t, flat_t, mask_t = _on_device(
        device, tokens, blocks, offsets, (blocks * block_size + offsets).reshape(-1), mask)
    return SDPACall(len(seqs), 1, tokens_t, None, blocks_t, offsets_t, flat_t, mask_t)


def plan_attention(batch: AttentionBatch, block_table: np.ndarray, device: torch.device) -> TorchAttentionPlan:
    """Decode steps and longer queries (prefill chunks) as two calls, so a long prompt does not pad every decode.

    ``block_table`` is the table's host copy (``HostMetadata.block_table_cpu``, as a numpy array).
    """
    decodes = [i for i, n in enumerate(batch.query_lens) if n == 1]
    longer = [i for i, n in enumerate(batch.query_lens) if n > 1]
    return TorchAttentionPlan(batch, tuple(plan(batch, block_table, seqs, device)
                                           for plan, seqs in ((plan_decodes, decodes), (plan_call, longer)) if seqs))


def attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: AttentionBatch,
           call: SDPACall) -> torch.Tensor:
    """One call's attention, ``[n, Hq, D]`` float32 (its query tokens in ``call.tokens`` order)."""
    num_seqs, max_q = call.seqs, call.max_query_len
    h_kv, group, head_size = batch.num_kv_heads, batch.num_queries_per_kv, batch.head_size
    every_token = call.real is None and num_seqs == batch.num_seqs            # the whole batch, in order
    picked = query if every_token else query[call.tokens]                     # [n, Hq, D]
    picked = picked if picked.dtype == torch.float32 else picked.float()
    k = gather_padded(key_cache, call.blocks, call.offsets, batch.k_scale if batch.fp8 else None, call.flat)
    v = gather_padded(value_cache, call.blocks, call.offsets, batch.v_scale if batch.fp8 else None, call.flat)
    if max_q == 1:                                                            # decodes: a group's rows are its heads
        o = F.scaled_dot_product_attention(picked.view(num_seqs, h_kv, group, head_size), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=call.mask, scale=batch.scale)
        return o.view(num_seqs, batch.num_q_heads, head_size)                 # [S, Hq, D]
    if call.real is None:                                                     # equal lengths: nothing to pad
        q = picked.view(num_seqs, max_q, batch.num_q_heads, head_size)
    else:
        q = picked.new_zeros((num_seqs, max_q, batch.num_q_heads, head_size))
        q[call.real] = picked                                                 # [S, Lq, Hq, D]
    q = q.view(num_seqs, max_q, h_kv, group, head_size).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, h_kv, group * max_q, head_size)                  # [S, Hkv, G * Lq, D]
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=call.mask,
                                       scale=batch.scale)                     # [S, Hkv, G * Lq, D]
    o = o.view(num_seqs, h_kv, group, max_q, head_size).permute(0, 3, 1, 2, 4)
    o = o.reshape(num_seqs, max_q, batch.num_q_heads, head_size)             # [S, Lq, Hq, D]
    return o.reshape(-1, batch.num_q_heads, head_size) if call.real is None else o[call.real]   # [n, Hq, D]


def _same_call_key(*tensors: torch.Tensor | None) -> tuple[object, ...]:
    """What two calls must share to share a plan: the index tensors themselves, and every other tensor's layout."""
    key: list[object] = []
    for t in tensors:
        key += [None] if t is None else [tuple(t.shape), t.dtype, t.device, t.stride()]
    return tuple(key)


def paged_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                          scale: float | None = None, causal: bool = True, k_scale: float = 1.0,
                          v_scale: float = 1.0, num_kv_splits: int | None = None, out: torch.Tensor | None = None,
                          config: KernelConfig | None = None, sliding_window: int | None = None,
                          host_metadata: HostMetadata | None = None,
                          plans: dict[tuple[object, ...], Any] | None = None) -> torch.Tensor:
    """``paged_attention`` through a batched gather and SDPA (module docstring): ``[num_tokens, Hq, D]``.

    Same arguments and checks as ``paged_attention``; ``num_kv_splits`` and ``config`` schedule
    the Triton kernel's work and are accepted and ignored here. ``sliding_window`` W hides keys
    W or more positions before a query (they are still gathered: the Triton kernel skips them).
    Decode steps and longer queries are attended in two batched calls. ``plans``: a dict the caller
    keeps for one step's index tensors (the engine's ``AttentionMetadata.plans``): the first call checks
    the batch and keeps its plan there (``plan_attention``: gather indices and masks), and a later call
    with the same index tensors and tensors laid out alike (the step's other layers) reuses it.
    """
    key = None
    if plans is not None and out is None:
        key = ("attend", id(block_table), id(seq_lens), id(query_start_loc), id(host_metadata), scale, causal,
               k_scale, v_scale, num_kv_splits, sliding_window, *_same_call_key(query, key_cache, value_cache))
    plan = None if key is None else plans.get(key)
    if plan is None:
        batch = check_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=scale,
                                causal=causal, k_scale=k_scale, v_scale=v_scale, num_kv_splits=num_kv_splits,
                                out=out, sliding_window=sliding_window, host_metadata=host_metadata)
        host_table = host_metadata.block_table_cpu if host_metadata is not None else block_table.cpu()
        plan = plan_attention(batch, host_table.numpy(), query.device)
        if key is not None:
            plans[key] = plan
    if out is None and len(plan.calls) == 1 and plan.calls[0].real is None and \
            plan.calls[0].seqs == plan.batch.num_seqs:   # one call, every token in order: its answer is the output
        return attend(query, key_cache, value_cache, plan.batch, plan.calls[0]).to(query.dtype)
    out = torch.empty_like(query) if out is None else out
    for call in plan.calls:
        out[call.tokens] = attend(query, key_cache, value_cache, plan.batch, call).to(out.dtype)
    return out


def reshape_and_cache_torch(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                            v_scale: float = 1.0, slot_mapping_cpu: torch.Tensor | None = None, *,
                            plans: dict[tuple[object, ...], Any] | None = None) -> None:
    """``reshape_and_cache_ref``'s write (token ``t``'s K and V into slot ``slot_mapping[t]``, -1 skipped, FP8
    stores value / scale) as one indexed copy per cache.

    ``plans`` as in ``paged_attention_torch``: the first call of a step checks the slots (range, no
    slot twice) and keeps them; a later call with the same slot mapping and tensors laid out alike
    checks only that the caches it writes share no memory with its inputs (byte ranges are compared
    only when two of them share a storage).
    """
    signature = ("write", id(slot_mapping), id(slot_mapping_cpu), k_scale, v_scale,
                 *_same_call_key(key, value, key_cache, value_cache))
    written = None if plans is None else plans.get(signature)
    if written is None:
        w = check_cache_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, slot_mapping_cpu)
        host = slot_mapping_cpu if slot_mapping_cpu is not None else slot_mapping
        if w.num_tokens == 0 or int(host.min()) >= 0:   # no padding token: every row is written
            written = (w, None, slot_mapping.long())
        else:
            keep = slot_mapping >= 0
            written = (w, keep, slot_mapping[keep].long())
        if plans is not None:
            plans[signature] = written
    elif len({t.untyped_storage().data_ptr() for t in (key_cache, value_cache, key, value, slot_mapping)}) < 5:
        check_no_aliasing(dict(key_cache=key_cache, value_cache=value_cache),  # some share storage: compare bytes
                          dict(key=key, value=value, slot_mapping=slot_mapping))
    w, keep, slots = written
    for src, cache, scale in ((key, key_cache, w.k_scale), (value, value_cache, w.v_scale)):
        rows = src if keep is None else src[keep]                       # [num_written, H, D]
        rows = quantize_fp8(rows, scale) if w.fp8 else rows
        if cache.stride(0) != cache.shape[1] * cache.stride(1):         # slots do not flatten as a view
            cache[slots // w.block_size, slots % w.block_size] = rows
        elif w.fp8:                                                     # index_copy_ has no float8 kernel
            cache.flatten(0, 1)[slots] = rows
        else:
            cache.flatten(0, 1).index_copy_(0, slots, rows)
