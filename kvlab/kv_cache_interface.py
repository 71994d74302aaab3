"""What each attention layer needs from the KV cache: the one hierarchy of specs that planning, the manager and the
engine share.

Mirrors ``vllm/v1/kv_cache_interface.py`` (vLLM 0.33.0) for the kinds kvlab serves. ``KVCacheSpec`` is one
layer's format (``block_size`` tokens per block); ``AttentionSpec`` adds the layer's shape, ``num_kv_heads``,
``head_size``, ``head_size_v`` and ``dtype``, from which ``page_size_bytes`` (a property, as in vLLM) is
``block_size x num_kv_heads x (head_size + head_size_v) x dtype size``. Its kinds:

* ``FullAttentionSpec``: a layer that keeps every token, a K and a V per KV head;
* ``MLAAttentionSpec``: DeepSeek's latent, one "head" of ``kv_lora_rank + qk_rope_head_dim`` values and
  no V (``head_size_v = 0``), never split across tensor-parallel ranks (``max_tp_shards = 1``); the manager
  serves it as full attention, as vLLM's ``FullAttentionManager`` does;
* ``SlidingWindowSpec``: a layer whose query at position ``q`` sees only keys ``q - W + 1 .. q``.

Layers of one spec form a KV cache group (``KVCacheGroupSpec``), and every group shares one block pool: a
block id is owned by one group at a time and holds that group's layers' pages. ``kvlab.capacity.hybrid``
makes a model's specs and groups and sizes the pool; ``kvlab.core.kv_cache_coordinator`` runs one manager per
group; the engine allocates each layer's tensors from its spec (``kvlab.engine.kv_cache_interface``).

Where kvlab differs: vLLM's ``dtype`` is a ``torch.dtype``; kvlab's is a KV dtype's name (``"bf16"``,
``"fp8_e4m3"``, ``"nvfp4"``; a ``torch.dtype`` is accepted and stored by its name), so that the layers below
the engine need no torch, and a page can be sized for dtypes torch has no tensor for (NVFP4: 4-bit values plus
one fp8 scale per 16, ``vector_bytes``). The shape may be left out, ``FullAttentionSpec(16)``: a spec of
0 bytes for code that only counts blocks (the manager never reads bytes). The byte size of each KV dtype is
here too (``KV_DTYPE_BYTES``), since a page is made of them; ``kvlab.capacity.sizing`` builds on it.
Mamba layers (``MambaSpec``: one state block per request, its page fixed by the state's shape) and chunked
local attention (``ChunkedLocalAttentionSpec``) are explained in notebook 08, not modelled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from kvlab._validate import checked, non_negative_int, positive_int
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.units import cdiv

__all__ = ["KV_DTYPE_ALIASES", "KV_DTYPE_BYTES", "NVFP4_GROUP", "AttentionSpec", "FullAttentionSpec",
           "KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec", "MLAAttentionSpec", "SlidingWindowSpec",
           "canonical_kv_dtype", "dtype_bytes", "kv_dtype_name", "vector_bytes"]

# ----------------------------------------------------------------- the bytes of one stored element

#: Bytes per stored KV element. nvfp4 stores 4-bit values plus one 1-byte (fp8) scale
#: per 16 values: 0.5 + 1/16 = 0.5625 bytes per element, never rounded up to 1.
KV_DTYPE_BYTES: Mapping[str, Fraction] = {
    "fp32": Fraction(4),
    "fp16": Fraction(2),
    "bf16": Fraction(2),
    "fp8": Fraction(1),
    "fp8_e4m3": Fraction(1),
    "fp8_e5m2": Fraction(1),
    "int8": Fraction(1),
    "nvfp4": Fraction(9, 16),
}
#: Spellings from torch and vLLM that mean one of the dtypes above.
KV_DTYPE_ALIASES: Mapping[str, str] = {
    "float32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}
NVFP4_GROUP = 16  # values that share one scale


@checked
def canonical_kv_dtype(kv_dtype: str) -> str:
    """The canonical name of ``kv_dtype`` (aliases resolved); raises listing the known dtypes."""
    return _canonical(kv_dtype, "kv_dtype")


def kv_dtype_name(dtype: Any) -> str:
    """The canonical name of a KV dtype given by name or as a ``torch.dtype`` (``torch.bfloat16`` is ``"bf16"``).

    Read without importing torch: a ``torch.dtype`` is known by its type and its name."""
    return _canonical(dtype, "dtype")


def _canonical(dtype: object, parameter: str) -> str:
    name = dtype
    if type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch":
        name = str(dtype).removeprefix("torch.")
    if isinstance(name, str):
        name = KV_DTYPE_ALIASES.get(name, name)
        if name in KV_DTYPE_BYTES:
            return name
    raise UnknownNameError(parameter, dtype, list(KV_DTYPE_BYTES) + list(KV_DTYPE_ALIASES))


@checked
def dtype_bytes(kv_dtype: str) -> Fraction:
    """b, the bytes of one stored element, as an exact fraction (nvfp4: 9/16)."""
    return KV_DTYPE_BYTES[canonical_kv_dtype(kv_dtype)]


@checked
def vector_bytes(num_elements: int, kv_dtype: str) -> int:
    """Bytes of one head vector of ``num_elements`` values (nvfp4: one scale per started group of 16)."""
    return _vector_bytes(positive_int("num_elements", num_elements), canonical_kv_dtype(kv_dtype))


def _vector_bytes(n: int, name: str) -> int:
    """``vector_bytes`` for a checked count and a canonical name (0 values: 0 bytes)."""
    if name == "nvfp4":
        return math.ceil(n / 2) + math.ceil(n / NVFP4_GROUP)
    return int(n * KV_DTYPE_BYTES[name])


# ----------------------------------------------------------------- the specs


@checked
@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """One layer's KV cache format (vLLM's base class): ``block_size`` tokens per block."""

    block_size: int

    def __post_init__(self) -> None:
        positive_int("block_size", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """One layer's block of ``block_size`` tokens, in bytes (each kind derives it from its shape)."""
        raise NotImplementedError

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
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer's page: ``num_kv_heads`` heads of ``head_size`` (K) and ``head_size_v`` (V) values per token.

    ``head_size_v`` defaults to ``head_size`` (a V per K). ``max_tp_shards``: how many tensor-parallel ranks can
    split this cache (vLLM's field; None: as many as there are KV heads, and ranks beyond them hold replicas).
    Without ``num_kv_heads``, ``head_size`` and ``dtype`` the spec only counts blocks (0 bytes a page).
    """

    num_kv_heads: int = 0
    head_size: int = 0
    dtype: Any = None  # a KV dtype's name ("bf16", "fp8_e4m3", "nvfp4") or a torch.dtype, stored by its name
    head_size_v: int | None = None
    max_tp_shards: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype is None and not self.num_kv_heads and not self.head_size:  # bookkeeping only
            if self.head_size_v:
                raise KvlabValueError(f"head_size_v={self.head_size_v} needs num_kv_heads, head_size and dtype")
            object.__setattr__(self, "head_size_v", 0)
        else:
            if self.dtype is None:
                raise KvlabValueError("dtype must name the layer's KV dtype (e.g. 'bf16') when num_kv_heads or "
                                      "head_size is given: together they size the page")
            positive_int("num_kv_heads", self.num_kv_heads)
            positive_int("head_size", self.head_size)
            object.__setattr__(self, "dtype", kv_dtype_name(self.dtype))
            if self.head_size_v is None:
                object.__setattr__(self, "head_size_v", self.head_size)
        if self.max_tp_shards is not None:
            positive_int("max_tp_shards", self.max_tp_shards)

    @property
    def page_size_bytes(self) -> int:
        """``block_size x num_kv_heads x (head_size + head_size_v) x dtype size`` (vLLM's ``page_size_bytes``)."""
        if self.dtype is None:
            return 0
        per_head = _vector_bytes(self.head_size, self.dtype) + (
            _vector_bytes(self.head_size_v, self.dtype) if self.head_size_v else 0)
        return self.block_size * self.num_kv_heads * per_head


@checked
@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """A layer that attends to every earlier token: a request holds a block for every ``block_size`` tokens."""

    @property
    def kind(self) -> str:
        return "full_attention"

    @checked
    def max_num_blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int = 0) -> int:
        """``cdiv(max_model_len, block_size)``: every block, whatever is in flight."""
        return cdiv(positive_int("max_model_len", max_model_len), self.block_size)


@checked
@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """An MLA layer's page: one latent of ``head_size`` values per token and no V, whole on every TP rank."""

    num_kv_heads: int = 1
    head_size_v: int | None = 0
    max_tp_shards: int | None = 1      # the latent is whole on every TP rank: replicated, never split

    def __post_init__(self) -> None:
        if self.dtype is None or not self.head_size:
            raise KvlabValueError("an MLA layer needs its latent's head_size (kv_lora_rank + qk_rope_head_dim) and "
                                  f"dtype, got head_size={self.head_size!r}, dtype={self.dtype!r}")
        super().__post_init__()
        if (self.num_kv_heads, self.head_size_v) != (1, 0):
            raise KvlabValueError(
                f"an MLA layer caches one latent per token (num_kv_heads=1, head_size_v=0), got "
                f"num_kv_heads={self.num_kv_heads}, head_size_v={self.head_size_v}"
            )


@checked
@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A layer whose query at position ``q`` sees keys ``q - sliding_window + 1 .. q`` (the window includes q)."""

    sliding_window: int

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
        if type(group.kv_cache_spec) not in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec):
            raise KvlabValueError(f"kv_cache_groups[{i}]: kvlab manages FullAttentionSpec, MLAAttentionSpec and "
                                  f"SlidingWindowSpec groups, got {type(group.kv_cache_spec).__name__}")
        if group.kv_cache_spec.block_size != block_size:
            raise KvlabValueError(f"kv_cache_groups[{i}] has block_size={group.kv_cache_spec.block_size}; every "
                                  f"group must use the manager's block_size={block_size}")
        out.append(group)
    if not out:
        raise KvlabValueError("kv_cache_groups must hold at least one group")
    return tuple(out)
