"""What kvlab's DeepSeek-V3 decoder needs from a ``config.json``, checked before any weight is read.

DeepSeek-V3 (``model_type`` ``deepseek_v3``) is a decoder with multi-head latent attention in
every layer and, from layer ``first_k_dense_replace`` on, a mixture of experts: ``n_routed_experts``
SwiGLU experts of ``moe_intermediate_size`` chosen ``num_experts_per_tok`` at a time by a sigmoid
router with a per-expert correction bias, limited to the ``topk_group`` best of ``n_group``
expert groups, plus ``n_shared_experts`` always on. Only what transformers 5 computes for that
``model_type`` is accepted; anything else is refused naming the field (DeepSeek-V2's softmax
router, biases on the attention projections, another activation).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvlab._validate import positive_int
from kvlab.capacity.mla import MLADims, mla_dims
from kvlab.capacity.models import ModelSpec
from kvlab.engine.deepseek_rope import DeepseekRope, deepseek_rope, softmax_scale
from kvlab.errors import KvlabValueError, MissingConfigKeyError, UnknownNameError

SUPPORTED_MODEL_TYPES = ("deepseek_v3",)


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """The shapes and constants of a DeepSeek-V3-style decoder (one ``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int          # the dense MLP of the first layers
    moe_intermediate_size: int      # each routed (and shared) expert
    num_hidden_layers: int
    mla: MLADims                    # heads, kv_lora_rank, q_lora_rank, nope / rope / v head sizes
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    rope: DeepseekRope
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    eos_token_id: tuple[int, ...]
    spec: ModelSpec                 # the same file read by kvlab.capacity.models, for KV sizing

    @property
    def scale(self) -> float:
        """The softmax scale of every MLA layer (``qk_head_dim^-0.5``, times YaRN's mscale squared)."""
        return softmax_scale(self.rope, self.mla.qk_head_dim)

    def is_moe_layer(self, layer: int) -> bool:
        """Layers from ``first_k_dense_replace`` on route to experts; the first ones are dense (as transformers)."""
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], name: str | None = None) -> DeepseekConfig:
        """Read and check a ``config.json`` dict; unsupported variants raise naming the field."""
        cfg = dict(config)
        if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise UnknownNameError("model_type", cfg.get("model_type"), SUPPORTED_MODEL_TYPES)
        _refuse_unsupported(cfg)
        spec = ModelSpec.from_hf_config(cfg, name=name)
        if spec.attention != "mla":
            raise MissingConfigKeyError("kv_lora_rank", where="a deepseek_v3 config")

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise MissingConfigKeyError(key)
            return cfg[key]

        experts = positive_int("n_routed_experts", need("n_routed_experts"))
        n_group = positive_int("n_group", cfg.get("n_group") or 1)
        topk_group = positive_int("topk_group", cfg.get("topk_group") or 1)
        if experts % n_group or experts // n_group < 2 or topk_group > n_group:
            raise KvlabValueError(
                f"n_routed_experts={experts}, n_group={n_group}, topk_group={topk_group}: the experts must split "
                "into n_group groups of at least 2 (a group's score is its two best experts), topk_group <= n_group"
            )
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=positive_int("vocab_size", need("vocab_size")),
            hidden_size=positive_int("hidden_size", need("hidden_size")),
            intermediate_size=positive_int("intermediate_size", need("intermediate_size")),
            moe_intermediate_size=positive_int("moe_intermediate_size", need("moe_intermediate_size")),
            num_hidden_layers=spec.num_layers,
            mla=mla_dims(spec),
            n_routed_experts=experts,
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            num_experts_per_tok=positive_int("num_experts_per_tok", need("num_experts_per_tok")),
            n_group=n_group,
            topk_group=topk_group,
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=deepseek_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings"),
            eos_token_id=() if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),),
            spec=spec,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> DeepseekConfig:
        """Read ``model_dir/config.json``."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise KvlabValueError(f"model_dir={str(model_dir)!r} has no config.json: is it a Hugging Face checkpoint?")
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")), name=Path(model_dir).name)


def _refuse_unsupported(cfg: Mapping[str, Any]) -> None:
    """What transformers' DeepseekV3 does not compute, or kvlab does not: refused by name."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise KvlabValueError(f"hidden_act={cfg['hidden_act']!r} is not supported; the SwiGLU experts need 'silu'")
    if cfg.get("attention_bias"):
        raise KvlabValueError("attention_bias=true is not supported: kvlab's MLA projections have no biases")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise KvlabValueError(f"scoring_func={cfg['scoring_func']!r}: DeepSeek-V3's router scores with 'sigmoid'")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise KvlabValueError(f"topk_method={cfg['topk_method']!r}: DeepSeek-V3 routes with 'noaux_tc'")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise KvlabValueError(f"moe_layer_freq={cfg['moe_layer_freq']!r}: every layer past the dense ones is MoE")
