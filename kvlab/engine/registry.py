"""Which architectures the engine serves: per ``model_type``, the config it reads, the model it builds, its KV spec.

vLLM maps a checkpoint's ``architectures`` entry to a model class (``vllm/model_executor/models/
registry.py``), and each attention layer of that class answers ``get_kv_cache_spec``. kvlab keeps the
same three facts per family in one ``ModelFamily``, keyed by ``model_type`` (the field transformers
dispatches on): a Llama-family checkpoint gets ``DecoderConfig``, ``LlamaForCausalLM`` and a
``FullAttentionSpec`` per layer (a ``SlidingWindowSpec`` for a sliding-window layer); a Gemma 3 text
checkpoint (``gemma3_text``) the same config class and specs with vLLM's ``Gemma3ForCausalLM``; a
DeepSeek-V3 one gets ``DeepseekConfig``, ``DeepseekV2ForCausalLM`` and an ``MLAAttentionSpec`` per layer. The specs are
``kvlab.kv_cache_interface``'s, the classes planning and the manager use. ``LLMEngine`` asks this module
and nothing else, so adding an architecture is one more entry here. ``load_model`` dispatches here too:
the loaders (``kvlab.engine.loader``, ``kvlab.engine.deepseek``) are leaves the registry calls, and never
import it back.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvlab.engine.config import (
    GEMMA3_MODEL_TYPES,
    LLAMA_MODEL_TYPES,
    DecoderConfig,
    config_from_pretrained,
    refuse_multimodal,
)
from kvlab.engine.deepseek_config import SUPPORTED_MODEL_TYPES as DEEPSEEK_MODEL_TYPES
from kvlab.engine.deepseek_config import DeepseekConfig
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.kv_cache_interface import AttentionSpec, FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

ModelConfig = DecoderConfig | DeepseekConfig


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One architecture the engine serves: how its config is read, its model loaded, its layers' KV cache shaped."""

    architecture: str                 # the vLLM class that serves these checkpoints
    model_types: tuple[str, ...]      # config.json's model_type values
    config_class: type                # from_dict / from_pretrained
    load: Callable[..., torch.nn.Module | None]  # (model_dir, dtype, config, tp_group=, check=, load=) -> model
    layer_spec: Callable[[Any, int, int, torch.dtype, int], AttentionSpec]  # (config, layer, block_size, dtype, tp)


def _load_llama(model_dir: str | os.PathLike, dtype: torch.dtype, config: DecoderConfig,
                **options: Any) -> torch.nn.Module | None:
    from kvlab.engine.loader import load_llama

    return load_llama(model_dir, dtype, config, **options)


def _load_gemma3(model_dir: str | os.PathLike, dtype: torch.dtype, config: DecoderConfig,
                 **options: Any) -> torch.nn.Module | None:
    from kvlab.engine.loader import load_gemma3

    return load_gemma3(model_dir, dtype, config, **options)


def _load_deepseek(model_dir: str | os.PathLike, dtype: torch.dtype, config: DeepseekConfig,
                   **options: Any) -> torch.nn.Module | None:
    from kvlab.engine.deepseek import load_deepseek

    return load_deepseek(model_dir, dtype, config, **options)


def _attention_spec(config: DecoderConfig, layer: int, block_size: int, dtype: torch.dtype,
                    tp: int = 1) -> AttentionSpec:
    """A sliding-window layer's ``SlidingWindowSpec``, else a ``FullAttentionSpec`` (vLLM's ``Attention`` layer), as
    one of ``tp`` ranks holds it: vLLM's ``ModelConfig.get_num_kv_heads``, ``max(1, total // tp)`` KV heads (fewer
    heads than ranks: a replica)."""
    shape = {"num_kv_heads": max(1, config.num_key_value_heads // tp), "head_size": config.head_dim, "dtype": dtype}
    window = config.layer_sliding_window(layer)
    if window is not None:
        return SlidingWindowSpec(block_size, **shape, sliding_window=window)
    return FullAttentionSpec(block_size, **shape)


def _mla_spec(config: DeepseekConfig, layer: int, block_size: int, dtype: torch.dtype, tp: int = 1) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=block_size, head_size=config.mla.latent_size, dtype=dtype)  # whole on every rank


MODEL_FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("LlamaForCausalLM", LLAMA_MODEL_TYPES, DecoderConfig, _load_llama, _attention_spec),
    ModelFamily("Gemma3ForCausalLM", GEMMA3_MODEL_TYPES, DecoderConfig, _load_gemma3, _attention_spec),
    ModelFamily("DeepseekV2ForCausalLM", DEEPSEEK_MODEL_TYPES, DeepseekConfig, _load_deepseek, _mla_spec),
)


