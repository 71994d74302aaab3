"""The worker side of the CPU tier: the block copies between the GPU's caches and CPU tensors.

``kvlab.core.kv_offload`` decides which blocks move (vLLM's ``OffloadingConnector`` and
``CPUOffloadingManager``); this module moves them, as vLLM's offloading worker and its
``swap_blocks`` do (``vllm/v1/kv_offload/cpu/gpu_worker.py``, vLLM 0.33.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlab._validate import positive_int
from kvlab.core.kv_offload import BlockTransfer, KVConnectorMetadata, OffloadingConnector
from kvlab.engine.kv_cache_interface import KVCache, layer_tensors
from kvlab.errors import KvlabValueError


def transfer_blocks(src_caches: Sequence[KVCache], dst_caches: Sequence[KVCache],
                    transfers: Sequence[BlockTransfer]) -> None:
    """Copy whole blocks ``src -> dst`` in every layer's cache (K and V, or MLA's latent) from one set of caches
    to another (``swap_blocks``)."""
    if not transfers:
        return
    num_src, num_dst = layer_tensors(src_caches[0])[0].shape[0], layer_tensors(dst_caches[0])[0].shape[0]
    for i, (s, d) in enumerate(transfers):
        if not (0 <= s < num_src and 0 <= d < num_dst):
            raise KvlabValueError(f"transfers[{i}] = ({s}, {d}): a source block must be in [0, {num_src}) and a "
                                  f"destination block in [0, {num_dst})")
    src = torch.tensor([s for s, _ in transfers], dtype=torch.int64, device=layer_tensors(src_caches[0])[0].device)
    dst = torch.tensor([d for _, d in transfers], dtype=torch.int64, device=layer_tensors(dst_caches[0])[0].device)
    for src_cache, dst_cache in zip(src_caches, dst_caches, strict=True):
        for src_t, dst_t in zip(layer_tensors(src_cache), layer_tensors(dst_cache), strict=True):
            dst_t[dst] = src_t[src].to(dst_t.device)  # [num_transfers, block_size, ...]


def allocate_cpu_kv_caches(gpu_kv_caches: Sequence[KVCache], num_blocks: int) -> list[KVCache]:
    """CPU tensors shaped like the GPU caches (K and V, or one latent) but with ``num_blocks`` blocks (pinned
    memory on a CUDA machine)."""
    num_blocks = positive_int("num_blocks", num_blocks)

    def like(cache: torch.Tensor) -> torch.Tensor:  # [num_gpu_blocks, block_size, ...] -> [num_blocks, ...]
        return torch.zeros((num_blocks, *cache.shape[1:]), dtype=cache.dtype, pin_memory=cache.is_cuda)

    return [like(kv) if isinstance(kv, torch.Tensor) else tuple(like(t) for t in kv) for kv in gpu_kv_caches]


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
