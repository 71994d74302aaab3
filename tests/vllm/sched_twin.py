"""kvlab's ``Scheduler`` and vLLM 0.33.0's, driven with the same requests and model outputs, compared every step.

vLLM's side is built as its own ``tests/v1/core/utils.py::create_scheduler`` builds it: a
``VllmConfig`` of ``SchedulerConfig`` (chunked prefill on), ``ModelConfig`` over a tokenizer-free
checkpoint directory (a ``config.json`` only), ``CacheConfig`` and a CPU ``DeviceConfig``, a
``KVCacheConfig`` of one ``FullAttentionSpec`` group (or a sliding window's group beside it) with
``num_blocks``, and ``StructuredOutputManager``. The twin speaks vLLM's V1 model-runner protocol
(``use_v2_model_runner`` off), where a request back from preemption is a cached request marked resumed
(the V2 runner gets it as a new request), as kvlab's output marks it. Each step both schedule, the twin compares the two
``SchedulerOutput`` through ``StepView`` (the new block ids each sends included: kvlab's, like vLLM's, are a new
or resumed request's whole table and a running request's added blocks), feeds both the same sampled tokens
(``ModelRunnerOutput``), and compares what finished and why, each request's ``num_computed_tokens``, the queues in
order and the prefix-cache stats of ``make_stats``.

The differences kvlab makes on purpose are in ``DELIBERATE_DIFFERENCES``; the twin steers clear of
them (it runs vLLM synchronously, as kvlab runs) rather than papering over them.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from twin import Divergence, kvlab_specs, vllm_kv_cache_config
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as vllm_utils
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.outputs import ModelRunnerOutput as VllmModelRunnerOutput
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus as VllmStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import RequestStatus
from kvlab.core.sched.output import GenerationRequest, ModelRunnerOutput, SamplingParams
from kvlab.core.sched.scheduler import Scheduler

logging.getLogger("vllm").setLevel(logging.ERROR)

#: What kvlab's scheduler does differently from vLLM 0.33.0's on purpose, and how the twin keeps clear of it.
#: Notebook 06's scheduler section states each in a sentence.
DELIBERATE_DIFFERENCES = {
    "synchronous step": "kvlab schedules step N+1 only after step N's tokens are back (no async scheduling, "
                        "no output placeholders); the twin calls vLLM's schedule/update_from_output in turn.",
    "no long_prefill_token_threshold": "kvlab chunks a prompt only by the token budget; vLLM 0.33.0 also caps "
                                       "one prefill at long_prefill_token_threshold (0, off, by default). The "
                                       "twin runs vLLM with it off, and one scenario shows the cap vLLM adds.",
    "parallel sampling by fork": "kvlab serves n > 1 by forking one request (copy-on-write, from vLLM's older "
                                 "block manager); V1 runs n requests. The twin sends n = 1 only.",
    "door checks": "kvlab refuses at add_request a prompt >= max_model_len or a request that could never fit "
                   "the pool; vLLM's engine refuses the first before the scheduler and the second at start-up. "
                   "The twin sends requests that fit.",
    "a failing step fails its requests": "an executor's exception fails that step's requests in kvlab "
                                         "(Scheduler.fail_step); vLLM's engine core dies. Not driven here.",
    "stop tokens": "kvlab stops on eos_token_id (a tuple); vLLM on sampling_params' eos_token_id or "
                   "stop_token_ids. The twin gives vLLM the same ids as stop_token_ids.",
}

STEPS_COMPARED = [0]  # scheduler steps compared in this process, for make test-vllm's summary
EOS = 0  # the stop token both sides know
VOCAB = 40  # sampled tokens are crc32(id:position) % VOCAB: EOS comes up about once in 40 tokens


def tiny_checkpoint(directory: Path) -> str:
    """A tokenizer-free checkpoint directory for vLLM's ``ModelConfig``: the committed Llama config, longer RoPE."""
    config = json.loads((Path(__file__).parents[2] / "data" / "tiny-pydoc-llama" / "config.json").read_text())
    config["max_position_embeddings"] = 1 << 16
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def sampled_token(rid: str, position: int, seed: int = 0) -> int:
    """The fake model's token for request ``rid`` at ``position``: the same on both sides and after a recompute."""
    return zlib.crc32(f"{seed}:{rid}:{position}".encode()) % VOCAB


