"""What one scheduler step hands over and gets back: the step's types, apart from the policy.

Mirrors ``vllm/v1/core/sched/output.py`` (``SchedulerOutput``), with the request and sampling
types the step carries (vLLM's ``vllm/sampling_params.py``, ``vllm/v1/outputs.py``'s
``ModelRunnerOutput`` and ``KVConnectorOutput``, ``vllm/v1/engine`` 's ``RequestOutput`` and
``vllm/v1/metrics/stats.py``'s ``SchedulerStats``; vLLM 0.33.0). ``Executor`` is the one method the
scheduler's caller needs from whatever runs the model: ``kvlab.engine.ModelRunner`` or
``NoComputeExecutor``. ``SchedulerKVConnector`` is the scheduler side of a KV connector (vLLM's
``KVConnectorBase_V1`` in ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, role
``SCHEDULER``): the scheduler is handed one, as it is handed an executor, and never imports its class
(``kvlab.distributed.kv_transfer`` holds the connectors; ``kvlab.core.kv_offload`` the CPU tier's).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvlab._validate import checked, non_negative_int, non_negative_number, positive_int
from kvlab.core.cache_stats import PrefixCacheStats
from kvlab.core.request import Request, RequestStatus
from kvlab.core.sequence import BlockCopy
from kvlab.errors import KvlabValueError

#: vLLM's ``_SAMPLING_EPS`` (``vllm/sampling_params.py``): a temperature below it means greedy.
SAMPLING_EPS = 1e-5
#: vLLM's ``_MAX_TEMP``: a temperature in (0, 0.01) is raised to 0.01, because dividing logits by a
#: tinier one overflows float32 to inf and softmax then gives NaN. (Only exactly 0 stays greedy.)
MIN_SAMPLING_TEMPERATURE = 1e-2
#: vLLM refuses temperatures above 2.
MAX_TEMPERATURE = 2.0
#: torch generators take 64-bit seeds, and sample ``i`` of ``n`` is seeded with ``seed + i``.
MAX_SEED = 2**64 - 1


@checked(skip=("seed",))  # the body checks seed + n - 1 against 64 bits, as torch generators take
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to choose tokens and when to stop (the part of vLLM's ``SamplingParams`` kvlab uses).

    ``temperature == 0`` is greedy; above 0, tokens are drawn from ``softmax(logits / T)`` with a
    generator seeded by ``seed`` (so a run can be repeated). With ``n > 1`` sample ``i`` uses
    ``seed + i``: a forked sample and an independent request with that seed draw the same tokens.
    As in vLLM 0.33.0, ``temperature`` must be finite and in [0, 2], and one in (0, 0.01) is raised
    to 0.01 with a warning (``MIN_SAMPLING_TEMPERATURE``); ``seed + n - 1`` must fit 64 bits. Every
    check runs here, when the request is made, so a bad value never reaches a step.
    """

    max_tokens: int = 16
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Integers are kept as Python ints (a numpy int passes the door too): torch generators take no other seed.
        object.__setattr__(self, "max_tokens", positive_int("max_tokens", self.max_tokens))
        object.__setattr__(self, "n", positive_int("n", self.n))
        temperature = non_negative_number("temperature", self.temperature)
        if temperature > MAX_TEMPERATURE:
            raise KvlabValueError(f"temperature must be in [0, {MAX_TEMPERATURE}] (as in vLLM), got {temperature!r}")
        if 0 < temperature < MIN_SAMPLING_TEMPERATURE:
            warnings.warn(
                f"temperature {temperature!r} is below {MIN_SAMPLING_TEMPERATURE}, where logits / T overflow to inf "
                f"and softmax gives NaN; raised to {MIN_SAMPLING_TEMPERATURE}, as vLLM does (use 0 for greedy)",
                stacklevel=3,
            )
            temperature = MIN_SAMPLING_TEMPERATURE
        object.__setattr__(self, "temperature", temperature)
        if self.seed is not None:
            seed = non_negative_int("seed", self.seed)
            object.__setattr__(self, "seed", seed)
            if seed + self.n - 1 > MAX_SEED:
                raise KvlabValueError(
                    f"seed must be an integer in [0, 2**64 - n] = [0, {MAX_SEED - self.n + 1}] (torch generators "
                    f"take 64-bit seeds, and sample i of the n={self.n} uses seed + i), got {self.seed!r}"
                )
        if not isinstance(self.ignore_eos, bool):
            raise KvlabValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    @property
    def is_greedy(self) -> bool:
        """Greedy decoding: vLLM's ``SamplingType.GREEDY``, a temperature below ``SAMPLING_EPS``."""
        return self.temperature < SAMPLING_EPS

    @checked
    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of parallel sample ``index`` (0 is the parent): ``n = 1``, seed ``seed + index``."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


#: finished status -> vLLM's finish reason (``vllm/v1/request.py``'s ``_FINISHED_REASON_MAP``).
FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                  RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