def supported_model_types() -> list[str]:
    """Every ``model_type`` some family serves."""
    return [t for family in MODEL_FAMILIES for t in family.model_types]


def model_family(model_type: object) -> ModelFamily:
    """The family serving ``model_type``; an unknown one raises listing every supported type (a multimodal
    wrapper, ``gemma3``, naming the text-only type to use)."""
    refuse_multimodal(model_type)
    for family in MODEL_FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnknownNameError("model_type", model_type, supported_model_types())


def model_config_from_dict(config: Mapping[str, Any], name: str | None = None) -> ModelConfig:
    """A ``config.json`` dict read by its family's config class (chosen by ``model_type``)."""
    if not isinstance(config, Mapping):
        raise KvlabValueError(f"a config must be a JSON object (a dict of fields), got a {type(config).__name__}")
    return model_family(config.get("model_type")).config_class.from_dict(config, name=name)


def read_model_config(model_dir: str | os.PathLike) -> ModelConfig:
    """``model_dir/config.json`` read by its family; anything wrong raises ``CheckpointError`` naming the file."""
    return config_from_pretrained(model_config_from_dict, model_dir)


def kv_cache_specs(config: ModelConfig, block_size: int, dtype: torch.dtype, tp: int = 1) -> list[AttentionSpec]:
    """One KV cache spec per layer (vLLM's ``get_kv_cache_spec``), layer 0 first, as one of ``tp`` ranks holds it.

    A family's ``layer_spec`` is asked layer by layer, so a model whose layers differ (a sliding
    window in some of them) can answer each one with its own kind of spec. Under tensor parallelism a
    Llama-family layer keeps ``max(1, num_kv_heads // tp)`` heads per rank; MLA's latent is whole on each.
    """
    family = model_family(config.model_type)
    return [family.layer_spec(config, layer, block_size, dtype, tp) for layer in range(config.num_hidden_layers)]


def load_model(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
               config: ModelConfig | None = None, tp_group: Any = None, *, check: bool = True) -> torch.nn.Module:
    """Build the decoder ``config.json`` describes and fill it from the checkpoint's tensors.

    The architecture follows ``model_type`` (``kvlab.engine.registry``): a Llama-family checkpoint
    loads into ``LlamaForCausalLM`` (``load_llama``), a Gemma 3 text one into ``Gemma3ForCausalLM``
    (``load_gemma3``), a DeepSeek-V3 one into ``DeepseekV2ForCausalLM`` (``load_deepseek``). ``config`` is
    the checkpoint's config if the caller read it already (``EngineConfig`` does). On CPU keep ``float32``:
    the Triton interpreter has no bf16 arithmetic. ``tp_group`` (a ``GroupCoordinator``): build and load only
    this tensor-parallel rank's shard. ``check=False`` skips ``check_before_loading`` (the tensors are still
    checked as they are copied): a rank does, since its engine ran ``check_checkpoint`` before starting it.
    """
    config = config or read_model_config(model_dir)
    return model_family(config.model_type).load(model_dir, dtype, config, tp_group=tp_group, check=check)


def check_checkpoint(model_dir: str | os.PathLike, config: ModelConfig, tp_group: Any = None) -> None:
    """``check_before_loading`` for the model ``config`` describes, split as ``tp_group`` says; nothing is loaded.

    A tensor-parallel engine runs it in its own process before it starts a rank, so a malformed checkpoint is
    refused once, there, by name; and each rank is spared building its model on the meta device.
    """
    model_family(config.model_type).load(model_dir, torch.float32, config, tp_group=tp_group, check=True, load=False)
