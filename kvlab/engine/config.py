"""What the forward pass needs from a checkpoint's ``config.json``, checked before any weight is read.

The Llama family (Llama 2/3, Mistral, Ministral, Qwen2, Qwen3, SmolLM) shares one decoder:
RMSNorm, rotary embeddings, grouped-query attention, a SwiGLU MLP. The differences kvlab
supports are data, not code: biases on q/k/v (Qwen2) are read from the weights when present,
per-head q/k RMSNorm (Qwen3) is switched on by ``model_type``, the rotary frequencies follow
``rope_parameters`` (transformers 5) or ``rope_theta`` / ``rope_scaling`` (older files), and
sliding-window layers follow ``sliding_window`` with ``layer_types`` (Ministral alternates them
with full attention; Mistral slides in every layer; Qwen2/Qwen3 slide where ``use_sliding_window``
is true, in ``layer_types``' sliding layers or else in layers ``max_window_layers`` and up, as
transformers' ``Qwen3Config`` reads them).

Gemma 3's text decoder (``gemma3_text``, vLLM's and transformers' ``Gemma3ForCausalLM``) is read by
the same class with the numbers its forward adds: the attention scale ``query_pre_attn_scalar**-0.5``,
a rotary base per layer type (``rope_parameters.sliding_attention`` / ``full_attention``, or in older
files ``rope_local_base_freq`` for the sliding layers and ``rope_theta`` for the others), the GeGLU's
``hidden_activation`` and ``final_logit_softcapping``; its layers slide as ``layer_types`` says, or
else all but every ``sliding_window_pattern``-th, and absent fields take ``Gemma3TextConfig``'s defaults
(``kvlab.capacity.models.with_family_defaults``). ``attn_logit_softcapping`` is read and not applied:
transformers' ``Gemma3Attention`` and vLLM 0.33.0's (``attn_logits_soft_cap=None``) both leave it out.
The multimodal ``gemma3`` checkpoint (a vision tower beside the decoder) is refused by name.
Everything else is refused with a message
that says why, and so is a value the forward could not use: a size that is not a positive
integer (a string "64" included), an ``rms_norm_eps`` or ``rope_theta`` that is not a positive
number (with either at or below 0 the forward would produce NaN, which would then be sampled
as token 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvlab._validate import positive_int, positive_number
from kvlab.capacity.config_fields import check_config_fields
from kvlab.capacity.models import ModelSpec, with_family_defaults
from kvlab.errors import CheckpointError, KvlabValueError, MissingConfigKeyError, UnknownNameError

ConfigT = TypeVar("ConfigT")

#: ``model_type`` values whose decoder is ``kvlab.engine.model``'s ``LlamaForCausalLM``.
LLAMA_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3")
#: ``model_type`` values of Gemma 3's text decoder (``kvlab.engine.gemma3``'s ``Gemma3ForCausalLM``).
GEMMA3_MODEL_TYPES = ("gemma3_text",)
#: Every ``model_type`` ``DecoderConfig`` reads.
SUPPORTED_MODEL_TYPES = LLAMA_MODEL_TYPES + GEMMA3_MODEL_TYPES
#: Multimodal checkpoints refused by name, with the text-only ``model_type`` kvlab serves instead.
MULTIMODAL_MODEL_TYPES = {"gemma3": "gemma3_text"}
#: ``model_type`` values whose ``sliding_window`` kvlab serves (Qwen's only where ``use_sliding_window`` is true).
SLIDING_WINDOW_MODEL_TYPES = ("mistral", "ministral", "qwen2", "qwen3", "gemma3_text")
#: The MLP's activation per family, and the config field that names it: SwiGLU, or Gemma 3's GeGLU.
ACTIVATIONS = {"llama": ("hidden_act", "silu"), "gemma3_text": ("hidden_activation", "gelu_pytorch_tanh")}
#: Families whose ``sliding_window`` counts only with ``use_sliding_window`` (transformers sets it to None otherwise).
USE_SLIDING_WINDOW_MODEL_TYPES = ("qwen2", "qwen3")
#: Rotary variants kvlab computes exactly as transformers does.
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: ``rope_type`` plus the numbers that variant reads."""

    rope_type: str
    rope_theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The shapes and constants of a Llama-family decoder (one ``config.json``)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig  # of the full-attention layers (every layer, but where sliding_rope is set)
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm over each head of q and k before the rotation
    max_position_embeddings: int | None
    eos_token_id: tuple[int, ...]
    spec: ModelSpec  # the same file read by kvlab.capacity.models, for KV sizing
    hidden_act: str = "silu"  # the MLP's gate: SwiGLU's silu, Gemma 3's gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None  # Gemma 3: attention scale = this ** -0.5 (None: head_dim)
    sliding_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' rotation (None: ``rope``)
    final_logit_softcapping: float | None = None  # Gemma 3: logits = c * tanh(logits / c)

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's attention, ``"full_attention"`` or ``"sliding_attention"`` (``config.json``'s names)."""
        return self.spec.layer_types

    @property
    def sliding_window(self) -> int | None:
        """W: a sliding layer's query at position q sees keys q - W + 1 .. q (None: no sliding layer)."""
        return self.spec.sliding_window

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of layer ``layer``, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rotation of layer ``layer``: Gemma 3's sliding layers have their own base, others share ``rope``."""
        sliding = self.layer_types[layer] == "sliding_attention"
        return self.sliding_rope if sliding and self.sliding_rope is not None else self.rope

    @property
    def attention_scale(self) -> float:
        """The softmax scale: ``head_dim ** -0.5``, or Gemma 3's ``query_pre_attn_scalar ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads that share one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], name: str | None = None) -> DecoderConfig:
        """Read and check a ``config.json`` dict; unsupported architectures and bad values raise naming the field."""
        cfg = check_config_fields(config)  # every field's type and range, by the field's name
        model_type = cfg.get("model_type")
        refuse_multimodal(model_type)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnknownNameError("model_type", model_type, SUPPORTED_MODEL_TYPES)
        gemma3 = model_type in GEMMA3_MODEL_TYPES
        cfg = with_family_defaults(cfg)  # Gemma 3's absent fields as Gemma3TextConfig fills them
        act_field, act = ACTIVATIONS["gemma3_text" if gemma3 else "llama"]
        if cfg.get(act_field, act) != act:
            raise KvlabValueError(f"{act_field}={cfg[act_field]!r} is not supported; the "
                                  f"{'GeGLU' if gemma3 else 'SwiGLU'} MLP of {model_type} needs {act!r}")
        if cfg.get("use_bidirectional_attention"):
            raise KvlabValueError("use_bidirectional_attention=true is not supported: kvlab's engine serves causal "
                                  "decoders (the KV cache holds what earlier tokens saw, never later ones)")
        if _uses_sliding_window(cfg) and model_type not in SLIDING_WINDOW_MODEL_TYPES:
            raise KvlabValueError(
                f"sliding_window={cfg.get('sliding_window')!r} is set: kvlab's engine serves sliding windows for "
                f"{', '.join(SLIDING_WINDOW_MODEL_TYPES)} only (set use_sliding_window=false or sliding_window=null "
                "to run this checkpoint with full attention)"
            )

        def need(key: str) -> int:
            if cfg.get(key) is None:
                raise MissingConfigKeyError(key)
            return positive_int(key, cfg[key])

        sizes = {key: need(key) for key in ("vocab_size", "hidden_size", "intermediate_size")}  # before the spec
        if model_type in USE_SLIDING_WINDOW_MODEL_TYPES and not _uses_sliding_window(cfg):
            # transformers' Qwen2/Qwen3Config: sliding_window = None unless use_sliding_window, so no layer slides
            cfg = {**cfg, "sliding_window": None, "layer_types": None}
        spec = ModelSpec.from_hf_config(cfg, name=name)
        max_len = cfg.get("max_position_embeddings")
        eps, tie = (cfg.get(key) for key in ("rms_norm_eps", "tie_word_embeddings"))  # absent or null: the default
        eps, tie = 1e-6 if eps is None else eps, False if tie is None else tie
        if not isinstance(tie, bool):
            raise KvlabValueError(f"tie_word_embeddings must be true or false, got {tie!r}")
        ropes = gemma3_rope_configs(cfg) if gemma3 else {}
        return cls(
            model_type=model_type,
            **sizes,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=positive_number("rms_norm_eps", eps),
            rope=ropes["full_attention"] if gemma3 else rope_config(cfg),
            tie_word_embeddings=tie,
            qk_norm=model_type in ("qwen3", *GEMMA3_MODEL_TYPES),
            max_position_embeddings=None if max_len is None else positive_int("max_position_embeddings", max_len),
            eos_token_id=eos_token_ids(cfg.get("eos_token_id")),
            spec=spec,
            hidden_act=act,
            query_pre_attn_scalar=cfg["query_pre_attn_scalar"] if gemma3 else None,
            sliding_rope=ropes["sliding_attention"] if gemma3 else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma3 else None,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> DecoderConfig:
        """Read ``model_dir/config.json``; anything wrong raises ``CheckpointError`` naming the file and the field."""
        return config_from_pretrained(cls.from_dict, model_dir)


def config_from_pretrained(from_dict: Callable[..., ConfigT], model_dir: str | os.PathLike) -> ConfigT:
    """``from_dict(config.json, name=folder name)`` for a checkpoint folder; what is wrong raises ``CheckpointError``.

    One reader for every architecture's config (``DecoderConfig``, ``DeepseekConfig``): a missing
    file, JSON that does not parse and a field ``from_dict`` refuses all name the file.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"model_dir={str(model_dir)!r} has no config.json: is it a Hugging Face checkpoint?")
    raw = read_json(path)
    try:
        return from_dict(raw, name=Path(model_dir).name)
    except KvlabValueError as error:
        raise CheckpointError(f"{path}: {error}") from error


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file, parsed; one that does not parse raises ``CheckpointError`` quoting the parser."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not a readable JSON file: {error}") from error


