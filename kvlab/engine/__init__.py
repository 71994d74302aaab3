"""kvlab.engine: a real Llama-family model generating through kvlab's paged cache, scheduler and kernels.

``LLMEngine`` is the serving loop, built from an ``EngineConfig``; ``load_model`` builds the decoder
from a checkpoint; ``save_tiny_llama`` writes the small seeded checkpoint tests and notebooks use offline,
``save_tiny_ministral`` its hybrid sibling (sliding-window layers beside full ones; ``kvlab.engine.hybrid``).
MLA: ``load_deepseek`` builds a DeepSeek-V3-style decoder over one latent cache per layer
(``allocate_mla_kv_caches``); ``save_tiny_deepseek`` writes its small seeded checkpoint. The registry
(``model_family``, ``kv_cache_specs``) says, per ``model_type``, which config, model and KV cache spec
(``FullAttentionSpec``, ``MLAAttentionSpec``) ``LLMEngine`` and ``load_model`` use.
"""

from kvlab.engine.attention import AttentionMetadata
from kvlab.engine.config import DecoderConfig
from kvlab.engine.deepseek import DeepseekV2ForCausalLM, load_deepseek
from kvlab.engine.deepseek_config import DeepseekConfig
from kvlab.engine.engine_config import EngineConfig
from kvlab.engine.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.loader import load_model
from kvlab.engine.mla import MLAAttention, allocate_mla_kv_caches
from kvlab.engine.model import LlamaForCausalLM
from kvlab.engine.model_runner import ModelRunner, copy_blocks, prepare_inputs
from kvlab.engine.registry import kv_cache_specs, model_family
from kvlab.engine.toy import save_tiny_llama, save_tiny_ministral
from kvlab.engine.toy_mla import save_tiny_deepseek

__all__ = [
    "AttentionMetadata",
    "DecoderConfig",
    "DeepseekConfig",
    "DeepseekV2ForCausalLM",
    "EngineConfig",
    "FullAttentionSpec",
    "LLMEngine",
    "LlamaForCausalLM",
    "MLAAttention",
    "MLAAttentionSpec",
    "ModelRunner",
    "allocate_mla_kv_caches",
    "copy_blocks",
    "kv_cache_specs",
    "load_deepseek",
    "load_model",
    "model_family",
    "prepare_inputs",
    "save_tiny_deepseek",
    "save_tiny_llama",
    "save_tiny_ministral",
]
