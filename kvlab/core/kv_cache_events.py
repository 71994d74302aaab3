"""The plain records ``BlockPool`` queues when KV cache events are on (vLLM 0.33.0's ``kv_event_queue``).

vLLM's pool appends ``vllm.distributed.kv_events`` msgspec structs directly; kvlab's core imports
no serialiser, so it queues these frozen dataclasses with the same names and fields, and
``kvlab.distributed.kv_events.to_wire`` turns each into the struct vLLM's decoder reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEDIUM_GPU = "GPU"


@dataclass(frozen=True)
class BlockStored:
    """Full blocks just cached: their hashes, the hash before the first one, and their tokens."""

    block_hashes: tuple[Any, ...]
    parent_block_hash: Any | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """A hash left the prefix cache (the block was evicted or re-keyed)."""

    block_hashes: tuple[Any, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """``reset_prefix_cache`` forgot every hash."""


KVCacheEventRecord = BlockStored | BlockRemoved | AllBlocksCleared
