"""A cost model: counted tokens and bytes turned into modelled seconds on a named GPU and host link.

Every figure this module returns is **modelled, not measured**: FLOPs over an assumed share
of the GPU's dense BF16 peak, and bytes over the link's theoretical bandwidth. The hardware
numbers come from ``data/hardware/*.json`` with their sources; the two efficiencies are
kvlab's assumptions, stated as parameters so a notebook can sweep them:

* ``prefill_mfu`` (default 0.5): the share of the dense peak a prefill reaches;
* ``link_efficiency`` (default 1.0): the share of the theoretical link bandwidth a copy reaches.

Prefill FLOPs for ``n`` new tokens after ``s`` cached ones: ``2 x P x n`` for the weight
matmuls (``P``: parameters outside the embedding and the LM head), the causal attention
``2 x H_q x (d_qk + d_v)`` per query-key pair over ``n x s + n (n + 1) / 2`` pairs and
layer, and the LM head once (the first token's logits). Every layer is counted as full
attention, as ``kvlab.capacity.budget`` sizes it. Dense models only: an MoE's active parameters are
not its ``num_params``, so pass ``active_params``. The rule of thumb "2 x parameters FLOPs per
token" is this count without the attention and with the embeddings: for short prompts the two agree
within a few percent.

A forward pass can also be no faster than reading the weights (and the KV it attends over) from
the GPU's memory once: ``forward_seconds`` takes the larger of the two, a roofline. Short prefills,
such as the few new tokens after a long prefix hit, sit on the memory side of it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvlab._validate import checked, fraction_in_unit_interval, non_negative_int, one_of, positive_int, positive_number
from kvlab.capacity.hardware import GPUSpec, LinkSpec, get_gpu, get_link
from kvlab.capacity.models import WEIGHT_DTYPE_BYTES, ModelSpec, params_bytes, resolve_model, weights_bytes
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.errors import KvlabValueError

#: Share of the dense peak a large prefill sustains (model FLOPs utilisation): kvlab's assumption, not a measurement.
DEFAULT_PREFILL_MFU = 0.5
DEFAULT_LINK_EFFICIENCY = 1.0  # the theoretical bandwidth: an upper bound on what a copy reaches
Where = Literal["recompute", "gpu", "cpu"]


def _dims(model: ModelSpec) -> tuple[int, int, int, int]:
    """(vocab, hidden, query-key dim, value dim) of one attention head, read from the config."""
    cfg = model.config
    vocab, hidden = cfg.get("vocab_size"), model.hidden_size
    if not vocab or not hidden:
        raise KvlabValueError(f"{model.name}'s config lacks vocab_size or hidden_size: the cost model needs both")
    if model.attention == "mla":
        return vocab, hidden, cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    return vocab, hidden, model.head_dim, model.head_dim


@checked
@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds for prefill on ``gpu`` (x ``tp``) and for KV copies over ``link``, for one ``model``."""

    model: ModelSpec
    gpu: GPUSpec
    link: LinkSpec
    kv_dtype: str = "bf16"
    tp: int = 1
    prefill_mfu: float = DEFAULT_PREFILL_MFU
    link_efficiency: float = DEFAULT_LINK_EFFICIENCY
    active_params: int | None = None
    weights_dtype: str | None = None  # None: the checkpoint's own

    def __post_init__(self) -> None:
        positive_int("tp", self.tp)
        fraction_in_unit_interval("prefill_mfu", self.prefill_mfu)
        fraction_in_unit_interval("link_efficiency", self.link_efficiency)
        if self.active_params is not None:
            positive_int("active_params", self.active_params)
        elif self.model.num_params is None or self.model.config.get("n_routed_experts") or self.model.config.get(
                "num_local_experts"):
            raise KvlabValueError(f"{self.model.name}: pass active_params (a mixture of experts, or an unknown "
                                  "parameter count, has no dense FLOP count kvlab can derive)")
        if self.weights_dtype is not None:
            one_of("weights_dtype", self.weights_dtype, WEIGHT_DTYPE_BYTES)
        _dims(self.model)
        kv_bytes_per_token(self.model, self.kv_dtype, self.tp)  # validates the dtype and TP

    # ----------------------------------------------------------------- compute

    @property
    def matmul_params(self) -> int:
        """Parameters every token multiplies by: all but the embedding table and the LM head."""
        vocab, hidden, _, _ = _dims(self.model)
        total = self.active_params or self.model.num_params
        tied = self.model.config.get("tie_word_embeddings", False)
        return total - vocab * hidden * (1 if tied else 2)  # type: ignore[operator]

    @checked
    def prefill_flops(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """FLOPs to compute ``num_new_tokens`` after ``num_cached_tokens`` whose KV is already in the cache."""
        n = non_negative_int("num_new_tokens", num_new_tokens)
        s = non_negative_int("num_cached_tokens", num_cached_tokens)
        if n == 0:
            return 0.0
        vocab, hidden, d_qk, d_v = _dims(self.model)
        pairs = n * s + n * (n + 1) // 2
        attention = 2 * self.model.num_attention_heads * (d_qk + d_v) * pairs * self.model.num_layers
        return float(2 * self.matmul_params * n + attention + 2 * vocab * hidden)

    @property
    def flops_per_second(self) -> float:
        """The assumed prefill rate of the whole TP group: ``tp x dense BF16 peak x prefill_mfu``."""
        return self.tp * self.gpu.bf16_dense_flops * self.prefill_mfu

    @checked
    def prefill_seconds(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """Modelled seconds to prefill ``num_new_tokens`` after ``num_cached_tokens`` cached ones (compute only)."""
        return self.prefill_flops(num_new_tokens, num_cached_tokens) / self.flops_per_second

    @checked
    def implied_mfu(self, seconds: float, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """The share of the dense peak at which a prefill of these tokens takes ``seconds``."""
        seconds = positive_number("seconds", seconds)
        return self.prefill_flops(num_new_tokens, num_cached_tokens) / (
            seconds * self.tp * self.gpu.bf16_dense_flops)

    # ----------------------------------------------------------------- memory: the roofline's other side

    @property
    def weights_bytes_per_gpu(self) -> int:
        """Weight bytes each GPU reads per forward pass: all of them for a dense model, the active ones for an MoE."""
        dtype = self.weights_dtype or self.model.weights_dtype
        if self.active_params is not None:
            return params_bytes(self.active_params, dtype) // self.tp
        return weights_bytes(self.model, dtype) // self.tp

    @checked
    def memory_read_seconds(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """Modelled seconds to read the weights and the KV of every token attended over, once, from HBM."""
        n = non_negative_int("num_new_tokens", num_new_tokens)
        s = non_negative_int("num_cached_tokens", num_cached_tokens)
        read = self.weights_bytes_per_gpu + (n + s) * self.kv_bytes_per_token
        return read / self.gpu.memory_bytes_per_s

    @checked
    def forward_seconds(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """The roofline: a prefill takes the longer of its compute and one read of the weights and KV."""
        return max(self.prefill_seconds(num_new_tokens, num_cached_tokens),
                   self.memory_read_seconds(num_new_tokens, num_cached_tokens))

    @checked
    def prefix_hit_speedup(self, prompt_tokens: int, reused_tokens: int) -> float:
        """How many times faster the first token comes when ``reused_tokens`` of the prompt hit the GPU prefix cache.

        Both sides on the roofline (``forward_seconds``): the speed-up approaches
        ``prompt / (prompt - reused)`` while compute dominates, and stops at the weights' read time.
        """
        prompt = positive_int("prompt_tokens", prompt_tokens)
        reused = non_negative_int("reused_tokens", reused_tokens)
        if reused >= prompt:
            raise KvlabValueError(f"reused_tokens={reused} must be below prompt_tokens={prompt}: the last token is "
                                  "always computed")
        return self.forward_seconds(prompt) / self.forward_seconds(prompt - reused, reused)

    # ----------------------------------------------------------------- copies

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token on one GPU (each GPU of the TP group copies its share over its own link)."""
        return kv_bytes_per_token(self.model, self.kv_dtype, self.tp)

    @property
    def link_bytes_per_second(self) -> float:
        """The assumed copy rate of one GPU's link, one direction."""
        return self.link.bytes_per_s * self.link_efficiency

    @checked
    def copy_seconds(self, num_tokens: int) -> float:
        """Modelled seconds to copy ``num_tokens`` tokens' KV across the link, one direction (the GPUs in parallel)."""
        return non_negative_int("num_tokens", num_tokens) * self.kv_bytes_per_token / self.link_bytes_per_second

    # ----------------------------------------------------------------- the questions notebook 07 asks

    @checked
    def ttft(self, prompt_tokens: int, reused_tokens: int, where: Where) -> float:
        """Modelled time to first token of a prompt whose first ``reused_tokens`` tokens' KV exist ``where``.

        ``"recompute"``: no cache (or the prefix was evicted from a GPU-only cache), everything is
        prefilled. ``"gpu"``: a GPU prefix-cache hit, only the rest is prefilled. ``"cpu"``: a hit in
        the CPU tier, copied back over the link before the rest is prefilled.
        """
        prompt = positive_int("prompt_tokens", prompt_tokens)
        reused = non_negative_int("reused_tokens", reused_tokens)
        if reused >= prompt:
            raise KvlabValueError(f"reused_tokens={reused} must be below prompt_tokens={prompt}: the last token is "
                                  "always computed")
        if where == "recompute":
            return self.prefill_seconds(prompt)
        if where == "gpu":
            return self.prefill_seconds(prompt - reused, reused)
        if where == "cpu":
            return self.copy_seconds(reused) + self.prefill_seconds(prompt - reused, reused)
        raise KvlabValueError(f"where must be 'recompute', 'gpu' or 'cpu', got {where!r}")

    @checked
    def recompute_seconds(self, computed_tokens: int, hit_tokens: int) -> float:
        """A preempted request resumed by recompute: prefill what the GPU prefix cache no longer holds."""
        computed = non_negative_int("computed_tokens", computed_tokens)
        hits = non_negative_int("hit_tokens", hit_tokens)
        if hits > computed:
            raise KvlabValueError(f"hit_tokens={hits} cannot exceed computed_tokens={computed}")
        return self.prefill_seconds(computed - hits, hits)

    @checked
    def swap_seconds(self, computed_tokens: int, hit_tokens: int = 0) -> float:
        """A preempted request resumed by swap: all its KV out to the CPU, then back what the GPU no longer holds."""
        computed = non_negative_int("computed_tokens", computed_tokens)
        hits = non_negative_int("hit_tokens", hit_tokens)
        if hits > computed:
            raise KvlabValueError(f"hit_tokens={hits} cannot exceed computed_tokens={computed}")
        return self.copy_seconds(computed) + self.copy_seconds(computed - hits)

    @checked
    def swap_or_recompute(self, computed_tokens: int, hit_tokens: int) -> Literal["swap", "recompute"]:
        """The cheaper way to resume a preempted request in this model (ties go to recompute, vLLM V1's way)."""
        swap = self.swap_seconds(computed_tokens, hit_tokens)
        return "swap" if swap < self.recompute_seconds(computed_tokens, hit_tokens) else "recompute"

    @checked(at_most={"resolution": 10**6})
    def crossover_hit_rate(self, computed_tokens: int, resolution: int = 1000) -> float | None:
        """The smallest prefix-hit rate (in steps of ``1 / resolution``) at which recompute is no dearer than swap.

        None when swap stays cheaper even with every block but the last still cached.
        """
        computed = positive_int("computed_tokens", computed_tokens)
        resolution = positive_int("resolution", resolution)
        for i in range(resolution + 1):
            hits = min(round(computed * i / resolution), computed)
            if self.swap_or_recompute(computed, hits) == "recompute":
                return i / resolution
        return None


@checked
def cost_model(
    model: str | ModelSpec,
    gpu: str | GPUSpec = "H100-SXM-80GB",
    link: str | LinkSpec | None = None,
    **kwargs: object,
) -> CostModel:
    """A ``CostModel`` from names: ``link`` defaults to the GPU's own host link."""
    spec = resolve_model(model)
    gpu_spec = get_gpu(gpu)
    return CostModel(spec, gpu_spec, get_link(link or gpu_spec.host_link), **kwargs)  # type: ignore[arg-type]