def eos_token_ids(eos: object) -> tuple[int, ...]:
    """``eos_token_id`` as a tuple: config files write one id, a list of ids, or null."""
    ids = () if eos is None else eos if isinstance(eos, list) else [eos]
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise KvlabValueError(f"eos_token_id must be a token id, a list of them or null, got {eos!r}")
    return tuple(ids)


def refuse_multimodal(model_type: object) -> None:
    """Refuse a multimodal wrapper (``gemma3``) by name, saying which text-only ``model_type`` kvlab serves."""
    if isinstance(model_type, str) and model_type in MULTIMODAL_MODEL_TYPES:
        raise KvlabValueError(
            f"model_type={model_type!r} is a multimodal checkpoint (a vision tower beside the decoder, the decoder's "
            f"weights under model.language_model); kvlab's engine serves the text-only model_type="
            f"{MULTIMODAL_MODEL_TYPES[model_type]!r} ({model_type.capitalize()}ForCausalLM). kvlab.capacity still "
            "sizes this config's KV cache from its text_config"
        )


def _uses_sliding_window(cfg: Mapping[str, Any]) -> bool:
    if cfg.get("model_type") in USE_SLIDING_WINDOW_MODEL_TYPES:  # these files carry a window but switch it off
        return bool(cfg.get("use_sliding_window", False))
    return cfg.get("sliding_window") is not None


