"""A tiny Llama checkpoint built with transformers, so tests and notebooks run the real loading path offline.

The workbook downloads nothing. Instead, ``save_tiny_llama`` builds a small ``LlamaConfig``,
initialises it with a seeded generator, and writes it with ``save_pretrained``: the same
``config.json`` + ``model.safetensors`` a real checkpoint has.

A randomly initialised model barely uses its context: its weights are so small that the
next token depends mostly on the current one, so a broken KV cache would go unnoticed.
``attention_gain`` scales the q, k, v and o projections until attention is sharp and its
output matters, which makes greedy tokens depend on early prompt tokens (the tests check
exactly that); ``logit_gain`` scales the final norm so the next-token distribution is peaked
enough for sampling at temperature 1 to follow the model rather than the dice.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvlab._validate import positive_int, positive_number
from kvlab.errors import KvlabValueError, UnknownNameError

#: The tiny model's shape: 2 layers of GQA (4 query heads, 2 KV heads, head size 16).
TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def save_tiny_llama(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    attention_gain: float = 8.0,
    logit_gain: float = 20.0,
    num_hidden_layers: int = 2,
    num_key_value_heads: int = 2,
) -> Path:
    """Write a seeded tiny Llama (``TINY_LLAMA`` shapes) to ``path`` with ``save_pretrained``; return ``path``.

    ``num_key_value_heads=1`` makes it MQA: one KV head, fewer than two tensor-parallel ranks (notebook 11).
    """
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy import, only when a model is built

    positive_number("attention_gain", attention_gain)
    positive_number("logit_gain", logit_gain)
    heads = positive_int("num_key_value_heads", num_key_value_heads)
    if TINY_LLAMA["num_attention_heads"] % heads:
        raise KvlabValueError(f"num_key_value_heads={heads} must divide num_attention_heads="
                              f"{TINY_LLAMA['num_attention_heads']}")
    config = LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": positive_int("num_hidden_layers", num_hidden_layers),
                            "num_key_value_heads": heads}, bos_token_id=1, eos_token_id=2)
    return save_seeded(LlamaForCausalLM, config, path, seed, lambda model: sharpen(model, attention_gain, logit_gain))


#: The tiny hybrid model: ``TINY_LLAMA``'s shapes in four layers, sliding and full attention in turn (Ministral).
TINY_MINISTRAL_LAYER_TYPES = ("sliding_attention", "full_attention") * 2


def save_tiny_ministral(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    sliding_window: int = 16,
    layer_types: tuple[str, ...] | None = None,
    attention_gain: float = 8.0,
    logit_gain: float = 20.0,
) -> Path:
    """Write a seeded tiny Ministral (a Mistral whose layers alternate a sliding window with full attention).

    The weights are those ``save_tiny_llama`` would draw for ``TINY_LLAMA``'s shapes with four layers
    and the same ``seed``, sharpened the same way, so the window matters to the tokens: the same
    weights saved with every layer full attention (``layer_types``) generate differently once a
    context is longer than ``sliding_window``.
    """
    from transformers import MinistralConfig, MinistralForCausalLM  # heavy import, only when a model is built

    positive_int("sliding_window", sliding_window)
    types = list(layer_types or TINY_MINISTRAL_LAYER_TYPES)
    config = MinistralConfig(**{**TINY_LLAMA, "num_hidden_layers": len(types)}, sliding_window=sliding_window,
                             layer_types=types, bos_token_id=1, eos_token_id=2)
    gains = positive_number("attention_gain", attention_gain), positive_number("logit_gain", logit_gain)
    return save_seeded(MinistralForCausalLM, config, path, seed, lambda model: sharpen(model, *gains))


def save_tiny_qwen(
    path: str | os.PathLike,
    *,
    model_type: str = "qwen3",
    seed: int = 0,
    sliding_window: int = 8,
    max_window_layers: int = 2,
    layer_types: tuple[str, ...] | None = None,
    num_hidden_layers: int = 4,
    attention_gain: float = 8.0,
    logit_gain: float = 20.0,
) -> Path:
    """Write a seeded tiny Qwen3 (q/k norms) or Qwen2 (q/k/v biases) with ``use_sliding_window`` on.

    Without ``layer_types`` transformers' own rule picks the sliding layers: those from
    ``max_window_layers`` on (the first ``max_window_layers`` attend fully); ``TINY_LLAMA``'s other
    shapes, sharpened as ``save_tiny_llama`` does, so the window matters to the tokens.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if model_type not in classes:
        raise UnknownNameError("model_type", model_type, classes)
    config_class, model_class = classes[model_type]
    gains = positive_number("attention_gain", attention_gain), positive_number("logit_gain", logit_gain)
    config = config_class(**{**TINY_LLAMA, "num_hidden_layers": positive_int("num_hidden_layers", num_hidden_layers)},
                          use_sliding_window=True, sliding_window=positive_int("sliding_window", sliding_window),
                          max_window_layers=max_window_layers, layer_types=list(layer_types) if layer_types else None,
                          bos_token_id=1, eos_token_id=2)
    return save_seeded(model_class, config, path, seed, lambda model: sharpen(model, *gains))


