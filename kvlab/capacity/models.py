"""Model shapes that decide the KV cache size, read from real Hugging Face ``config.json`` files.

``ModelSpec.from_hf_config`` reads only fields a real checkpoint ships; presets in
``data/models/`` are those files as published (``get_model`` / ``list_models``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from kvlab._validate import checked, positive_int
from kvlab.capacity.config_fields import MAX_LAYERS, TORCH_DTYPES, check_config_fields
from kvlab.data import DATA_DIR
from kvlab.errors import KvlabValueError, MissingConfigKeyError, UnknownNameError

Attention = Literal["mha", "gqa", "mqa", "mla"]
LayerType = Literal["full_attention", "sliding_attention"]

#: Bytes per weight element for the dtypes checkpoints declare (``torch_dtype`` /
#: ``dtype``) and for quantization methods (``quantization_config.quant_method``).
#: mxfp4 is 4-bit values plus one 8-bit scale per 32 values: 4.25 bits.
WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "mxfp4": 4.25 / 8,
    "nvfp4": 0.5625,
}

MODELS_DIR = DATA_DIR / "models"


@checked
@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder's attention, as far as the KV cache is concerned.

    ``num_kv_heads`` and ``head_dim`` are what one token stores per layer: for MLA
    that is one latent (``num_kv_heads == 1``, ``head_dim == kv_lora_rank +
    qk_rope_head_dim``), whatever ``num_key_value_heads`` the config lists.
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    attention: Attention
    hidden_size: int | None = None
    weights_dtype: str = "bf16"
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    mha_head_dim: int | None = None
    num_params: int | None = None
    max_position_embeddings: int | None = None
    config: Mapping[str, Any] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            positive_int(field, getattr(self, field))
        if self.num_layers > MAX_LAYERS:  # layer_types holds one entry per layer
            raise KvlabValueError(f"num_layers must be at most {MAX_LAYERS:,}, got {self.num_layers!r}")
        object.__setattr__(self, "config", check_config_fields(self.config, "config"))
        if self.weights_dtype not in WEIGHT_DTYPE_BYTES:
            raise UnknownNameError("weights_dtype", self.weights_dtype, WEIGHT_DTYPE_BYTES)
        if self.attention not in ("mha", "gqa", "mqa", "mla"):
            raise UnknownNameError("attention", self.attention, ["mha", "gqa", "mqa", "mla"])
        self._check_heads()
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        for i, kind in enumerate(self.layer_types):
            if kind not in typing.get_args(LayerType):
                raise UnknownNameError(f"layer_types[{i}]", kind, typing.get_args(LayerType))
        if len(self.layer_types) != self.num_layers:
            raise KvlabValueError(
                f"layer_types has {len(self.layer_types)} entries but num_layers is {self.num_layers}"
            )
        if "sliding_attention" in self.layer_types:
            positive_int("sliding_window", self.sliding_window)

    def _check_heads(self) -> None:
        """KV heads that fit the query heads and the label: MHA has as many, MQA one, GQA fewer (a divisor)."""
        q, kv = self.num_attention_heads, self.num_kv_heads
        if self.attention == "mla":
            return
        if kv > q or q % kv:
            raise KvlabValueError(f"num_kv_heads={kv} must divide num_attention_heads={q} (each KV head serves "
                                  "a whole group of query heads)")
        expected = {"mha": kv == q, "mqa": kv == 1, "gqa": 1 <= kv < q}[self.attention]
        if not expected:
            rule = {"mha": "as many KV heads as query heads", "mqa": "one KV head",
                    "gqa": "fewer KV heads than query heads"}[self.attention]
            raise KvlabValueError(f"attention={self.attention!r} means {rule}; got num_kv_heads={kv} for "
                                  f"num_attention_heads={q}")

    @property
    def kv_factor(self) -> int:
        """f in f x L x Hkv x D x b: 2 (a K and a V) for MHA/GQA/MQA, 1 (one latent) for MLA."""
        return 1 if self.attention == "mla" else 2

    @property
    def num_sliding_layers(self) -> int:
        """Layers that keep only the last ``sliding_window`` tokens."""
        return sum(t == "sliding_attention" for t in self.layer_types)

    @property
    def num_full_layers(self) -> int:
        """Layers that keep every token of the context."""
        return self.num_layers - self.num_sliding_layers

    @checked
    def mha_equivalent(self) -> ModelSpec:
        """The same model with one K/V head per query head (for MLA: heads x ``v_head_dim``)."""
        return dataclasses.replace(
            self,
            name=f"{self.name} (as MHA)",
            attention="mha",
            num_kv_heads=self.num_attention_heads,
            head_dim=self.mha_head_dim or self.head_dim,
            kv_lora_rank=None,
            qk_rope_head_dim=None,
        )

    @classmethod
    @checked
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike, name: str | None = None) -> ModelSpec:
        """Build a spec from a Hugging Face ``config.json`` given as a dict or a path.

        Multimodal configs are read through their ``text_config``. Raises
        ``MissingConfigKeyError`` naming the first required key that is absent.
        """
        if isinstance(config, (str, os.PathLike)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                with open(path, encoding="utf-8") as fh:
                    config = json.load(fh)
            except (OSError, ValueError) as error:  # missing, unreadable, or not JSON
                raise KvlabValueError(f"config={str(config)!r}: cannot read {path} as JSON ({error})") from error
            name = name or (path.parent.name if path.name == "config.json" else path.stem)
        raw = check_config_fields(config, "config")
        cfg = with_family_defaults({**raw, **(raw.get("text_config") or {})})

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise MissingConfigKeyError(key)
            return cfg[key]

        num_layers = positive_int("num_hidden_layers", need("num_hidden_layers"))
        num_heads = positive_int("num_attention_heads", need("num_attention_heads"))
        if cfg.get("kv_lora_rank"):
            kv_lora_rank = positive_int("kv_lora_rank", cfg["kv_lora_rank"])
            rope_dim = positive_int("qk_rope_head_dim", need("qk_rope_head_dim"))
            attention: Attention = "mla"
            num_kv_heads, head_dim = 1, kv_lora_rank + rope_dim
            mha_head_dim = cfg.get("v_head_dim") or cfg.get("qk_nope_head_dim")
        else:
            kv_lora_rank = rope_dim = None
            num_kv_heads = positive_int(
                "num_key_value_heads", cfg.get("num_key_value_heads") or num_heads
            )
            if cfg.get("head_dim"):
                head_dim = positive_int("head_dim", cfg["head_dim"])
            else:
                head_dim = positive_int("hidden_size", need("hidden_size")) // num_heads
            if num_heads % num_kv_heads:
                raise KvlabValueError(
                    f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
                )
            attention = "mha" if num_kv_heads == num_heads else ("mqa" if num_kv_heads == 1 else "gqa")
            mha_head_dim = None
        layer_types, window = _layer_types(cfg, num_layers)
        return cls(
            name=name or cfg.get("_name") or cfg.get("model_type", "model"),
            num_layers=num_layers,
            num_attention_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            attention=attention,
            hidden_size=cfg.get("hidden_size"),
            weights_dtype=_weights_dtype(cfg),
            layer_types=layer_types,
            sliding_window=window,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=rope_dim,
            mha_head_dim=mha_head_dim,
            num_params=_count_parameters(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings"),
            config=raw,
        )


#: ``model_type`` values transformers reads with ``Gemma3TextConfig`` (the multimodal ``gemma3`` holds one in
#: ``text_config``).
GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")
#: ``Gemma3TextConfig``'s defaults where they differ from what kvlab assumes of an absent field: a Gemma 3 file
#: without ``sliding_window`` still slides (4,096 tokens), and its ``head_dim`` is not ``hidden_size / heads``.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "num_key_value_heads": 4, "sliding_window": 4096, "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
}


@checked
def with_family_defaults(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` (a ``config.json`` dict) with its family's transformers defaults for the fields it lacks: Gemma 3's
    (``GEMMA3_TEXT_DEFAULTS``); other families' configs come back unchanged.

    Only absent fields are filled: a null stays null, and the reader refuses it where it must not be.
    ``ModelSpec.from_hf_config`` and the engine's ``DecoderConfig`` both read a config through this.
    """
    cfg = check_config_fields(cfg, "cfg")
    if cfg.get("model_type") not in GEMMA3_MODEL_TYPES:
        return dict(cfg)
    return {**GEMMA3_TEXT_DEFAULTS, **cfg}


