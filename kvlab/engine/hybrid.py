"""A hybrid model served two ways, measured on the pool: KV cache groups against one full-attention allocation.

With vLLM's hybrid KV cache manager (the default) the sliding-window layers of a model get a
KV cache group of their own, whose blocks are freed once the window has passed them; with
``disable_hybrid_kv_cache_manager`` every layer is allocated as full attention, while still
attending in its window, so the tokens are the same and only the memory differs.
``compare_allocations`` runs the same requests both ways and reads, after every step, the bytes
the pool has in use (blocks not in the free queue x bytes per block): a measurement, not a formula.
``without_sliding_window`` writes a copy of a checkpoint whose layers all attend fully, to show
that the window is part of the model: dropping it changes the tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlab.capacity.config_fields import check_config_fields
from kvlab.engine.llm_engine import LLMEngine
from kvlab.errors import KvlabValueError


@dataclasses.dataclass(frozen=True)
class PoolUsage:
    """One run of an engine: its tokens, and the pool's bytes in use after each step."""

    hybrid: bool  # the hybrid KV cache manager (sliding-window groups) or every layer as full attention
    outputs: list[list[int]]
    bytes_in_use: list[int]  # after each step: (usable blocks - free blocks) x bytes per block
    bytes_per_block: int
    num_blocks: int
    kv_cache_bytes: int  # the K and V tensors the engine allocated

    @property
    def peak_bytes(self) -> int:
        return max(self.bytes_in_use, default=0)


def bytes_in_use(engine: LLMEngine) -> int:
    """The pool's bytes in use now, read off the pool: blocks out of the free queue x bytes per block."""
    pool = engine.kv_cache_manager.block_pool
    return (pool.num_usable_blocks - pool.get_num_free_blocks()) * engine.bytes_per_block


def run_measured(model_dir: str | os.PathLike, prompts: Sequence[Sequence[int]], max_tokens: int,
                 hybrid: bool = True, **engine_args: Any) -> PoolUsage:
    """Serve ``prompts`` to the end (greedy), reading the pool's bytes in use after every step."""
    engine = LLMEngine(model_dir, disable_hybrid_kv_cache_manager=not hybrid, **engine_args)
    ids = [engine.add_request(p, max_tokens=max_tokens) for p in prompts]
    usage = []
    while engine.has_unfinished_requests():
        engine.step()
        usage.append(bytes_in_use(engine))
    return PoolUsage(hybrid, [engine.outputs[i] for i in ids], usage, engine.bytes_per_block,
                     engine.num_gpu_blocks, engine.kv_cache_bytes)


def compare_allocations(model_dir: str | os.PathLike, prompts: Sequence[Sequence[int]], max_tokens: int,
                        **engine_args: Any) -> tuple[PoolUsage, PoolUsage]:
    """The same requests with KV cache groups and with every layer as full attention: (hybrid, full)."""
    return (run_measured(model_dir, prompts, max_tokens, True, **engine_args),
            run_measured(model_dir, prompts, max_tokens, False, **engine_args))


def without_sliding_window(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Copy a checkpoint with every layer full attention (``layer_types``): the same weights, no window."""
    src, dst = Path(model_dir), Path(out_dir)
    config = dict(check_config_fields(json.loads((src / "config.json").read_text(encoding="utf-8"))))
    if not config.get("layer_types") or "sliding_attention" not in config["layer_types"]:
        raise KvlabValueError(f"{src / 'config.json'} has no sliding-window layer in layer_types: nothing to drop")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    config["layer_types"] = ["full_attention"] * len(config["layer_types"])
    (dst / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return dst
