"""Load a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``) into kvlab's decoder.

A checkpoint is either one ``model.safetensors`` or several shards listed in
``model.safetensors.index.json`` (its ``weight_map`` names the file of every tensor). Only
safetensors are read: they are plain tensors, never code, so loading one is safe. Everything
that can be wrong with the files is refused with a ``CheckpointError`` naming the file: a JSON
file that does not parse, a shard path that leaves the folder (``../``, an absolute path), a
truncated or garbage safetensors file (the library's own message is kept), a tensor the index
puts in one shard and the shard lacks, a tensor in two files, a weight file that is a link to a
file outside the folder (the real path is what counts). ``check_before_loading`` then compares the
headers' tensor names and shapes with the model ``config.json`` describes, built on the meta
device, before a weight is read or allocated; ``LlamaForCausalLM.load_weights`` checks the tensors
again as it copies them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvlab.engine.config import DecoderConfig, read_json
from kvlab.engine.gemma3 import Gemma3ForCausalLM
from kvlab.engine.model import LlamaForCausalLM, check_layer_count
from kvlab.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


def _check_shard_path(index: Path, tensor: str, shard: object) -> str:
    """A shard file name from the index: a relative path that stays inside the checkpoint folder."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index}: weight_map[{tensor!r}] must be a shard file name, got {shard!r}")
    for flavour in (PurePosixPath, PureWindowsPath):
        path = flavour(shard)
        if path.is_absolute() or path.drive or path.root or ".." in path.parts:
            raise CheckpointError(
                f"{index}: weight_map[{tensor!r}] = {shard!r} leaves the checkpoint folder; shard paths must be "
                "relative and inside it (no absolute paths, no '..')"
            )
    return shard


def shard_map(model_dir: str | os.PathLike) -> dict[Path, set[str] | None]:
    """Each weight file of a checkpoint, with the tensors its index assigns to it (None: no index, any tensor).

    The shards ``model.safetensors.index.json`` lists, else every ``*.safetensors`` in the folder.
    """
    root = Path(model_dir)
    index = root / INDEX_FILE
    if not index.is_file():
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"model_dir={str(model_dir)!r} holds no *.safetensors file (kvlab does not read pickled .bin weights)"
            )
        for file in files:
            _check_inside(root, file)
        return dict.fromkeys(files)
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} must hold a non-empty 'weight_map' object: tensor name -> shard file")
    shards: dict[Path, set[str] | None] = {}
    for tensor, shard in weight_map.items():
        shards.setdefault(root / _check_shard_path(index, tensor, shard), set()).add(tensor)  # type: ignore[union-attr]
    absent = [str(f.relative_to(root)) for f in shards if not f.is_file()]
    if absent:
        raise CheckpointError(f"{index} lists shards that are missing: {absent}")
    for file in shards:
        _check_inside(root, file)
    return shards


def _check_inside(root: Path, file: Path) -> None:
    """The one rule for every weight file: its real path (symlinks followed) lies inside the checkpoint folder's."""
    real = file.resolve()
    if not real.is_relative_to(root.resolve()):
        raise CheckpointError(
            f"{file} is a link to {real}, which leaves the checkpoint folder {root}: weight files must be inside it "
            "(copy the file in; a Hugging Face download can write real files with snapshot_download(local_dir=...))"
        )