def _layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[tuple[LayerType, ...], int | None]:
    """Which layers slide, from ``layer_types`` or the model family's own rule.

    Gemma 3's rule does not ask for a window (``Gemma3TextConfig``: layer ``i`` slides unless ``i + 1`` is a
    multiple of ``sliding_window_pattern``), so a Gemma 3 file with ``sliding_window: null`` has sliding layers
    and no window, which ``ModelSpec`` refuses by name, as transformers cannot run it either.
    """
    window = cfg.get("sliding_window")
    if cfg.get("model_type") in GEMMA3_MODEL_TYPES and not cfg.get("layer_types"):
        pattern = cfg["sliding_window_pattern"]  # with_family_defaults has filled it
        types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))
        return types, (window if "sliding_attention" in types else None)  # type: ignore[return-value]
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise KvlabValueError(
                f"layer_types contains {unknown}; kvlab sizes only 'full_attention' and "
                "'sliding_attention' layers"
            )
        if len(types) != num_layers:
            raise KvlabValueError(f"layer_types has {len(types)} entries, num_hidden_layers is {num_layers}")
        return types, (window if "sliding_attention" in types else None)  # type: ignore[return-value]
    if not window or cfg.get("use_sliding_window") is False:
        return ("full_attention",) * num_layers, None
    family = cfg.get("model_type", "")
    if family == "gemma2":  # even layers slide, odd layers are global
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", num_layers)
        sliding = [i >= first for i in range(num_layers)]
    else:  # Mistral-style: every layer uses the window
        sliding = [True] * num_layers
    types = tuple("sliding_attention" if s else "full_attention" for s in sliding)
    return types, (window if any(sliding) else None)  # type: ignore[return-value]


