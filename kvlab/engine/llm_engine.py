"""``LLMEngine``: a checkpoint, a paged KV cache, the scheduler and the model runner in one serving loop.

Start-up follows vLLM: check the configuration (``EngineConfig``), load the weights, size the KV
pool (a block count, or a memory budget cut into blocks by ``kvlab.capacity.budget``), allocate
each layer's cache as its KV cache spec says (one K and one V tensor ``[num_blocks, block_size,
num_kv_heads, head_size]`` for a Llama-family layer, one latent tensor ``[num_blocks, block_size,
kv_lora_rank + qk_rope_head_dim]`` for DeepSeek's MLA; ``kvlab.engine.registry`` picks the family
by ``model_type``), and print the start-up lines. Each ``step()`` is vLLM's ``EngineCore.step``:
the scheduler picks tokens, the runner computes them through ``kvlab.kernels``, the scheduler
appends the samples and frees finished requests. ``metrics_text()`` is what a Prometheus scrape
of ``/metrics`` would see; ``history`` keeps one ``SchedulerStats`` per step for plots.

A request that fails (its logits are not finite, or the executor raises in its step) finishes
with finish reason ``"error"`` and frees its blocks; ``step()`` then raises its error and the
engine keeps serving the others. vLLM instead treats an exception in ``execute_model`` as fatal
to the whole engine (``kvlab.core.sched.loop``). An exception outside the executor (a Ctrl-C while
the scheduler works) undoes the step, the sampler's draws included, and ``step()`` raises it: the
next call runs the same step again, so no request, block or token is lost.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvlab.capacity.budget import KVCachePlan, format_gib
from kvlab.capacity.hybrid import HybridKVCachePlan
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector
from kvlab.core.kv_offload import CPUOffloadingManager, OffloadingConnector
from kvlab.core.request import RequestStatus
from kvlab.core.sched.loop import step
from kvlab.core.sched.output import (
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    SchedulerStats,
    child_request_id,
)
from kvlab.core.sched.scheduler import Scheduler
from kvlab.distributed.parallel_state import GroupCoordinator
from kvlab.engine.engine_config import KV_CACHE_DTYPES, EngineConfig
from kvlab.engine.kv_offload import OffloadingExecutor, allocate_cpu_kv_caches
from kvlab.engine.kv_pool import allocate_kv_caches, kv_cache_bytes, kv_cache_groups, layer_groups, plan_pool
from kvlab.engine.metrics import EngineMetrics, LatencyMetrics, prometheus_text
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.multiproc_executor import start_rank_executor
from kvlab.engine.registry import check_checkpoint, kv_cache_specs, load_model
from kvlab.errors import CheckpointError, KvlabValueError, RequestStateError


class LLMEngine:
    """Serve a Llama-family or DeepSeek-V3 checkpoint through kvlab's paged KV cache, scheduler and Triton kernels.

    ``LLMEngine(model_dir, **engine_args)`` takes ``EngineConfig``'s fields as keywords (or one
    ``EngineConfig``). The pool holds ``num_gpu_blocks`` blocks (vLLM's ``num_gpu_blocks_override``),
    or as many as ``kv_cache_memory_gib`` buys (vLLM's ``kv_cache_memory_bytes``), or by default
    enough for ``max_num_seqs`` requests of ``max_model_len`` tokens, capped at 1 GiB (vLLM would
    profile the GPU instead; kvlab does not profile). Block 0 is the null block, as in vLLM.
    ``kv_cache_dtype="fp8"`` stores K and V as float8 e4m3 with scale 1.0 (vLLM's default)
    and the kernels dequantize on load. The model and the cache live on ``device``: by default
    the GPU where the kernels run natively, else the CPU (``kernels.default_device()``); a CPU
    engine plans with this machine's RAM in place of GPU memory. ``attention_backend``: the attention
    kernels, ``"triton"`` or ``"torch"`` (gather + SDPA), by default chosen by hardware (``EngineConfig``).
    ``dtype``: the weights' and activations' dtype, vLLM's ``--dtype`` ("auto": the checkpoint's, except float32
    under Triton's interpreter and for a float32 checkpoint; ``kvlab.engine.dtype``).

    ``cpu_offload_blocks`` adds a CPU tier of that many blocks under the pool (``kvlab.core.kv_offload``;
    vLLM sizes its tier in GiB with ``kv_offloading_size``): blocks the pool evicts are copied
    there and copied back on a prefix hit. ``preemption_mode="swap"`` resumes preempted requests
    from that tier instead of recomputing them. ``kv_cache_metrics`` records vLLM's block lifetime
    histograms (sampling ``kv_cache_metrics_sample`` of the blocks) and adds them to ``metrics_text()``.

    ``tensor_parallel_size=N`` splits the model over N ranks, each a process with its shard of every layer and
    its own KV cache of the same block count (``kvlab.engine.multiproc_executor`` starts them, as vLLM's
    ``MultiprocExecutor`` does; ``distributed_executor_backend="external_launcher"`` when torchrun started them
    and this process is rank 0). This engine keeps the scheduler and the block tables, holds no weights, and
    reads rank 0's tokens; ``kv_cache_reports`` says what each rank allocated. ``shutdown()`` (or a ``with``
    block) stops the ranks; a rank that fails stops them all (``RankFailedError``).
    """

    def __init__(self, model_dir: str | os.PathLike | EngineConfig, **engine_args: Any) -> None:
        # 1. Config: every argument checked once, with the checkpoint's config.json, before a weight is read.
        if isinstance(model_dir, EngineConfig) and engine_args:
            raise KvlabValueError("pass an EngineConfig alone, or a model_dir with keywords, not both")
        config = model_dir if isinstance(model_dir, EngineConfig) else EngineConfig.create(model_dir, **engine_args)
        self.engine_config = config
        self.model_dir, self.config, self.max_model_len = config.model_dir, config.model_config, config.max_model_len
        self.block_size, self.kv_cache_dtype = config.block_size, config.kv_cache_dtype
        # 2. Device: where the kernels run (chosen and checked in step 1).
        self.device = config.device
        # 3. Weights: the checkpoint's tensors, checked against config.json, onto the device. Under tensor
        #    parallelism the ranks start now, each loading its shard (kvlab.engine.worker); the engine keeps none.
        self.tensor_parallel_size = config.tensor_parallel_size
        started = time.perf_counter()
        self.model: Any = None
        self.rank_executor: Any = None
        if config.tensor_parallel_size == 1:
            self.model = load_model(config.model_dir, config.dtype, config=config.model_config).to(self.device)
            self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        else:  # the checkpoint checked here, once, as each rank's shard will read it; then the ranks
            check_checkpoint(config.model_dir, config.model_config,
                             GroupCoordinator.unconnected(0, config.tensor_parallel_size))
            self.rank_executor = start_rank_executor(config)
            self.weights_bytes = max(r["weights_bytes"] for r in self.rank_executor.load_reports)  # per rank
        self.load_seconds = time.perf_counter() - started
        self.cache_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or config.dtype
        # 4. Pool plan: the KV cache groups (sliding-window layers apart), and how many blocks, from a count,
        #    a memory budget, or the default.
        self.kv_cache_groups = kv_cache_groups(config, self.cache_dtype)
        self.plan: KVCachePlan | HybridKVCachePlan = plan_pool(config, self.cache_dtype, self.weights_bytes,
                                                               self.kv_cache_groups)
        self.num_gpu_blocks, self.bytes_per_block = self.plan.num_blocks, self.plan.bytes_per_block
        # 5. Tensors: per layer what its spec says: K and V [num_blocks, block_size, num_kv_heads, head_size],
        #    or MLA's latent [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (with several
        #    groups, layer j of every group shares one cache).
        #    Each rank allocates its own, the same block count (its shapes: kv_cache_reports).
        self.kv_cache_specs = kv_cache_specs(config.model_config, config.block_size, self.cache_dtype,
                                             config.tensor_parallel_size)
        self.kv_caches = [] if self.rank_executor else \
            allocate_kv_caches(config, self.num_gpu_blocks, self.cache_dtype, self.kv_cache_groups)
        self.kv_cache_reports = (self.rank_executor.initialize_kv_cache(self.num_gpu_blocks, self.kv_cache_groups)
                                 if self.rank_executor else [])
        # 6. Manager: the block pool and prefix cache (a manager per group), and vLLM's --kv-cache-metrics.
        self.kv_cache_manager = KVCacheManager(self.num_gpu_blocks, config.block_size,
                                               enable_caching=config.enable_prefix_caching,
                                               kv_cache_groups=self.kv_cache_groups,
                                               enable_kv_cache_events=config.enable_kv_cache_events)
        self.kv_cache_metrics = (KVCacheMetricsCollector(config.kv_cache_metrics_sample)
                                 if config.kv_cache_metrics else None)
        self.kv_cache_manager.block_pool.metrics_collector = self.kv_cache_metrics
        #    --kv-events-config: the publisher vLLM's scheduler makes (EventPublisherFactory.create); see _publish.
        self.kv_event_publisher = _event_publisher(config)
        # 7. KV connector: the CPU tier of cpu_offload_blocks blocks (kvlab.core.kv_offload), or one that moves KV
        #    between engines (kv_transfer_config: kvlab.distributed.kv_transfer), as two halves, scheduler and worker.
        self.cpu_offload_blocks = config.cpu_offload_blocks
        self.cpu_kv_caches = (allocate_cpu_kv_caches(self.kv_caches, config.cpu_offload_blocks)
                              if config.cpu_offload_blocks else [])
        self.connector: Any = (OffloadingConnector(self.kv_cache_manager,
                                                   CPUOffloadingManager(config.cpu_offload_blocks))
                               if config.cpu_offload_blocks else None)
        self.kv_connector_worker: Any = None
        #    Under tensor parallelism each rank built its worker half beside its cache; the engine keeps the other.
        kvt = config.kv_transfer_config
        if kvt is not None and kvt.kv_connector not in (None, "OffloadingConnector"):
            from kvlab.distributed.kv_transfer.kv_connector import factory  # the one upward import

            if self.rank_executor is None:
                self.connector, self.kv_connector_worker = factory.create_connectors(
                    kvt, config.block_size, self.kv_caches, self.kv_cache_manager, config.model_config)
            else:
                handshakes = {r["rank"]: r["kv_connector_handshake"] for r in self.kv_cache_reports
                              if r["kv_connector_handshake"] is not None}
                self.connector = factory.create_scheduler_connector(kvt, config.block_size, self.kv_cache_manager,
                                                                    handshakes)
        # 8. Scheduler: the token budget, queues and preemption over the manager.
        self.scheduler = Scheduler(self.kv_cache_manager, **dataclasses.asdict(config.scheduler_config),
                                   connector=self.connector,
                                   kv_load_failure_policy=kvt.kv_load_failure_policy if kvt else "fail")
        # 9. Executor: the model runner (with the connector's worker half), behind the CPU tier's copies if any; or
        #    the ranks of a tensor-parallel engine.
        self.model_runner: ModelRunner | None = None
        if self.rank_executor is not None:
            self.executor = self.rank_executor
        else:
            self.model_runner = ModelRunner(self.model, self.kv_caches, config.block_size,
                                            keep_logits=config.keep_logits,
                                            layer_groups=layer_groups(self.kv_cache_groups)[0],
                                            attention_backend=config.attention_backend)
            self.model_runner.kv_connector = self.kv_connector_worker
            self.executor = (OffloadingExecutor(self.model_runner, self.kv_caches, self.cpu_kv_caches, self.connector)
                             if config.cpu_offload_blocks else self.model_runner)
        # What the engine has served: metrics, per-step history, and each request's tokens and end.
        self.metrics = EngineMetrics()
        self.latency = LatencyMetrics()  # vLLM's time-to-first-token, inter-token and end-to-end histograms
        self.history: list[SchedulerStats] = []
        self.step_seconds: list[float] = []
        self.outputs: dict[str, list[int]] = {}  # request id -> generated tokens (children included)
        self.finish_reasons: dict[str, str | None] = {}
        self.errors: dict[str, BaseException] = {}  # request id -> why it finished with "error"
        self.kv_transfer_params: dict[str, dict[str, Any]] = {}  # request id -> what its KV connector returned
        self.last_scheduler_output: SchedulerOutput | None = None  # what the latest step computed
        self._request_ids = itertools.count()
        self._tokenizer: Any = None

    # ----------------------------------------------------------------- what start-up prints

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of every cache tensor, K and V or latent (what ``kv_cache_dtype`` halves or quarters; shared
        tensors count once)."""
        return kv_cache_bytes(self.kv_caches) if self.rank_executor is None else \
            sum(r["kv_cache_bytes"] for r in self.kv_cache_reports)

    def shutdown(self) -> None:
        """Stop what runs beside the engine: a KV connector's threads and sockets (both halves), the ranks of a
        tensor-parallel engine (each stops its own half and exits; nothing is left running), and the KV event
        publisher. An engine with none of them has nothing to stop. Also run by ``with LLMEngine(...) as engine:``;
        the ranks also stop when their executor is collected."""
        if self.kv_connector_worker is not None:
            self.kv_connector_worker.shutdown()
        if self.connector is not None and hasattr(self.connector, "shutdown"):
            self.connector.shutdown()
        if self.rank_executor is not None:
            self.rank_executor.shutdown()
        if self.kv_event_publisher is not None:  # --kv-events-config's publisher, as vLLM's Scheduler.shutdown
            self.kv_event_publisher.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def startup_log(self) -> list[str]:
        """The start-up lines a vLLM user reads: weights, KV cache size, maximum concurrency; then a dtype cast, if
        any (vLLM logs that one first, while building its config; kvlab keeps the KV cache line second)."""
        return [f"Model loading took {format_gib(self.weights_bytes)} GiB memory and {self.load_seconds:.6f} seconds",
                *self.plan.startup_log(), *([self.engine_config.dtype_log] if self.engine_config.dtype_log else [])]

    # ----------------------------------------------------------------- requests

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (transformers' ``AutoTokenizer``), if it ships one; else None.

        Only the folder's own files are read and no code they name is run (``trust_remote_code=False``): a
        ``tokenizer_config.json`` whose ``auto_map`` asks for custom code is a ``CheckpointError``, never a
        "run the custom code? [y/N]" prompt, which would wait forever in a notebook kernel.
        """
        if self._tokenizer is None and any(
            (self.model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")
        ):
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=False,
                                                                local_files_only=True)
            except (ValueError, OSError, TypeError, KeyError) as error:
                raise CheckpointError(f"{self.model_dir}: its tokenizer files could not be loaded without running "
                                      f"code they name (trust_remote_code=False): {error}") from error
        return self._tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids: a string goes through the checkpoint's tokenizer; ids are checked as they are."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise KvlabValueError(f"prompt is a string, but {self.model_dir} has no tokenizer: pass token ids")
            return list(self.tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, Iterable) or isinstance(prompt, (bytes, dict)):
            raise KvlabValueError(f"a prompt must be a string or a sequence of token ids, got {prompt!r}")
        tokens = list(prompt)
        vocab = self.config.vocab_size
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
        if bad:
            raise KvlabValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:3]}")
        return [int(t) for t in tokens]

    def _make_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None,
                      cache_salt: str | None, kv_transfer_params: dict[str, Any] | None = None) -> GenerationRequest:
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in self.outputs:
            raise RequestStateError(f"request id {request_id!r} was used already")
        request = GenerationRequest(request_id, self.encode(prompt), params, eos_token_id=self.config.eos_token_id,
                                    cache_salt=cache_salt, kv_transfer_params=kv_transfer_params)
        self.scheduler.check_admissible(request)
        return request

    def add_request(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 16,
        request_id: str | None = None,
        *,
        n: int = 1,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        """Queue one prompt; return its request id. A request that could never fit is refused, changing nothing.

        ``cache_salt`` (vLLM's per-request ``cache_salt``) enters the hash of every block of the
        prompt, so only requests with the same salt share cached blocks: give each tenant its own.
        ``lora_name`` is refused: kvlab's engine has no LoRA adapters (see ``_refuse_lora``).
        ``kv_transfer_params``: what the engine's KV connector reads (vLLM takes them from the request body):
        ``{"do_remote_decode": True}`` on a prefill engine, the prefill's returned parameters on a decode
        engine (``engine.kv_transfer_params[request_id]`` once it finished; ``kvlab.fleet.disagg``).
        """
        _refuse_lora(lora_name)
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=temperature, seed=seed, ignore_eos=ignore_eos)
        request = self._make_request(prompt, params, request_id, cache_salt, kv_transfer_params)
        self._queue([request], n)
        return request.request_id

    def _queue(self, requests: Sequence[GenerationRequest], n: int) -> None:
        """Hand checked requests to the scheduler and start their clocks (and those of their n - 1 samples)."""
        ids = [i for r in requests for i in (r.request_id, *(child_request_id(r.request_id, k) for k in range(1, n)))]
        self.latency.arrived(ids, time.perf_counter())  # first: it refuses a clashing id before anything changes
        for request in requests:
            self.scheduler.add_request(request)
            self.outputs[request.request_id] = []

    def abort_request(self, request_ids: str | Iterable[str]) -> list[str]:
        """Abort requests, as vLLM's ``LLMEngine.abort_request``: free their blocks, finish them with "abort".

        A parent's id aborts its parallel samples too (``n > 1``), as vLLM's output processor does.
        Ids that are unknown or already finished are ignored, as in vLLM. An aborted request is not
        counted in ``vllm:request_success_total``: vLLM 0.33.0's ``OutputProcessor.abort_requests`` drops
        it before ``_update_stats_from_finished`` would count it, so the "abort" label stays 0.
        Returns the ids aborted, samples included.
        """
        if not isinstance(request_ids, str | Iterable) or isinstance(request_ids, bytes | dict):
            raise KvlabValueError(f"request_ids must be a request id string or a list of them, got {request_ids!r}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        bad = [i for i in ids if not isinstance(i, str)]
        if bad:
            raise KvlabValueError(f"request_ids must be request id strings, got {bad[:3]}")
        children = [r.request_id for r in self.scheduler.requests.values() if r.parent_id in ids]
        outputs = self.scheduler.finish_requests([*ids, *children], RequestStatus.FINISHED_ABORTED)
        self._record(outputs, time.perf_counter())
        return [o.request_id for o in outputs]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _publish_kv_events(self) -> None:
        """The step's KV cache events as one ``KVEventBatch``, if there are any (vLLM's ``update_from_output``)."""
        if self.kv_event_publisher is not None:
            events = self.kv_cache_manager.take_events()
            if events:
                from kvlab.distributed.kv_events import make_batch

                self.kv_event_publisher.publish(make_batch(events))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's ``LLMEngine.reset_prefix_cache``; False (nothing done) while a
        request holds blocks. The ``AllBlocksCleared`` event is published at once (vLLM's goes with the next step)."""
        done = self.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones whose blocks a KV connector still holds (to send them)."""
        return self.scheduler.has_requests()

    # ----------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        """Schedule, execute and update once; return what each request produced in this step.

        A request that failed in this step finished with finish reason "error" and freed its
        blocks; once the step is recorded, its error is raised (the first, if several) with a
        note naming the failed requests. The next call serves the others.
        """
        outputs = self._step()
        failed = [o for o in outputs if o.error is not None]
        if failed:
            raise _with_note(failed[0].error, [o.request_id for o in failed])
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One step, recorded; errors stay in the outputs (an interrupt of the executor is raised again).

        An exception outside the executor undoes the step (``kvlab.core.sched.loop.step``) and the
        sampler's draws with it, and is raised again with nothing recorded.
        """
        started = time.perf_counter()
        # the sampler's draws, to undo with the step (under TP they live in the ranks, which an undone step may
        # have advanced: a seeded request then draws on from there)
        draws = None if self.model_runner is None else self.model_runner.sampler.get_state()
        try:
            self.last_scheduler_output, outputs, stats = step(self.scheduler, self.executor)
        except BaseException:  # the step was undone (kvlab.core.sched.loop.step): so are its draws
            if self.model_runner is not None:
                self.model_runner.sampler.set_state(draws)
            raise
        now = time.perf_counter()
        self.step_seconds.append(now - started)
        self._record(outputs, now)
        self.history.append(stats)
        self._publish_kv_events()
        if self.kv_cache_metrics is not None:
            self.kv_cache_metrics.advance()
        self.metrics.record(stats, sum(len(o.new_token_ids) for o in outputs))
        for out in outputs:
            if out.error is not None and not isinstance(out.error, Exception):
                raise out.error  # Ctrl-C during the forward: the step's requests are finished, now stop
        return outputs

    def _record(self, outputs: Sequence[RequestOutput], now: float) -> None:
        """Fold requests' outputs into the engine's tokens, finish reasons, errors and metrics."""
        for out in outputs:
            self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason == "abort":
                self.latency.forget(out.request_id)  # as in vLLM: an abort observes no latency
            else:
                self.latency.tokens(out.request_id, bool(out.new_token_ids), out.finished, now)
            if out.finished:
                self.finish_reasons[out.request_id] = out.finish_reason
                if out.finish_reason != "abort":  # a client's abort is dropped before vLLM counts it
                    self.metrics.record_finished(out.finish_reason)
            if out.error is not None:
                self.errors[out.request_id] = out.error
            if out.kv_transfer_params is not None:
                self.kv_transfer_params[out.request_id] = out.kv_transfer_params

    def generate(
        self,
        prompts: Iterable[str | Sequence[int]],
        max_tokens: int = 16,
        n: int = 1,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        cache_salt: str | None = None,
        use_tqdm: bool | None = None,
    ) -> list[list[int]] | list[list[list[int]]]:
        """Generate for every prompt; return per prompt its token ids (for ``n > 1``, a list of ``n`` lists).

        ``prompts`` is any iterable of prompts (a list, a tuple, a generator), never one prompt
        bare. Greedy unless ``temperature > 0``; ``cache_salt`` salts every prompt of the call.
        All prompts are checked before any is queued, so a prompt that could never fit raises and
        nothing runs. A request that fails does not stop the others: they run to the end, then
        its error is raised (their tokens are in ``outputs``). A progress bar counts finished
        requests when the run is long (``use_tqdm=None``: prompts x n x max_tokens above 256).
        """
        prompts = _prompt_list(prompts)
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=temperature, seed=seed, ignore_eos=ignore_eos)
        requests = [self._make_request(p, params, None, cache_salt) for p in prompts]
        self._queue(requests, n)
        ids = [r.request_id for r in requests]
        wanted = list(itertools.chain.from_iterable((i, *(child_request_id(i, k) for k in range(1, n))) for i in ids))
        self._run_until_finished(wanted, use_tqdm if use_tqdm is not None else len(wanted) * max_tokens > 256)
        failed = [i for i in wanted if i in self.errors]
        if failed:
            raise _with_note(self.errors[failed[0]], failed)
        if n == 1:
            return [self.outputs[i] for i in ids]
        return [[self.outputs[i], *(self.outputs[child_request_id(i, k)] for k in range(1, n))] for i in ids]

    def _run_until_finished(self, wanted: Sequence[str], use_tqdm: bool) -> None:
        """Step until every request in ``wanted`` finished, with an optional progress bar."""
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(wanted), desc="Processed prompts", unit="req")
        try:
            while set(wanted) - self.finish_reasons.keys():
                if not self.has_unfinished_requests():
                    raise RequestStateError("the engine stopped with requests of this call unfinished")
                finished = [o for o in self._step() if o.finished and o.request_id in wanted]
                if bar is not None:
                    bar.update(len(finished))
        finally:
            if bar is not None:
                bar.close()

    # ----------------------------------------------------------------- observing

    @property
    def num_computed_tokens(self) -> int:
        """Tokens the model has computed since start (prefill chunks and decode steps; hits excluded)."""
        return sum(h.num_scheduled_tokens for h in self.history)

    def metrics_text(self) -> str:
        """The metrics in Prometheus' text format, labelled as vLLM labels them: gauges and counters, the
        latency histograms (seconds on this machine's clock), and block lifetimes if recorded."""
        labels = {"model_name": self.model_dir.name, "engine": "0"}
        text = prometheus_text(self.metrics, labels) + self.latency.prometheus_text(labels)
        return text if self.kv_cache_metrics is None else text + self.kv_cache_metrics.metrics_text()

    def history_frame(self) -> Any:
        """The per-step history as a pandas DataFrame (one row per step, seconds included)."""
        import pandas as pd

        rows = []
        for stats, seconds in zip(self.history, self.step_seconds, strict=True):
            rows.append({
                "step": stats.step, "running": stats.num_running_reqs, "waiting": stats.num_waiting_reqs,
                "kv_cache_usage": stats.kv_cache_usage, "preempted": stats.num_preempted_reqs,
                "scheduled_tokens": stats.num_scheduled_tokens, "prefill_tokens": stats.num_prefill_tokens,
                "decode_tokens": stats.num_decode_tokens, "block_copies": stats.num_block_copies,
                "prefix_queries": stats.prefix_cache_stats.queries, "prefix_hits": stats.prefix_cache_stats.hits,
                "resumed_hits": stats.prefix_cache_stats.preempted_hits, "seconds": seconds,
            })
        return pd.DataFrame(rows).set_index("step") if rows else pd.DataFrame()


def _event_publisher(config: EngineConfig) -> Any:
    """The publisher ``kv_events_config`` asks for (vLLM's ``EventPublisherFactory.create``: ZMQ, or a null one
    that drops each batch), or None when events are off. Imported here, so an engine without events loads no ZMQ."""
    if not config.enable_kv_cache_events:
        return None
    from kvlab.distributed.kv_events import EventPublisherFactory

    return EventPublisherFactory.create(config.kv_events_config)


def _refuse_lora(lora_name: str | None) -> None:
    """kvlab's engine serves the base weights only, so a LoRA adapter is refused rather than silently ignored.

    Accepting the name would key the prefix cache apart, as an adapter's name does in vLLM's
    block hash, while every token still came from the base model: a teacher asking for an
    adapter would see the base model's answer. ``kvlab.core``'s ``KVCacheManager`` takes
    ``lora_name`` (notebook 04) to show how an adapter keeps its cache apart; tenants of one engine
    keep theirs apart with ``cache_salt``.
    """
    if lora_name is not None:
        raise KvlabValueError(
            f"lora_name={lora_name!r}: kvlab's engine has no LoRA adapters, so the request would run the base "
            "model while only its prefix cache was kept apart. Leave lora_name=None; use cache_salt= to keep "
            "tenants' caches apart"
        )


def _prompt_list(prompts: Iterable[str | Sequence[int]]) -> list[str | Sequence[int]]:
    """Any iterable of prompts as a list; a single prompt passed bare (a string, a list of ids) is refused."""
    if isinstance(prompts, str) or not isinstance(prompts, Iterable):
        raise KvlabValueError(f"prompts must be a list of prompts (strings or lists of token ids), got {prompts!r}")
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], numbers.Integral):
        raise KvlabValueError("prompts must be a list of prompts (strings or lists of token ids), not one prompt: "
                              "wrap it, generate([prompt])")
    return prompts


def _with_note(error: BaseException, request_ids: Sequence[str]) -> BaseException:
    """``error``, with a note (once) saying which requests it finished and that the engine goes on."""
    note = (f"kvlab: request(s) {list(request_ids)} finished with finish_reason 'error' (FINISHED_ERROR) and freed "
            "their blocks; the engine keeps serving the others")
    if note not in getattr(error, "__notes__", []):
        error.add_note(note)
    return error
