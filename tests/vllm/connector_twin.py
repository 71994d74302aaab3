"""The scheduler twin with a KV connector on both sides: one script, one connector class per side, compared every step.

``ScriptedLogic`` answers the scheduler's questions from a script shared by both sides
(``kv_connector_extra_config["script"]``): how many tokens each request can load beyond its local hit and
whether asynchronously, which finished requests keep their blocks for a send. vLLM 0.33.0 builds its half
itself, by name and module path (``TwinKVConnector``, a ``KVConnectorBase_V1``); kvlab's scheduler is handed
``KvlabTwinConnector``. Each records its calls; the twin compares the two records step by step, so the order
of ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output`` and ``request_finished`` is checked against vLLM's own scheduler.

The "worker" is the twin: an asynchronous load started in one step is reported in ``finished_recving``
``load_steps`` steps later, a delayed free in ``finished_sending`` the step after it was asked for; a load the
script marks failing reports its blocks in ``invalid_block_ids`` (a synchronous load in its own step, an
asynchronous one with its ``finished_recving``). Both sides get the same ``KVConnectorOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sched_twin
from sched_twin import SchedTwin, StepView, sampled_token, vllm_step_view
from twin import kvlab_specs, vllm_kv_cache_config
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig as VllmKVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.outputs import KVConnectorOutput as VllmKVConnectorOutput
from vllm.v1.outputs import ModelRunnerOutput as VllmModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.output import KVConnectorOutput, ModelRunnerOutput
from kvlab.core.sched.scheduler import Scheduler


class ScriptedLogic:
    """The connector's answers, the same on both sides: ``script = {"external": {rid: [tokens, async]},
    "delay": [rid, ...], "fail": [rid, ...]}``; a request's first load is its only one (NIXL's rule)."""

    def __init__(self, script: dict, block_size: int) -> None:
        self.external = {rid: tuple(v) for rid, v in script.get("external", {}).items()}
        self.delay, self.fail = set(script.get("delay", ())), set(script.get("fail", ()))
        self.block_size = block_size
        self.calls: list[tuple] = []
        self.started: dict[str, list[int]] = {}  # rid -> blocks an asynchronous load fills (this step)
        self.sync_loads: dict[str, list[int]] = {}  # rid -> blocks a synchronous load fills (this step)
        self.finished: list[str] = []  # delayed frees asked for since the last step
        self.local_hit: dict[str, int] = {}  # rid -> the block-aligned local hit its last lookup was shown

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        self.local_hit[request.request_id] = num_computed_tokens
        tokens, load_async = self.external.get(request.request_id, (0, False))
        if tokens is None:
            return None, False
        # A synchronous load must leave the last token to compute (vLLM asserts it); an asynchronous one may cover all.
        count = max(min(tokens, request.num_tokens - (not load_async)) - num_computed_tokens, 0)
        return count, bool(load_async) and count > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("update_state_after_alloc", request.request_id, num_external_tokens,
                           [b.block_id for b in blocks.blocks[0]]))
        if num_external_tokens:
            _, load_async = self.external.pop(request.request_id)
            first = self.local_hit[request.request_id] // self.block_size
            last = -(-(first * self.block_size + num_external_tokens) // self.block_size)
            loaded = [b.block_id for b in blocks.blocks[0][first:last]]  # the blocks the load fills
            (self.started if load_async else self.sync_loads)[request.request_id] = loaded

    def build_connector_meta(self, step_ids):
        self.calls.append(("build_connector_meta", sorted(step_ids)))

    def update_connector_output(self, recving, sending):
        self.calls.append(("update_connector_output", sorted(recving or ()), sorted(sending or ())))

    def request_finished(self, request, block_ids):
        self.calls.append(("request_finished", request.request_id, list(block_ids)))
        # As NIXL's producer: only a request that ended well keeps its blocks for a send.
        delay = (request.request_id in self.delay and bool(block_ids)
                 and request.status.name in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"))
        if delay:
            self.finished.append(request.request_id)
        return delay, {"remote_block_ids": list(block_ids)} if request.request_id in self.delay else None


class TwinKVConnector(KVConnectorBase_V1):
    """vLLM's half: the script through vLLM's interface (its worker methods are never called here)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.logic = ScriptedLogic(self._kv_transfer_config.kv_connector_extra_config["script"],
                                   vllm_config.cache_config.block_size)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.logic.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.logic.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        self.logic.build_connector_meta(scheduler_output.num_scheduled_tokens)
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output):
        self.logic.update_connector_output(connector_output.finished_recving, connector_output.finished_sending)

    def request_finished(self, request, block_ids):
        return self.logic.request_finished(request, block_ids)

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