@checked
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
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(request_id, prompt_token_ids, cache_salt=cache_salt, lora_name=lora_name)
        self.sampling_params = sampling_params or SamplingParams()
        if not isinstance(self.sampling_params, SamplingParams):
            raise KvlabValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        self.eos_token_id: tuple[int, ...] = tuple(eos_token_id)
        self.num_pending_forks = self.sampling_params.n - 1  # children still to fork (n > 1)
        self.parent_id: str | None = None
        self.stop_reason: str | None = None
        # What a KV connector needs to move this request's KV between engines (vLLM's ``kv_transfer_params``,
        # which the OpenAI server reads from the request body): a copy, since connectors write into it.
        if kv_transfer_params is not None and (not isinstance(kv_transfer_params, dict) or not all(
                isinstance(k, str) for k in kv_transfer_params)):
            raise KvlabValueError(f"kv_transfer_params must be a dict with string keys or None, got "
                                  f"{kv_transfer_params!r}")
        self.kv_transfer_params: dict[str, Any] | None = (None if kv_transfer_params is None
                                                          else dict(kv_transfer_params))

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def get_finished_reason(self) -> str | None:
        """"stop" (an end-of-sequence token), "length" (max_tokens or max_model_len), "abort", "error", or None."""
        return FINISH_REASONS.get(self.status)


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: the tokens to compute, where they sit, its new block ids, whether to sample.

    vLLM splits this into ``NewRequestData`` / ``CachedRequestData`` because its model runner lives in
    another process and keeps its own copy of each request; kvlab keeps one record per request, but
    sends block ids as vLLM does: a request's whole block table when the executor does not have it yet
    (``whole_table``: a new or resumed request, as ``NewRequestData.block_ids`` and a resumed request's
    ``CachedRequestData.new_block_ids`` carry it), and otherwise only the blocks this step added
    (``CachedRequestData.new_block_ids``; none on most decode steps). kvlab also sends the whole table
    where only it changes a table other than by appending: a forked sample's first step, a
    copy-on-write, and the step after one was undone (``kvlab.core.sched.loop``). The executor keeps
    the tables (``kvlab.engine.input_batch.InputBatch``, vLLM's persistent batch).
    """

    request_id: str
    token_ids: tuple[int, ...]  # tokens whose KV this step computes
    num_computed_tokens: int  # tokens already cached: the position of token_ids[0]
    block_ids: tuple[int, ...]  # the first group's block ids this step sends (whole_table: all of them)
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    sampling_params: SamplingParams
    forked: tuple[tuple[str, SamplingParams], ...] = ()  # children forked now, sampled from the same logits
    # Every KV cache group's block ids (vLLM's tuple of lists), block_ids first; () means (block_ids,).
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    # True: the block ids are the request's whole table, replacing the executor's; False: blocks added this step.
    whole_table: bool = True

    @property
    def new_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """The block ids this step sends, per KV cache group (the whole table per group when ``whole_table``)."""
        return self.group_block_ids or (self.block_ids,)

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
    kv_connector_metadata: Any = None  # what the KV connector's worker side loads and saves in this step

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


@dataclasses.dataclass
class KVConnectorOutput:
    """What a KV connector's worker side reports after a step (vLLM's ``KVConnectorOutput``, ``vllm/v1/outputs.py``).

    ``finished_sending``: requests whose blocks the connector kept after they finished (to send them)
    and no longer needs; ``finished_recving``: requests whose asynchronous load ended, well or not;
    ``invalid_block_ids``: blocks a load failed to fill (their requests recompute from the first of
    them, or fail, by ``kv_load_failure_policy``); ``failed_recving``: failed loads named by request.
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = dataclasses.field(default_factory=set)
    failed_recving: set[str] = dataclasses.field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids or self.failed_recving)


@dataclasses.dataclass(frozen=True)
class ModelRunnerOutput:
    """The tokens an executor sampled, by request id (prefill chunks that do not finish sample none).

    ``errors`` is kvlab's addition: requests the executor could not sample (non-finite logits, say),
    with the exception that says why. Each finishes with ``FINISHED_ERROR``; the others go on.
    ``kv_connector_output``: the KV connector's report on this step, when the engine has one.
    """

    sampled_token_ids: dict[str, int]
    errors: dict[str, BaseException] = dataclasses.field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: its new token, and whether (and why) it finished.

    A request that finished with ``FINISHED_ERROR`` (finish reason ``"error"``) carries the exception;
    one whose KV a connector will send on carries the connector's ``kv_transfer_params`` (vLLM's
    ``EngineCoreOutput.kv_transfer_params``): what the next engine needs to pull it.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    error: BaseException | None = None
    kv_transfer_params: dict[str, Any] | None = None  # what the KV connector returned when the request finished


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
    # A KV connector's lookups this step, in tokens beyond the local hits (vllm:external_prefix_cache_queries, _hits).
    connector_prefix_cache_stats: PrefixCacheStats | None = None


class Executor(Protocol):
    """Anything that turns a ``SchedulerOutput`` into sampled tokens."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class SchedulerKVConnector(Protocol):
    """The scheduler side of a KV connector: the calls ``Scheduler`` makes, where vLLM 0.33.0's makes them.

    ``get_num_new_matched_tokens`` after the local prefix lookup (tokens beyond it the connector can
    load, or None to ask again later, and whether the load is asynchronous); ``update_state_after_alloc``
    once blocks are allocated for them; ``build_connector_meta`` at the end of ``schedule()`` (the worker
    side's orders for this step); ``update_connector_output`` with the worker's report; ``request_finished``
    before a finished request's blocks are freed (True: free them only once the worker reports the
    request in ``finished_sending``; and the ``kv_transfer_params`` for its output). It never touches tensors.
    """

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None: ...

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]: ...


@checked
def child_request_id(parent_id: str, index: int) -> str:
    """The id of parallel sample ``index`` (1 .. n - 1) of request ``parent_id``: ``"<parent>#<index>"``."""
    return f"{parent_id}#{index}"