@dataclass(frozen=True)
class StepView:
    """One step, as both schedulers' outputs can state it (kvlab's and vLLM's ``SchedulerOutput`` alike)."""

    num_scheduled_tokens: dict[str, int]  # in batch order
    new_req_ids: list[str]  # first scheduled this step (NewRequestData)
    resumed_req_ids: list[str]  # back after a preemption
    running_req_ids: list[str]  # cached requests continuing
    new_block_ids: dict[str, tuple[tuple[int, ...], ...]]  # per request, per group: blocks added this step
    preempted_req_ids: list[str]
    finished_req_ids: set[str]


def vllm_step_view(out) -> StepView:
    """vLLM's ``SchedulerOutput`` as a ``StepView`` (new requests give all their blocks, cached ones the new)."""
    cached = out.scheduled_cached_reqs
    new_blocks = {r.req_id: tuple(tuple(ids) for ids in r.block_ids) for r in out.scheduled_new_reqs}
    for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
        new_blocks[rid] = tuple(tuple(g) for g in ids) if ids is not None else ()
    resumed = [rid for rid in cached.req_ids if rid in cached.resumed_req_ids]
    return StepView(
        num_scheduled_tokens=dict(out.num_scheduled_tokens),
        new_req_ids=[r.req_id for r in out.scheduled_new_reqs],
        resumed_req_ids=resumed,
        running_req_ids=[rid for rid in cached.req_ids if rid not in cached.resumed_req_ids],
        new_block_ids={rid: ids for rid, ids in new_blocks.items() if any(ids)},
        preempted_req_ids=sorted(out.preempted_req_ids or ()),
        finished_req_ids=set(out.finished_req_ids),
    )


def kvlab_step_view(out) -> StepView:
    """kvlab's ``SchedulerOutput`` as a ``StepView``: each request's new block ids are what its record sends
    (``ScheduledRequest.new_block_ids``: a new or resumed request's whole table, a running one's added blocks)."""
    new_blocks = {s.request_id: tuple(tuple(g) for g in s.new_block_ids) for s in out.scheduled}
    return StepView(
        num_scheduled_tokens={s.request_id: s.num_tokens for s in out.scheduled},
        new_req_ids=list(out.scheduled_new_req_ids),
        resumed_req_ids=list(out.scheduled_resumed_req_ids),
        running_req_ids=list(out.scheduled_running_req_ids),
        new_block_ids={rid: ids for rid, ids in new_blocks.items() if any(ids)},
        preempted_req_ids=sorted(out.preempted_req_ids),
        finished_req_ids=set(out.finished_req_ids),
    )


