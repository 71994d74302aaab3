"""KV cache groups and the budget of a hybrid model, as vLLM 0.33.0's hybrid KV cache manager plans them.

A model such as gpt-oss-20b (12 sliding-window layers of 128 tokens, 12 full-attention layers)
or Gemma 2 (21 and 21, a window of 4096) gets one **KV cache group** per kind and pattern slot
(``get_kv_cache_groups``: vLLM's ``_get_kv_cache_groups_uniform_page_size`` in
``vllm/v1/core/kv_cache_planning.py``). Every group has the same number of layers, so every
block of the one shared pool has the same size: ``layers per group x one layer's page``. A block
id belongs to one group at a time and holds that group's layers' pages; the groups' tensors
alias the same memory. So a pool of B blocks serves each group with blocks that, sized for all
layers, would be B / 2 blocks: the window's saving is that a sliding group holds only the
blocks its window reaches.

``plan_hybrid_kv_cache`` sizes the pool as vLLM does (``available // bytes_per_block``, the budget
of ``plan_kv_cache``) and reports what 0.33.0 logs: the maximum concurrency
``num_blocks / sum over groups of the blocks one request of max_model_len holds`` and
``kv_cache_size_tokens = int(max_concurrency x max_model_len)``
(``get_max_concurrency_for_kv_cache_config``, ``update_kv_cache_capacity`` in
``kv_cache_utils.py``). A sliding group's request is counted at vLLM's admission cap,
``cdiv(min(W - 1 + max_in_flight_tokens, max_model_len), block_size) + 1``, where
``max_in_flight_tokens = max_concurrent_batches x max_num_batched_tokens``: frees follow computed
tokens, so a request keeps the tokens scheduled but not yet computed too. With async scheduling
(0.33.0's default) two batches are in flight. The plan of the same model with every layer as
full attention (``--disable-hybrid-kv-cache-manager``) comes along as ``full_attention``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab._validate import checked, positive_int
from kvlab.capacity.budget import (
    DEFAULT_BLOCK_SIZE,
    KVCachePlan,
    kv_cache_capacity_line,
    num_gpu_blocks,
    plan_kv_cache,
)
from kvlab.capacity.hardware import GPUSpec, get_gpu
from kvlab.capacity.models import ModelSpec, resolve_model
from kvlab.capacity.sizing import kv_heads_per_rank
from kvlab.errors import KvlabValueError
from kvlab.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    canonical_kv_dtype,
)
from kvlab.units import GiB, cdiv

__all__ = ["HybridKVCachePlan", "default_max_num_batched_tokens", "describe_groups", "get_kv_cache_groups",
           "layer_specs", "plan_hybrid_kv_cache"]

#: EngineArgs' token budget for the offline ``LLM`` class on a GPU under 70 GiB or an A100 in vLLM 0.33.0
#: (``default_max_num_batched_tokens`` gives it for a named GPU: 16,384 on an H100 or H200).
VLLM_MAX_NUM_BATCHED_TOKENS = 8192


@checked
def default_max_num_batched_tokens(gpu: GPUSpec | str, api_server: bool = False) -> int:
    """vLLM 0.33.0's default ``max_num_batched_tokens`` on ``gpu`` (``EngineArgs.get_batch_defaults``).

    From 160 GiB both the offline ``LLM`` class and the API server get 16,384; from 70 GiB, unless the GPU
    is an A100, the ``LLM`` class 16,384 and the API server 8,192; otherwise 8,192 and 2,048.
    """
    spec = get_gpu(gpu)
    if spec.memory_gib >= 160:
        return 16384
    if spec.memory_gib >= 70 and "a100" not in spec.name.lower():
        return 8192 if api_server else 16384
    return 2048 if api_server else VLLM_MAX_NUM_BATCHED_TOKENS


@checked
def layer_name(index: int) -> str:
    """vLLM's name for layer ``index``'s attention: ``model.layers.{index}.self_attn.attn``."""
    return f"model.layers.{index}.self_attn.attn"


@checked
def layer_specs(model: ModelSpec, block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str = "bf16",
                tp: int = 1) -> dict[str, KVCacheSpec]:
    """Each layer's spec on one GPU (vLLM's ``get_kv_cache_spec``): full attention, a sliding window of the
    model's size, or MLA's latent; its page is ``page_size_bytes(model, block_size, kv_dtype, tp)``."""
    shape = {"num_kv_heads": kv_heads_per_rank(model, tp), "head_size": model.head_dim,
             "dtype": canonical_kv_dtype(kv_dtype)}
    if model.attention == "mla":
        return {layer_name(i): MLAAttentionSpec(block_size, head_size=model.head_dim, dtype=shape["dtype"])
                for i in range(model.num_layers)}
    return {layer_name(i): (SlidingWindowSpec(block_size, **shape, sliding_window=model.sliding_window)
                            if kind == "sliding_attention" else FullAttentionSpec(block_size, **shape))
            for i, kind in enumerate(model.layer_types)}


@checked
def get_kv_cache_groups(specs: dict[str, KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """Split layers into KV cache groups of one spec and (nearly) one size, as vLLM 0.33.0 does.

    Layers of one spec are bucketed in order of first appearance. The group size is the
    smallest bucket's, or the largest's when no bucket is 1.5 times the smallest (fewer padding
    layers: gpt-oss with an EAGLE head, 12 + 13 layers, pads to 13 + 13). A bucket is cut into
    ``cdiv(len, group_size)`` groups taking every ``num_groups``-th layer, so that pipeline stages
    see the same pattern. One spec for every layer is one group.
    """
    if not specs:
        raise KvlabValueError("specs must name at least one layer")
    pages = {spec.page_size_bytes for spec in specs.values()}
    if len(pages) > 1:
        raise KvlabValueError(f"layers have different page sizes {sorted(pages)}; kvlab groups layers of one page size")
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        buckets.setdefault(spec, []).append(name)
    if len(buckets) == 1:
        ((spec, names),) = buckets.items()
        return (KVCacheGroupSpec(tuple(names), spec),)
    sizes = [len(names) for names in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for spec, names in buckets.items():
        num_groups = cdiv(len(names), group_size)
        groups += [KVCacheGroupSpec(tuple(names[i::num_groups]), spec) for i in range(num_groups)]
    return tuple(groups)


@dataclasses.dataclass(frozen=True)
class HybridKVCachePlan:
    """One GPU's KV pool for a model's KV cache groups, with the all-full-attention plan beside it."""

    model: str
    block_size: int
    max_model_len: int
    max_in_flight_tokens: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    layers_per_group: int  # the largest group's layers (the others are padded to it)
    bytes_per_block: int  # layers_per_group x one layer's page
    num_blocks: int  # available // bytes_per_block, the null block included
    blocks_per_request: tuple[int, ...]  # per group: the blocks one request of max_model_len holds at most
    max_concurrency: float  # num_blocks / sum(blocks_per_request), as vLLM logs it
    kv_cache_size_tokens: int  # int(max_concurrency x max_model_len), vLLM's "GPU KV cache size"
    full_attention: KVCachePlan  # the same budget with every layer full attention

    @property
    def num_padding_layers(self) -> int:
        """Layers' worth of pages no layer uses: groups smaller than the largest are padded."""
        return sum(self.layers_per_group - len(g.layer_names) for g in self.kv_cache_groups)

    @property
    def concurrency_gain(self) -> float:
        """How many times more requests of ``max_model_len`` fit than with every layer as full attention."""
        return self.max_concurrency / self.full_attention.max_concurrency

    @property
    def fits(self) -> bool:
        """Whether vLLM would start: one request of ``max_model_len`` fits beside the null block."""
        return self.num_blocks - 1 >= sum(self.blocks_per_request)

    @checked
    def startup_log(self) -> list[str]:
        """vLLM 0.33.0's one start-up line for the pool (``update_kv_cache_capacity``)."""
        return [kv_cache_capacity_line(self.kv_cache_size_tokens, self.max_model_len, self.max_concurrency)]


