"""Reading vLLM's start-up log backwards: from the lines it prints to a plan that prints them.

A start-up log states three numbers: the weights, the KV cache in tokens, and the maximum
concurrency at ``max_model_len``. Given the model, those numbers fix the pool's blocks, and so its
bytes. ``reconstruct`` finds that pool, plans it with ``plan_kv_cache`` (as
``kv_cache_memory_bytes``), checks that the plan logs the same numbers, and, given a GPU, says how
much non-KV memory (activations, CUDA graphs) the budget must have held for the pool to come out
so. ``parse_startup_log`` reads vLLM 0.33.0's one line (``update_kv_cache_capacity``: tokens =
``int(max_concurrency x max_model_len)``) as well as the two lines the source article quotes
(tokens = ``num_blocks x block_size``); ``StartupLog.form`` says which it read.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

from kvlab._validate import checked, positive_int
from kvlab.capacity.budget import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KVCachePlan,
    StartupLogForm,
    plan_kv_cache,
)
from kvlab.capacity.hardware import GPUSpec, get_gpu
from kvlab.capacity.models import ModelSpec, resolve_model
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.errors import KvlabValueError
from kvlab.units import GiB, cdiv

_WEIGHTS = re.compile(r"Model loading took ([\d.]+) GiB")
_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens(, Maximum concurrency)?")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


@dataclasses.dataclass(frozen=True)
class StartupLog:
    """The numbers a start-up log states."""

    weights_gib: float | None  # None when the log has no weights line
    kv_cache_tokens: int
    max_model_len: int
    max_concurrency: float  # as printed, two decimals
    form: StartupLogForm  # "0.33.0" (one line) or "article" (the two lines the source article quotes)


@checked
def parse_startup_log(lines: Iterable[str] | str) -> StartupLog:
    """The weights, KV cache tokens, ``max_model_len`` and concurrency a start-up log prints."""
    text = lines if isinstance(lines, str) else "\n".join(lines)
    tokens, concurrency = _TOKENS.search(text), _CONCURRENCY.search(text)
    if tokens is None or concurrency is None:
        raise KvlabValueError("lines must contain vLLM's 'KV cache size: N tokens' and 'Maximum concurrency for M "
                              "tokens per request: C.CCx'")
    weights = _WEIGHTS.search(text)
    return StartupLog(weights_gib=float(weights.group(1)) if weights else None,
                      kv_cache_tokens=int(tokens.group(1).replace(",", "")),
                      max_model_len=int(concurrency.group(1).replace(",", "")),
                      max_concurrency=float(concurrency.group(2)),
                      form="0.33.0" if tokens.group(2) else "article")


@dataclasses.dataclass(frozen=True)
class Reconstruction:
    """A plan that logs what a start-up log says, and what it takes to believe it."""

    log: StartupLog
    plan: KVCachePlan  # the pool planned from the log's tokens
    pool_bytes: int  # the log's blocks x bytes per block
    matches: bool  # the plan logs the same tokens and concurrency, in the log's form
    gpu: GPUSpec | None
    implied_non_kv_bytes: int | None  # requested - weights - pool, on ``gpu``; None without one

    @property
    def pool_gib(self) -> float:
        """The pool in GiB."""
        return self.pool_bytes / GiB


@checked
def reconstruct(
    model: ModelSpec | str,
    lines: Iterable[str] | str,
    *,
    kv_dtype: str = "bf16",
    block_size: int = DEFAULT_BLOCK_SIZE,
    tp: int = 1,
    gpu: str | GPUSpec | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> Reconstruction:
    """The KV pool a start-up log implies for ``model``, planned and checked against the log's own lines.

    The pool is a whole number of blocks: the article's two lines count ``num_blocks x block_size`` tokens
    (which must then be a whole number of blocks), 0.33.0's line ``int(num_blocks / blocks_per_request x
    max_model_len)``, whose smallest ``num_blocks`` is taken. The plan then uses ``kv_cache_memory_bytes``
    = blocks x bytes per block. With ``gpu``, ``implied_non_kv_bytes``
    is what the budget ``ceil(total x gpu_memory_utilization)`` must have lost besides the weights
    the log states and the pool (negative: the log cannot come from that GPU).
    """
    spec = resolve_model(model)
    log = parse_startup_log(lines)
    block_size = positive_int("block_size", block_size)
    if log.form == "article":
        if log.kv_cache_tokens % block_size:
            raise KvlabValueError(f"the log's {log.kv_cache_tokens:,} tokens are not a whole number of blocks of "
                                  f"block_size={block_size}")
        num_blocks = log.kv_cache_tokens // block_size
    else:  # tokens = int(num_blocks / per_request x max_model_len): the smallest num_blocks that logs it
        if block_size > log.max_model_len:
            raise KvlabValueError(f"block_size={block_size:,} is larger than the log's max_model_len "
                                  f"({log.max_model_len:,} tokens): no block of such a pool is ever full")
        per_request = cdiv(log.max_model_len, block_size)
        num_blocks = cdiv(log.kv_cache_tokens * per_request, log.max_model_len)
    pool = num_blocks * block_size * kv_bytes_per_token(spec, kv_dtype, tp)
    gpu_spec = None if gpu is None else get_gpu(gpu)
    weights_gib = log.weights_gib or 0.0
    room = gpu_spec.memory_gib if gpu_spec else pool / GiB + weights_gib + 1  # without a GPU: one that holds both
    plan = plan_kv_cache(spec, gpu_memory_gib=room,
                         gpu_memory_utilization=gpu_memory_utilization, weights_gib=weights_gib,
                         kv_cache_memory_gib=pool / GiB, kv_dtype=kv_dtype, block_size=block_size,
                         max_model_len=log.max_model_len, tp=tp)
    matches = parse_startup_log(plan.startup_log(form=log.form)) == dataclasses.replace(log, weights_gib=None)
    implied = None
    if gpu_spec is not None and log.weights_gib is not None:
        implied = math.ceil(gpu_spec.memory_bytes * gpu_memory_utilization) - round(log.weights_gib * GiB) - pool
    return Reconstruction(log=log, plan=plan, pool_bytes=pool, matches=matches, gpu=gpu_spec,
                          implied_non_kv_bytes=implied)