@dataclass
class SchedTwin:
    """The two schedulers over pools of ``num_blocks`` blocks; ``groups``: "full" or a sliding window per group."""

    checkpoint: str
    num_blocks: int
    block_size: int
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int = 1024
    enable_caching: bool = True
    long_prefill_token_threshold: int = 0
    groups: tuple = ("full",)
    token_seed: int = 0
    steps: int = 0
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        k_specs = kvlab_specs(self.groups, self.block_size)
        manager = KVCacheManager(self.num_blocks, self.block_size, self.enable_caching, "sha256",
                                 max_model_len=self.max_model_len, kv_cache_groups=k_specs)
        self.k = Scheduler(manager, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                           max_model_len=self.max_model_len)
        self.v = self._vllm_scheduler()
        vllm_utils.init_none_hash(sha256)
        self.v_hasher = vllm_utils.get_request_block_hasher(self.block_size, sha256) if self.enable_caching else None
        self.v_requests: dict[str, VllmRequest] = {}

    def _vllm_scheduler(self) -> VllmScheduler:
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
            long_prefill_token_threshold=self.long_prefill_token_threshold)
        model_config = ModelConfig(model=self.checkpoint, skip_tokenizer_init=True, max_model_len=self.max_model_len)
        cache_config = CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_caching)
        cache_config.num_gpu_blocks = self.num_blocks
        vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                                 cache_config=cache_config, device_config=DeviceConfig(device="cpu"))
        kv_cache_config = vllm_kv_cache_config(self.groups, self.block_size, self.num_blocks)
        scheduler = VllmScheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                                  structured_output_manager=StructuredOutputManager(vllm_config),
                                  block_size=self.block_size)
        scheduler.use_v2_model_runner = False  # the protocol that tells resumed requests from new ones, as kvlab's
        return scheduler

    # ----------------------------------------------------------------- what a driver does

    def add(self, rid: str, prompt: Iterable[int], max_tokens: int = 16) -> None:
        prompt = list(prompt)
        self.k.add_request(GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens),
                                             eos_token_id=(EOS,)))
        params = VllmSamplingParams(max_tokens=max_tokens, stop_token_ids=[EOS])
        request = VllmRequest(rid, prompt, params, None, block_hasher=self.v_hasher)
        self.v_requests[rid] = request
        self.v.add_request(request)
        self.log.append(f"add {rid} prompt={len(prompt)} max_tokens={max_tokens}")
        self.compare_state("add " + rid)

    def abort(self, rid: str) -> None:
        k_done = {o.request_id for o in self.k.finish_requests(rid, RequestStatus.FINISHED_ABORTED)}
        v_known = rid in self.v.requests and not self.v.requests[rid].is_finished()
        self.v.finish_requests(rid, VllmStatus.FINISHED_ABORTED)
        self.log.append(f"abort {rid}")
        self.same("aborted", sorted(k_done), [rid] if v_known else [])
        self.compare_state("abort " + rid)

    def step(self) -> StepView:
        """One step on both sides: schedule, compare, the same sampled tokens to both, compare what finished."""
        self.steps += 1
        where = f"step {self.steps}"
        k_out, v_out = self.k.schedule(), self.v.schedule()
        view = kvlab_step_view(k_out)
        self.same(f"{where}: the step", view, vllm_step_view(v_out))
        samplers = [rid for rid in v_out.num_scheduled_tokens
                    if self.v.requests[rid].num_computed_tokens >= self.v.requests[rid].num_tokens]
        self.same(f"{where}: requests that sample", [s.request_id for s in k_out.scheduled if s.sample], samplers)
        tokens = {rid: sampled_token(rid, self.v.requests[rid].num_tokens, self.token_seed) for rid in samplers}
        k_finished = {o.request_id: o.finish_reason for o in
                      self.k.update_from_output(k_out, ModelRunnerOutput(tokens)) if o.finished}
        order = list(v_out.num_scheduled_tokens)
        v_outputs = self.v.update_from_output(v_out, VllmModelRunnerOutput(
            req_ids=order, req_id_to_index={rid: i for i, rid in enumerate(order)},
            sampled_token_ids=[[tokens[rid]] if rid in tokens else [] for rid in order]))
        v_finished = {o.request_id: str(o.finish_reason) for outs in v_outputs.values() for o in outs.outputs
                      if o.finish_reason is not None}
        self.same(f"{where}: finished and why", k_finished, v_finished)
        k_stats = self.k.make_stats()
        v_stats = next(o.scheduler_stats for o in v_outputs.values() if o.scheduler_stats is not None)
        k_p, v_p = k_stats.prefix_cache_stats, v_stats.prefix_cache_stats
        fields = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")
        self.same(f"{where}: prefix-cache stats", [getattr(k_p, f) for f in fields], [getattr(v_p, f) for f in fields])
        self.same(f"{where}: kv cache usage", round(k_stats.kv_cache_usage, 9), round(v_stats.kv_cache_usage, 9))
        self.log.append(f"step -> {view.num_scheduled_tokens} preempted={view.preempted_req_ids} "
                        f"finished={sorted(k_finished.items())}")
        self.compare_state(where)
        STEPS_COMPARED[0] += 1
        return view

    def run(self, max_steps: int = 10_000) -> int:
        """Step until both are idle; returns the steps taken."""
        taken = 0
        while self.k.has_unfinished_requests() or self.v.has_unfinished_requests():
            assert taken < max_steps, "no progress"
            self.step()
            taken += 1
        return taken

    # ----------------------------------------------------------------- comparing

    def compare_state(self, where: str) -> None:
        self.same(f"{where}: running queue", [r.request_id for r in self.k.running],
                  [r.request_id for r in self.v.running])
        self.same(f"{where}: waiting queue", [r.request_id for r in self.k.waiting],
                  [r.request_id for r in self.v.waiting])
        self.same(f"{where}: num_computed_tokens", {rid: r.num_computed_tokens for rid, r in self.k.requests.items()},
                  {rid: r.num_computed_tokens for rid, r in self.v.requests.items() if not r.is_finished()})
        self.same(f"{where}: output tokens", {rid: list(r.output_token_ids) for rid, r in self.k.requests.items()},
                  {rid: list(r.output_token_ids) for rid, r in self.v.requests.items() if not r.is_finished()})

    def same(self, what: str, k, v) -> None:
        if k != v:
            tail = "\n  ".join(self.log[-12:])
            raise Divergence(f"{what}: kvlab {k!r} != vLLM {v!r}\n  last operations:\n  {tail}")


