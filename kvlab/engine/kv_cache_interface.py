"""The tensors an engine allocates for one layer's KV cache, shaped by that layer's spec.

vLLM asks every attention layer for its ``KVCacheSpec`` (``vllm/v1/kv_cache_interface.py``), sizes the
pool from the specs' ``page_size_bytes`` and reshapes each layer's share of it by the spec
(``GPUModelRunner.initialize_kv_cache``). kvlab's specs are the one hierarchy of
``kvlab.kv_cache_interface`` (the same classes planning and the manager use); this module is their tensor
side, the only part that needs torch:

* ``FullAttentionSpec`` (and ``SlidingWindowSpec``): a K and a V per KV head, allocated as two tensors
  ``[num_blocks, block_size, num_kv_heads, head_size]`` (vLLM stacks the two in one ``[2, num_blocks, ...]``
  tensor for its flash layout);
* ``MLAAttentionSpec``: one latent per token, ``c_kv`` then ``k_pe``, as one "head" of
  ``head_size = kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V3) and ``head_size_v = 0``: no
  separate V. It is one tensor ``[num_blocks, block_size, head_size]``. vLLM's MLA layer sets
  ``max_tp_shards = 1`` (``vllm/model_executor/layers/attention/mla_attention.py``): the latent cannot
  be split across tensor-parallel ranks, so every rank beyond the first holds a replica.

So a layer's cache, ``KVCache``, is a ``(key_cache, value_cache)`` pair or one latent tensor;
``layer_tensors`` gives both kinds as a tuple, for code that copies whole blocks whatever the kind.
"""

from __future__ import annotations

import torch

from kvlab._validate import positive_int
from kvlab.errors import KvlabValueError
from kvlab.kv_cache_interface import AttentionSpec, MLAAttentionSpec

#: One layer's cache: (key_cache, value_cache), each [num_blocks, block_size, Hkv, D]; or MLA's latent
#: cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].
KVCache = tuple[torch.Tensor, torch.Tensor] | torch.Tensor

#: The torch dtype of each KV dtype the engine can allocate (a spec names its dtype; nvfp4 has no tensor here).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8,
}


def layer_tensors(kv_cache: KVCache) -> tuple[torch.Tensor, ...]:
    """The tensors of one layer's cache, each indexed by block first: ``(K, V)``, or ``(latent,)``."""
    return (kv_cache,) if isinstance(kv_cache, torch.Tensor) else tuple(kv_cache)


def allocate_kv_cache(spec: AttentionSpec, num_blocks: int, device: str | torch.device = "cpu") -> KVCache:
    """Zeroed caches for one layer of ``spec``: K and V ``[num_blocks, block_size, num_kv_heads, head_size]``,
    or MLA's one latent ``[num_blocks, block_size, head_size]``. Their bytes are ``num_blocks`` pages."""
    if not isinstance(spec, AttentionSpec) or spec.dtype is None:
        raise KvlabValueError(f"spec must be an attention spec with a shape and a dtype, got {spec!r}")
    if spec.dtype not in TORCH_DTYPES:
        raise KvlabValueError(f"the engine allocates {sorted(TORCH_DTYPES)} caches, not {spec.dtype!r}")
    num_blocks, dtype = positive_int("num_blocks", num_blocks), TORCH_DTYPES[spec.dtype]
    if isinstance(spec, MLAAttentionSpec):
        return torch.zeros((num_blocks, spec.block_size, spec.head_size), dtype=dtype, device=device)
    key = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    value = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size_v)
    return torch.zeros(key, dtype=dtype, device=device), torch.zeros(value, dtype=dtype, device=device)
