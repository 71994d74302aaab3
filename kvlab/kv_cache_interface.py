"""What each attention layer needs from the KV cache: the specs that planning and the manager share.

Mirrors ``vllm/v1/kv_cache_interface.py`` (vLLM 0.33.0) for the two kinds kvlab serves:
``FullAttentionSpec`` (a layer that keeps every token) and ``SlidingWindowSpec`` (a layer whose
query at position ``q`` sees only keys ``q - W + 1 .. q``). Layers of one spec form a KV cache
group (``KVCacheGroupSpec``), and every group shares one block pool: a block id is owned by one
group at a time and holds that group's layers' pages. ``kvlab.capacity.hybrid`` groups a model's
layers and sizes the pool; ``kvlab.core.kv_cache_coordinator`` runs one manager per group.

vLLM's spec holds ``num_kv_heads``, ``head_size`` and a torch dtype and derives the page from them;
kvlab's holds the page in bytes directly (``kvlab.capacity.sizing.page_size_bytes`` computes it,
FP8 and NVFP4 included), so the manager, which never touches bytes, can use a spec of 0 bytes.
Mamba layers (``MambaSpec``: one state block per request, its page fixed by the state's shape) and
chunked local attention (``ChunkedLocalAttentionSpec``) are explained in notebook 08, not modelled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvlab._validate import checked, non_negative_int, positive_int
from kvlab.errors import KvlabValueError
from kvlab.units import cdiv

__all__ = ["FullAttentionSpec", "KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec", "SlidingWindowSpec"]


@checked
@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """One layer's KV cache format: ``block_size`` tokens per block and the bytes of one layer's page."""

    block_size: int
    page_size_bytes: int = 0  # one layer's block of block_size tokens (0: bookkeeping only)

    def __post_init__(self) -> None:
        positive_int("block_size", self.block_size)
        non_negative_int("page_size_bytes", self.page_size_bytes)

    @property
    def kind(self) -> str:
        """``"full_attention"`` or ``"sliding_attention"``: the name a ``config.json``'s ``layer_types`` uses."""
        raise NotImplementedError

    @checked
    def max_num_blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Blocks one request of ``max_model_len`` tokens can hold at once in a group of this spec."""
        raise NotImplementedError

    @checked
    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """vLLM's ``max_memory_usage_bytes``: the most one request's pages take in one layer."""
        return self.max_num_blocks_per_request(max_model_len, max_in_flight_tokens) * self.page_size_bytes


@checked
@dataclasses.dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """A layer that attends to every earlier token: a request holds a block for every ``block_size`` tokens."""

    @property
    def kind(self) -> str:
        return "full_attention"

    @checked
    def max_num_blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int = 0) -> int:
        """``cdiv(max_model_len, block_size)``: every block, whatever is in flight."""
        return cdiv(positive_int("max_model_len", max_model_len), self.block_size)


@checked
@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A layer whose query at position ``q`` sees keys ``q - sliding_window + 1 .. q`` (the window includes q)."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        positive_int("sliding_window", self.sliding_window)

    @property
    def kind(self) -> str:
        return "sliding_attention"

    @checked
    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """vLLM 0.33.0's cap: ``cdiv(min(W - 1 + in_flight, max_model_len), block_size) + 1``.

        A request keeps the last ``W - 1`` computed tokens plus the tokens scheduled but not yet
        computed (frees happen on computed tokens), never more than ``max_model_len``; the ``+ 1``
        is because the kept tokens rarely start at a block boundary: with block size 4, the four
        tokens C D E F can straddle two blocks, ``[x x C D][E F . .]``.
        """
        in_flight = non_negative_int("max_in_flight_tokens", max_in_flight_tokens)
        num_tokens = min(self.sliding_window - 1 + in_flight, positive_int("max_model_len", max_model_len))
        return cdiv(num_tokens, self.block_size) + 1

    @checked
    def max_num_blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        return self.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)

    @checked
    def num_contiguous_blocks_for_hit(self) -> int:
        """Blocks a prefix hit must find in a row, those the next token's window reaches: ``cdiv(W - 1, block_size)``.

        The next token sees itself and the ``W - 1`` tokens before it."""
        return cdiv(self.sliding_window - 1, self.block_size)


@checked
@dataclasses.dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table, and their common spec (vLLM's ``KVCacheGroupSpec``)."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise KvlabValueError(f"kv_cache_spec must be a KVCacheSpec, got {self.kv_cache_spec!r}")
        object.__setattr__(self, "layer_names", tuple(self.layer_names))


@checked
@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """The pool's block count and its groups (vLLM's ``KVCacheConfig``, without tensors: the engine makes those)."""

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        positive_int("num_blocks", self.num_blocks)
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))


@checked
def as_group_specs(groups: Sequence[KVCacheGroupSpec | KVCacheSpec], block_size: int) -> tuple[KVCacheGroupSpec, ...]:
    """``groups`` as ``KVCacheGroupSpec``s (a bare spec gets no layer names), each checked against ``block_size``.

    kvlab's manager gives every group the same block size, which equal page sizes imply for
    layers of equal KV width (vLLM may give groups different block sizes; kvlab does not).
    """
    out = []
    for i, group in enumerate(groups):
        if isinstance(group, KVCacheSpec):
            group = KVCacheGroupSpec((), group)
        if not isinstance(group, KVCacheGroupSpec):
            raise KvlabValueError(f"kv_cache_groups[{i}] must be a KVCacheSpec or KVCacheGroupSpec, got {group!r}")
        if type(group.kv_cache_spec) not in (FullAttentionSpec, SlidingWindowSpec):
            raise KvlabValueError(f"kv_cache_groups[{i}]: kvlab manages FullAttentionSpec and SlidingWindowSpec "
                                  f"groups, got {type(group.kv_cache_spec).__name__}")
        if group.kv_cache_spec.block_size != block_size:
            raise KvlabValueError(f"kv_cache_groups[{i}] has block_size={group.kv_cache_spec.block_size}; every "
                                  f"group must use the manager's block_size={block_size}")
        out.append(group)
    if not out:
        raise KvlabValueError("kv_cache_groups must hold at least one group")
    return tuple(out)
