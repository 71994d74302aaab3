"""A capacity-planning playbook over ``kvlab.capacity.budget``: from a model, a GPU and a workload to what to change.

``plan_deployment`` answers the operator's questions for one deployment: the start-up lines
vLLM would print, how many requests fit at ``max_model_len`` (the worst case vLLM logs) and at
the workload's typical length (with its shared prefix stored once), which band of the
source material's decision flow that puts it in, and the levers ranked by the concurrency
each buys, each with its cost in a sentence. The source material's three worked examples are
data of their own, in ``kvlab.capacity.source_deployments``.

What kvlab models and vLLM measures: vLLM profiles the activation peak, non-torch memory and
CUDA graphs at start-up; here they are one input, ``non_kv_gib``. Weights are parameters x
bytes of the weight dtype (``kvlab.capacity.models.weights_bytes``), divided by TP.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

from kvlab._validate import checked, fraction_in_unit_interval, non_negative_int, one_of, positive_int
from kvlab.capacity.budget import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KVCachePlan,
    format_gib,
    plan_kv_cache,
)
from kvlab.capacity.hardware import GPUSpec, get_gpu
from kvlab.capacity.models import WEIGHT_DTYPE_BYTES, ModelSpec, resolve_model
from kvlab.capacity.sizing import canonical_kv_dtype, dtype_bytes, kv_heads_per_rank
from kvlab.errors import KvlabValueError
from kvlab.units import cdiv, format_bytes

RankBy = Literal["max_model_len", "typical"]
#: The source material's advice for the middle band: raise gpu_memory_utilization "to 0.93-0.95".
UTILIZATION_STEP = (0.93, 0.95)
HIGHER_UTILIZATION = UTILIZATION_STEP[1]  # the lever applies the top of the range
#: The source material's switch points for an FP8 KV cache, on vLLM's logged maximum concurrency:
#: above 100 memory is not the bottleneck (keep 16-bit quality); below 20 FP8 is the cheapest doubling.
FP8_NOT_NEEDED_ABOVE = 100
FP8_CHEAPEST_BELOW = 20


# ----------------------------------------------------------------- inputs


@checked
@dataclasses.dataclass(frozen=True)
class Workload:
    """What requests look like: mean prompt and output tokens, and the share of the prompt every request shares.

    ``shared_prefix`` is the fraction of the mean prompt that is one common prefix (a system
    prompt, a RAG template): with prefix caching its full blocks are stored once for all
    requests running at the same time.
    """

    mean_prompt_tokens: int
    mean_output_tokens: int
    shared_prefix: float = 0.0

    def __post_init__(self) -> None:
        positive_int("mean_prompt_tokens", self.mean_prompt_tokens)
        non_negative_int("mean_output_tokens", self.mean_output_tokens)
        if isinstance(self.shared_prefix, bool) or not isinstance(self.shared_prefix, (int, float)) or not (
                0 <= self.shared_prefix <= 1):
            raise KvlabValueError(f"shared_prefix must be a share in [0, 1], got {self.shared_prefix!r}")

    @property
    def typical_tokens(self) -> int:
        """A request's tokens just before it finishes, prompt plus output: the most KV it ever holds."""
        return self.mean_prompt_tokens + self.mean_output_tokens

    @property
    def shared_prefix_tokens(self) -> int:
        """Prompt tokens every request shares (rounded down to whole tokens)."""
        return math.floor(self.mean_prompt_tokens * self.shared_prefix)


