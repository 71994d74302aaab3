"""Colocated against disaggregated serving on clocks, each engine its own machine: time to first token, between tokens.

Requests arrive as a Poisson stream (``PDWorkload``). **Colocated**: ``num_replicas`` engines, each prefilling
and decoding its share (round robin): a prompt's chunks share steps with other requests' decodes, which is
what stretches their inter-token latency. **Disaggregated** (1P1D): a prefill engine runs each request with
``max_tokens=1``; its KV crosses to a decode engine (``transfer_seconds(prompt)`` later), which computes the
prompt's last token again, as NIXL's decode side does, and generates every output token.

Each engine is a ``Stepper`` with its own ``clock``: a step advances it by the step's seconds, an idle engine
jumps to its next arrival, and the engine whose clock is behind always steps first, so the engines run as on
separate machines whatever the order this process runs them in. Two kinds of stepper:

* ``ModelledEngine``: kvlab's own ``Scheduler`` with the no-compute executor, each step's seconds from the
  cost model (``kvlab.capacity.disaggregation.step_seconds``): a GPU, **modelled**;
* ``kvlab.fleet.disagg.MeasuredEngine``: a real ``LLMEngine``, each step's seconds **measured** (CPU time of
  the step on this machine).

The decode engine of a modelled run learns of the KV through ``ArrivedKVConnector``, a scheduler-side KV
connector that reports the whole prompt but its last token as loaded (the transfer time is in the arrival).
"""

from __future__ import annotations

import bisect
import dataclasses
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvlab._validate import MAX_OBJECTS, checked, non_negative_int, positive_int, positive_number
from kvlab.capacity.cost_model import CostModel
from kvlab.capacity.disaggregation import step_seconds
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.loop import NoComputeExecutor, step
from kvlab.core.sched.output import GenerationRequest, SamplingParams
from kvlab.core.sched.scheduler import Scheduler
from kvlab.errors import KvlabValueError

COLOCATED, DISAGGREGATED = "colocated", "disaggregated"


@checked(at_most={"num_requests": MAX_OBJECTS})
@dataclasses.dataclass(frozen=True)
class PDWorkload:
    """``num_requests`` prompts of ``prompt_tokens`` random tokens, each asking ``output_tokens``, arriving as a
    Poisson stream of ``rate`` requests per second (seeded)."""

    prompt_tokens: int = 512
    output_tokens: int = 64
    rate: float = 4.0
    num_requests: int = 32
    seed: int = 0
    vocab_size: int = 4096

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens", "num_requests", "vocab_size"):
            positive_int(name, getattr(self, name))
        positive_number("rate", self.rate)
        non_negative_int("seed", self.seed)

    def requests(self) -> list[tuple[float, list[int]]]:
        """``(arrival second, prompt)`` for each request, in arrival order."""
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in range(self.num_requests):
            t += rng.expovariate(self.rate)
            out.append((t, [rng.randrange(1, self.vocab_size) for _ in range(self.prompt_tokens)]))
        return out


class Stepper(Protocol):
    """One engine on its own machine: requests in, one step at a time, each step's seconds."""

    clock: float

    def add(self, request_id: str, prompt: list[int], max_tokens: int, remote: bool = False) -> None: ...

    def step(self) -> tuple[list[Any], float]: ...

    def has_requests(self) -> bool: ...


@dataclasses.dataclass
class ServingResult:
    """What one run measured or modelled: per request its arrival, first-token time and token gaps."""

    mode: str
    arrival: dict[str, float] = dataclasses.field(default_factory=dict)
    first_token: dict[str, float] = dataclasses.field(default_factory=dict)
    gaps: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    transfer: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds each request's KV took to cross
    num_steps: int = 0
    last_token: dict[str, float] = dataclasses.field(default_factory=dict, repr=False)  # when each got its latest

    @property
    def ttft(self) -> list[float]:
        """Seconds from arrival to the first token, per request."""
        return [self.first_token[r] - self.arrival[r] for r in self.first_token]

    @property
    def itl(self) -> list[float]:
        """Every gap between two tokens of one request, all requests together."""
        return [g for gaps in self.gaps.values() for g in gaps]

    def summary(self) -> dict[str, float]:
        """Median and 90th percentile TTFT, median and 99th percentile ITL (seconds), and mean transfer."""
        return {"ttft_p50": _quantile(self.ttft, 0.5), "ttft_p90": _quantile(self.ttft, 0.9),
                "itl_p50": _quantile(self.itl, 0.5), "itl_p99": _quantile(self.itl, 0.99),
                "transfer_mean": statistics.fmean(self.transfer.values()) if self.transfer else 0.0}