class KvlabTwinConnector:
    """kvlab's half: the same script through kvlab's ``SchedulerKVConnector`` protocol."""

    def __init__(self, script: dict, block_size: int) -> None:
        self.logic = ScriptedLogic(script, block_size)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.logic.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.logic.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        self.logic.build_connector_meta(scheduler_output.num_scheduled_tokens)

    def update_connector_output(self, connector_output):
        self.logic.update_connector_output(connector_output.finished_recving, connector_output.finished_sending)

    def request_finished(self, request, block_ids):
        return self.logic.request_finished(request, block_ids)


@dataclass
class ConnectorTwin(SchedTwin):
    """``SchedTwin`` with the scripted connector on both sides, ``kv_load_failure_policy`` and the twin as worker."""

    script: dict = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    load_steps: int = 1
    _in_flight: dict = field(default_factory=dict)  # rid -> (steps left, blocks) of asynchronous loads

    def __post_init__(self) -> None:
        super().__post_init__()
        manager = KVCacheManager(self.num_blocks, self.block_size, self.enable_caching, "sha256",
                                 max_model_len=self.max_model_len, kv_cache_groups=kvlab_specs(self.groups,
                                                                                               self.block_size))
        self.k_connector = KvlabTwinConnector(self.script, self.block_size)
        self.k = Scheduler(manager, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                           max_model_len=self.max_model_len, connector=self.k_connector,
                           kv_load_failure_policy=self.kv_load_failure_policy)

    def _vllm_scheduler(self) -> VllmScheduler:
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
            long_prefill_token_threshold=self.long_prefill_token_threshold, disable_hybrid_kv_cache_manager=True)
        model_config = ModelConfig(model=self.checkpoint, skip_tokenizer_init=True, max_model_len=self.max_model_len)
        cache_config = CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_caching)
        cache_config.num_gpu_blocks = self.num_blocks
        kv_transfer_config = VllmKVTransferConfig(
            kv_connector="TwinKVConnector", kv_connector_module_path="connector_twin", kv_role="kv_both",
            kv_connector_extra_config={"script": self.script}, kv_load_failure_policy=self.kv_load_failure_policy)
        vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                                 cache_config=cache_config, device_config=DeviceConfig(device="cpu"),
                                 kv_transfer_config=kv_transfer_config)
        scheduler = VllmScheduler(vllm_config=vllm_config,
                                  kv_cache_config=vllm_kv_cache_config(self.groups, self.block_size, self.num_blocks),
                                  log_stats=True, structured_output_manager=StructuredOutputManager(vllm_config),
                                  block_size=self.block_size)
        scheduler.use_v2_model_runner = False
        return scheduler

    def _worker_report(self) -> tuple[set[str], set[str], set[int]]:
        """What the (twin) worker reports this step: loads done, sends done, blocks that failed to load."""
        k_logic, v_logic = self.k_connector.logic, self.v.connector.logic
        self.same(f"step {self.steps}: loads started", k_logic.started, v_logic.started)
        self.same(f"step {self.steps}: synchronous loads", k_logic.sync_loads, v_logic.sync_loads)
        invalid = {ids[0] for rid, ids in k_logic.sync_loads.items() if rid in k_logic.fail and ids}
        for rid, blocks in k_logic.started.items():
            self._in_flight[rid] = [self.load_steps, blocks]
        k_logic.started, v_logic.started, k_logic.sync_loads, v_logic.sync_loads = {}, {}, {}, {}
        recving = set()
        for rid, entry in list(self._in_flight.items()):
            entry[0] -= 1
            if entry[0] < 0:
                recving.add(rid)
                if rid in k_logic.fail:
                    invalid |= set(entry[1])
                del self._in_flight[rid]
        sending = set(k_logic.finished)
        self.same(f"step {self.steps}: delayed frees", k_logic.finished, v_logic.finished)
        k_logic.finished, v_logic.finished = [], []
        return recving, sending, invalid

    def step(self) -> StepView:
        self.steps += 1
        where = f"step {self.steps}"
        k_out, v_out = self.k.schedule(), self.v.schedule()
        view = sched_twin.kvlab_step_view(k_out)
        self.same(f"{where}: the step", view, vllm_step_view(v_out))
        samplers = [rid for rid in v_out.num_scheduled_tokens
                    if self.v.requests[rid].num_computed_tokens >= self.v.requests[rid].num_tokens]
        tokens = {rid: sampled_token(rid, self.v.requests[rid].num_tokens, self.token_seed) for rid in samplers}
        recving, sending, invalid = self._worker_report()
        k_kv = KVConnectorOutput(sending or None, recving or None, set(invalid))
        v_kv = VllmKVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                                     invalid_block_ids=set(invalid))
        k_outputs = self.k.update_from_output(k_out, ModelRunnerOutput(tokens, kv_connector_output=k_kv))
        order = list(v_out.num_scheduled_tokens)
        v_outputs = self.v.update_from_output(v_out, VllmModelRunnerOutput(
            req_ids=order, req_id_to_index={rid: i for i, rid in enumerate(order)},
            sampled_token_ids=[[tokens[rid]] if rid in tokens else [] for rid in order], kv_connector_output=v_kv))
        k_finished = {o.request_id: (o.finish_reason, o.kv_transfer_params) for o in k_outputs if o.finished}
        v_finished = {o.request_id: (str(o.finish_reason), o.kv_transfer_params) for outs in v_outputs.values()
                      for o in outs.outputs if o.finish_reason is not None}
        self.same(f"{where}: finished, why, and kv_transfer_params", k_finished, v_finished)
        self.same(f"{where}: the connector's calls", self.k_connector.logic.calls, self.v.connector.logic.calls)
        self.k_connector.logic.calls, self.v.connector.logic.calls = [], []
        k_stats = self.k.make_stats()
        v_stats = next(o.scheduler_stats for o in v_outputs.values() if o.scheduler_stats is not None)
        fields = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")
        for kind in ("prefix_cache_stats", "connector_prefix_cache_stats"):
            self.same(f"{where}: {kind}", [getattr(getattr(k_stats, kind), f) for f in fields],
                      [getattr(getattr(v_stats, kind), f) for f in fields])
        self.same(f"{where}: kv cache usage", round(k_stats.kv_cache_usage, 9), round(v_stats.kv_cache_usage, 9))
        self.log.append(f"step -> {view.num_scheduled_tokens} recving={sorted(recving)} sending={sorted(sending)} "
                        f"invalid={sorted(invalid)} finished={sorted(k_finished)}")
        self.compare_state(where)
        sched_twin.STEPS_COMPARED[0] += 1
        return view

    def compare_state(self, where: str) -> None:
        self.same(f"{where}: running queue", [r.request_id for r in self.k.running],
                  [r.request_id for r in self.v.running])
        self.same(f"{where}: waiting queue", [r.request_id for r in self.k.waiting],
                  [r.request_id for r in self.v.waiting])
        self.same(f"{where}: kv-holding waiting queue", [r.request_id for r in self.k.kv_holding_waiting],
                  [r.request_id for r in self.v.kv_holding_waiting])
        live_k = {rid: r for rid, r in self.k.requests.items() if not r.is_finished()}
        live_v = {rid: r for rid, r in self.v.requests.items() if not r.is_finished()}
        self.same(f"{where}: status", {rid: r.status.name for rid, r in live_k.items()},
                  {rid: r.status.name for rid, r in live_v.items()})
        self.same(f"{where}: num_computed_tokens", {rid: r.num_computed_tokens for rid, r in live_k.items()},
                  {rid: r.num_computed_tokens for rid, r in live_v.items()})
        self.same(f"{where}: requests held after finishing", sorted(set(self.k.requests) - set(live_k)),
                  sorted(set(self.v.requests) - set(live_v)))
        self.same(f"{where}: output tokens", {rid: list(r.output_token_ids) for rid, r in live_k.items()},
                  {rid: list(r.output_token_ids) for rid, r in live_v.items()})

    def run(self, max_steps: int = 10_000) -> int:
        taken = 0
        while self.k.has_requests() or self._in_flight or self.v.has_requests():
            assert taken < max_steps, "no progress"
            self.step()
            taken += 1
        return taken