@checked
@dataclasses.dataclass(frozen=True)
class Deployment:
    """One vLLM instance's settings: model, GPU type, TP, ``max_model_len``, KV dtype, utilization, weights dtype.

    ``non_kv_gib`` is the per-GPU memory that is neither weights nor KV cache (activation peak,
    non-torch allocations, CUDA graphs), which vLLM measures and kvlab takes as given.
    """

    model: str | ModelSpec
    gpu: str | GPUSpec
    max_model_len: int
    tp: int = 1
    kv_dtype: str = "bf16"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    weights_dtype: str | None = None
    non_kv_gib: float = 0.0
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        get_gpu(self.gpu)
        if isinstance(self.model, str):
            resolve_model(self.model)
        elif not isinstance(self.model, ModelSpec):
            raise KvlabValueError(f"model must be a ModelSpec or a preset name, got {type(self.model).__name__}")
        positive_int("max_model_len", self.max_model_len)
        positive_int("tp", self.tp)
        canonical_kv_dtype(self.kv_dtype)
        fraction_in_unit_interval("gpu_memory_utilization", self.gpu_memory_utilization)
        if self.weights_dtype is not None:
            one_of("weights_dtype", self.weights_dtype, WEIGHT_DTYPE_BYTES)
        positive_int("block_size", self.block_size)

    @property
    def spec(self) -> ModelSpec:
        """The model's ``ModelSpec``."""
        return resolve_model(self.model)

    @property
    def gpu_spec(self) -> GPUSpec:
        """The GPU's ``GPUSpec``."""
        return get_gpu(self.gpu)

    @checked
    def replace(self, **changes: Any) -> Deployment:
        """A copy with ``changes`` applied (checked like the original)."""
        return dataclasses.replace(self, **changes)

    @checked
    def plan(self) -> KVCachePlan:
        """One GPU's KV cache plan, as ``kvlab.capacity.budget.plan_kv_cache`` computes it for these settings."""
        return plan_kv_cache(
            self.spec, gpu_memory_gib=self.gpu_spec.memory_gib, gpu_memory_utilization=self.gpu_memory_utilization,
            weights_dtype=self.weights_dtype, non_kv_peak_gib=self.non_kv_gib, kv_dtype=self.kv_dtype,
            block_size=self.block_size, max_model_len=self.max_model_len, tp=self.tp,
        )


# ----------------------------------------------------------------- concurrency


@checked
def concurrency_at(num_usable_blocks: int, block_size: int, tokens: int, shared_prefix_tokens: int = 0) -> int:
    """Requests of ``tokens`` tokens that hold all their blocks at once when ``shared_prefix_tokens`` are shared.

    The shared prefix's full blocks are stored once (a partial block cannot be shared); every
    request holds its own blocks for the rest, at least one: as in vLLM's ``get_computed_blocks``,
    a prefix hit never covers a request's last token. 0 when not even one request fits.
    """
    num_usable_blocks = non_negative_int("num_usable_blocks", num_usable_blocks)
    block_size = positive_int("block_size", block_size)
    tokens = positive_int("tokens", tokens)
    shared_prefix_tokens = non_negative_int("shared_prefix_tokens", shared_prefix_tokens)
    if shared_prefix_tokens > tokens:
        raise KvlabValueError(f"shared_prefix_tokens={shared_prefix_tokens} exceeds the request's {tokens} tokens")
    shared_blocks = min(shared_prefix_tokens, tokens - 1) // block_size
    own_blocks = cdiv(tokens - shared_blocks * block_size, block_size)
    if shared_blocks + own_blocks > num_usable_blocks:
        return 0
    return (num_usable_blocks - shared_blocks) // own_blocks


# ----------------------------------------------------------------- the decision flow


@dataclasses.dataclass(frozen=True)
class Decision:
    """The source material's decision flow: a band of the logged concurrency and what to try, in order."""

    band: str
    verdict: str
    steps: tuple[str, ...]


DECISION_BANDS: tuple[tuple[float, Decision], ...] = (
    (10, Decision("< 10", "Memory is badly short.", (
        "FP8 KV cache", "Lower max_model_len", "Weight quantization (FP8 or AWQ)", "More tensor parallelism",
        "A GQA (or MLA) model"))),
    (50, Decision("10 to 50", "Enough for steady load, but traffic peaks will preempt.", (
        "FP8 KV cache", f"Higher gpu_memory_utilization ({UTILIZATION_STEP[0]} to {UTILIZATION_STEP[1]})",
        "Watch vllm:num_preemptions"))),
    (math.inf, Decision(">= 50", "Memory is plentiful: the bottleneck is elsewhere.", (
        "Check CPU cores", "Check tokenization overhead", "Check that max_num_batched_tokens is not too small"))),
)


