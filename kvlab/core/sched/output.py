"""What one scheduler step hands over and gets back: the step's types, apart from the policy.

Mirrors ``vllm/v1/core/sched/output.py`` (``SchedulerOutput``), with the request and sampling
types the step carries (vLLM's ``vllm/sampling_params.py``, ``vllm/v1/outputs.py``'s
``ModelRunnerOutput``, ``vllm/v1/engine`` 's ``RequestOutput`` and ``vllm/v1/metrics/stats.py``'s
``SchedulerStats``; vLLM 0.33.0). ``Executor`` is the one method the scheduler's caller needs
from whatever runs the model: ``kvlab.engine.ModelRunner`` or ``NoComputeExecutor``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvlab._validate import non_negative_int, non_negative_number, positive_int
from kvlab.core.cache_stats import PrefixCacheStats
from kvlab.core.request import Request, RequestStatus
from kvlab.core.sequence import BlockCopy
from kvlab.errors import KvlabValueError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to choose tokens and when to stop (the part of vLLM's ``SamplingParams`` kvlab uses).

    ``temperature == 0`` is greedy; above 0, tokens are drawn from ``softmax(logits / T)`` with a
    generator seeded by ``seed`` (so a run can be repeated). With ``n > 1`` sample ``i`` uses
    ``seed + i``: a forked sample and an independent request with that seed draw the same tokens.
    """

    max_tokens: int = 16
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        positive_int("max_tokens", self.max_tokens)
        positive_int("n", self.n)
        non_negative_number("temperature", self.temperature)
        if self.seed is not None:
            non_negative_int("seed", self.seed)

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of parallel sample ``index`` (0 is the parent): ``n = 1``, seed ``seed + index``."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


class GenerationRequest(Request):
    """A ``kvlab.core.request.Request`` plus what generation needs: sampling parameters and the stop token.

    vLLM keeps all of this on one ``Request``; kvlab's manager-side ``Request`` holds only what
    the KV cache needs, and this subclass adds the rest.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        eos_token_id: Iterable[int] = (),
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        super().__init__(request_id, prompt_token_ids, cache_salt=cache_salt, lora_name=lora_name)
        self.sampling_params = sampling_params or SamplingParams()
        if not isinstance(self.sampling_params, SamplingParams):
            raise KvlabValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        self.eos_token_id: tuple[int, ...] = tuple(eos_token_id)
        self.num_pending_forks = self.sampling_params.n - 1  # children still to fork (n > 1)
        self.parent_id: str | None = None
        self.stop_reason: str | None = None

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def get_finished_reason(self) -> str | None:
        """"stop" (an end-of-sequence token), "length" (max_tokens or max_model_len), or None."""
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self.status)


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: the tokens to compute, where they sit, and whether to sample.

    vLLM splits this into ``NewRequestData`` / ``CachedRequestData`` because its model runner
    lives in another process and keeps its own copy of each request; kvlab's executor runs in
    the same process, so each step states everything outright.
    """

    request_id: str
    token_ids: tuple[int, ...]  # tokens whose KV this step computes
    num_computed_tokens: int  # tokens already cached: the position of token_ids[0]
    block_ids: tuple[int, ...]  # the request's block table after this step's allocation
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    sampling_params: SamplingParams
    forked: tuple[tuple[str, SamplingParams], ...] = ()  # children forked now, sampled from the same logits

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        """More than one token, or a first token: the request is (re)building its cache."""
        return self.num_tokens > 1 or self.num_computed_tokens == 0


@dataclasses.dataclass
class SchedulerOutput:
    """What one step computes: requests in batch order, their token counts, and block copies first."""

    step: int
    scheduled: list[ScheduledRequest]
    scheduled_new_req_ids: list[str]
    scheduled_resumed_req_ids: list[str]
    scheduled_running_req_ids: list[str]
    preempted_req_ids: list[str]
    finished_req_ids: set[str]  # finished since the previous step (the executor may drop their state)
    blocks_to_copy: list[BlockCopy]  # copy-on-write copies to make on every layer's K and V, before the forward
    kv_connector_metadata: Any = None  # the CPU tier's copies this step (core.kv_offload), before the forward

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return self.total_num_scheduled_tokens - self.num_prefill_tokens


@dataclasses.dataclass(frozen=True)
class ModelRunnerOutput:
    """The tokens an executor sampled, by request id (prefill chunks that do not finish sample none)."""

    sampled_token_ids: dict[str, int]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: its new token, and whether (and why) it finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """The numbers vLLM exports after a step, plus the step's token mix (one row of the history)."""

    step: int
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_stats: PrefixCacheStats  # this step's lookups (tokens queried and hit)
    num_preempted_reqs: int  # preemptions in this step
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_block_copies: int


class Executor(Protocol):
    """Anything that turns a ``SchedulerOutput`` into sampled tokens."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


def child_request_id(parent_id: str, index: int) -> str:
    """The id of parallel sample ``index`` (1 .. n - 1) of request ``parent_id``: ``"<parent>#<index>"``."""
    return f"{parent_id}#{index}"