@checked
def plan_hybrid_kv_cache(
    model: ModelSpec | str,
    *,
    max_model_len: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str = "bf16",
    tp: int = 1,
    max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS,
    async_scheduling: bool = True,
    **budget: Any,
) -> HybridKVCachePlan:
    """Plan the pool of ``model``'s KV cache groups on one GPU, as vLLM 0.33.0 with its hybrid manager.

    ``budget`` is ``plan_kv_cache``'s memory arguments (``gpu_memory_gib``, ``weights_gib``,
    ``kv_cache_memory_gib``, ...), which give the bytes available for KV. ``async_scheduling``
    (0.33.0's default) keeps two batches of ``max_num_batched_tokens`` in flight, one without.
    """
    spec = resolve_model(model)
    if not isinstance(async_scheduling, bool):
        raise KvlabValueError(f"async_scheduling must be True or False, got {async_scheduling!r}")
    in_flight = (2 if async_scheduling else 1) * positive_int("max_num_batched_tokens", max_num_batched_tokens)
    full = plan_kv_cache(spec, max_model_len=max_model_len, block_size=block_size, kv_dtype=kv_dtype, tp=tp, **budget)
    groups = get_kv_cache_groups(layer_specs(spec, full.block_size, full.kv_dtype, tp))
    layers_per_group = max(len(g.layer_names) for g in groups)
    bytes_per_block = layers_per_group * groups[0].kv_cache_spec.page_size_bytes
    blocks = num_gpu_blocks.__wrapped__(full.available_bytes, bytes_per_block)  # checked at this door
    per_request = tuple(g.kv_cache_spec.max_num_blocks_per_request(full.max_model_len, in_flight) for g in groups)
    concurrency = blocks / sum(per_request)
    return HybridKVCachePlan(
        model=spec.name, block_size=full.block_size, max_model_len=full.max_model_len,
        max_in_flight_tokens=in_flight, kv_cache_groups=groups, layers_per_group=layers_per_group,
        bytes_per_block=bytes_per_block, num_blocks=blocks, blocks_per_request=per_request,
        max_concurrency=concurrency, kv_cache_size_tokens=int(concurrency * full.max_model_len),
        full_attention=full,
    )


@checked
def describe_groups(plan: HybridKVCachePlan) -> list[dict[str, Any]]:
    """One row per group, for a table: its kind, window, layers, and what one request holds in it."""
    rows = []
    for group, per_request in zip(plan.kv_cache_groups, plan.blocks_per_request, strict=True):
        spec = group.kv_cache_spec
        rows.append({"group": len(rows), "kind": spec.kind,
                     "sliding_window": getattr(spec, "sliding_window", None),
                     "layers": ", ".join(n.split(".")[2] for n in group.layer_names),
                     "blocks_per_request": per_request,
                     "GiB_per_request": round(per_request * plan.bytes_per_block / GiB, 3)})
    return rows