#: The tiny Gemma 3: ``TINY_LLAMA``'s shapes in six layers, two sliding then one full, twice (``sliding_window_pattern``
#: 3, transformers' rule), a softmax scale from ``query_pre_attn_scalar`` (not ``head_dim``) and other rotary bases.
TINY_GEMMA3 = dict(num_hidden_layers=6, sliding_window_pattern=3, query_pre_attn_scalar=24,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def save_tiny_gemma3(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    sliding_window: int = 8,
    layer_types: tuple[str, ...] | None = None,
    final_logit_softcapping: float | None = None,
    attention_gain: float = 8.0,
    logit_gain: float = 20.0,
) -> Path:
    """Write a seeded tiny Gemma 3 text model (``Gemma3ForCausalLM``, ``model_type`` "gemma3_text").

    ``TINY_GEMMA3``'s layers (or ``layer_types``). Gemma's norms are stored as offsets from 1 and transformers
    initialises them to 0; here each gets a seeded offset, so a norm read as ``weight`` instead of ``1 + weight``,
    or one norm used in another's place, changes the tokens. The q/k norms then scale by ``attention_gain ** 0.5``
    each (q and k are normed, so their projections cannot sharpen attention) and the final norm by ``logit_gain``.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    gains = positive_number("attention_gain", attention_gain), positive_number("logit_gain", logit_gain)
    types = {"layer_types": list(layer_types)} if layer_types else {}
    config = Gemma3TextConfig(**{**TINY_LLAMA, **TINY_GEMMA3, **types}, sliding_window=positive_int(
        "sliding_window", sliding_window), final_logit_softcapping=final_logit_softcapping, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    return save_seeded(Gemma3ForCausalLM, config, path, seed, lambda model: sharpen_gemma(model, *gains, seed=seed))


def sharpen_gemma(model: torch.nn.Module, attention_gain: float, logit_gain: float, seed: int = 0) -> None:
    """Give every Gemma norm an offset drawn from ``seed``, then sharpen attention and logits (in place;
    ``save_tiny_gemma3`` says why)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.25 * torch.randn(param.shape, generator=generator))
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.mul_(attention_gain**0.5).add_(attention_gain**0.5 - 1)
        model.model.norm.weight.mul_(logit_gain).add_(logit_gain - 1)


def save_seeded(model_class: Any, config: Any, path: str | os.PathLike, seed: int,
                sharpen: Callable[[Any], None]) -> Path:
    """Build ``model_class(config)`` from a seeded generator, ``sharpen`` it in place, ``save_pretrained`` to ``path``.

    The seed is forked, so the caller's random state is untouched; every tiny checkpoint of the
    workbook (``save_tiny_llama``, ``save_tiny_ministral``, ``save_tiny_deepseek``) is written this way.
    """
    with torch.random.fork_rng():  # seed the init without touching the caller's random state
        torch.manual_seed(seed)
        model = model_class(config)
    with torch.no_grad():
        sharpen(model)
    path = Path(path)
    model.save_pretrained(path)
    return path


#: The attention projections ``sharpen`` scales in a Llama-family layer (DeepSeek's are in ``toy_mla``).
LLAMA_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def sharpen(model: torch.nn.Module, attention_gain: float, logit_gain: float,
            projections: tuple[str, ...] = LLAMA_ATTENTION_PROJECTIONS) -> None:
    """Scale each layer's attention ``projections`` by ``attention_gain`` and the final norm by ``logit_gain``
    (in place; the module's docstring says why)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for name in projections:
                getattr(layer.self_attn, name).weight.mul_(attention_gain)
        model.model.norm.weight.mul_(logit_gain)


def random_token_ids(length: int, seed: int, vocab_size: int = TINY_LLAMA["vocab_size"]) -> list[int]:
    """``length`` reproducible token ids in ``[3, vocab_size)`` (0, 1 and 2 are pad, BOS and EOS)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (positive_int("length", length),), generator=generator).tolist()