def read_weights(model_dir: str | os.PathLike, *, meta: bool = False
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Every tensor of the checkpoint by name, and the file each came from.

    ``meta=True`` reads the safetensors headers only (a few kB): each tensor is then a meta tensor of
    its shape and dtype, enough to check a checkpoint before any weight is read or allocated.
    Rotary ``inv_freq`` buffers some old files carry are skipped (kvlab computes them).
    """
    weights: dict[str, torch.Tensor] = {}
    sources: dict[str, Path] = {}
    for path, assigned in shard_map(model_dir).items():
        try:
            with safe_open(str(path), framework="pt") as handle:
                names = [n for n in handle.keys() if not n.endswith("rotary_emb.inv_freq")]  # noqa: SIM118
                tensors = {name: _meta_tensor(path, name, handle.get_slice(name)) if meta else handle.get_tensor(name)
                           for name in names}
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from error
        lacking = sorted(n for n in assigned or () if n not in tensors and not n.endswith("rotary_emb.inv_freq"))
        if lacking:
            raise CheckpointError(f"{path} lacks tensors that {INDEX_FILE} puts there: {lacking[:3]}")
        for name, tensor in tensors.items():
            if name in sources:
                raise CheckpointError(f"tensor {name} is in two weight files: {sources[name]} and {path}")
            weights[name], sources[name] = tensor, path
    return weights, sources


#: safetensors' dtype names (the header's "dtype" field) -> torch's.
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _meta_tensor(path: Path, name: str, tensor_slice: Any) -> torch.Tensor:
    """A meta tensor shaped and typed as the header describes tensor ``name``: no data is read."""
    dtype = _SAFETENSORS_DTYPES.get(tensor_slice.get_dtype())
    if dtype is None:
        raise CheckpointError(f"{path}: {name} has dtype {tensor_slice.get_dtype()}, which kvlab does not read")
    return torch.empty(tensor_slice.get_shape(), dtype=dtype, device="meta")


def check_before_loading(model_dir: str | os.PathLike, config: Any, build: Callable[[], torch.nn.Module]) -> None:
    """Compare the checkpoint's tensor names and shapes (its headers) with the model ``build()`` makes from
    ``config.json``, on the meta device, so a config that disagrees costs no memory and no time.

    The layer count goes first: even on the meta device, 200,000 layers would take minutes to build.
    """
    header, sources = read_weights(model_dir, meta=True)
    config_file = str(Path(model_dir) / "config.json")
    check_layer_count(config, header, config_file)
    with torch.device("meta"):
        model = build()
    model.check_weights(header, sources={name: str(path) for name, path in sources.items()}, config_file=config_file)


def load_llama(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
               config: DecoderConfig | None = None, tp_group: Any = None, *, check: bool = True,
               load: bool = True) -> LlamaForCausalLM | None:
    """A Llama-family checkpoint in kvlab's ``LlamaForCausalLM``.

    Biases are switched on where the checkpoint has them (Qwen2's q/k/v biases, Llama's
    ``attention_bias``), so no per-model flag is needed; every tensor must then fit the config
    exactly (``LlamaForCausalLM.load_weights``).
    """
    config = config or DecoderConfig.from_pretrained(model_dir)
    names = read_weights(model_dir, meta=True)[0]

    def build() -> LlamaForCausalLM:
        return LlamaForCausalLM(
            config,
            qkv_bias="model.layers.0.self_attn.q_proj.bias" in names,
            o_bias="model.layers.0.self_attn.o_proj.bias" in names,
            mlp_bias="model.layers.0.mlp.gate_proj.bias" in names,
            tp_group=tp_group,
        )

    return load_checked(model_dir, dtype, config, build, check=check, load=load)


def load_checked(model_dir: str | os.PathLike, dtype: torch.dtype, config: Any, build: Callable[[], torch.nn.Module],
                 *, check: bool = True, load: bool = True) -> Any:
    """``build()``'s model filled from the checkpoint, after ``check_before_loading`` on the meta device.

    ``check=False`` skips that comparison (a tensor-parallel rank, whose engine ran it once); ``load=False``
    only checks and returns None (the engine's ``check_checkpoint``).
    """
    if check:
        check_before_loading(model_dir, config, build)
    if not load:
        return None
    weights, sources = read_weights(model_dir)
    model = build()
    model.to(dtype)
    model.load_weights(weights, sources={name: str(path) for name, path in sources.items()},
                       config_file=str(Path(model_dir) / "config.json"))
    return model.eval()


def load_gemma3(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                config: DecoderConfig | None = None, tp_group: Any = None, *, check: bool = True,
                load: bool = True) -> Gemma3ForCausalLM | None:
    """A ``gemma3_text`` checkpoint in ``Gemma3ForCausalLM``. Its biases follow ``attention_bias``, as in
    transformers: a bias tensor the config does not ask for is refused as unused, not silently read. kvlab's
    Gemma 3 decoder is not sharded: ``EngineConfig`` refuses it with ``tensor_parallel_size > 1``."""
    assert tp_group is None or tp_group.world_size == 1, "EngineConfig refuses a sharded Gemma 3"
    config = config or DecoderConfig.from_pretrained(model_dir)
    bias = bool(config.spec.config.get("attention_bias"))
    return load_checked(model_dir, dtype, config, lambda: Gemma3ForCausalLM(config, attention_bias=bias),
                        check=check, load=load)