def _weights_dtype(cfg: Mapping[str, Any]) -> str:
    """The dtype most weights are stored in: a quantization method wins over ``torch_dtype``."""
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method in WEIGHT_DTYPE_BYTES:
        return method
    return TORCH_DTYPES[cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"]


#: The parts ``parameter_parts`` counts. ``routed_experts`` is what expert parallelism splits across GPUs;
#: data-parallel attention keeps a copy of every other part on each GPU.
PARAMETER_PARTS = ("embeddings", "attention", "mlp", "shared_experts", "routed_experts", "router", "norms")


@checked
def count_parameters(cfg: Mapping[str, Any]) -> int | None:
    """Count a decoder's parameters from its config (embeddings, attention, MLP/MoE, norms).

    Covers the Llama family (Llama, Mistral, Qwen2/3, Gemma 2 and 3), DeepSeek-V3 (MLA + MoE)
    and gpt-oss (MoE); returns None for families it does not know, or a config lacking a field
    the count needs. Multi-token-prediction layers (``num_nextn_predict_layers``) are not counted:
    serving loads them separately.
    """
    return _count_parameters(check_config_fields(cfg, "cfg"))


def _count_parameters(cfg: Mapping[str, Any]) -> int | None:
    parts = _parameter_parts(cfg)
    return None if parts is None else sum(parts.values())


@checked
def parameter_parts(cfg: Mapping[str, Any]) -> dict[str, int] | None:
    """``count_parameters`` by part (``PARAMETER_PARTS``): where a model's parameters sit, all layers summed.

    ``embeddings`` holds the input embedding, the language-model head (unless tied) and the final
    norm; ``norms`` the per-layer norms around attention and MLP; ``attention`` its projections and
    the norms inside it (MLA's ``q_a_layernorm`` / ``kv_a_layernorm``, Qwen3's q/k norms).
    """
    return _parameter_parts(check_config_fields(cfg, "cfg"))


def _parameter_parts(cfg: Mapping[str, Any]) -> dict[str, int] | None:
    family = cfg.get("model_type", "")
    H, V, L, nq = (cfg.get(k) for k in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads"))
    if None in (H, V, L, nq):
        return None
    tied = cfg.get("tie_word_embeddings", family.startswith("gemma"))
    parts = dict.fromkeys(PARAMETER_PARTS, 0)
    parts["embeddings"] = V * H * (1 if tied else 2) + H  # embeddings, lm_head, final norm
    if family in ("llama", "mistral", "qwen2", "qwen3", "gemma2", *GEMMA3_MODEL_TYPES):
        layer = _llama_layer(cfg, family, H, nq)
    elif family == "deepseek_v3":
        layer = _deepseek_layer(cfg, H, nq, L)
    elif family == "gpt_oss":
        layer = _gpt_oss_layer(cfg, H, nq)
    else:
        return None
    if layer is None:
        return None
    for name, count in layer.items():
        parts[name] += count if name in ("mlp", "shared_experts", "routed_experts", "router") else L * count
    return parts


def _llama_layer(cfg: Mapping[str, Any], family: str, H: int, nq: int) -> dict[str, int] | None:
    """One Llama-family layer's attention and norms, and the dense MLPs of all layers."""
    nkv = cfg.get("num_key_value_heads") or nq
    hd = cfg.get("head_dim") or H // nq
    inter = cfg.get("intermediate_size")
    if inter is None:
        return None
    attn = 2 * H * nq * hd + 2 * H * nkv * hd
    if cfg.get("attention_bias") or family == "qwen2":
        attn += nq * hd + 2 * nkv * hd + (H if cfg.get("attention_bias") else 0)
    qk_norms = 2 * hd if family in ("qwen3", *GEMMA3_MODEL_TYPES) else 0
    four_norms = family in ("gemma2", *GEMMA3_MODEL_TYPES)  # pre and post norms around attention and the MLP
    return {"attention": attn + qk_norms, "norms": (4 if four_norms else 2) * H,
            "mlp": cfg["num_hidden_layers"] * 3 * H * inter}


def _deepseek_layer(cfg: Mapping[str, Any], H: int, nq: int, L: int) -> dict[str, int] | None:
    """One DeepSeek-V3 layer's MLA and norms, and the dense MLPs and experts of all layers.

    Without ``q_lora_rank`` (DeepSeek-V2-Lite's style) the query is one projection, ``q_proj``.
    """
    names = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
             "moe_intermediate_size", "intermediate_size")
    r_kv, nope, rope, vd, experts, moe_inter, inter = (cfg.get(k) for k in names)
    if None in (r_kv, nope, rope, vd, experts, moe_inter, inter):
        return None
    r_q = cfg.get("q_lora_rank")
    query = H * r_q + r_q + r_q * nq * (nope + rope) if r_q else H * nq * (nope + rope)  # down, norm, up / q_proj
    attn = (query + H * (r_kv + rope) + r_kv + r_kv * nq * (nope + vd)  # kv down (+ rope key), norm, kv up
            + nq * vd * H)  # o_proj
    dense = min(cfg.get("first_k_dense_replace") or 0, L)
    expert = 3 * H * moe_inter
    return {"attention": attn, "norms": 2 * H, "mlp": dense * 3 * H * inter,
            "shared_experts": (L - dense) * (cfg.get("n_shared_experts") or 0) * expert,
            "routed_experts": (L - dense) * experts * expert,
            "router": (L - dense) * (experts * H + experts)}  # gate weight and correction bias


def _gpt_oss_layer(cfg: Mapping[str, Any], H: int, nq: int) -> dict[str, int] | None:
    """One gpt-oss layer's attention (biases and sinks included) and norms, and the experts of all layers."""
    nkv, hd, inter, experts = (cfg.get(k) for k in ("num_key_value_heads", "head_dim", "intermediate_size",
                                                    "num_local_experts"))
    if None in (nkv, hd, inter, experts):
        return None
    L = cfg["num_hidden_layers"]
    attn = 2 * H * nq * hd + 2 * H * nkv * hd + (nq * hd + 2 * nkv * hd + H) + nq  # + biases, sinks
    return {"attention": attn, "norms": 2 * H,
            "routed_experts": L * experts * (H * 2 * inter + 2 * inter + inter * H + H),
            "router": L * (experts * H + experts)}


@checked(at_most={"num_params": 1e15})  # a thousand times the largest model served today
def params_bytes(num_params: float, weights_dtype: str) -> int:
    """Bytes of ``num_params`` parameters stored as ``weights_dtype``: how a "70B in bf16 is 130 GiB" is counted.

    Takes a nominal count (``70e9``) as readily as one counted from a config, so a source's
    back-of-the-envelope weights can be redone beside ``weights_bytes``.
    """
    if weights_dtype not in WEIGHT_DTYPE_BYTES:
        raise UnknownNameError("weights_dtype", weights_dtype, WEIGHT_DTYPE_BYTES)
    if isinstance(num_params, bool) or not isinstance(num_params, (int, float)) or not (num_params > 0):
        raise KvlabValueError(f"num_params must be a number > 0, got {num_params!r}")
    return round(num_params * WEIGHT_DTYPE_BYTES[weights_dtype])


@checked
def weights_bytes(model: ModelSpec, weights_dtype: str | None = None) -> int:
    """Estimated bytes of the weights: ``num_params`` (counted from the config) x bytes of the weight dtype."""
    dtype = weights_dtype or model.weights_dtype
    if dtype not in WEIGHT_DTYPE_BYTES:
        raise UnknownNameError("weights_dtype", dtype, WEIGHT_DTYPE_BYTES)
    if model.num_params is None:
        raise KvlabValueError(
            f"cannot estimate the weights of {model.name!r}: its config does not allow counting "
            "parameters; pass the weights size explicitly"
        )
    return params_bytes(model.num_params, dtype)


@checked
def list_models() -> list[str]:
    """The names of the presets shipped in ``data/models/``."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


@checked
@functools.cache
def get_model(name: str) -> ModelSpec:
    """The preset ``name`` (see ``list_models()``), built from its real ``config.json``."""
    known = list_models()
    if name not in known:
        raise UnknownNameError("name", name, known)
    return ModelSpec.from_hf_config(MODELS_DIR / f"{name}.json", name=name)


@checked
def resolve_model(model: ModelSpec | str, parameter: str = "model") -> ModelSpec:
    """``model`` itself, or the preset it names; an error names ``parameter``, the caller's argument."""
    if isinstance(model, ModelSpec):
        return model
    known = list_models()
    if not isinstance(model, str) or model not in known:
        raise UnknownNameError(parameter, model, known)
    return get_model(model)
