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
import os
from collections.abc import Mapping
from typing import Any

from kvlab._validate import positive_int, positive_number
from kvlab.capacity.config_fields import check_config_fields
from kvlab.capacity.mla import MLADims, mla_dims
from kvlab.capacity.models import ModelSpec
from kvlab.engine.config import config_from_pretrained, eos_token_ids
from kvlab.engine.deepseek_rope import DeepseekRope, deepseek_rope, softmax_scale
from kvlab.errors import KvlabValueError, MissingConfigKeyError, UnknownNameError

SUPPORTED_MODEL_TYPES = ("deepseek_v3",)


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """The shapes and constants of a DeepSeek-V3-style decoder (one ``config.json``)."""

    model_type: str
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
        cfg = check_config_fields(config)  # every field's type and range, by the field's name
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
        max_len, eps, tie = (cfg.get(key) for key in ("max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"))
        if not isinstance(tie, bool | None):
            raise KvlabValueError(f"tie_word_embeddings must be true or false, got {tie!r}")
        return cls(
            model_type=cfg["model_type"],
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
            rms_norm_eps=positive_number("rms_norm_eps", 1e-6 if eps is None else eps),
            rope=deepseek_rope(cfg),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=None if max_len is None else positive_int("max_position_embeddings", max_len),
            eos_token_id=eos_token_ids(cfg.get("eos_token_id")),
            spec=spec,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> DeepseekConfig:
        """Read ``model_dir/config.json``; anything wrong raises ``CheckpointError`` naming the file and the field."""
        return config_from_pretrained(cls.from_dict, model_dir)


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