@checked
def decide(max_concurrency: float) -> Decision:
    """The band of ``max_concurrency`` (vLLM's logged "Maximum concurrency"): < 10, 10 to 50, or >= 50."""
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, (int, float)) or not (
            max_concurrency >= 0):
        raise KvlabValueError(f"max_concurrency must be a number >= 0, got {max_concurrency!r}")
    return next(decision for bound, decision in DECISION_BANDS if max_concurrency < bound)


@checked
def fp8_kv_verdict(max_concurrency: float) -> Literal["not needed", "cheapest doubling", "weigh it"]:
    """The source material's rule for an FP8 KV cache, read off vLLM's logged maximum concurrency.

    Above ``FP8_NOT_NEEDED_ABOVE`` (100) memory is not what limits the server: keep the 16-bit
    cache and its quality. Below ``FP8_CHEAPEST_BELOW`` (20) halving every token's bytes is the
    cheapest way to double the requests held. In between, weigh the gain against an evaluation.
    """
    decide(max_concurrency)  # the same check of the argument
    if max_concurrency > FP8_NOT_NEEDED_ABOVE:
        return "not needed"
    if max_concurrency < FP8_CHEAPEST_BELOW:
        return "cheapest doubling"
    return "weigh it"


# ----------------------------------------------------------------- levers


@dataclasses.dataclass(frozen=True)
class LeverResult:
    """One lever applied to a deployment: the new settings and plan, what it buys, and what it costs."""

    name: str
    flag: str  # the vLLM setting (or action) it changes
    deployment: Deployment | None  # None when the lever does not apply
    plan: KVCachePlan | None
    max_concurrency: float  # vLLM's logged figure after the change (0 when it does not apply)
    concurrency_typical: int
    gain_max_concurrency: float
    gain_typical: int
    cost: str
    applicable: bool


LeverFn = Callable[[Deployment, Workload], "tuple[Deployment, str] | str"]


def _fp8_kv(d: Deployment, w: Workload) -> tuple[Deployment, str] | str:
    if dtype_bytes(d.kv_dtype) <= 1:
        return f"the KV cache is already {d.kv_dtype} (at most one byte per value)"
    gpu = d.gpu_spec
    cost = ("Halves every token's KV bytes. vLLM's FP8 scales default to 1.0, so measure quality on your own "
            "evaluation first: precise recall over long contexts degrades first.")
    if not gpu.native_fp8:
        cost += (f" The {gpu.name} ({gpu.architecture}) has no FP8 tensor cores: the conversion runs in software "
                 "and gives back part of the gain.")
    return d.replace(kv_dtype="fp8"), cost


