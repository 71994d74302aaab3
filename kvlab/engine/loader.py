"""Load a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``) into kvlab's decoder.

A checkpoint is either one ``model.safetensors`` or several shards listed in
``model.safetensors.index.json`` (its ``weight_map`` names the file of every tensor). Only
safetensors are read: they are plain tensors, never code, so loading one is safe.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from kvlab.engine.config import DecoderConfig
from kvlab.engine.model import LlamaForCausalLM
from kvlab.errors import KvlabValueError

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | os.PathLike) -> list[Path]:
    """The weight files of a checkpoint: the shards its index lists, else every ``*.safetensors``."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise KvlabValueError(f"{INDEX_FILE} in {root} lists shards that are missing: {absent}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise KvlabValueError(
            f"model_dir={str(model_dir)!r} holds no *.safetensors file (kvlab does not read pickled .bin weights)"
        )
    return files


def read_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name (rotary ``inv_freq`` buffers some old files carry are skipped)."""
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if not name.endswith("rotary_emb.inv_freq"):
                    weights[name] = handle.get_tensor(name)
    return weights


def load_model(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build the decoder ``config.json`` describes and fill it from the checkpoint's tensors.

    Biases are switched on where the checkpoint has them (Qwen2's q/k/v biases, Llama's
    ``attention_bias``), so no per-model flag is needed. On CPU keep ``float32``: the Triton
    interpreter has no bf16 arithmetic.
    """
    config = DecoderConfig.from_pretrained(model_dir)
    weights = read_weights(model_dir)
    names = set(weights)
    model = LlamaForCausalLM(
        config,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in names,
        o_bias="model.layers.0.self_attn.o_proj.bias" in names,
        mlp_bias="model.layers.0.mlp.gate_proj.bias" in names,
    )
    model.to(dtype)
    model.load_weights(weights)
    return model.eval()
