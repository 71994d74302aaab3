"""``EngineConfig``: every knob of an ``LLMEngine``, checked once, before a single weight is read.

vLLM 0.33.0 turns ``EngineArgs`` into one ``VllmConfig`` made of ``ModelConfig``, ``CacheConfig``,
``SchedulerConfig`` and more (``vllm/config/``), each validated when it is built. kvlab keeps one
flat dataclass whose fields are ``LLMEngine``'s keywords (the comment beside each names the vLLM
field it plays), and builds from it the two configs the layers below check themselves: the
checkpoint's config (its ``config.json``, read by its family: ``DecoderConfig`` or ``DeepseekConfig``,
``kvlab.engine.registry``) and the scheduler's ``SchedulerConfig``.
``max_model_len`` is checked against the checkpoint as vLLM's ``_get_and_verify_max_len``
(``vllm/config/model.py``) checks it.

``attention_backend`` plays vLLM's ``--attention-backend`` (``EngineArgs.attention_backend`` ->
``AttentionConfig.backend``, names from ``AttentionBackendEnum`` in
``vllm/v1/attention/backends/registry.py``; 0.33.0 has no ``VLLM_ATTENTION_BACKEND`` variable any
more). Left unset, vLLM's platform picks by hardware (``get_attn_backend`` in
``vllm/v1/attention/selector.py`` asks the platform): ``TRITON_ATTN`` among the GPU choices, and on
a CPU always ``CPU_ATTN``, ignoring any other request. kvlab mirrors the choice with two names:
``"triton"`` (kvlab's Triton kernels, ``TRITON_ATTN``'s role) by default where they compile
natively, ``"torch"`` (gather + SDPA, in ``CPU_ATTN``'s role but not its C++ kernel) by default on
a CPU; unlike vLLM, kvlab lets a CPU engine ask for ``"triton"``, which runs through the interpreter.

``kv_events_config`` plays vLLM's ``--kv-events-config`` (``KVEventsConfig``, ``vllm/config/kv_events.py``):
with ``enable_kv_cache_events`` the pool queues its KV cache events and ``LLMEngine`` publishes them.

``dtype`` plays vLLM's ``--dtype`` (``ModelConfig.dtype``), resolved as ``kvlab.engine.dtype`` says:
``"auto"`` is the checkpoint's dtype where the device computes it, except that a float32 checkpoint
stays float32 (vLLM downcasts it to bf16) and Triton's interpreter computes in float32 only.

``tensor_parallel_size`` (vLLM's ``ParallelConfig``) splits the model over that many ranks, each a process
(``kvlab.engine.worker``); ``distributed_executor_backend`` says who starts them: ``"uni"`` (one rank, this
process), ``"mp"`` (the engine spawns them, the default past one rank) or ``"external_launcher"`` (torchrun
did, and this process is rank 0). A model whose heads do not split evenly is refused as vLLM's
``ModelConfig.verify_with_parallel_config`` and ``QKVParallelLinear`` refuse it, naming both numbers.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from kvlab import kernels
from kvlab._validate import fraction_in_unit_interval, non_negative_int, one_of, positive_int, positive_number
from kvlab.core.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, SchedulerConfig
from kvlab.engine.config import GEMMA3_MODEL_TYPES
from kvlab.engine.deepseek_config import DeepseekConfig
from kvlab.engine.dtype import checkpoint_dtype, resolve_dtype
from kvlab.engine.kv_events_config import KVEventsConfig
from kvlab.engine.kv_transfer_config import KVTransferConfig
from kvlab.engine.linear import qkv_partition
from kvlab.engine.registry import ModelConfig, read_model_config
from kvlab.engine.vocab_parallel_embedding import pad_vocab_size
from kvlab.errors import KvlabValueError, UnknownNameError

#: kv_cache_dtype -> torch dtype of the cache tensors (None: the model's own dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn,
                                                   "fp8_e4m3": torch.float8_e4m3fn}
#: The longest sequence when ``config.json`` names none (vLLM's fallback too).
DEFAULT_MAX_MODEL_LEN = 2048
#: Rotary variants whose ``max_position_embeddings`` already counts the scaling, so vLLM does not
#: multiply it by ``factor`` (``_get_and_verify_max_len``); for any other type it does.
#: attention_backend names (``kvlab.engine.attention.BACKEND_KERNELS`` says which kernels each calls).
ATTENTION_BACKENDS = ("triton", "torch")
PRESCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
#: distributed_executor_backend names (vLLM's, less Ray): one process, spawned ranks, ranks torchrun started.
EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher")
#: The most ranks a CPU engine spawns (each is a process with its own torch, a few hundred MB); on GPUs, one per GPU.
MAX_CPU_TENSOR_PARALLEL_SIZE = 8


def engine_device(device: str | torch.device | None = None) -> torch.device:
    """The device an engine runs on: ``device``, or by default where the kernels run (``kernels.default_device()``).

    Checked before anything is loaded: native Triton kernels need CUDA tensors, so on the
    ``triton-cuda`` backend a CPU engine is refused, and ``cuda`` needs a device torch can see.
    """
    try:
        chosen = torch.device(kernels.default_device() if device is None else device)
    except (RuntimeError, TypeError, ValueError, UnicodeError) as error:
        raise KvlabValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from error
    if chosen.type not in ("cpu", "cuda"):
        raise KvlabValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise KvlabValueError(f"device={device!r} needs a CUDA device, and torch sees none here: use 'cpu'")
    kernels.check_kernel_device(kernels.backend(), chosen)
    return chosen


def default_attention_backend() -> str:
    """``"triton"`` where kvlab's Triton kernels compile natively (``triton-cuda``), else ``"torch"``."""
    return "triton" if kernels.backend() == kernels.TRITON_CUDA else "torch"