def _callable(name: str, value: object) -> None:
    if not callable(value):
        raise KvlabValueError(f"{name} must be a function (called with no argument, it makes an engine), got {value!r}")


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Clocked:
    """A stepper and the requests due to reach it, by time."""

    def __init__(self, stepper: Stepper) -> None:
        self.stepper = stepper
        self.inbox: list[tuple[float, int, str, list[int], int, bool]] = []  # (time, seq, id, prompt, max, remote)
        self._seq = 0

    def put(self, when: float, request_id: str, prompt: list[int], max_tokens: int, remote: bool) -> None:
        bisect.insort(self.inbox, (when, self._seq, request_id, prompt, max_tokens, remote))
        self._seq += 1

    def next_time(self) -> float:
        """When this engine next has something to do (its clock if busy, its next arrival if idle)."""
        if self.stepper.has_requests():
            return self.stepper.clock
        return self.inbox[0][0] if self.inbox else float("inf")

    def deliver(self) -> None:
        """Hand over every request due by now; an idle engine first jumps to the next arrival."""
        s = self.stepper
        if not s.has_requests() and self.inbox:
            s.clock = max(s.clock, self.inbox[0][0])
        while self.inbox and self.inbox[0][0] <= s.clock:
            _, _, request_id, prompt, max_tokens, remote = self.inbox.pop(0)
            s.add(request_id, prompt, max_tokens, remote)


def _run(engines: list[_Clocked], on_outputs: Callable[[int, list[Any], float], None], max_steps: int) -> int:
    """Step the engine whose clock is behind until none has anything left; returns the steps taken."""
    steps = 0
    while True:
        index = min(range(len(engines)), key=lambda i: engines[i].next_time())
        engine = engines[index]
        if engine.next_time() == float("inf"):
            return steps
        if steps >= max_steps:
            raise KvlabValueError(f"max_steps: the run was still going after {max_steps} steps")
        engine.deliver()
        outputs, seconds = engine.stepper.step()
        engine.stepper.clock += seconds
        on_outputs(index, outputs, engine.stepper.clock)
        steps += 1


def _record(result: ServingResult, outputs: list[Any], now: float) -> None:
    """Each output's new token, at ``now``: a first token, or one more gap since the request's previous token."""
    for out in outputs:
        if not out.new_token_ids:
            continue
        rid = out.request_id
        if rid not in result.first_token:
            result.first_token[rid] = now
            result.gaps[rid] = []
        else:
            result.gaps[rid].append(now - result.last_token[rid])
        result.last_token[rid] = now


@checked(skip=("make_engine",))
def serve_colocated(make_engine: Callable[[], Stepper], workload: PDWorkload, num_replicas: int = 2,
                    max_steps: int = 1_000_000, id_prefix: str = "r") -> ServingResult:
    """``workload`` on ``num_replicas`` engines, each prefilling and decoding its requests (round robin); request
    ``i`` is ``f"{id_prefix}{i}"`` (engines that serve several runs need a new prefix each time)."""
    _callable("make_engine", make_engine)
    if positive_int("num_replicas", num_replicas) > workload.num_requests:
        raise KvlabValueError(f"num_replicas={num_replicas}: more replicas than the workload's "
                              f"{workload.num_requests} requests would leave some idle; at most num_requests")
    engines = [_Clocked(make_engine()) for _ in range(num_replicas)]
    result = ServingResult(COLOCATED)
    for i, (when, prompt) in enumerate(workload.requests()):
        rid = f"{id_prefix}{i}"
        result.arrival[rid] = when
        engines[i % num_replicas].put(when, rid, prompt, workload.output_tokens, False)
    result.num_steps = _run(engines, lambda _i, outputs, now: _record(result, outputs, now), max_steps)
    return result


