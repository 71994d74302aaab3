"""The door for a ``config.json``'s contents: every field kvlab reads, with its type and range, checked once.

A Hugging Face ``config.json`` is input like any argument: a hub file can hold ``"vocab_size": "32000"``,
``"model_type": null`` or ``"torch_dtype": 5``. ``check_config_fields`` refuses such a file by the field's
own name (``config.json field 'vocab_size' must be a positive integer, got '32000'``) before any reader
(``ModelSpec.from_hf_config``, ``count_parameters``, the engine's ``DecoderConfig`` / ``DeepseekConfig``)
touches it, so readers can use the values as they are. Fields kvlab never reads are left alone; an
absent field is the reader's business (``MissingConfigKeyError`` names a required one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from kvlab._validate import checked
from kvlab.errors import ConfigFieldError, KvlabValueError

#: ``torch_dtype`` / ``dtype`` values a checkpoint declares, and the weight dtype each names.
TORCH_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
#: The largest size a config may give: an int32 (tensor sizes and token ids are int32 in the kernels).
MAX_SIZE = 2**31 - 1
#: The deepest decoder kvlab sizes (today's deepest has 126 layers): ``layer_types`` is built per layer.
MAX_LAYERS = 10_000


@dataclasses.dataclass(frozen=True)
class _Field:
    """One field's rule: its ``kind`` (see ``_RULES``), whether JSON ``null`` means "absent", and its maximum."""

    kind: str
    nullable: bool = True
    at_most: float = MAX_SIZE


def _is_int(v: object) -> bool:
    return type(v) is int or (isinstance(v, int) and not isinstance(v, bool))


