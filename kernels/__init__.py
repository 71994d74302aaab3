"""kvlab.kernels: the paged attention kernel and the cache write, in Triton, with a torch reference.

* ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)`` writes
  each token's K and V into its slot of the paged cache (``cache_write.py``).
* ``paged_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, ...)``
  attends every query token to its sequence's keys, read through the block table
  (``attention.py``; its grid and index arithmetic: ``grid.py``).
* ``paged_attention_ref`` / ``reshape_and_cache_ref``: the torch specification (``reference.py``).
* ``paged_attention_torch``: the same answer for CPUs, one batched gather plus torch's SDPA
  (``torch_attention.py``), as fast as torch allows without Triton's interpreter; ``reshape_and_cache_torch``
  writes the cache as the reference does, with its checks run once per step.
* MLA's latent cache: ``concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping)`` writes each
  token's ``[c_kv, k_pe]`` into its slot of ``[num_blocks, block_size, kv_lora_rank + rope_dim]``
  (``mla_cache_write.py``); ``mla_decode(q_latent, q_pe, kv_cache, block_table, seq_lens, scale=...)``
  attends absorbed queries over it, output in latent space (``mla_decode.py``); their torch
  specification is ``concat_and_cache_mla_ref`` / ``mla_decode_ref`` (``mla_reference.py``), and
  ``kvlab.kernels.mla_absorb`` holds the naive and absorbed attention they are checked against.
* ``check_kernel(fn)``: a learner's attention function against the reference on packaged batches,
  with the worst (sequence, query token, head) per batch (``verify.py``; the batches: ``batches.py``);
  ``kvlab.kernels.mutants`` holds broken copies of the kernels to try it on.
* ``cuda_thread_layout(head_size, block_size, dtype_bytes)``: how vLLM's older hand-written CUDA
  kernel divides one (sequence, head) among warps, thread groups and lanes, and
  ``compare_work_division`` against this package's Triton kernel (``legacy_layout.py``).
* ``backend()``: ``"triton-cuda"``, ``"triton-interpreter"`` or ``"torch-reference"``; choose one with
  ``KVLAB_KERNEL_BACKEND=cuda|interpreter|torch`` before importing this package. ``default_device()``
  is where that backend wants its tensors: ``"cuda"`` for native Triton, ``"cpu"`` otherwise.

Caches are ``[num_blocks, block_size, num_kv_heads, head_size]`` (vLLM V1's flash layout); index
tensors may be int32 or int64. ``HostMetadata`` carries the index tensors' host copies (vLLM's
``CommonAttentionMetadata.*_cpu``): given it, ``paged_attention`` and ``mla_decode`` check their
inputs without reading the device (no synchronisation; CUDA-graph friendly). An ``out`` or a cache
that overlaps itself or shares memory with another argument is refused.

Importing this package sets Triton up (``TRITON_INTERPRET=1`` when
there is no GPU) and then imports the kernel modules, before anything else can decorate them.

The kernels live in ``attention.py`` (so the function ``kvlab.kernels.paged_attention`` shadows
no module) and ``cache_write.py``; ``kvlab.kernels.attention.paged_attention_kernel`` is the kernel.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import torch
from kvlab.kernels._backend import (
    BACKEND_ENV,
    BACKENDS,
    TORCH_REFERENCE,
    TRITON_CUDA,
    TRITON_INTERPRETER,
    backend,
    default_device,
    describe_backend,
    device_for,
)
from kvlab.kernels.checks import (
    AttentionBatch,
    HostMetadata,
    check_attention,
    check_cache_write,
    check_kernel_device,
)
from kvlab.kernels.fp8 import E4M3_MAX, calibrated_scale, dequantize_fp8, quantize_fp8
from kvlab.kernels.grid import KernelConfig, LaunchPlan, choose_config, choose_num_kv_splits, plan_launch
from kvlab.kernels.layouts import from_legacy_layout, legacy_x, to_legacy_layout
from kvlab.kernels.legacy_layout import CudaThreadLayout, WorkDivision, compare_work_division, cuda_thread_layout
from kvlab.kernels.mla_checks import MLADecodeBatch, check_concat_and_cache_mla, check_mla_decode
from kvlab.kernels.mla_reference import concat_and_cache_mla_ref, mla_decode_ref
from kvlab.kernels.reference import (
    compute_slot_mapping,
    gather_kv,
    masked_attention,
    paged_attention_ref,
    reshape_and_cache_ref,
)
from kvlab.kernels.torch_attention import paged_attention_torch, reshape_and_cache_torch
from kvlab.kernels.verify import PACKAGED_BATCHES, BatchSpec, KernelReport, check_kernel

from kvlab.errors import KernelInputError, UnknownNameError

if backend() != TORCH_REFERENCE:
    # Imported once here, where the backend is known: importing them decorates the kernels.
    from kvlab.kernels.attention import paged_attention_triton
    from kvlab.kernels.cache_write import reshape_and_cache_triton
    from kvlab.kernels.mla_cache_write import concat_and_cache_mla_triton
    from kvlab.kernels.mla_decode import mla_decode_triton


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                      slot_mapping_cpu: torch.Tensor | None = None) -> None:
    """Write token ``t``'s K and V ``[num_tokens, num_kv_heads, head_size]`` into slot ``slot_mapping[t]``.

    Slot ``s`` is ``cache[s // block_size, s % block_size]``; -1 is padding and is skipped. An FP8
    (e4m3) cache stores ``value / scale``. ``slot_mapping_cpu``, the slots' host copy, spares the
    checks a device read. Runs the Triton kernel, or the reference on ``torch-reference``.
    """
    if backend() == TORCH_REFERENCE:
        return reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                                     slot_mapping_cpu)
    return reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                                    slot_mapping_cpu)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                    scale: float | None = None, causal: bool = True, k_scale: float = 1.0, v_scale: float = 1.0,
                    num_kv_splits: int | None = None, out: torch.Tensor | None = None,
                    config: KernelConfig | None = None, sliding_window: int | None = None,
                    host_metadata: HostMetadata | None = None) -> torch.Tensor:
    """Varlen paged attention for a batch mixing prefill chunks and decode steps.

    ``query`` is ``[num_tokens, num_q_heads, head_size]``; sequence ``i``'s query tokens are
    ``query[query_start_loc[i]:query_start_loc[i + 1]]``, its *last* tokens, so its cached context
    is ``seq_lens[i] - query_len``. ``block_table[i]`` lists its physical blocks. ``scale`` defaults
    to ``1/sqrt(head_size)``; FP8 caches are dequantized with ``k_scale``/``v_scale``;
    ``num_kv_splits`` (default: chosen) splits each sequence's keys across programs. ``out``, if
    given, is written in place; ``config`` overrides the tile sizes. ``sliding_window`` W (causal
    only; vLLM 0.33.0's and transformers' convention) lets the query at position ``q`` see keys
    ``q - W + 1 .. q`` only, W keys itself included; tiles wholly outside are not read.
    ``host_metadata`` (the index tensors' host copies) lets the checks run without reading the
    device: no synchronisation. Returns ``[num_tokens, Hq, D]``.
    """
    kwargs = dict(scale=scale, causal=causal, k_scale=k_scale, v_scale=v_scale, num_kv_splits=num_kv_splits, out=out,
                  config=config, sliding_window=sliding_window, host_metadata=host_metadata)
    if backend() == TORCH_REFERENCE:
        return paged_attention_ref(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, **kwargs)
    return paged_attention_triton(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, **kwargs)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: float = 1.0,
                         slot_mapping_cpu: torch.Tensor | None = None) -> None:
    """Write token ``t``'s ``c_kv [num_tokens, kv_lora_rank]`` and ``k_pe [num_tokens, rope_dim]`` into one slot.

    Slot ``s`` is ``kv_cache[s // block_size, s % block_size]``, ``c_kv`` first; -1 is padding and is
    skipped. An FP8 cache stores ``x / k_scale``. Runs the Triton kernel, or the reference on ``torch-reference``.
    """
    if backend() == TORCH_REFERENCE:
        return concat_and_cache_mla_ref(kv_c, k_pe, kv_cache, slot_mapping, k_scale, slot_mapping_cpu)
    return concat_and_cache_mla_triton(kv_c, k_pe, kv_cache, slot_mapping, k_scale, slot_mapping_cpu)


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, *, scale: float, k_scale: float = 1.0, num_kv_splits: int | None = None,
               out: torch.Tensor | None = None, config: KernelConfig | None = None,
               host_metadata: HostMetadata | None = None) -> torch.Tensor:
    """One decode token per sequence attends over its latents: ``[num_seqs, num_heads, kv_lora_rank]``.

    ``q_latent [num_seqs, num_heads, kv_lora_rank]`` is the query with ``W_UK`` absorbed, ``q_pe``
    ``[num_seqs, num_heads, rope_dim]`` its rotated rope part; sequence ``i`` reads ``seq_lens[i]``
    latents through ``block_table[i]``. ``scale`` is the model's softmax scale (required: it
    depends on ``qk_nope_head_dim``, which these shapes do not show). ``config.block_m`` sets the
    heads per program; ``num_kv_splits`` (default: chosen) splits each sequence's latents.
    """
    kwargs = dict(scale=scale, k_scale=k_scale, num_kv_splits=num_kv_splits, out=out, host_metadata=host_metadata)
    if backend() == TORCH_REFERENCE:
        return mla_decode_ref(q_latent, q_pe, kv_cache, block_table, seq_lens, **kwargs)
    return mla_decode_triton(q_latent, q_pe, kv_cache, block_table, seq_lens, config=config, **kwargs)


def function_sources(module: str | os.PathLike) -> dict[str, str]:
    """Every top-level function of ``kernels/<module>.py`` (or of a file path) by name, decorators included.

    Reading instead of importing works where Triton is missing (the notebook shows the kernels
    anyway) and where it interprets (``compile_check`` recompiles them from their source).
    """
    path = Path(module) if isinstance(module, os.PathLike) or str(module).endswith(".py") else \
        Path(__file__).with_name(f"{module}.py")
    if not path.is_file():
        raise KernelInputError(f"module must name a kernel module or a .py file, got {str(module)!r} (no such file)")
    text = path.read_text()
    lines = text.splitlines()
    sources = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            sources[node.name] = "\n".join(lines[first - 1:node.end_lineno]) + "\n"
    return sources


def kernel_source(name: str, module: str = "attention") -> str:
    """The source of function ``name`` in ``kernels/<module>.py`` (default: the attention kernels)."""
    sources = function_sources(module)
    if name not in sources:
        raise UnknownNameError("name", name, sources)
    return sources[name]


__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "E4M3_MAX",
    "PACKAGED_BATCHES",
    "TORCH_REFERENCE",
    "TRITON_CUDA",
    "TRITON_INTERPRETER",
    "AttentionBatch",
    "BatchSpec",
    "CudaThreadLayout",
    "HostMetadata",
    "KernelConfig",
    "KernelReport",
    "LaunchPlan",
    "MLADecodeBatch",
    "WorkDivision",
    "backend",
    "calibrated_scale",
    "check_attention",
    "check_cache_write",
    "check_concat_and_cache_mla",
    "check_kernel",
    "check_kernel_device",
    "check_mla_decode",
    "choose_config",
    "choose_num_kv_splits",
    "compare_work_division",
    "compute_slot_mapping",
    "concat_and_cache_mla",
    "concat_and_cache_mla_ref",
    "cuda_thread_layout",
    "dequantize_fp8",
    "default_device",
    "describe_backend",
    "device_for",
    "from_legacy_layout",
    "function_sources",
    "gather_kv",
    "kernel_source",
    "legacy_x",
    "masked_attention",
    "mla_decode",
    "mla_decode_ref",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_torch",
    "plan_launch",
    "quantize_fp8",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "reshape_and_cache_torch",
    "to_legacy_layout",
]
