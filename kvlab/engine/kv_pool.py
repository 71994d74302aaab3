"""Start-up steps 4 and 5 of an ``LLMEngine``: how many KV blocks the pool gets, and the tensors that hold them.

vLLM's worker profiles the GPU to find the memory left for KV (``determine_available_memory``
in ``vllm/v1/worker/gpu_worker.py``), cuts it into blocks (``get_kv_cache_configs`` in
``vllm/v1/core/kv_cache_planning.py``) and allocates one tensor per layer
(``GPUModelRunner.initialize_kv_cache``), shaped by the layer's ``KVCacheSpec`` (K and V, or MLA's
one latent). kvlab does not profile: the pool is a block count, a memory budget
(``kvlab.capacity.budget`` cuts it), or by default what ``max_num_seqs`` requests of
``max_model_len`` tokens need, within ``DEFAULT_KV_CACHE_MEMORY_GIB``.

A model with sliding-window layers gets vLLM's KV cache groups (``kv_cache_groups``,
``kvlab.capacity.hybrid``): every group has the same number of layers, and the groups share
the tensors, layer slot by layer slot, as vLLM's do, since a block id belongs to one group at a
time. So the pool holds ``layers_per_group`` K and V tensors, not one per layer, and a block
costs that many pages. ``disable_hybrid_kv_cache_manager`` gives every layer full attention's
allocation instead (one group, one tensor per layer), while the layers still attend in windows.

Under tensor parallelism (``tensor_parallel_size``) everything here is one rank's: every rank allocates the
same number of blocks (one scheduler, one block table for all), each of its own size, ``max(1, Hkv / tp)``
KV heads per layer, or MLA's whole latent.
"""

from __future__ import annotations

import os

import torch

from kvlab.capacity.budget import KVCachePlan, plan_kv_cache
from kvlab.capacity.hybrid import HybridKVCachePlan, get_kv_cache_groups, layer_name, plan_hybrid_kv_cache
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.engine.engine_config import EngineConfig
from kvlab.engine.kv_cache_interface import KVCache, allocate_kv_cache, layer_tensors
from kvlab.engine.registry import kv_cache_specs
from kvlab.errors import KvlabValueError
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec, kv_dtype_name
from kvlab.units import GiB, cdiv

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


def kv_cache_groups(config: EngineConfig, cache_dtype: torch.dtype) -> tuple[KVCacheGroupSpec, ...]:
    """The model's KV cache groups, made of its layers' specs (``kv_cache_specs``): vLLM's grouping of its layers,
    or one group for all of them (a model without sliding windows, or ``disable_hybrid_kv_cache_manager``, which
    gives sliding layers full attention's spec as vLLM's ``unify_hybrid_kv_cache_specs`` does)."""
    specs = kv_cache_specs(config.model_config, config.block_size, cache_dtype, config.tensor_parallel_size)  # a rank's
    named = {layer_name(i): spec for i, spec in enumerate(specs)}
    if config.disable_hybrid_kv_cache_manager or not any(isinstance(s, SlidingWindowSpec) for s in specs):
        first = specs[0]
        full = first if isinstance(first, FullAttentionSpec) else FullAttentionSpec(
            first.block_size, num_kv_heads=first.num_kv_heads, head_size=first.head_size, dtype=first.dtype,
            head_size_v=first.head_size_v)
        return (KVCacheGroupSpec(tuple(named), full),)
    return get_kv_cache_groups(named)


def layer_groups(groups: tuple[KVCacheGroupSpec, ...]) -> tuple[list[int], list[int]]:
    """Per layer: its group, and its slot in the group (the slot picks the tensors it shares with other groups)."""
    group_of, slot_of = {}, {}
    for g, group in enumerate(groups):
        for slot, name in enumerate(group.layer_names):
            layer = int(name.split(".")[2])
            group_of[layer], slot_of[layer] = g, slot
    return [group_of[i] for i in range(len(group_of))], [slot_of[i] for i in range(len(slot_of))]


