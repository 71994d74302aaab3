"""kvlab.engine: a real Llama-family model generating through kvlab's paged cache, scheduler and kernels.

``LLMEngine`` is the serving loop, built from an ``EngineConfig``; ``load_model`` builds the decoder
from a checkpoint; ``save_tiny_llama`` writes the small seeded checkpoint tests and notebooks use offline.
"""

from kvlab.engine.attention import AttentionMetadata
from kvlab.engine.config import DecoderConfig
from kvlab.engine.engine_config import EngineConfig
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.loader import load_model
from kvlab.engine.model import LlamaForCausalLM
from kvlab.engine.model_runner import ModelRunner, copy_blocks, prepare_inputs
from kvlab.engine.toy import save_tiny_llama

__all__ = [
    "AttentionMetadata",
    "DecoderConfig",
    "EngineConfig",
    "LLMEngine",
    "LlamaForCausalLM",
    "ModelRunner",
    "copy_blocks",
    "load_model",
    "prepare_inputs",
    "save_tiny_llama",
]
