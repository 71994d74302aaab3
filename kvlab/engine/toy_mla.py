"""A tiny DeepSeek-V3-style checkpoint built with transformers, so MLA runs the real loading path offline.

``save_tiny_deepseek`` builds a small ``DeepseekV3Config`` (2 layers, hidden 64, 4 heads,
``kv_lora_rank`` 32, ``q_lora_rank`` 48, rope 8 + nope 16 per head, V 16; the first layer dense,
the second a mixture of 4 routed experts, 2 per token, plus a shared one; YaRN rotary as
DeepSeek-V3 has it), initialises it with a seeded generator and writes it with ``save_pretrained``:
``config.json`` + ``model.safetensors``. One token then caches 32 + 8 = 40 values per layer.

As for the tiny Llama (``kvlab.engine.toy``), random weights barely use the context, so attention
is sharpened: ``attention_gain`` scales the query up-projection ``q_b_proj``, the key/value
up-projection ``kv_b_proj``, ``kv_a_proj_with_mqa`` (which moves only ``k_pe``: ``c_kv`` is
normalised right after) and ``o_proj``; ``logit_gain`` scales the final norm.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvlab._validate import positive_int, positive_number
from kvlab.engine.toy import save_seeded, sharpen

#: The tiny model's shape (YaRN over an original 128 positions, factor 4, as DeepSeek-V3's 40 over 4096).
TINY_DEEPSEEK = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    tie_word_embeddings=False,
)


#: The attention projections ``sharpen`` scales in a DeepSeek-V3 layer (the low-rank ups, the latent's down, o).
DEEPSEEK_ATTENTION_PROJECTIONS = ("q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa", "o_proj")


def save_tiny_deepseek(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    attention_gain: float = 16.0,
    logit_gain: float = 20.0,
    num_hidden_layers: int = 2,
) -> Path:
    """Write a seeded tiny DeepSeek-V3 (``TINY_DEEPSEEK`` shapes) to ``path`` with ``save_pretrained``; return it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # heavy import, only when a model is built

    positive_number("attention_gain", attention_gain)
    positive_number("logit_gain", logit_gain)
    layers = positive_int("num_hidden_layers", num_hidden_layers)
    config = DeepseekV3Config(**{**TINY_DEEPSEEK, "num_hidden_layers": layers}, bos_token_id=1, eos_token_id=2)
    return save_seeded(DeepseekV3ForCausalLM, config, path, seed,
                       lambda model: sharpen(model, attention_gain, logit_gain, DEEPSEEK_ATTENTION_PROJECTIONS))