def plan_pool(config: EngineConfig, cache_dtype: torch.dtype, weights_bytes: int,
              groups: tuple[KVCacheGroupSpec, ...] | None = None) -> KVCachePlan | HybridKVCachePlan:
    """How many blocks the pool gets: ``num_gpu_blocks``, or what ``kv_cache_memory_gib`` buys, or by default
    room for ``max_num_seqs`` requests of ``max_model_len`` tokens within ``DEFAULT_KV_CACHE_MEMORY_GIB``.

    With KV cache groups of sliding windows (``groups``) the plan is ``plan_hybrid_kv_cache``'s, counted for
    kvlab's synchronous scheduler: one batch of ``max_num_batched_tokens`` in flight."""
    spec, block_size = config.model_config.spec, config.block_size
    hybrid = groups is not None and any(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups)
    if hybrid:
        return _plan_hybrid_pool(config, cache_dtype, weights_bytes, groups)  # type: ignore[arg-type]
    tp = config.tensor_parallel_size
    per_block = kv_bytes_per_token(spec, kv_dtype_name(cache_dtype), tp) * block_size  # on one rank
    num_gpu_blocks, memory_gib = config.num_gpu_blocks, config.kv_cache_memory_gib
    if num_gpu_blocks is None and memory_gib is None:
        wanted = 1 + config.max_num_seqs * cdiv(config.max_model_len, block_size)
        num_gpu_blocks = max(2, min(wanted, int(DEFAULT_KV_CACHE_MEMORY_GIB * GiB) // per_block))
    if num_gpu_blocks is not None:
        memory_gib = num_gpu_blocks * per_block / GiB  # exact: GiB = 2**30
    plan = plan_kv_cache(
        spec, gpu_memory_gib=_device_memory_gib(config.device), weights_gib=weights_bytes / GiB,
        kv_cache_memory_gib=memory_gib, kv_dtype=kv_dtype_name(cache_dtype),
        block_size=block_size, max_model_len=config.max_model_len, tp=tp,
    )
    if plan.num_blocks < 2:
        raise KvlabValueError(
            f"the KV pool would hold {plan.num_blocks} block(s) of {per_block} bytes; it needs at least 2 "
            "(block 0 is the null block): raise num_gpu_blocks or kv_cache_memory_gib"
        )
    return plan


def _plan_hybrid_pool(config: EngineConfig, cache_dtype: torch.dtype, weights_bytes: int,
                      groups: tuple[KVCacheGroupSpec, ...]) -> HybridKVCachePlan:
    """``plan_pool`` for KV cache groups: a block is ``layers_per_group`` pages; the default counts each group."""
    in_flight = config.max_num_batched_tokens
    layers_per_group = max(len(g.layer_names) for g in groups)
    per_block = layers_per_group * groups[0].kv_cache_spec.page_size_bytes
    num_gpu_blocks, memory_gib = config.num_gpu_blocks, config.kv_cache_memory_gib
    if num_gpu_blocks is None and memory_gib is None:
        per_request = sum(g.kv_cache_spec.max_num_blocks_per_request(config.max_model_len, in_flight) for g in groups)
        wanted = 1 + config.max_num_seqs * per_request
        num_gpu_blocks = max(2, min(wanted, int(DEFAULT_KV_CACHE_MEMORY_GIB * GiB) // per_block))
    if num_gpu_blocks is not None:
        memory_gib = num_gpu_blocks * per_block / GiB
    plan = plan_hybrid_kv_cache(
        config.model_config.spec, max_model_len=config.max_model_len, block_size=config.block_size,
        kv_dtype=kv_dtype_name(cache_dtype), max_num_batched_tokens=in_flight, async_scheduling=False,
        gpu_memory_gib=_device_memory_gib(config.device), weights_gib=weights_bytes / GiB,
        kv_cache_memory_gib=memory_gib, tp=config.tensor_parallel_size)
    assert plan.kv_cache_groups == groups
    if plan.num_blocks < 2:
        raise KvlabValueError(f"the KV pool would hold {plan.num_blocks} block(s) of {per_block} bytes; it needs at "
                              "least 2 (block 0 is the null block): raise num_gpu_blocks or kv_cache_memory_gib")
    return plan


def allocate_kv_caches(config: EngineConfig, num_blocks: int, dtype: torch.dtype,
                       groups: tuple[KVCacheGroupSpec, ...] | None = None) -> list[KVCache]:
    """Zeroed caches listed per layer, each shaped by its layer's spec (``kvlab.engine.registry.kv_cache_specs``).

    A full-attention layer gets one K and one V tensor ``[num_blocks, block_size, num_kv_heads,
    head_size]``; an MLA layer one latent tensor ``[num_blocks, block_size, kv_lora_rank +
    qk_rope_head_dim]``, as vLLM's ``GPUModelRunner.initialize_kv_cache`` reshapes each layer's
    share of the pool by its ``KVCacheSpec``. One cache per layer; with KV cache ``groups``, one per
    layer slot of a group, which layer ``j`` of every group shares (vLLM's
    ``KVCacheTensor(shared_by=...)``): ``kv_caches[i]`` of two layers in different groups may be the
    same tensors.
    """
    specs = kv_cache_specs(config.model_config, config.block_size, dtype, config.tensor_parallel_size)  # one rank's
    if groups is None:
        return [allocate_kv_cache(spec, num_blocks, config.device) for spec in specs]
    _, slots = layer_groups(groups)
    shared: dict[int, KVCache] = {}
    for layer, slot in enumerate(slots):  # the layers sharing a slot have pages of one size and shape
        if slot not in shared:
            shared[slot] = allocate_kv_cache(specs[layer], num_blocks, config.device)
    return [shared[slot] for slot in slots]


def kv_cache_bytes(kv_caches: list[KVCache]) -> int:
    """Bytes of every tensor of every layer's cache: what the pool really holds (shared tensors count once)."""
    unique = {id(t): t for kv_cache in kv_caches for t in layer_tensors(kv_cache)}.values()
    return sum(t.numel() * t.element_size() for t in unique)