#: ``Gemma3TextConfig.default_theta``: the rotary bases when a file names none.
GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def gemma3_rope_configs(cfg: Mapping[str, Any]) -> dict[str, RopeConfig]:
    """Gemma 3's rotation per layer type, read as ``Gemma3TextConfig.convert_rope_params_to_dict`` reads it.

    transformers 5 writes ``rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}``;
    older files give ``rope_theta`` (the full-attention layers' base), ``rope_local_base_freq`` (the
    sliding layers') and ``rope_scaling``, which scales the full-attention layers only. A base no file
    names is ``GEMMA3_DEFAULT_THETA``'s.
    """
    per_type = cfg.get("rope_parameters") or {}
    full = {**(per_type.get("full_attention") or {"rope_type": "default"}), **(cfg.get("rope_scaling") or {})}
    full.setdefault("rope_theta", cfg.get("rope_theta", GEMMA3_DEFAULT_THETA["full_attention"]))
    sliding = dict(per_type.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_DEFAULT_THETA["sliding_attention"]))
    return {"full_attention": rope_config({"rope_parameters": full}),
            "sliding_attention": rope_config({"rope_parameters": sliding})}


def rope_config(cfg: Mapping[str, Any]) -> RopeConfig:
    """The rotary parameters of a config, in either spelling transformers has written.

    transformers 5 writes ``rope_parameters = {"rope_type", "rope_theta", ...}``; older files
    have a top-level ``rope_theta`` and an optional ``rope_scaling`` dict (whose type key was
    once called ``type``). Only "default" and "llama3" are computed; others raise, and so does a
    value no rotation could use (a theta or factor that is not a positive number).
    """
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise KvlabValueError(f"rope_parameters / rope_scaling must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnknownNameError("rope_type", rope_type, SUPPORTED_ROPE_TYPES)
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    if positive_number("partial_rotary_factor", partial) != 1.0:
        raise KvlabValueError("partial_rotary_factor != 1 is not supported: kvlab rotates the whole head")
    theta = positive_number("rope_theta", params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig("default", theta)
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise MissingConfigKeyError(key, where="rope_parameters (llama3)")
    low, high = (positive_number(key, params[key]) for key in ("low_freq_factor", "high_freq_factor"))
    if high <= low:
        raise KvlabValueError(f"llama3 rope needs high_freq_factor > low_freq_factor, got {high} and {low}")
    return RopeConfig(
        "llama3",
        theta,
        factor=positive_number("factor", params["factor"]),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=positive_int(
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings") or 8192,
        ),
    )