def _lower_max_model_len(d: Deployment, w: Workload) -> tuple[Deployment, str] | str:
    floor = cdiv(w.typical_tokens, d.block_size) * d.block_size
    new = max(d.max_model_len // 2, floor)
    if new >= d.max_model_len:
        return f"max_model_len {d.max_model_len:,} is already close to the workload's {w.typical_tokens:,} tokens"
    return d.replace(max_model_len=new), (
        f"Requests longer than {new:,} tokens are refused. The pool holds exactly as many tokens as before "
        "(vLLM V1 sizes it from the memory left, not from max_model_len): only the worst case the log reports "
        "improves, not the requests the workload runs at once.")


def _higher_utilization(d: Deployment, w: Workload) -> tuple[Deployment, str] | str:
    if d.gpu_memory_utilization >= HIGHER_UTILIZATION:
        return f"gpu_memory_utilization is already {d.gpu_memory_utilization:g}"
    freed = (HIGHER_UTILIZATION - d.gpu_memory_utilization) * d.gpu_spec.memory_bytes
    return d.replace(gpu_memory_utilization=HIGHER_UTILIZATION), (
        f"Leaves {format_bytes(freed)} less headroom outside vLLM's budget (NCCL buffers, allocator "
        "fragmentation, any other process on the GPU): an out-of-memory error at a peak stops the server.")


def _quantize_weights(d: Deployment, w: Workload) -> tuple[Deployment, str] | str:
    spec = d.spec
    current = d.weights_dtype or spec.weights_dtype
    if WEIGHT_DTYPE_BYTES[current] <= 1:
        return f"the weights are already {current}"
    if spec.num_params is None:
        return f"kvlab cannot count {spec.name}'s parameters, so it cannot size quantized weights"
    saved = spec.num_params * (WEIGHT_DTYPE_BYTES[current] - 1) / d.tp
    cost = (f"Frees {format_bytes(saved)} of weights per GPU for the KV cache. Quantized weights change the "
            "outputs: evaluate them before serving.")
    if not d.gpu_spec.native_fp8:
        cost += (f" The {d.gpu_spec.name} has no FP8 tensor cores: use a weight-only int8 or int4 scheme "
                 "(AWQ, GPTQ) instead; its kernels are slower for large batches.")
    return d.replace(weights_dtype="fp8"), cost


def _more_tp(d: Deployment, w: Workload) -> tuple[Deployment, str] | str:
    spec, tp = d.spec, d.tp * 2
    try:
        kv_heads_per_rank(spec, tp)
    except KvlabValueError as exc:
        return str(exc)
    mla = (" An MLA latent is copied to every rank, so only the weights' share shrinks." if spec.attention == "mla"
           else " Each GPU holds half the weights and half of every token's KV heads.")
    return d.replace(tp=tp), (
        f"Needs {tp} GPUs instead of {d.tp}, and every layer adds an all-reduce across them (fast over NVLink, "
        f"slow over PCIe).{mla}")


def _gqa_model(d: Deployment, w: Workload) -> tuple[Deployment, str] | str:
    spec = d.spec
    if spec.attention != "mha" or spec.num_attention_heads % 8:
        return (f"{spec.name} already stores {spec.num_kv_heads} KV head(s) per layer ({spec.attention.upper()}); "
                "fewer would take another checkpoint")
    gqa = dataclasses.replace(spec, name=f"{spec.name} with {spec.num_attention_heads // 8} KV heads (GQA)",
                              num_kv_heads=spec.num_attention_heads // 8, attention="gqa")
    return d.replace(model=gqa), (
        "KV heads are fixed when a model is trained: this means serving another checkpoint (or uptraining this "
        "one), not setting a flag, and re-evaluating quality.")


#: The source material's levers, in the order its decision flow tries them.
LEVERS: tuple[tuple[str, str, LeverFn], ...] = (
    ("FP8 KV cache", "--kv-cache-dtype fp8", _fp8_kv),
    ("Lower max_model_len", "--max-model-len", _lower_max_model_len),
    ("Higher gpu_memory_utilization", f"--gpu-memory-utilization {HIGHER_UTILIZATION}", _higher_utilization),
    ("Weight quantization", "an FP8 (or AWQ/GPTQ) checkpoint", _quantize_weights),
    ("More tensor parallelism", "--tensor-parallel-size", _more_tp),
    ("A GQA/MLA model", "another checkpoint", _gqa_model),
)


@checked
def rank_levers(deployment: Deployment, workload: Workload, rank_by: RankBy = "max_model_len") -> list[LeverResult]:
    """Apply each lever alone to ``deployment`` and rank them by the concurrency they buy.

    ``rank_by="max_model_len"`` ranks by vLLM's logged maximum concurrency (what the decision
    flow reads), ``"typical"`` by the requests of the workload's typical length held at once;
    ties fall to the other figure. Levers that do not apply come last, their reason as cost.
    """
    one_of("rank_by", rank_by, ("max_model_len", "typical"))
    base = deployment.plan()
    base_typical = _typical(base, workload)
    results = []
    for name, flag, lever in LEVERS:
        outcome = lever(deployment, workload)
        if isinstance(outcome, str):
            results.append(LeverResult(name, flag, None, None, 0.0, 0, 0.0, 0, outcome, False))
            continue
        changed, cost = outcome
        plan = changed.plan()
        typical = _typical(plan, workload)
        results.append(LeverResult(name, flag, changed, plan, plan.max_concurrency, typical,
                                   plan.max_concurrency - base.max_concurrency, typical - base_typical, cost, True))
    first, second = ("gain_max_concurrency", "gain_typical") if rank_by == "max_model_len" else (
        "gain_typical", "gain_max_concurrency")
    return sorted(results, key=lambda r: (not r.applicable, -getattr(r, first), -getattr(r, second)))


def _typical(plan: KVCachePlan, workload: Workload) -> int:
    return concurrency_at(plan.num_usable_blocks, plan.block_size, workload.typical_tokens,
                          workload.shared_prefix_tokens)


# ----------------------------------------------------------------- the whole answer


@dataclasses.dataclass(frozen=True)
class PlaybookResult:
    """Everything the playbook says about one deployment and workload."""

    deployment: Deployment
    workload: Workload
    plan: KVCachePlan
    startup_log: tuple[str, ...]
    max_concurrency: float  # vLLM's "Maximum concurrency for max_model_len tokens per request"
    concurrency_max_model_len: int  # requests of max_model_len tokens held whole at once
    concurrency_typical: int  # requests of the typical length held at once, shared prefix stored once
    decision: Decision
    levers: tuple[LeverResult, ...]
    warnings: tuple[str, ...]


@checked
def startup_log(deployment: Deployment, plan: KVCachePlan | None = None) -> list[str]:
    """The lines vLLM 0.33.0 prints at start-up: the weights line, then the KV cache line (or its error).

    The weights line is worded and rounded as vLLM 0.33.0 logs it (``gpu_model_runner.py``:
    "Model loading took %s GiB memory and %.6f seconds", the GiB rounded to two decimals by
    ``format_gib``). Its load time depends on the disk and nothing kvlab models: it is shown as "…".
    """
    plan = plan or deployment.plan()
    return [f"Model loading took {format_gib(plan.weights_bytes)} GiB memory and … seconds",
            *plan.startup_log()]


@checked
def plan_deployment(deployment: Deployment, workload: Workload, rank_by: RankBy = "max_model_len") -> PlaybookResult:
    """The playbook for one deployment and workload: log lines, concurrency, decision band, ranked levers."""
    if not isinstance(deployment, Deployment) or not isinstance(workload, Workload):
        raise KvlabValueError("plan_deployment takes a Deployment and a Workload")
    plan = deployment.plan()
    return PlaybookResult(
        deployment=deployment, workload=workload, plan=plan, startup_log=tuple(startup_log(deployment, plan)),
        max_concurrency=plan.max_concurrency, concurrency_max_model_len=plan.usable_concurrency,
        concurrency_typical=_typical(plan, workload), decision=decide(plan.max_concurrency),
        levers=tuple(rank_levers(deployment, workload, rank_by)),
        warnings=tuple(plan.warnings) + tuple(_warnings(deployment, workload)),
    )


def _warnings(d: Deployment, w: Workload) -> list[str]:
    out, gpu, spec = [], d.gpu_spec, d.spec
    if not gpu.memory_is_reported:
        out.append(f"kvlab has no source for the memory the {gpu.name}'s driver reports; it takes the label's "
                   f"{gpu.label_gb:g} as GiB. Read yours with nvidia-smi and expect a little less.")
    if dtype_bytes(d.kv_dtype) <= 1 and canonical_kv_dtype(d.kv_dtype) != "int8" and not gpu.native_fp8:
        out.append(f"The {gpu.name} has no FP8 tensor cores: an FP8 KV cache is converted in software there.")
    if spec.max_position_embeddings and d.max_model_len > spec.max_position_embeddings:
        out.append(f"max_model_len {d.max_model_len:,} exceeds {spec.name}'s max_position_embeddings "
                   f"({spec.max_position_embeddings:,}): vLLM refuses to start unless rope scaling (YaRN, for "
                   "Qwen2.5) is configured to stretch the context.")
    if w.typical_tokens > d.max_model_len:
        out.append(f"The workload's typical request ({w.typical_tokens:,} tokens) is longer than max_model_len.")
    return out
