"""``LLMEngine``: a checkpoint, a paged KV cache, the scheduler and the model runner in one serving loop.

Start-up follows vLLM: load the weights, size the KV pool (a block count, or a memory
budget cut into blocks by ``kvlab.capacity.budget``), allocate one K and one V tensor
``[num_blocks, block_size, num_kv_heads, head_size]`` per layer, and print the start-up
lines. Each ``step()`` is vLLM's ``EngineCore.step``: the scheduler picks tokens, the runner
computes them through ``kvlab.kernels``, the scheduler appends the samples and frees
finished requests. ``metrics_text()`` is what a Prometheus scrape of ``/metrics`` would see;
``history`` keeps one ``SchedulerStats`` per step for plots.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvlab import kernels
from kvlab._validate import non_negative_int, one_of, positive_int
from kvlab.capacity.budget import KVCachePlan, plan_kv_cache
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector
from kvlab.core.kv_offload import CPUOffloadingManager, OffloadingConnector
from kvlab.core.sched.output import (
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    SchedulerStats,
    child_request_id,
)
from kvlab.core.sched.scheduler import DEFAULT_MAX_NUM_SEQS, Scheduler, check_request_fits, step
from kvlab.engine.kv_offload import OffloadingExecutor, allocate_cpu_kv_caches
from kvlab.engine.loader import load_model
from kvlab.engine.metrics import EngineMetrics, LatencyMetrics, prometheus_text
from kvlab.engine.model_runner import ModelRunner
from kvlab.errors import KvlabValueError, RequestStateError
from kvlab.units import GiB, cdiv

#: kv_cache_dtype -> (torch dtype of the cache tensors or None for the model's, kvlab.capacity.sizing name or None).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn,
                                                   "fp8_e4m3": torch.float8_e4m3fn}
_SIZING_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.float8_e4m3fn: "fp8_e4m3"}
#: kvlab's default token budget: small, because every token costs a lot on a CPU.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
#: The most memory a default-sized pool takes (a real checkpoint would otherwise ask for many GiB).
DEFAULT_KV_CACHE_MEMORY_GIB = 1


def _device_memory_gib(device: torch.device) -> float:
    """The memory the start-up plan divides: the GPU's, or on a CPU engine this machine's RAM in its place."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GiB
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16.0


def engine_device(device: str | torch.device | None = None) -> torch.device:
    """The device an engine runs on: ``device``, or by default where the kernels run (``kernels.default_device()``).

    Checked before anything is loaded: native Triton kernels need CUDA tensors, so on the
    ``triton-cuda`` backend a CPU engine is refused, and ``cuda`` needs a device torch can see.
    """
    try:
        chosen = torch.device(kernels.default_device() if device is None else device)
    except (RuntimeError, TypeError) as error:
        raise KvlabValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from error
    if chosen.type not in ("cpu", "cuda"):
        raise KvlabValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise KvlabValueError(f"device={device!r} needs a CUDA device, and torch sees none here: use 'cpu'")
    kernels.check_kernel_device(kernels.backend(), chosen)
    return chosen