# ----------------------------------------------------------------- seeded random traces


@dataclass(frozen=True)
class SchedConfig:
    """One random trace's scheduler and pool; ``str(config)`` names it in a failure."""

    num_blocks: int
    block_size: int
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    enable_caching: bool = True
    groups: tuple = ("full",)
    max_model_len: int = 512

    def twin(self, checkpoint: str) -> SchedTwin:
        return SchedTwin(checkpoint, self.num_blocks, self.block_size, self.max_num_seqs,
                         self.max_num_batched_tokens, self.max_model_len, self.enable_caching, groups=self.groups)

    @property
    def max_request_tokens(self) -> int:
        """Prompt plus output kept within what a lone request can always hold (full attention: every block)."""
        return min((self.num_blocks - 1) * self.block_size, self.max_model_len - 1)


def generate_ops(config: SchedConfig, rng, num_steps: int) -> list[tuple]:
    """``num_steps`` steps of traffic, drawn up front: arrivals sharing prefixes (so they hit), aborts, steps."""
    bs = config.block_size
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.choice([bs, 2 * bs + 3, 3 * bs]))] for _ in range(3)]
    ops: list[tuple] = []
    count = steps = 0
    while steps < num_steps:
        roll = rng.random()
        if roll < 0.3:
            count += 1
            prefix = rng.choice(prefixes + [[]])[:rng.choice([1000, 1000, rng.randrange(3 * bs + 1)])]
            tail = [rng.randrange(1, VOCAB) for _ in range(rng.choice([1, 3, bs, 2 * bs + 1, 5 * bs]))]
            prompt = (prefix + tail)[:config.max_request_tokens - 1]
            max_tokens = min(rng.choice([1, 2, 8, 30, 60]), config.max_request_tokens - len(prompt))
            ops.append(("add", f"r{count}", tuple(prompt), max_tokens))
        elif roll < 0.34 and count:
            ops.append(("abort", f"r{rng.randrange(1, count + 1)}"))
        else:
            ops.append(("step",))
            steps += 1
    return ops


def apply(twin: SchedTwin, op: tuple) -> None:
    if op[0] == "add":
        twin.add(op[1], op[2], op[3])
    elif op[0] == "abort":
        twin.abort(op[1])
    else:
        twin.step()
