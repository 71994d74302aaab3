"""Tensor parallelism measured (notebook 11): the same requests on one rank and on several, each rank's KV bytes,
and the collectives one step makes.

``serve`` runs a workload to the end through any ``LLMEngine`` and records what it exercised, read from
the scheduler's own outputs: prefix-cache hits, prefill chunks that do not reach the prompt's end, and
preemptions by recompute (a preempted request prefills again, generated tokens included: nano-vllm's
issue 144 broke TP exactly there). ``shared_prefix_prompts`` builds such a workload.
``rank_bytes_per_token`` reads each rank's cache as allocated (the tensors' bytes over blocks x block
size); ``formula_bytes_per_token`` is ``kvlab.capacity``'s ``f x L x max(1, Hkv / tp) x D x b`` for the
same engine, which the ranks must match. ``step_collectives`` runs one step and reads what every rank's
``GroupCoordinator`` counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.distributed.parallel_state import CollectiveStats
from kvlab.engine.toy import random_token_ids
from kvlab.kv_cache_interface import kv_dtype_name


@dataclasses.dataclass
class ServedRun:
    """One engine's tokens for a workload, and what the run exercised (counted from the scheduler's outputs)."""

    tensor_parallel_size: int
    outputs: list[list[int]]
    steps: int
    prefix_hit_tokens: int        # tokens served from the prefix cache
    partial_prefill_chunks: int   # prefill chunks that stopped short of the prompt's end (chunked prefill)
    preemptions: int              # requests preempted by recompute (each prefills again later)


def shared_prefix_prompts(vocab_size: int, num_prompts: int = 4, prefix_len: int = 32, suffix_len: int = 24,
                          seed: int = 11) -> list[list[int]]:
    """``num_prompts`` prompts that share their first ``prefix_len`` tokens (whole blocks of 16: prefix hits)."""
    prefix = random_token_ids(prefix_len, seed, vocab_size)
    return [prefix + random_token_ids(suffix_len + 8 * i, seed + 1 + i, vocab_size) for i in range(num_prompts)]


def serve(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> ServedRun:
    """Add every prompt (greedy), step to the end, and count the hits, partial chunks and preemptions."""
    start = len(engine.history)
    ids = [engine.add_request(list(p), max_tokens=max_tokens) for p in prompts]
    lengths = dict(zip(ids, (len(p) for p in prompts), strict=True))
    partial = 0
    while engine.has_unfinished_requests():
        engine.step()
        for s in engine.last_scheduler_output.scheduled:
            partial += not s.sample and s.request_id in lengths
    history = engine.history[start:]
    return ServedRun(engine.tensor_parallel_size, [engine.outputs[i] for i in ids], len(history),
                     sum(h.prefix_cache_stats.hits for h in history), partial,
                     sum(h.num_preempted_reqs for h in history))


def formula_bytes_per_token(engine: Any) -> int:
    """``kvlab.capacity``'s bytes per token on one rank for this engine's model, cache dtype and tp."""
    return kv_bytes_per_token(engine.config.spec, kv_dtype_name(engine.cache_dtype), engine.tensor_parallel_size)


def rank_bytes_per_token(engine: Any) -> list[float]:
    """Each rank's bytes per token, measured: the bytes of the KV tensors it allocated / (blocks x block size).

    A one-rank engine's own tensors count as rank 0's. (A hybrid model's groups share tensors, so its figure is
    per token slot of the pool, not per token of a sequence.)
    """
    reports = engine.kv_cache_reports or [{"kv_cache_bytes": engine.kv_cache_bytes,
                                           "num_blocks": engine.num_gpu_blocks}]
    return [r["kv_cache_bytes"] / (r["num_blocks"] * engine.block_size) for r in reports]


def step_collectives(engine: Any) -> tuple[list[Any], list[CollectiveStats]]:
    """Run one step; return its outputs and what each rank's collectives moved in it (calls, bytes, seconds)."""
    if engine.rank_executor is None:
        return engine.step(), [CollectiveStats()]
    engine.rank_executor.collective_rpc("collective_stats", True)  # reset every rank's counters
    outputs = engine.step()
    return outputs, engine.rank_executor.collective_rpc("collective_stats", True)
