"""What the forward pass needs from a checkpoint's ``config.json``, checked before any weight is read.

The Llama family (Llama 2/3, Mistral without a sliding window, Qwen2, Qwen3, SmolLM) shares
one decoder: RMSNorm, rotary embeddings, grouped-query attention, a SwiGLU MLP. The
differences kvlab supports are data, not code: biases on q/k/v (Qwen2) are read from the
weights when present, per-head q/k RMSNorm (Qwen3) is switched on by ``model_type``, and the
rotary frequencies follow ``rope_parameters`` (transformers 5) or ``rope_theta`` /
``rope_scaling`` (older files). Everything else is refused with a message that says why.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvlab._validate import positive_int
from kvlab.capacity.models import ModelSpec
from kvlab.errors import KvlabValueError, MissingConfigKeyError, UnknownNameError

#: ``model_type`` values whose decoder is the one ``kvlab.engine.model`` implements.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
    rope: RopeConfig
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before the rotation
    max_position_embeddings: int | None
    eos_token_id: tuple[int, ...]
    spec: ModelSpec  # the same file read by kvlab.capacity.models, for KV sizing

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads that share one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], name: str | None = None) -> DecoderConfig:
        """Read and check a ``config.json`` dict; unsupported architectures raise naming the field."""
        cfg = dict(config)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnknownNameError("model_type", model_type, SUPPORTED_MODEL_TYPES)
        if cfg.get("hidden_act", "silu") != "silu":
            raise KvlabValueError(f"hidden_act={cfg['hidden_act']!r} is not supported; the SwiGLU MLP needs 'silu'")
        if _uses_sliding_window(cfg):
            raise KvlabValueError(
                f"sliding_window={cfg.get('sliding_window')!r} is set: kvlab's engine implements full attention "
                "only (set use_sliding_window=false or sliding_window=null to run this checkpoint)"
            )
        spec = ModelSpec.from_hf_config(cfg, name=name)

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise MissingConfigKeyError(key)
            return cfg[key]

        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        return cls(
            model_type=model_type,
            vocab_size=positive_int("vocab_size", need("vocab_size")),
            hidden_size=positive_int("hidden_size", need("hidden_size")),
            intermediate_size=positive_int("intermediate_size", need("intermediate_size")),
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope_config(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=cfg.get("max_position_embeddings"),
            eos_token_id=eos_ids,
            spec=spec,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> DecoderConfig:
        """Read ``model_dir/config.json``."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise KvlabValueError(f"model_dir={str(model_dir)!r} has no config.json: is it a Hugging Face checkpoint?")
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")), name=Path(model_dir).name)


def _uses_sliding_window(cfg: Mapping[str, Any]) -> bool:
    if cfg.get("model_type") in ("qwen2", "qwen3"):  # these files carry a window but switch it off
        return bool(cfg.get("use_sliding_window", False))
    return cfg.get("sliding_window") is not None


def rope_config(cfg: Mapping[str, Any]) -> RopeConfig:
    """The rotary parameters of a config, in either spelling transformers has written.

    transformers 5 writes ``rope_parameters = {"rope_type", "rope_theta", ...}``; older files
    have a top-level ``rope_theta`` and an optional ``rope_scaling`` dict (whose type key was
    once called ``type``). Only "default" and "llama3" are computed; others raise.
    """
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnknownNameError("rope_type", rope_type, SUPPORTED_ROPE_TYPES)
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise KvlabValueError("partial_rotary_factor != 1 is not supported: kvlab rotates the whole head")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope_type == "default":
        return RopeConfig("default", float(theta))
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise MissingConfigKeyError(key, where="rope_parameters (llama3)")
    return RopeConfig(
        "llama3",
        float(theta),
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings") or 8192
        ),
    )
