"""The scheduler's knobs, checked in one place (vLLM's ``SchedulerConfig``), and the requests they can ever admit.

``SchedulerConfig`` mirrors ``vllm/config/scheduler.py``; ``check_request_fits`` is kvlab's door check.

``Scheduler`` builds one from its keyword arguments and ``kvlab.engine.EngineConfig`` builds one
before any weight is loaded, so a bad budget or preemption mode is refused the same way, with
the same message, wherever it is given.

The defaults, and why kvlab's token budget is smaller than vLLM's. vLLM 0.33.0's ``SchedulerConfig``
falls back to ``DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048`` and ``DEFAULT_MAX_NUM_SEQS = 128`` ("mainly for
convenience when testing"); in real use ``EngineArgs.get_batch_defaults`` picks them by hardware and
entry point: 8192 tokens for the offline ``LLM`` class and 2048 for the API server on most GPUs
(256 sequences), 16384 and 8192 on an H100/H200 (1024 sequences), 4096 and 2048 on a CPU (256 and 128
sequences). kvlab's budget is 512 tokens, because its engine runs on a CPU through Triton's
interpreter, where a step costs time in proportion to its tokens, and because the notebooks'
prompts are tens to hundreds of tokens: with a budget far above them no prompt would ever be
chunked. ``max_num_seqs`` keeps EngineArgs' 256 of most GPUs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvlab._validate import checked, one_of, positive_int
from kvlab.core.request import Request
from kvlab.errors import RequestTooLongError
from kvlab.units import cdiv

#: kvlab's token budget per step (vLLM 0.33.0: 2048 in SchedulerConfig, 2048 to 16384 from EngineArgs).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
#: Requests running at once: EngineArgs' value on most GPUs (SchedulerConfig's own fallback is 128).
DEFAULT_MAX_NUM_SEQS = 256
#: How a preempted request resumes: "recompute" (vLLM V1) or "swap" (to the CPU tier; V1 dropped it).
PREEMPTION_MODES = ("recompute", "swap")


@checked
@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Token budget, sequence cap, longest sequence and preemption mode of one scheduler, validated on creation.

    ``max_model_len=None`` lets the scheduler take the pool's capacity (blocks x block size).
    vLLM also refuses ``max_num_batched_tokens < max_num_seqs``; kvlab does not, so a teaching
    engine can run a budget of 64 tokens with the default 256 sequences.
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)
        one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)

    @property
    def needs_cpu_tier(self) -> bool:
        """Swapping needs somewhere to swap to: a CPU tier (a connector, or the engine's ``cpu_offload_blocks``)."""
        return self.preemption_mode == "swap"


@checked
def check_request_fits(request: Request, max_model_len: int, num_usable_blocks: int, block_size: int,
                       blocks_for: Callable[[int], int] | None = None) -> None:
    """Refuse a request whose prompt passes ``max_model_len``, or whose KV could never fit the whole pool.

    A request that needs more blocks than the pool has would, once alone, preempt itself
    forever; vLLM prevents it at start-up by checking ``max_model_len`` against the pool, and
    kvlab checks each request, so a tiny teaching pool can still serve the requests that fit.
    The last sampled token needs no slot: it is never fed back. ``blocks_for(tokens)`` counts the blocks
    a request of ``tokens`` tokens holds at most (``Scheduler.blocks_for``: sliding windows hold fewer);
    by default ``cdiv(tokens, block_size)``, one group of full attention.
    """
    if request.num_prompt_tokens >= max_model_len:
        raise RequestTooLongError(
            f"request {request.request_id!r}: its prompt has {request.num_prompt_tokens} tokens, but max_model_len "
            f"is {max_model_len} (prompt plus output must stay within it)"
        )
    max_tokens = getattr(request, "max_tokens", 1)
    tokens_with_kv = min(request.num_prompt_tokens + max_tokens, max_model_len) - 1
    needed = cdiv(tokens_with_kv, block_size) if blocks_for is None else blocks_for(tokens_with_kv)
    if needed > num_usable_blocks:
        raise RequestTooLongError(
            f"request {request.request_id!r} needs {needed} blocks of {block_size} tokens for its "
            f"{request.num_prompt_tokens} prompt tokens and up to {max_tokens} output tokens, but the pool has only "
            f"{num_usable_blocks} usable blocks: it could never run. Shorten it, lower max_tokens, or give the "
            "engine more blocks"
        )