class LLMEngine:
    """Serve a Llama-family checkpoint through kvlab's paged KV cache, scheduler and Triton kernels.

    The pool holds ``num_gpu_blocks`` blocks (vLLM's ``num_gpu_blocks_override``), or as many
    as ``kv_cache_memory_gib`` buys (vLLM's ``kv_cache_memory_bytes``), or by default enough
    for ``max_num_seqs`` requests of ``max_model_len`` tokens, capped at 1 GiB (vLLM would
    profile the GPU instead; kvlab does not profile). Block 0 is the null block, as in vLLM.
    ``kv_cache_dtype="fp8"`` stores K and V as float8 e4m3 with scale 1.0 (vLLM's default)
    and the kernels dequantize on load. The model and the cache live on ``device``: by default
    the GPU where the kernels run natively, else the CPU (``kernels.default_device()``); a CPU
    engine plans with this machine's RAM in place of GPU memory.

    ``cpu_offload_blocks`` adds a CPU tier of that many blocks under the pool (``kvlab.core.kv_offload``;
    vLLM sizes its tier in GiB with ``kv_offloading_size``): blocks the pool evicts are copied
    there and copied back on a prefix hit. ``preemption_mode="swap"`` resumes preempted requests
    from that tier instead of recomputing them. ``kv_cache_metrics`` records vLLM's block lifetime
    histograms (sampling ``kv_cache_metrics_sample`` of the blocks) and adds them to ``metrics_text()``.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        num_gpu_blocks: int | None = None,
        kv_cache_memory_gib: float | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        keep_logits: bool = False,
        cpu_offload_blocks: int = 0,
        preemption_mode: str = "recompute",
        kv_cache_metrics: bool = False,
        kv_cache_metrics_sample: float = 1.0,
        device: str | torch.device | None = None,
    ) -> None:
        one_of("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
        self.device = engine_device(device)
        block_size = positive_int("block_size", block_size)
        if num_gpu_blocks is not None and kv_cache_memory_gib is not None:
            raise KvlabValueError("give num_gpu_blocks or kv_cache_memory_gib, not both")
        self.model_dir = Path(model_dir)
        started = time.perf_counter()
        self.model = load_model(model_dir).to(self.device)
        self.load_seconds = time.perf_counter() - started
        self.config = self.model.config
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or next(self.model.parameters()).dtype
        self.max_model_len = positive_int(
            "max_model_len", max_model_len or self.config.max_position_embeddings or 2048
        )
        self.block_size = block_size
        per_block = kv_bytes_per_token(self.config.spec, _SIZING_NAMES[self.cache_dtype]) * block_size
        if num_gpu_blocks is None and kv_cache_memory_gib is None:
            wanted = 1 + positive_int("max_num_seqs", max_num_seqs) * cdiv(self.max_model_len, block_size)
            num_gpu_blocks = max(2, min(wanted, int(DEFAULT_KV_CACHE_MEMORY_GIB * GiB) // per_block))
        if num_gpu_blocks is not None:
            kv_cache_memory_gib = positive_int("num_gpu_blocks", num_gpu_blocks) * per_block / GiB  # exact: GiB = 2**30
        self.plan: KVCachePlan = plan_kv_cache(
            self.config.spec, gpu_memory_gib=_device_memory_gib(self.device), weights_gib=self.weights_bytes / GiB,
            kv_cache_memory_gib=kv_cache_memory_gib, kv_dtype=_SIZING_NAMES[self.cache_dtype],
            block_size=block_size, max_model_len=self.max_model_len,
        )
        if self.plan.num_blocks < 2:
            raise KvlabValueError(
                f"the KV pool would hold {self.plan.num_blocks} block(s) of {per_block} bytes; it needs at least 2 "
                "(block 0 is the null block): raise num_gpu_blocks or kv_cache_memory_gib"
            )
        self.num_gpu_blocks = self.plan.num_blocks
        shape = (self.num_gpu_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.cache_dtype, device=self.device),
             torch.zeros(shape, dtype=self.cache_dtype, device=self.device))
            for _ in range(self.config.num_hidden_layers)
        ]  # per layer: K and V, each [num_blocks, block_size, num_kv_heads, head_size]
        self.kv_cache_manager = KVCacheManager(self.num_gpu_blocks, block_size, enable_caching=enable_prefix_caching)
        # vLLM's --kv-cache-metrics: block lifetimes, idle time before eviction, reuse gaps (core.kv_cache_metrics).
        self.kv_cache_metrics = KVCacheMetricsCollector(kv_cache_metrics_sample) if kv_cache_metrics else None
        self.kv_cache_manager.block_pool.metrics_collector = self.kv_cache_metrics
        # kvlab.core.kv_offload: an optional CPU tier of cpu_offload_blocks blocks (vLLM's kv_offloading_size).
        self.cpu_offload_blocks = non_negative_int("cpu_offload_blocks", cpu_offload_blocks)
        one_of("preemption_mode", preemption_mode, ("recompute", "swap"))
        if preemption_mode == "swap" and not cpu_offload_blocks:
            raise KvlabValueError("preemption_mode='swap' needs a CPU tier to swap to: set cpu_offload_blocks")
        self.bytes_per_block = per_block
        self.cpu_kv_caches = allocate_cpu_kv_caches(self.kv_caches, cpu_offload_blocks) if cpu_offload_blocks else []
        self.connector = (OffloadingConnector(self.kv_cache_manager, CPUOffloadingManager(cpu_offload_blocks))
                          if cpu_offload_blocks else None)
        self.scheduler = Scheduler(self.kv_cache_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                   connector=self.connector, preemption_mode=preemption_mode)
        self.model_runner = ModelRunner(self.model, self.kv_caches, block_size, keep_logits=keep_logits)
        self.executor = (self.model_runner if self.connector is None else
                         OffloadingExecutor(self.model_runner, self.kv_caches, self.cpu_kv_caches, self.connector))
        self.metrics = EngineMetrics()
        self.latency = LatencyMetrics()  # vLLM's time-to-first-token, per-token and end-to-end histograms
        self.history: list[SchedulerStats] = []
        self.step_seconds: list[float] = []
        self.outputs: dict[str, list[int]] = {}  # request id -> generated tokens (children included)
        self.finish_reasons: dict[str, str | None] = {}
        self.last_scheduler_output: SchedulerOutput | None = None  # what the latest step computed
        self._request_ids = itertools.count()
        self._tokenizer: Any = None

    # ----------------------------------------------------------------- what start-up prints

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of all K and V tensors (what ``kv_cache_dtype`` halves or quarters)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_caches)

    def startup_log(self) -> list[str]:
        """The start-up lines a vLLM user reads: weights, KV cache size, maximum concurrency."""
        return [f"Model loading took {self.weights_bytes / GiB:.4f} GiB memory and {self.load_seconds:.6f} seconds",
                *self.plan.startup_log()]

    # ----------------------------------------------------------------- requests

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (transformers' ``AutoTokenizer``), if it ships one; else None."""
        if self._tokenizer is None and any(
            (self.model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")
        ):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids: a string goes through the checkpoint's tokenizer; ids are checked as they are."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise KvlabValueError(f"prompt is a string, but {self.model_dir} has no tokenizer: pass token ids")
            return list(self.tokenizer(prompt)["input_ids"])
        tokens = list(prompt)
        vocab = self.config.vocab_size
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise KvlabValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:3]}")
        return tokens

    def _make_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None
                      ) -> GenerationRequest:
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in self.outputs:
            raise RequestStateError(f"request id {request_id!r} was used already")
        request = GenerationRequest(request_id, self.encode(prompt), params, eos_token_id=self.config.eos_token_id)
        check_request_fits(request, self.max_model_len, self.scheduler.num_usable_blocks, self.block_size)
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
    ) -> str:
        """Queue one prompt; return its request id. A request that could never fit is refused, changing nothing."""
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=temperature, seed=seed, ignore_eos=ignore_eos)
        request = self._make_request(prompt, params, request_id)
        self._queue([request], n)
        return request.request_id

    def _queue(self, requests: Sequence[GenerationRequest], n: int) -> None:
        """Hand checked requests to the scheduler and start their clocks (and those of their n - 1 samples)."""
        ids = [i for r in requests for i in (r.request_id, *(child_request_id(r.request_id, k) for k in range(1, n)))]
        self.latency.arrived(ids, time.perf_counter())  # first: it refuses a clashing id before anything changes
        for request in requests:
            self.scheduler.add_request(request)
            self.outputs[request.request_id] = []

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ----------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        """Schedule, execute and update once; return what each request produced in this step."""
        started = time.perf_counter()
        self.last_scheduler_output, outputs, stats = step(self.scheduler, self.executor)
        now = time.perf_counter()
        self.step_seconds.append(now - started)
        for out in outputs:
            self.latency.tokens(out.request_id, bool(out.new_token_ids), out.finished, now)
            self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.finish_reasons[out.request_id] = out.finish_reason
        self.history.append(stats)
        if self.kv_cache_metrics is not None:
            self.kv_cache_metrics.advance()
        self.metrics.record(stats, sum(len(o.new_token_ids) for o in outputs))
        return outputs

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int = 16,
        n: int = 1,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        use_tqdm: bool | None = None,
    ) -> list[list[int]] | list[list[list[int]]]:
        """Generate for every prompt; return per prompt its token ids (for ``n > 1``, a list of ``n`` lists).

        Greedy unless ``temperature > 0``. All prompts are checked before any is queued, so a
        prompt that could never fit raises and nothing runs. A progress bar counts finished
        requests when the run is long (``use_tqdm=None``: prompts x n x max_tokens above 256).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise KvlabValueError("prompts must be a list of prompts (strings or lists of token ids), not one prompt")
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=temperature, seed=seed, ignore_eos=ignore_eos)
        requests = [self._make_request(p, params, None) for p in prompts]
        self._queue(requests, n)
        ids = [r.request_id for r in requests]
        wanted = set(ids) | {child_request_id(i, k) for i in ids for k in range(1, n)}
        if use_tqdm is None:
            use_tqdm = len(requests) * n * max_tokens > 256
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(wanted), desc="Processed prompts", unit="req")
        try:
            while wanted - self.finish_reasons.keys():
                if not self.has_unfinished_requests():
                    raise RequestStateError("the engine stopped with requests of this call unfinished")
                finished = [o for o in self.step() if o.finished and o.request_id in wanted]
                if bar is not None:
                    bar.update(len(finished))
        finally:
            if bar is not None:
                bar.close()
        if n == 1:
            return [self.outputs[i] for i in ids]
        return [[self.outputs[i], *(self.outputs[child_request_id(i, k)] for k in range(1, n))] for i in ids]

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
