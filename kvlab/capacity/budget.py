"""The KV cache budget as vLLM V1 computes it at start-up: bytes, blocks and concurrency on one GPU.

vLLM V1 measures the GPU, takes ``requested = ceil(total x gpu_memory_utilization)``
(``vllm/v1/worker/utils.py``, ``request_memory``), subtracts what profiling finds outside
the KV cache (weights, the activation peak, non-torch memory, the CUDA-graph estimate;
``gpu_worker.py``, ``determine_available_memory``) and cuts the rest into blocks of
``block_size`` tokens (``kv_cache_utils.py``: ``num_blocks = available // page_size //
num_layers``). ``kv_cache_memory_bytes`` replaces all of that arithmetic with one number.

kvlab plans instead of profiling: the non-KV figures are inputs, and weights default to
parameter count x weight dtype bytes (divided by TP). Every layer is sized as full
attention (vLLM's single KV cache group, what ``--disable-hybrid-kv-cache-manager`` gives
sliding-window models); ``kvlab.capacity.hybrid`` plans the KV cache groups of 0.33.0's
default. A plan that would not start is returned with ``warnings`` rather than raised, so a
learner can look at it; ``startup_log`` then shows vLLM's error line.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from kvlab._validate import (
    checked,
    fraction_in_unit_interval,
    non_negative_int,
    non_negative_number,
    one_of,
    positive_int,
    positive_number,
)
from kvlab.capacity.models import ModelSpec, resolve_model, weights_bytes
from kvlab.capacity.sizing import canonical_kv_dtype, kv_bytes_per_token
from kvlab.errors import KvlabValueError
from kvlab.units import GiB, cdiv, format_bytes

#: vLLM 0.33.0's defaults (``vllm/config/cache.py``): ``gpu_memory_utilization`` 0.92 and
#: ``CacheConfig.DEFAULT_BLOCK_SIZE`` 16.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
DEFAULT_BLOCK_SIZE = 16
#: The block size the source article on the memory budget reads as the default: 64 tokens in the
#: vLLM revision it quotes (commit e740bad). vLLM 0.33.0's default is 16 (``DEFAULT_BLOCK_SIZE``).
SOURCE_REVISION_BLOCK_SIZE = 64
#: With an "extensible KV cache", revision e740bad resolves an unset ``gpu_memory_utilization`` to 1.0
#: (``resolved_gpu_memory_utilization`` in its ``vllm/config/cache.py``): the pool is sized from the
#: memory actually free after profiling. vLLM 0.33.0 has no such option.
EXTENSIBLE_KV_CACHE_UTILIZATION = 1.0


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """One GPU's KV cache budget, in bytes, blocks and requests (all memory figures per GPU).

    ``num_blocks`` counts block 0, the null block that never holds KV, exactly as vLLM's
    ``num_gpu_blocks`` does; the ``usable`` figures leave it out. ``max_concurrency`` is
    vLLM's figure (``num_blocks / blocks_per_request``, null block included) and
    ``concurrency`` its floor; ``usable_concurrency`` is how many requests of
    ``max_model_len`` tokens can hold all their blocks at the same time.
    """

    model: str
    kv_dtype: str
    block_size: int
    max_model_len: int
    tp: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int  # ceil(total x gpu_memory_utilization)
    weights_bytes: int
    non_kv_peak_bytes: int  # activation peak and non-torch memory
    cudagraph_bytes: int
    kv_cache_memory_bytes: int | None  # the override, when given
    available_bytes: int  # what the KV cache may take (negative: over budget)
    kv_bytes_per_token: int
    bytes_per_block: int  # kv_bytes_per_token x block_size
    num_blocks: int  # available // bytes_per_block, null block included
    num_usable_blocks: int  # num_blocks - 1
    usable_tokens: int  # num_usable_blocks x block_size
    blocks_per_request: int  # ceil(max_model_len / block_size)
    max_concurrency: float  # num_blocks / blocks_per_request, as vLLM logs it
    concurrency: int  # floor(max_concurrency)
    usable_concurrency: int  # num_usable_blocks // blocks_per_request
    warnings: tuple[str, ...] = ()

    @property
    def kv_bytes_per_request(self) -> int:
        """KV of one request of ``max_model_len`` tokens, counted token by token."""
        return self.kv_bytes_per_token * self.max_model_len

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes the block pool actually allocates: ``num_blocks x bytes_per_block``."""
        return self.num_blocks * self.bytes_per_block

    @property
    def unrounded_blocks(self) -> float:
        """``available / bytes_per_block`` before the floor."""
        return max(self.available_bytes, 0) / self.bytes_per_block

    @property
    def unrounded_concurrency(self) -> float:
        """``available / kv_bytes_per_request``: the byte arithmetic, no blocks, no floor."""
        return max(self.available_bytes, 0) / self.kv_bytes_per_request

    @property
    def headroom_bytes(self) -> int:
        """GPU memory nobody takes: the ``1 - gpu_memory_utilization`` share plus the sub-block remainder."""
        taken = self.weights_bytes + self.non_kv_peak_bytes + self.cudagraph_bytes + self.kv_pool_bytes
        return self.gpu_memory_bytes - taken

    @property
    def fits(self) -> bool:
        """Whether vLLM would start: some KV memory, and one request of ``max_model_len`` fits."""
        return self.available_bytes > 0 and self.concurrency >= 1

    @checked
    def max_model_len_for(self, concurrency: int) -> int:
        """The largest ``max_model_len`` at which ``concurrency`` requests all hold their blocks at once."""
        return max_model_len_for(self.num_blocks, self.block_size, concurrency)

    @property
    def kv_cache_size_tokens(self) -> int:
        """vLLM 0.33.0's "GPU KV cache size": ``int(max_concurrency x max_model_len)`` (``get_kv_cache_capacity``)."""
        return int(self.max_concurrency * self.max_model_len)

    @checked
    def startup_log(self, form: StartupLogForm = "0.33.0") -> list[str]:
        """The line vLLM 0.33.0 logs (or the error it raises) at start-up for this plan.

        0.33.0 logs one line, from ``update_kv_cache_capacity`` in ``vllm/v1/core/kv_cache_utils.py``
        (``kv_cache_capacity_line``). ``form="article"`` gives instead the two lines the source article
        quotes (Part 2, section 8.1; it names no vLLM revision), in which "GPU KV cache size" is
        ``num_blocks x block_size`` tokens: the same number when ``max_model_len`` is a multiple of
        ``block_size``. A plan that does not fit gets the ``ValueError`` of 0.33.0's
        ``_check_enough_kv_cache_memory`` (``vllm/v1/core/kv_cache_planning.py``) instead.
        """
        if self.available_bytes <= 0:
            return ["ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                    "when initializing the engine (this flag also controls CPU memory reservation on the CPU "
                    f"backend, despite its name). {CONSERVING_MEMORY_DOCS}"]
        needed = self.blocks_per_request * self.bytes_per_block
        if needed > self.available_bytes:
            estimate = min(self.num_blocks * self.block_size, self.max_model_len)
            hint = (f"Based on the available memory, the estimated maximum model length is {estimate}. "
                    if estimate > 0 else "")
            return [f"ValueError: To serve at least one request with the model's max seq len "
                    f"({self.max_model_len}), ({format_gib(needed)} GiB KV cache is needed, which is larger than "
                    f"the available KV cache memory ({format_gib(self.available_bytes)} GiB). {hint}"
                    "Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) "
                    f"or decreasing `max_model_len` when initializing the engine. {CONSERVING_MEMORY_DOCS}"]
        if form == "article":
            return [f"GPU KV cache size: {self.num_blocks * self.block_size:,} tokens",
                    f"Maximum concurrency for {self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"]
        return [kv_cache_capacity_line(self.kv_cache_size_tokens, self.max_model_len, self.max_concurrency)]


#: Which start-up log ``KVCachePlan.startup_log`` prints: vLLM 0.33.0's one line, or the source article's two.
StartupLogForm = Literal["0.33.0", "article"]
#: The sentence 0.33.0's memory errors end with (``vllm/v1/core/kv_cache_planning.py``).
CONSERVING_MEMORY_DOCS = "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."


@checked
def format_gib(num_bytes: int) -> str:
    """GiB as vLLM prints them (``format_gib`` in ``vllm/utils/mem_utils.py``): ``round(b / GiB, 2)`` as text."""
    return f"{round(num_bytes / GiB, 2)}"


@checked
def kv_cache_capacity_line(num_tokens: int, max_model_len: int, max_concurrency: float) -> str:
    """vLLM 0.33.0's start-up line (``update_kv_cache_capacity``, ``vllm/v1/core/kv_cache_utils.py``)."""
    return (f"GPU KV cache size: {num_tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens per "
            f"request: {max_concurrency:.2f}x")


def _gib_to_bytes(name: str, value: object, *, allow_zero: bool = True) -> int:
    """``value`` GiB as whole bytes (GiB = 1024**3 B), refusing negatives and non-numbers."""
    number = non_negative_number(name, value) if allow_zero else positive_number(name, value)
    return round(number * GiB)


def _resolve_model(model: ModelSpec | str) -> ModelSpec:
    return resolve_model(model)


@checked(at_most=dict.fromkeys(("gpu_memory_gib", "weights_gib", "non_kv_peak_gib", "cudagraph_gib",
                                "kv_cache_memory_gib"), 2**20))  # a mebi-GiB: a PiB per GPU is past any GPU
def plan_kv_cache(
    model: ModelSpec | str,
    *,
    gpu_memory_gib: float,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    weights_gib: float | None = None,
    weights_dtype: str | None = None,
    non_kv_peak_gib: float = 0.0,
    cudagraph_gib: float = 0.0,
    kv_cache_memory_gib: float | None = None,
    kv_dtype: str = "bf16",
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int,
    tp: int = 1,
) -> KVCachePlan:
    """Plan one GPU's KV cache the way vLLM V1 sizes it at start-up.

    All memory is per GPU, in GiB (1024**3 B). ``weights_gib=None`` estimates the weights
    as ``weights_bytes(model, weights_dtype) // tp`` (``weights_dtype`` defaults to the
    checkpoint's). ``kv_cache_memory_gib`` replaces the whole budget, as vLLM's
    ``kv_cache_memory_bytes`` does (then a model whose parameters cannot be counted
    is planned with 0 bytes of weights). Invalid input raises ``KvlabValueError`` naming the
    parameter; a plan that does not fit is returned with ``warnings`` saying why.
    """
    spec = _resolve_model(model)
    total = _gib_to_bytes("gpu_memory_gib", gpu_memory_gib, allow_zero=False)
    utilization = fraction_in_unit_interval("gpu_memory_utilization", gpu_memory_utilization)
    non_kv = _gib_to_bytes("non_kv_peak_gib", non_kv_peak_gib)
    cudagraph = _gib_to_bytes("cudagraph_gib", cudagraph_gib)
    override = None if kv_cache_memory_gib is None else _gib_to_bytes("kv_cache_memory_gib", kv_cache_memory_gib)
    kv_dtype = canonical_kv_dtype(kv_dtype)
    block_size = positive_int("block_size", block_size)
    max_model_len = positive_int("max_model_len", max_model_len)
    tp = positive_int("tp", tp)
    if weights_gib is not None and weights_dtype is not None:
        raise KvlabValueError("give weights_gib or weights_dtype, not both: weights_dtype only sets the estimate")
    if weights_gib is None and override is not None and spec.num_params is None:
        weights = 0  # the override sizes the pool; weights only matter for the picture
    elif weights_gib is None:
        weights = weights_bytes(spec, weights_dtype) // tp
    else:
        weights = _gib_to_bytes("weights_gib", weights_gib)
    per_token = kv_bytes_per_token(spec, kv_dtype, tp)

    # vllm/v1/worker/utils.py: requested_memory = math.ceil(total_memory * gpu_memory_utilization)
    requested = math.ceil(total * utilization)
    available = override if override is not None else requested - weights - non_kv - cudagraph
    bytes_per_block = per_token * block_size
    num_blocks = num_gpu_blocks.__wrapped__(available, bytes_per_block)  # checked at this door
    blocks_per_request = cdiv(max_model_len, block_size)
    concurrency = max_concurrency(num_blocks, max_model_len, block_size)
    num_usable = max(num_blocks - 1, 0)
    plan = KVCachePlan(
        model=spec.name, kv_dtype=kv_dtype, block_size=block_size, max_model_len=max_model_len, tp=tp,
        gpu_memory_bytes=total, gpu_memory_utilization=utilization, requested_bytes=requested,
        weights_bytes=weights, non_kv_peak_bytes=non_kv, cudagraph_bytes=cudagraph,
        kv_cache_memory_bytes=override, available_bytes=available, kv_bytes_per_token=per_token,
        bytes_per_block=bytes_per_block, num_blocks=num_blocks, num_usable_blocks=num_usable,
        usable_tokens=num_usable * block_size, blocks_per_request=blocks_per_request,
        max_concurrency=concurrency, concurrency=math.floor(concurrency),
        usable_concurrency=num_usable // blocks_per_request,
    )
    return dataclasses.replace(plan, warnings=tuple(_warnings(plan, spec)))


def _warnings(plan: KVCachePlan, spec: ModelSpec) -> list[str]:
    """Why a plan would not start, or where its figures mislead, in words."""
    out = []
    taken = plan.weights_bytes + plan.non_kv_peak_bytes + plan.cudagraph_bytes
    if plan.kv_cache_memory_bytes is not None and taken + plan.kv_cache_memory_bytes > plan.gpu_memory_bytes:
        out.append(
            f"kv_cache_memory ({format_bytes(plan.kv_cache_memory_bytes)}) plus weights and non-KV memory "
            f"({format_bytes(taken)}) exceed the GPU's {format_bytes(plan.gpu_memory_bytes)}: the pool "
            "could not be allocated."
        )
    if plan.available_bytes <= 0:
        out.append(
            f"Weights ({format_bytes(plan.weights_bytes)}) plus non-KV peak and CUDA graphs "
            f"({format_bytes(plan.non_kv_peak_bytes + plan.cudagraph_bytes)}) take the whole budget of "
            f"{plan.gpu_memory_utilization:g} x {format_bytes(plan.gpu_memory_bytes)} = "
            f"{format_bytes(plan.requested_bytes)}: nothing is left for the KV cache, and vLLM refuses to start."
        )
    elif plan.concurrency == 0:
        longest = plan.max_model_len_for(1)
        out.append(
            f"One request of max_model_len={plan.max_model_len:,} tokens needs {plan.blocks_per_request:,} "
            f"blocks ({format_bytes(plan.blocks_per_request * plan.bytes_per_block)}) but the pool holds "
            f"{plan.num_blocks:,} ({format_bytes(plan.kv_pool_bytes)}): concurrency is 0 and vLLM refuses "
            f"to start. The longest max_model_len that fits is {longest:,} tokens (vLLM's own estimate, "
            f"{plan.num_blocks * plan.block_size:,}, counts the null block as usable)."
        )
    elif plan.usable_concurrency == 0:
        out.append(
            f"vLLM would start (max_concurrency {plan.max_concurrency:.2f}x counts the null block), but only "
            f"{plan.num_usable_blocks:,} blocks hold KV: one request of {plan.max_model_len:,} tokens "
            f"({plan.blocks_per_request:,} blocks) can never be held whole."
        )
    if spec.num_sliding_layers:
        out.append(
            f"{spec.name} has {spec.num_sliding_layers} sliding-window layers; this plan sizes them as full "
            "attention (vLLM with --disable-hybrid-kv-cache-manager); kvlab.capacity.hybrid.plan_hybrid_kv_cache "
            "plans vLLM's default, the hybrid KV cache manager."
        )
    return out


@checked
def resolved_gpu_memory_utilization(gpu_memory_utilization: float | None = None, *,
                                    extensible_kv_cache: bool = False) -> float:
    """The utilization a plan uses, by revision e740bad's rule: a value given wins; unset, 0.92, or 1.0 if extensible.

    The switch is the source article's revision, not vLLM 0.33.0's: 0.33.0's ``CacheConfig`` has no
    extensible KV cache, so there an unset utilization is always 0.92. Feed the result to
    ``plan_kv_cache(gpu_memory_utilization=...)``.
    """
    if not isinstance(extensible_kv_cache, bool):
        raise KvlabValueError(f"extensible_kv_cache must be True or False, got {extensible_kv_cache!r}")
    if gpu_memory_utilization is not None:
        return fraction_in_unit_interval("gpu_memory_utilization", gpu_memory_utilization)
    return EXTENSIBLE_KV_CACHE_UTILIZATION if extensible_kv_cache else DEFAULT_GPU_MEMORY_UTILIZATION


@checked
def num_gpu_blocks(available_bytes: int, bytes_per_block: int) -> int:
    """Blocks the pool gets: ``available // bytes_per_block``, none below zero.

    vLLM 0.33.0 computes ``available_memory // bytes_per_block`` in ``get_kv_cache_config_from_groups``
    (``vllm/v1/core/kv_cache_planning.py``), after ``_check_enough_kv_cache_memory`` stopped a budget <= 0.

    A learner's negative ``available_bytes`` is refused; kvlab's own plans pass what is left, which can be.
    """
    return max(available_bytes, 0) // positive_int("bytes_per_block", bytes_per_block)


@checked
def max_concurrency(num_blocks: int, max_model_len: int, block_size: int) -> float:
    """vLLM's "Maximum concurrency": ``num_blocks / ceil(max_model_len / block_size)``, null block included."""
    return non_negative_int("num_blocks", num_blocks) / cdiv(positive_int("max_model_len", max_model_len),
                                                             positive_int("block_size", block_size))


@checked
def max_model_len_for(num_blocks: int, block_size: int, concurrency: int) -> int:
    """The largest ``max_model_len`` for which ``concurrency`` requests all hold their blocks at once.

    Counts only usable blocks (``num_blocks - 1``: block 0 is the null block) and whole blocks
    per request, so the answer is a multiple of ``block_size``; 0 when not even one block each fits.
    """
    num_blocks = non_negative_int("num_blocks", num_blocks)
    block_size = positive_int("block_size", block_size)
    concurrency = positive_int("concurrency", concurrency)
    return (max(num_blocks - 1, 0) // concurrency) * block_size


#: The source material's three scenarios, one click each in the panel. A: Llama-3-70B in bf16
#: on a 160 GiB GPU (hypothetical: no GPU has 160 GiB; the article picks it so the weights fit);
#: B: one GPU of a TP=8 DeepSeek-V3 deployment on 8 x 141 GiB (weights 625/8 GiB); C: preset A at
#: a 128K context, where not even one request fits. They keep the article's block size, 64
#: (``SOURCE_REVISION_BLOCK_SIZE``), so that its figures come out; vLLM 0.33.0's default is 16.
PRESETS: Mapping[str, Mapping[str, Any]] = {
    "A": {"model": "llama-3-70b", "gpu_memory_gib": 160, "gpu_memory_utilization": 0.92, "weights_gib": 130,
          "kv_dtype": "bf16", "block_size": SOURCE_REVISION_BLOCK_SIZE, "max_model_len": 8192, "tp": 1},
    "B": {"model": "deepseek-v3", "gpu_memory_gib": 141, "gpu_memory_utilization": 0.92, "weights_gib": 78.125,
          "kv_dtype": "bf16", "block_size": SOURCE_REVISION_BLOCK_SIZE, "max_model_len": 32768, "tp": 8},
    "C": {"model": "llama-3-70b", "gpu_memory_gib": 160, "gpu_memory_utilization": 0.92, "weights_gib": 130,
          "kv_dtype": "bf16", "block_size": SOURCE_REVISION_BLOCK_SIZE, "max_model_len": 131072, "tp": 1},
}


@checked
def plan_preset(name: str) -> KVCachePlan:
    """The plan of preset ``name`` ("A", "B" or "C")."""
    settings = dict(PRESETS[one_of("name", name, PRESETS)])
    return plan_kv_cache(settings.pop("model"), **settings)
