"""kvlab.engine: a real Llama-family model generating through kvlab's paged cache and kernels.

``load_model`` builds the decoder from a checkpoint; ``save_tiny_llama`` writes the small
seeded checkpoint tests and notebooks use offline.
"""

from kvlab.engine.attention import AttentionMetadata
from kvlab.engine.config import DecoderConfig
from kvlab.engine.loader import load_model
from kvlab.engine.model import LlamaForCausalLM
from kvlab.engine.toy import save_tiny_llama

__all__ = ["AttentionMetadata", "DecoderConfig", "LlamaForCausalLM", "load_model", "save_tiny_llama"]