def derived_max_model_len(model_config: ModelConfig) -> int | None:
    """The longest sequence the checkpoint supports: ``max_position_embeddings``, times the rotary scaling
    ``factor`` where vLLM applies it (not for ``PRESCALED_ROPE_TYPES``); None if the config names no length."""
    if model_config.max_position_embeddings is None:
        return None
    rope = model_config.rope
    factor = 1.0 if rope.rope_type in PRESCALED_ROPE_TYPES else rope.factor
    return int(model_config.max_position_embeddings * factor)


def verify_max_model_len(max_model_len: int | None, model_config: ModelConfig) -> int:
    """``max_model_len``, by default the checkpoint's own length; one past what the checkpoint supports is refused.

    Positions past the trained range give rotary angles the model never saw, so its output would
    be noise. vLLM refuses the same length unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``; kvlab has no override.
    """
    derived = derived_max_model_len(model_config)
    if max_model_len is None:
        return derived or DEFAULT_MAX_MODEL_LEN
    max_model_len = positive_int("max_model_len", max_model_len)
    if derived is not None and max_model_len > derived:
        rope = model_config.rope
        raise KvlabValueError(
            f"max_model_len={max_model_len} is longer than the checkpoint supports: config.json has "
            f"max_position_embeddings={model_config.max_position_embeddings} and rope_type={rope.rope_type!r}"
            f"{'' if rope.rope_type == 'default' else f' (factor {rope.factor})'}, so at most {derived} tokens. "
            "Lower max_model_len, or use a checkpoint whose rope scaling extends its context"
        )
    return max_model_len


