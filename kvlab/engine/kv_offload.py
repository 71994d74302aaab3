"""The worker side of the CPU tier: the block copies between the GPU's caches and CPU tensors.

``kvlab.core.kv_offload`` decides which blocks move (vLLM's ``OffloadingConnector`` and
``CPUOffloadingManager``); this module moves them, as vLLM's offloading worker and its
``swap_blocks`` do (``vllm/v1/kv_offload/worker/``, vLLM 0.33.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlab._validate import positive_int
from kvlab.core.kv_offload import BlockTransfer, KVConnectorMetadata, OffloadingConnector


def transfer_blocks(src_caches: Sequence[Any], dst_caches: Sequence[Any], transfers: Sequence[BlockTransfer]) -> None:
    """Copy whole blocks ``src -> dst`` in every layer's K and V from one set of caches to another (``swap_blocks``)."""
    if not transfers:
        return
    src = torch.tensor([s for s, _ in transfers], dtype=torch.int64, device=src_caches[0][0].device)
    dst = torch.tensor([d for _, d in transfers], dtype=torch.int64, device=dst_caches[0][0].device)
    for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches, strict=True):
        dst_k[dst] = src_k[src].to(dst_k.device)  # [num_transfers, block_size, num_kv_heads, head_size]
        dst_v[dst] = src_v[src].to(dst_v.device)


def allocate_cpu_kv_caches(gpu_kv_caches: Sequence[Any], num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CPU tensors shaped like the GPU caches but with ``num_blocks`` blocks (pinned memory on a CUDA machine)."""
    num_blocks = positive_int("num_blocks", num_blocks)
    out = []
    for key_cache, value_cache in gpu_kv_caches:  # each [num_gpu_blocks, block_size, num_kv_heads, head_size]
        shape = (num_blocks, *key_cache.shape[1:])
        pin = key_cache.is_cuda
        out.append((torch.zeros(shape, dtype=key_cache.dtype, pin_memory=pin),
                    torch.zeros(shape, dtype=value_cache.dtype, pin_memory=pin)))
    return out


class OffloadingExecutor:
    """Wraps an executor: makes the step's CPU-tier copies (stores, then loads) before the model runs."""

    def __init__(self, inner: Any, gpu_kv_caches: Sequence[Any], cpu_kv_caches: Sequence[Any],
                 connector: OffloadingConnector) -> None:
        self.inner = inner
        self.gpu_kv_caches = gpu_kv_caches
        self.cpu_kv_caches = cpu_kv_caches
        self.connector = connector

    def execute_model(self, scheduler_output: Any) -> Any:
        meta: KVConnectorMetadata | None = scheduler_output.kv_connector_metadata
        if meta is not None:
            transfer_blocks(self.gpu_kv_caches, self.cpu_kv_caches, meta.stores)
            transfer_blocks(self.cpu_kv_caches, self.gpu_kv_caches, meta.loads)
        return self.inner.execute_model(scheduler_output)