@checked(skip=("make_prefill", "make_decode", "transfer"))
def serve_disaggregated(make_prefill: Callable[[], Stepper], make_decode: Callable[[], Stepper], workload: PDWorkload,
                        transfer: Callable[[int], float] | None = None, max_steps: int = 1_000_000,
                        id_prefix: str = "r") -> ServingResult:
    """``workload`` through a prefill engine (``max_tokens=1``) then a decode engine, the KV arriving
    ``transfer(prompt_tokens)`` seconds after the prefill ends (0 without ``transfer``: the decode stepper's own
    pull is timed in its steps). The client's tokens are the decode engine's, the first included."""
    _callable("make_prefill", make_prefill)
    _callable("make_decode", make_decode)
    if transfer is not None:
        _callable("transfer", transfer)
    prefill, decode = _Clocked(make_prefill()), _Clocked(make_decode())
    result = ServingResult(DISAGGREGATED)
    prompts = {}
    for i, (when, prompt) in enumerate(workload.requests()):
        rid = f"{id_prefix}{i}"
        result.arrival[rid] = when
        prompts[rid] = prompt
        prefill.put(when, rid, prompt, 1, False)

    def on_outputs(index: int, outputs: list[Any], now: float) -> None:
        if index == 1:
            _record(result, outputs, now)
            return
        for out in outputs:
            if out.finished and out.finish_reason in ("length", "stop"):
                seconds = transfer(len(prompts[out.request_id])) if transfer is not None else 0.0
                result.transfer[out.request_id] = seconds
                decode.put(now + seconds, out.request_id, prompts[out.request_id], workload.output_tokens, True)

    result.num_steps = _run([prefill, decode], on_outputs, max_steps)
    return result


# ----------------------------------------------------------------- a modelled GPU


class ArrivedKVConnector:
    """Scheduler side of a connector whose KV is already here: a remote request loads its prompt but the last
    token, synchronously (the transfer was counted in its arrival). Never touches a tensor."""

    def __init__(self) -> None:
        self.remote: set[str] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id not in self.remote:
            return 0, False
        return max(request.num_tokens - 1 - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.remote.discard(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> None:
        return None

    def update_connector_output(self, connector_output: Any) -> None:
        pass

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        self.remote.discard(request.request_id)
        return False, None


@checked(at_most={"num_blocks": MAX_OBJECTS})
class ModelledEngine:
    """kvlab's scheduler over ``num_blocks`` blocks, no model: each step's seconds come from ``cost``."""

    def __init__(self, cost: CostModel, num_blocks: int = 4096, block_size: int = 16,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 256) -> None:
        manager = KVCacheManager(num_blocks, block_size, hash_seed="pd")
        self.connector = ArrivedKVConnector()
        self.scheduler = Scheduler(manager, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   connector=self.connector)
        self.cost = cost
        self.clock = 0.0
        self._executor = NoComputeExecutor()

    @checked
    def add(self, request_id: str, prompt: list[int], max_tokens: int, remote: bool = False) -> None:
        """Queue a request; ``remote``: its KV arrived from a prefill engine (all but its last token is loaded)."""
        if remote:
            self.connector.remote.add(request_id)
        self.scheduler.add_request(GenerationRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens,
                                                                                        ignore_eos=True)))

    def step(self) -> tuple[list[Any], float]:
        scheduler_output, outputs, _ = step(self.scheduler, self._executor, atomic=False)
        batch = [(s.num_tokens, s.num_computed_tokens) for s in scheduler_output.scheduled]
        return outputs, step_seconds(self.cost, batch)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()