def _verify_tensor_parallel(model_config: ModelConfig, tp: int) -> None:
    """Refuse a model whose heads, MLP or vocabulary do not split over ``tp`` ranks as vLLM splits them.

    The error names the config field and ``tensor_parallel_size`` (``qkv_partition`` for the heads).
    """
    if tp == 1:
        return
    if model_config.model_type in GEMMA3_MODEL_TYPES:
        raise KvlabValueError(f"tensor_parallel_size={tp}: kvlab's Gemma 3 decoder ({model_config.model_type}) runs "
                              "on one rank (vLLM shards it; kvlab shards the Llama family and DeepSeek-V3). Use "
                              "tensor_parallel_size=1")
    if isinstance(model_config, DeepseekConfig):
        heads = model_config.mla.num_heads
        if heads % tp:
            raise KvlabValueError(f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp}: every "
                                  "rank must hold the same number of MLA heads (the latent itself is never split)")
        sizes = {"intermediate_size": model_config.intermediate_size,
                 "moe_intermediate_size": model_config.moe_intermediate_size,
                 "moe_intermediate_size x n_shared_experts":
                     model_config.moe_intermediate_size * model_config.n_shared_experts}
    else:
        qkv_partition(model_config.num_attention_heads, model_config.num_key_value_heads, tp)
        sizes = {"intermediate_size": model_config.intermediate_size}
    sizes[f"vocab_size padded to 64 ({model_config.vocab_size} -> {pad_vocab_size(model_config.vocab_size)})"] = \
        pad_vocab_size(model_config.vocab_size)
    for field, size in sizes.items():
        if size % tp:
            raise KvlabValueError(f"{field}={size} is not divisible by tensor_parallel_size={tp}: each rank holds "
                                  "an equal slice of it")


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise KvlabValueError(f"{name} must be True or False, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What an ``LLMEngine`` is built from, validated when it is created (``EngineConfig.create``).

    Give ``num_gpu_blocks`` or ``kv_cache_memory_gib``, not both; with neither the pool holds
    ``max_num_seqs`` requests of ``max_model_len`` tokens, capped by memory (``LLMEngine``).
    After validation ``device`` is a ``torch.device``, ``max_model_len`` an int, ``attention_backend`` a name,
    ``dtype`` a ``torch.dtype`` (``dtype_log``: vLLM's line for a cast, or None), and ``model_config`` /
    ``scheduler_config`` hold the checkpoint's and the scheduler's configs.
    """

    model_dir: Path                                 # ModelConfig.model
    num_gpu_blocks: int | None = None               # CacheConfig.num_gpu_blocks_override
    kv_cache_memory_gib: float | None = None        # CacheConfig.kv_cache_memory_bytes, in GiB
    block_size: int = 16                            # CacheConfig.block_size
    enable_prefix_caching: bool = True              # CacheConfig.enable_prefix_caching
    kv_cache_dtype: str = "auto"                    # CacheConfig.cache_dtype
    max_model_len: int | None = None                # ModelConfig.max_model_len
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS        # SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # SchedulerConfig.max_num_batched_tokens
    preemption_mode: str = "recompute"              # kvlab: "swap" is what V1 dropped
    cpu_offload_blocks: int = 0                     # the CPU tier; vLLM sizes it in GiB (kv_offloading_size)
    kv_transfer_config: KVTransferConfig | None = None  # VllmConfig.kv_transfer_config: a KV connector, its role
    kv_cache_metrics: bool = False                  # ObservabilityConfig.kv_cache_metrics
    kv_cache_metrics_sample: float = 1.0            # ObservabilityConfig.kv_cache_metrics_sample
    keep_logits: bool = False                       # kvlab: keep each sampled row of logits
    disable_hybrid_kv_cache_manager: bool = False   # SchedulerConfig.disable_hybrid_kv_cache_manager
    device: Any = None                              # DeviceConfig.device: "cpu", "cuda", or where the kernels run
    attention_backend: str | None = None            # AttentionConfig.backend: "triton", "torch", None: by hardware
    dtype: Any = "auto"                             # ModelConfig.dtype: "auto", "float32", "bfloat16", "float16"
    kv_events_config: KVEventsConfig | dict[str, Any] | None = None  # VllmConfig.kv_events_config
    tensor_parallel_size: int = 1                   # ParallelConfig.tensor_parallel_size
    distributed_executor_backend: str | None = None  # ParallelConfig.distributed_executor_backend: None: by tp
    distributed_timeout_seconds: float = 60.0       # ParallelConfig.distributed_timeout_seconds (vLLM: torch's)
    dtype_log: str | None = dataclasses.field(init=False, repr=False)
    model_config: ModelConfig = dataclasses.field(init=False, repr=False)
    scheduler_config: SchedulerConfig = dataclasses.field(init=False, repr=False)

    @classmethod
    def create(cls, model_dir: str | os.PathLike, **engine_args: Any) -> EngineConfig:
        """``EngineConfig(model_dir, **engine_args)``, refusing an unknown keyword by name."""
        known = [f.name for f in dataclasses.fields(cls) if f.init and f.name != "model_dir"]
        for name in engine_args:
            if name not in known:
                raise UnknownNameError("LLMEngine keyword", name, known)
        return cls(model_dir, **engine_args)

    def __post_init__(self) -> None:
        self._check_arguments()
        set_ = object.__setattr__  # frozen: the checks store what they resolved, as vLLM's configs do
        set_(self, "device", engine_device(self.device))
        set_(self, "model_config", read_model_config(self.model_dir))
        # MLA layers call kvlab's Triton kernels whatever attention_backend says (it names the K/V kernels only)
        triton = self.attention_backend == "triton" or isinstance(self.model_config, DeepseekConfig)
        interpreter = triton and kernels.backend() == kernels.TRITON_INTERPRETER
        dtype, line = resolve_dtype(self.dtype, checkpoint_dtype(self.model_dir), self.device, interpreter,
                                    self.model_config.model_type)
        set_(self, "dtype", dtype)
        set_(self, "dtype_log", line)
        set_(self, "max_model_len", verify_max_model_len(self.max_model_len, self.model_config))
        set_(self, "scheduler_config", SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens,
                                                       self.max_model_len, self.preemption_mode))
        self._resolve_offloading_connector()
        if self.scheduler_config.needs_cpu_tier and not self.cpu_offload_blocks:
            raise KvlabValueError("preemption_mode='swap' needs a CPU tier to swap to: set cpu_offload_blocks")
        _verify_tensor_parallel(self.model_config, self.tensor_parallel_size)
        if self.tensor_parallel_size > 1:
            if self.device.type == "cuda" and torch.cuda.device_count() < self.tensor_parallel_size:
                raise KvlabValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs as many GPUs; torch "
                                      f"sees {torch.cuda.device_count()}")
            if self.cpu_offload_blocks:
                raise KvlabValueError("cpu_offload_blocks: kvlab's CPU tier lives in one process; with "
                                      "tensor_parallel_size > 1 each rank holds its own cache. Use one of them")
            if self.keep_logits:
                raise KvlabValueError("keep_logits: with tensor_parallel_size > 1 the logits stay in the ranks' "
                                      "processes; keep them on a one-rank engine")
            self._verify_connector_tensor_parallel()
        if self.cpu_offload_blocks and self.hybrid_kv_cache:
            raise KvlabValueError("cpu_offload_blocks: kvlab's CPU tier copies one block table per request, and this "
                                  "model's sliding-window layers get KV cache groups of their own; set "
                                  "disable_hybrid_kv_cache_manager=True to offload it")

    def _verify_connector_tensor_parallel(self) -> None:
        """Which KV connector runs on several ranks: ``P2pGlooConnector`` on a producer (each rank a worker half
        over its own heads; a one-rank consumer re-slices them on arrival). The others are refused by name."""
        kvt = self.kv_transfer_config
        if kvt is None or kvt.kv_connector is None:
            return
        tp = self.tensor_parallel_size
        if kvt.kv_connector != "P2pGlooConnector":
            raise KvlabValueError(f"kv_transfer_config names {kvt.kv_connector!r} with tensor_parallel_size={tp}: "
                                  "vLLM's ExampleConnector names one file per layer, not per rank (every rank would "
                                  "write the same file), and kvlab's CPU tier lives in one process. Use "
                                  "'P2pGlooConnector' on a producer, or tensor_parallel_size=1")
        if kvt.kv_role != "kv_producer":
            raise KvlabValueError(f"kv_role={kvt.kv_role!r} with tensor_parallel_size={tp}: kvlab's P2pGlooConnector "
                                  "pulls in one process, so a consumer runs on one rank (it takes the heads of a "
                                  "producer of any tensor_parallel_size). Use kv_role='kv_producer' on this engine, "
                                  "or tensor_parallel_size=1")

    def _resolve_offloading_connector(self) -> None:
        """The CPU tier is a KV connector: ``kv_connector="OffloadingConnector"`` (with ``num_cpu_blocks`` in its
        extra config) is the same engine as ``cpu_offload_blocks``; kvlab runs one connector at a time."""
        kvt = self.kv_transfer_config
        if kvt is None:
            return
        if not isinstance(kvt, KVTransferConfig):
            raise KvlabValueError(f"kv_transfer_config must be a KVTransferConfig or None, got {kvt!r}")
        if kvt.kv_connector == "OffloadingConnector":
            blocks = kvt.get_from_extra_config("num_cpu_blocks", None)
            positive_int("kv_connector_extra_config['num_cpu_blocks']", blocks)
            if self.cpu_offload_blocks not in (0, blocks):
                raise KvlabValueError(f"cpu_offload_blocks={self.cpu_offload_blocks} and the OffloadingConnector's "
                                      f"num_cpu_blocks={blocks} disagree: give one of them")
            object.__setattr__(self, "cpu_offload_blocks", blocks)
        elif kvt.kv_connector is not None and self.cpu_offload_blocks:
            raise KvlabValueError(f"cpu_offload_blocks: kvlab runs one KV connector per engine (vLLM's MultiConnector "
                                  f"is not kept), and kv_transfer_config names {kvt.kv_connector!r}")

    @property
    def hybrid_kv_cache(self) -> bool:
        """Whether the model's sliding-window layers get KV cache groups of their own (vLLM's default)."""
        return bool(self.model_config.spec.num_sliding_layers) and not self.disable_hybrid_kv_cache_manager

    def _check_arguments(self) -> None:
        """The checks that need no file: types, ranges, and arguments that exclude each other."""
        if not isinstance(self.model_dir, (str, os.PathLike)):
            raise KvlabValueError(f"model_dir must be a path to a checkpoint folder, got {self.model_dir!r}")
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        object.__setattr__(self, "attention_backend", default_attention_backend() if self.attention_backend is None
                           else one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS))
        one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        positive_int("block_size", self.block_size)
        if self.num_gpu_blocks is not None and self.kv_cache_memory_gib is not None:
            raise KvlabValueError("give num_gpu_blocks or kv_cache_memory_gib, not both")
        if self.num_gpu_blocks is not None:
            positive_int("num_gpu_blocks", self.num_gpu_blocks)
        if self.kv_cache_memory_gib is not None:
            positive_number("kv_cache_memory_gib", self.kv_cache_memory_gib)
        non_negative_int("cpu_offload_blocks", self.cpu_offload_blocks)
        tp = positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if tp > MAX_CPU_TENSOR_PARALLEL_SIZE and not torch.cuda.is_available():
            raise KvlabValueError(f"tensor_parallel_size={tp}: a CPU engine starts at most "
                                  f"{MAX_CPU_TENSOR_PARALLEL_SIZE} ranks (each is a process with its own torch)")
        backend = self.distributed_executor_backend
        if backend is None:
            backend = "mp" if tp > 1 else "uni"
        one_of("distributed_executor_backend", backend, EXECUTOR_BACKENDS)
        if backend == "uni" and tp > 1:
            raise KvlabValueError(f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size={tp} needs "
                                  "'mp' (the engine starts the ranks) or 'external_launcher' (torchrun did)")
        object.__setattr__(self, "distributed_executor_backend", backend)
        positive_number("distributed_timeout_seconds", self.distributed_timeout_seconds)
        if self.distributed_timeout_seconds > 24 * 3600:
            raise KvlabValueError(f"distributed_timeout_seconds={self.distributed_timeout_seconds}: at most a day "
                                  "(a collective that waits longer has a dead peer)")
        fraction_in_unit_interval("kv_cache_metrics_sample", self.kv_cache_metrics_sample)
        for name in ("enable_prefix_caching", "kv_cache_metrics", "keep_logits", "disable_hybrid_kv_cache_manager"):
            _flag(name, getattr(self, name))
        object.__setattr__(self, "kv_events_config", _kv_events_config(self.kv_events_config))

    @property
    def enable_kv_cache_events(self) -> bool:
        """Whether the block pool queues KV cache events (vLLM's scheduler reads the same flag)."""
        return self.kv_events_config is not None and self.kv_events_config.enable_kv_cache_events


def _kv_events_config(value: object) -> KVEventsConfig | None:
    """``kv_events_config`` as a ``KVEventsConfig``: one given, one built from a dict (``--kv-events-config``'s
    JSON), or None; an unknown key or a wrong field is refused naming ``kv_events_config``."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if not isinstance(value, dict):
        raise KvlabValueError(f"kv_events_config must be a KVEventsConfig, a dict of its fields or None, got {value!r}")
    known = [f.name for f in dataclasses.fields(KVEventsConfig)]
    for key in value:
        if key not in known:
            raise UnknownNameError("kv_events_config key", key, known)
    try:
        return KVEventsConfig(**value)
    except KvlabValueError as error:
        raise KvlabValueError(f"kv_events_config: {error}") from error
