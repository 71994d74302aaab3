"""kvlab.engine: a real Llama-family model generating through kvlab's paged cache, scheduler and kernels.

``LLMEngine`` is the serving loop, built from an ``EngineConfig``; ``load_model`` builds the decoder
from a checkpoint; ``save_tiny_llama`` writes the small seeded checkpoint tests and notebooks use offline,
``save_tiny_ministral`` its hybrid sibling (sliding-window layers beside full ones; ``kvlab.engine.hybrid``).
MLA: ``load_deepseek`` builds a DeepSeek-V3-style decoder over one latent cache per layer
(``allocate_mla_kv_caches``); ``save_tiny_deepseek`` writes its small seeded checkpoint. The registry
(``model_family``, ``kv_cache_specs``) says, per ``model_type``, which config, model and KV cache spec
(``FullAttentionSpec``, ``MLAAttentionSpec``: ``kvlab.kv_cache_interface``'s) ``LLMEngine`` and ``load_model``
use; ``allocate_kv_cache`` makes a layer's tensors from its spec. Tensor parallelism
(``LLMEngine(..., tensor_parallel_size=N)``): the sharded layers (``linear``, ``vocab_parallel_embedding``), one
rank's ``Worker`` and the loop every rank runs (``worker``), the executors that start or join the ranks
(``multiproc_executor``, ``uniproc_executor``) and torchrun's entry point (``launch``).
"""
from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use (as kvlab's own top level is), so that ``kvlab.engine.metrics`` and the other
# light modules import without torch's model code or the kernels.
_WHERE = {
    "AttentionMetadata": "kvlab.engine.attention",
    "DecoderConfig": "kvlab.engine.config",
    "DeepseekV2ForCausalLM": "kvlab.engine.deepseek",
    "load_deepseek": "kvlab.engine.deepseek",
    "DeepseekConfig": "kvlab.engine.deepseek_config",
    "EngineConfig": "kvlab.engine.engine_config",
    "FullAttentionSpec": "kvlab.kv_cache_interface",     # the one spec hierarchy, re-exported here
    "MLAAttentionSpec": "kvlab.kv_cache_interface",
    "allocate_kv_cache": "kvlab.engine.kv_cache_interface",
    "LLMEngine": "kvlab.engine.llm_engine",
    "load_model": "kvlab.engine.registry",
    "MLAAttention": "kvlab.engine.mla",
    "allocate_mla_kv_caches": "kvlab.engine.mla",
    "LlamaForCausalLM": "kvlab.engine.model",
    "ModelRunner": "kvlab.engine.model_runner",
    "copy_blocks": "kvlab.engine.model_runner",
    "prepare_inputs": "kvlab.engine.model_runner",
    "kv_cache_specs": "kvlab.engine.registry",
    "model_family": "kvlab.engine.registry",
    "save_tiny_llama": "kvlab.engine.toy",
    "save_tiny_ministral": "kvlab.engine.toy",
    "save_tiny_deepseek": "kvlab.engine.toy_mla",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'kvlab.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
