"""What one layer's KV cache looks like: vLLM's KV cache specs, and the tensors an engine allocates from them.

vLLM asks every attention layer for its ``KVCacheSpec`` (``vllm/v1/kv_cache_interface.py``) and sizes
the pool from the specs' ``page_size_bytes``: the bytes of one block of ``block_size`` tokens in that
layer. Two kinds are served here:

* ``FullAttentionSpec``: a K and a V per KV head, ``num_kv_heads x (head_size + head_size_v)`` values
  per token; kvlab allocates them as two tensors ``[num_blocks, block_size, num_kv_heads, head_size]``
  (vLLM stacks the two in one ``[2, num_blocks, ...]`` tensor for its flash layout);
* ``MLAAttentionSpec``: one latent per token, ``c_kv`` then ``k_pe``, as one "head" of
  ``head_size = kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V3) and ``head_size_v = 0``: no
  separate V. It is one tensor ``[num_blocks, block_size, head_size]``. vLLM's MLA layer sets
  ``max_tp_shards = 1`` (``vllm/model_executor/layers/attention/mla_attention.py``): the latent cannot
  be split across tensor-parallel ranks, so every rank beyond the first holds a replica.

So a layer's cache, ``KVCache``, is a ``(key_cache, value_cache)`` pair or one latent tensor;
``layer_tensors`` gives both kinds as a tuple, for code that copies whole blocks whatever the kind.

These are the tensor side of vLLM's specs (heads, sizes, a torch dtype). The manager's side of the
same layers, the page in bytes and the attention kind (full or sliding window) that KV cache groups
are made of, is ``kvlab.kv_cache_interface``, which ``core`` and ``capacity`` use without torch. An
``LLMEngine`` holds both, ``kv_cache_specs`` per layer and ``kv_cache_groups``, and they page alike
(``tests/engine/test_mla_engine.py``). An MLA layer is a full-attention layer to the manager.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab._validate import positive_int
from kvlab.errors import KvlabValueError

#: One layer's cache: (key_cache, value_cache), each [num_blocks, block_size, Hkv, D]; or MLA's latent
#: cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].
KVCache = tuple[torch.Tensor, torch.Tensor] | torch.Tensor


def layer_tensors(kv_cache: KVCache) -> tuple[torch.Tensor, ...]:
    """The tensors of one layer's cache, each indexed by block first: ``(K, V)``, or ``(latent,)``."""
    return (kv_cache,) if isinstance(kv_cache, torch.Tensor) else tuple(kv_cache)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec:
    """A full-attention layer's page: K and V of ``num_kv_heads`` heads for each of ``block_size`` tokens.

    ``max_tp_shards``: how many tensor-parallel ranks can split this cache (vLLM's field; None: as
    many as there are KV heads, and ranks beyond them hold replicas).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int | None = None     # None: the same as head_size (a V per K)
    max_tp_shards: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size"):
            positive_int(name, getattr(self, name))
        if not isinstance(self.dtype, torch.dtype):
            raise KvlabValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def bytes_per_token(self) -> int:
        """One token's bytes in this layer: ``num_kv_heads x (head_size + head_size_v) x dtype size``."""
        return self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        """One block of ``block_size`` tokens in this layer (vLLM's ``AttentionSpec.page_size_bytes``)."""
        return self.block_size * self.bytes_per_token

    def allocate(self, num_blocks: int, device: str | torch.device = "cpu") -> KVCache:
        """Zeroed K and V tensors, each ``[num_blocks, block_size, num_kv_heads, head_size]``."""
        shape = (positive_int("num_blocks", num_blocks), self.block_size, self.num_kv_heads, self.head_size)
        return (torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """An MLA layer's page: one latent of ``head_size`` values per token, no V (vLLM's ``MLAAttentionSpec``)."""

    num_kv_heads: int = 1
    head_size_v: int | None = 0
    max_tp_shards: int | None = 1      # the latent is whole on every TP rank: replicated, never split

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.num_kv_heads, self.head_size_v) != (1, 0):
            raise KvlabValueError(
                f"an MLA layer caches one latent per token (num_kv_heads=1, head_size_v=0), got "
                f"num_kv_heads={self.num_kv_heads}, head_size_v={self.head_size_v}"
            )

    def allocate(self, num_blocks: int, device: str | torch.device = "cpu") -> KVCache:
        """One zeroed latent cache ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``."""
        shape = (positive_int("num_blocks", num_blocks), self.block_size, self.head_size)
        return torch.zeros(shape, dtype=self.dtype, device=device)
