"""Start-up steps 4 and 5 of an ``LLMEngine``: how many KV blocks the pool gets, and the tensors that hold them.

vLLM's worker profiles the GPU to find the memory left for KV (``determine_available_memory``
in ``vllm/v1/worker/gpu_worker.py``), cuts it into blocks (``get_kv_cache_configs`` in
``vllm/v1/core/kv_cache_utils.py``) and allocates one tensor per layer
(``GPUModelRunner.initialize_kv_cache``), shaped by the layer's ``KVCacheSpec``. kvlab does not
profile: the pool is a block count, a memory budget (``kvlab.capacity.budget`` cuts it), or by
default what ``max_num_seqs`` requests of ``max_model_len`` tokens need, within
``DEFAULT_KV_CACHE_MEMORY_GIB``.
"""

from __future__ import annotations

import os

import torch

from kvlab.capacity.budget import KVCachePlan, plan_kv_cache
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.engine.engine_config import EngineConfig
from kvlab.engine.kv_cache_interface import KVCache, layer_tensors
from kvlab.engine.registry import kv_cache_specs
from kvlab.errors import KvlabValueError
from kvlab.units import GiB, cdiv

_SIZING_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.float8_e4m3fn: "fp8_e4m3"}
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


def plan_pool(config: EngineConfig, cache_dtype: torch.dtype, weights_bytes: int) -> KVCachePlan:
    """How many blocks the pool gets: ``num_gpu_blocks``, or what ``kv_cache_memory_gib`` buys, or by default
    room for ``max_num_seqs`` requests of ``max_model_len`` tokens within ``DEFAULT_KV_CACHE_MEMORY_GIB``."""
    spec, block_size = config.model_config.spec, config.block_size
    per_block = kv_bytes_per_token(spec, _SIZING_NAMES[cache_dtype]) * block_size
    num_gpu_blocks, memory_gib = config.num_gpu_blocks, config.kv_cache_memory_gib
    if num_gpu_blocks is None and memory_gib is None:
        wanted = 1 + config.max_num_seqs * cdiv(config.max_model_len, block_size)
        num_gpu_blocks = max(2, min(wanted, int(DEFAULT_KV_CACHE_MEMORY_GIB * GiB) // per_block))
    if num_gpu_blocks is not None:
        memory_gib = num_gpu_blocks * per_block / GiB  # exact: GiB = 2**30
    plan = plan_kv_cache(
        spec, gpu_memory_gib=_device_memory_gib(config.device), weights_gib=weights_bytes / GiB,
        kv_cache_memory_gib=memory_gib, kv_dtype=_SIZING_NAMES[cache_dtype],
        block_size=block_size, max_model_len=config.max_model_len,
    )
    if plan.num_blocks < 2:
        raise KvlabValueError(
            f"the KV pool would hold {plan.num_blocks} block(s) of {per_block} bytes; it needs at least 2 "
            "(block 0 is the null block): raise num_gpu_blocks or kv_cache_memory_gib"
        )
    return plan


def allocate_kv_caches(config: EngineConfig, num_blocks: int, dtype: torch.dtype) -> list[KVCache]:
    """One zeroed cache per layer, shaped by the layer's spec (``kvlab.engine.registry.kv_cache_specs``).

    A full-attention layer gets one K and one V tensor ``[num_blocks, block_size, num_kv_heads,
    head_size]``; an MLA layer one latent tensor ``[num_blocks, block_size, kv_lora_rank +
    qk_rope_head_dim]``, as vLLM's ``GPUModelRunner.initialize_kv_cache`` reshapes each layer's
    share of the pool by its ``KVCacheSpec``.
    """
    specs = kv_cache_specs(config.model_config, config.block_size, dtype)
    return [spec.allocate(num_blocks, config.device) for spec in specs]


def kv_cache_bytes(kv_caches: list[KVCache]) -> int:
    """Bytes of every tensor of every layer's cache: what the pool really holds."""
    return sum(t.numel() * t.element_size() for kv_cache in kv_caches for t in layer_tensors(kv_cache))