def _is_real(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


#: kind -> (predicate on a non-null value and its field, what the value must be)
_RULES: dict[str, tuple[Any, str]] = {
    "size": (lambda v, f: _is_int(v) and 1 <= v <= f.at_most, "a positive integer"),
    "count": (lambda v, f: _is_int(v) and 0 <= v <= f.at_most, "a non-negative integer"),
    "number": (lambda v, f: _is_real(v) and 0 < v <= f.at_most, "a finite number > 0"),
    "number0": (lambda v, f: _is_real(v) and 0 <= v <= f.at_most, "a finite number >= 0"),
    "flag": (lambda v, f: isinstance(v, bool), "true or false"),
    "name": (lambda v, f: isinstance(v, str), "a string"),
    "dtype": (lambda v, f: isinstance(v, str) and v in TORCH_DTYPES, f"one of {', '.join(map(repr, TORCH_DTYPES))}"),
    "token_ids": (lambda v, f: (_is_int(v) and 0 <= v <= f.at_most)
                  or (isinstance(v, list) and all(_is_int(t) and 0 <= t <= f.at_most for t in v)),
                  "a token id or a list of token ids"),
    "layer_types": (lambda v, f: isinstance(v, list) and all(isinstance(t, str) for t in v)
                    and len(v) <= MAX_LAYERS, "a list of layer type names"),
    "object": (lambda v, f: isinstance(v, Mapping), "an object"),
}

#: What ``rope_scaling`` / ``rope_parameters`` hold (transformers writes either spelling).
#: A null here means nothing a rotation could use, except where the variant has a default for it.
ROPE_FIELDS: dict[str, _Field] = {
    **{key: _Field("name", nullable=False) for key in ("rope_type", "type")},
    **{key: _Field("number", nullable=False) for key in ("rope_theta", "factor", "low_freq_factor",
                                                        "high_freq_factor")},
    "original_max_position_embeddings": _Field("size", nullable=False), "truncate": _Field("flag", nullable=False),
    "beta_fast": _Field("number"), "beta_slow": _Field("number"), "mscale": _Field("number0"),
    "mscale_all_dim": _Field("number0"), "attention_factor": _Field("number"),
    "partial_rotary_factor": _Field("number", at_most=1.0),
    # Gemma 3 (transformers 5): one rotation per layer type, each an object of the fields above
    "sliding_attention": _Field("object"), "full_attention": _Field("object"),
}
#: What kvlab reads of ``quantization_config``: the method names the weights' dtype.
QUANTIZATION_FIELDS: dict[str, _Field] = {"quant_method": _Field("name", nullable=False)}

#: Every top-level field kvlab reads (a multimodal ``text_config`` holds the same fields).
CONFIG_FIELDS: dict[str, _Field] = {
    "model_type": _Field("name", nullable=False), "_name": _Field("name"),
    "hidden_act": _Field("name"), "hidden_activation": _Field("name"),
    "torch_dtype": _Field("dtype"), "dtype": _Field("dtype"),
    # shapes
    **{key: _Field("size", nullable=False) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "moe_intermediate_size",
        "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
        "num_local_experts", "experts_per_token", "moe_layer_freq")},
    "num_hidden_layers": _Field("size", nullable=False, at_most=MAX_LAYERS),
    "num_key_value_heads": _Field("size"), "head_dim": _Field("size"), "kv_lora_rank": _Field("size"),
    "q_lora_rank": _Field("size"), "max_position_embeddings": _Field("size"),
    "n_shared_experts": _Field("count"), "n_group": _Field("size"), "topk_group": _Field("size"),
    "first_k_dense_replace": _Field("count"), "num_nextn_predict_layers": _Field("count"),
    # sliding windows
    "sliding_window": _Field("size"), "use_sliding_window": _Field("flag"),
    "max_window_layers": _Field("count", at_most=MAX_LAYERS), "sliding_window_pattern": _Field("size"),
    "layer_types": _Field("layer_types"),
    # Gemma 3: the attention scale's denominator, the sliding layers' rotary base (older files), soft-capping
    "query_pre_attn_scalar": _Field("number", nullable=False), "rope_local_base_freq": _Field("number", nullable=False),
    "final_logit_softcapping": _Field("number"), "attn_logit_softcapping": _Field("number"),
    "use_bidirectional_attention": _Field("flag"),
    # constants of the forward pass
    "rms_norm_eps": _Field("number"), "rope_theta": _Field("number", nullable=False),
    "rope_interleave": _Field("flag", nullable=False), "partial_rotary_factor": _Field("number", at_most=1.0),
    "routed_scaling_factor": _Field("number", nullable=False), "tie_word_embeddings": _Field("flag"),
    "attention_bias": _Field("flag"), "norm_topk_prob": _Field("flag", nullable=False),
    "scoring_func": _Field("name"), "topk_method": _Field("name"),
    "eos_token_id": _Field("token_ids"), "bos_token_id": _Field("token_ids"), "pad_token_id": _Field("token_ids"),
    # nested objects
    "rope_scaling": _Field("object"), "rope_parameters": _Field("object"),
    "quantization_config": _Field("object"), "text_config": _Field("object"),
}
#: The nested objects kvlab reads, each with its own fields.
NESTED_FIELDS: dict[str, dict[str, _Field]] = {
    "rope_scaling": ROPE_FIELDS, "rope_parameters": ROPE_FIELDS, "quantization_config": QUANTIZATION_FIELDS,
    "text_config": CONFIG_FIELDS, "sliding_attention": ROPE_FIELDS, "full_attention": ROPE_FIELDS,
}


class CheckedConfig(dict):  # type: ignore[type-arg]
    """A copy of a ``config.json`` dict that passed ``check_config_fields``: the next reader does not check again."""


@checked
def check_config_fields(config: object, parameter: str = "config") -> CheckedConfig:
    """``config`` as a ``CheckedConfig`` if every field kvlab reads has its type and range, else raise naming it.

    ``parameter`` is the caller's name for the dict, used when it is not a dict at all.
    """
    if type(config) is CheckedConfig:
        return config
    if not isinstance(config, Mapping):
        raise KvlabValueError(f"{parameter} must be a config.json dict (a JSON object), got {type(config).__name__}")
    _check(config, CONFIG_FIELDS, "")
    return CheckedConfig(config)


def _check(config: Mapping[str, Any], fields: Mapping[str, _Field], prefix: str) -> None:
    for key, field in fields.items():
        if key not in config:
            continue
        value = config[key]
        if value is None and field.nullable:
            continue
        ok, what = _RULES[field.kind]
        if value is None or not ok(value, field):
            bound = f" and at most {field.at_most:,}" if field.kind in ("size", "count", "number", "number0") else ""
            raise ConfigFieldError(f"{prefix}{key}", f"must be {what}{bound}, got {value!r}")
        if key in NESTED_FIELDS:
            _check(value, NESTED_FIELDS[key], f"{prefix}{key}.")
