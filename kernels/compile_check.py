"""Compile the kernels for a GPU ahead of time, on a machine without one: does the source make a cubin?

Triton's wheel ships NVIDIA's ``ptxas``, so ``triton.compile`` can lower a kernel to PTX and cubin
for, say, an H100/H200 (``sm_90``) with no GPU present. The interpreter accepts code a GPU would
reject (a ``tl.dot`` tile under 16, a type mix-up in a loop); this check catches that on any Linux
machine, and reports each variant's shared memory. It must run in a process where Triton compiles
rather than interprets, so run it as::

    KVLAB_KERNEL_BACKEND=torch python -m kvlab.kernels.compile_check [--arch 90] [--json] [my_attention.py]

(``torch`` keeps ``import kvlab.kernels`` from switching the interpreter on; the kernels are
loaded here from their source files instead.) Files named on the command line, a learner's own
edited kernels, replace the package's functions of the same names.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlab.kernels import TORCH_REFERENCE, backend, function_sources
from kvlab.kernels.grid import next_power_of_2

from kvlab.errors import BackendUnavailableError

KERNEL_MODULES = ("attention", "cache_write", "online_softmax", "mla_cache_write", "mla_decode")
POINTER_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32", "fp8": "*fp8e4nv"}


def jit_sources(kernel_files: Sequence[str | os.PathLike] = ()) -> dict[str, str]:
    """The ``@triton.jit`` functions to compile by name: the package's, then those of ``kernel_files``, which win.

    A learner's edited copy of ``attention.py`` (under any name) so replaces the package's
    ``paged_attention_kernel`` and its helpers, and is compiled with everything else.
    """
    sources: dict[str, str] = {}
    for source in [*KERNEL_MODULES, *(Path(f) for f in kernel_files)]:
        sources.update({name: src for name, src in function_sources(source).items() if src.startswith("@triton.jit")})
    return sources


def load_compiled_mode_kernels(kernel_files: Sequence[str | os.PathLike] = ()) -> Any:
    """Every ``@triton.jit`` function of ``KERNEL_MODULES`` (and ``kernel_files``), compiled-mode, in one module."""
    import triton

    if triton.knobs.runtime.interpret:
        raise BackendUnavailableError("Triton is interpreting in this process; run with KVLAB_KERNEL_BACKEND=torch")
    body = "\n\n\n".join(jit_sources(kernel_files).values())
    scratch = Path(tempfile.mkdtemp()) / "kvlab_kernels_aot.py"
    scratch.write_text("import triton\nimport triton.language as tl\n\n\n" + body + "\n")
    spec = importlib.util.spec_from_file_location("kvlab_kernels_aot", scratch)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _signature(fn: Any, constexprs: dict[str, Any], types: dict[str, str]) -> dict[str, str]:
    """Every argument typed: constexprs as such, the rest from ``types`` (default: a 32-bit integer)."""
    return {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}


def variants(m: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, int]]]:
    """(label, kernel, argument types, constexprs, launch options) for each shape worth compiling."""
    import triton.language as tl

    out = []

    def attention(label: str, kv: str = "bf16", act: str = "bf16", splits: int = 1, block_q: int = 4,
                  block_m: int = 16, tile_n: int = 64, head: int = 128, trace: bool = False, window: int = 0,
                  **options: int):
        compute = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[act]
        const = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, GROUP=4, HEAD_SIZE=head, HEAD_PAD=max(16, next_power_of_2(head)),
                     BLOCK_SIZE=16, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, NUM_SPLITS=splits, CAUSAL=True,
                     SLIDING_WINDOW=window, KV_FP8=kv == "fp8", COMPUTE_DTYPE=compute, TRACE=trace, MAX_TILES=512)
        types = {"out_ptr": POINTER_TYPES[act], "split_acc_ptr": "*fp32", "split_max_ptr": "*fp32",
                 "split_sum_ptr": "*fp32", "trace_ptr": "*i32", "query_ptr": POINTER_TYPES[act],
                 "key_cache_ptr": POINTER_TYPES[kv], "value_cache_ptr": POINTER_TYPES[kv], "block_table_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "scale": "fp32", "k_scale": "fp32",
                 "v_scale": "fp32"}
        fn = m.paged_attention_kernel
        out.append((label, fn, _signature(fn, const, types), const, {"num_warps": 4, "num_stages": 3, **options}))

    attention("decode bf16")
    attention("decode fp8 cache", kv="fp8")
    attention("decode bf16, 4 splits", splits=4)
    attention("prefill bf16, 64 rows", block_q=16, block_m=64)
    attention("fp16, head 80", act="fp16", kv="fp16", head=80)
    attention("fp32 (exact dots)", act="fp32", kv="fp32")
    attention("decode bf16 with trace", trace=True)
    attention("decode bf16, sliding window 4096", window=4096)
    attention("prefill bf16, sliding window 1024, 4 splits", block_q=16, block_m=64, window=1024, splits=4)

    reduce_const = dict(NUM_Q_HEADS=32, HEAD_SIZE=128, HEAD_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4)
    fn = m.reduce_splits_kernel
    out.append(("merge of 4 splits", fn, _signature(fn, reduce_const, {
        "out_ptr": "*bf16", "split_acc_ptr": "*fp32", "split_max_ptr": "*fp32", "split_sum_ptr": "*fp32"}),
        reduce_const, {"num_warps": 4}))

    for kv in ("bf16", "fp8"):
        const = dict(NUM_KV_HEADS=8, HEAD_SIZE=128, HEADS_PAD=8, HEAD_PAD=128, BLOCK_SIZE=16, FP8=kv == "fp8",
                     FP8_MAX=448.0)
        fn = m.reshape_and_cache_kernel
        out.append((f"cache write, {kv} cache", fn, _signature(fn, const, {
            "key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": POINTER_TYPES[kv],
            "value_cache_ptr": POINTER_TYPES[kv], "slot_mapping_ptr": "*i64", "k_scale": "fp32", "v_scale": "fp32"}),
            const, {"num_warps": 4}))

    out.extend(mla_variants(m))

    const = dict(HEAD=32, BLOCK_M=16, TILE_N=16, UPDATE=m.online_softmax_update)
    fn = m.attention_by_tiles_kernel
    out.append(("exercise tile kernel", fn, _signature(fn, const, {
        "q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "visible_ptr": "*i8", "out_ptr": "*fp32",
        "states_ptr": "*fp32", "scale": "fp32"}), const, {"num_warps": 4}))
    return out


def mla_variants(m: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, int]]]:
    """MLA at DeepSeek-V3's shapes (latent 512 + rope 64, 16 heads per program, tiles of 32): decode and cache write."""
    import triton.language as tl

    out = []
    for label, kv, splits in (("MLA decode: bf16", "bf16", 1), ("MLA decode: fp8 cache", "fp8", 1),
                              ("MLA decode: bf16, 4 splits", "bf16", 4)):
        const = dict(NUM_HEADS=128, KV_LORA_RANK=512, ROPE_DIM=64, LATENT_PAD=512, ROPE_PAD=64, BLOCK_SIZE=64,
                     BLOCK_H=16, TILE_N=32, NUM_SPLITS=splits, KV_FP8=kv == "fp8", COMPUTE_DTYPE=tl.bfloat16)
        types = {"out_ptr": "*bf16", "split_acc_ptr": "*fp32", "split_max_ptr": "*fp32", "split_sum_ptr": "*fp32",
                 "q_latent_ptr": "*bf16", "q_pe_ptr": "*bf16", "kv_cache_ptr": POINTER_TYPES[kv],
                 "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "scale": "fp32", "k_scale": "fp32"}
        fn = m.mla_decode_kernel
        out.append((label, fn, _signature(fn, const, types), const, {"num_warps": 4, "num_stages": 2}))
    reduce_const = dict(NUM_Q_HEADS=128, HEAD_SIZE=512, HEAD_PAD=512, NUM_SPLITS=4, SPLITS_PAD=4)
    fn = m.reduce_splits_kernel
    out.append(("MLA merge of 4 splits (latent 512)", fn, _signature(fn, reduce_const, {
        "out_ptr": "*bf16", "split_acc_ptr": "*fp32", "split_max_ptr": "*fp32", "split_sum_ptr": "*fp32"}),
        reduce_const, {"num_warps": 4}))
    for kv in ("bf16", "fp8"):
        const = dict(KV_LORA_RANK=512, ROPE_DIM=64, LATENT_PAD=512, ROPE_PAD=64, BLOCK_SIZE=64, FP8=kv == "fp8",
                     FP8_MAX=448.0)
        fn = m.concat_and_cache_mla_kernel
        out.append((f"MLA cache write, {kv} cache", fn, _signature(fn, const, {
            "kv_c_ptr": "*bf16", "k_pe_ptr": "*bf16", "kv_cache_ptr": POINTER_TYPES[kv], "slot_mapping_ptr": "*i64",
            "k_scale": "fp32"}), const, {"num_warps": 4}))
    return out


def compile_all(arch: int = 90, kernel_files: Sequence[str | os.PathLike] = (), only: str | None = None
                ) -> list[dict[str, Any]]:
    """Compile every variant for ``sm_<arch>``; one row per variant (shared memory in bytes, or the error).

    ``kernel_files`` (a learner's own kernel source, say an edited copy of ``attention.py``)
    replace the package's functions of the same names before compiling; ``only`` keeps the
    variants whose label contains it.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    m = load_compiled_mode_kernels(kernel_files)
    target = GPUTarget("cuda", arch, 32)
    rows = []
    for label, fn, signature, constexprs, options in variants(m):
        if only is not None and only not in label:
            continue
        start = time.perf_counter()
        try:
            kernel = triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)
            rows.append({"variant": label, "ok": True, "shared_bytes": kernel.metadata.shared,
                         "cubin_bytes": len(kernel.asm["cubin"]), "seconds": time.perf_counter() - start})
        except Exception as exc:  # a compile error is the finding, reported per variant
            rows.append({"variant": label, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("kernel_files", nargs="*", metavar="FILE",
                        help="your own kernel source (e.g. an edited copy of attention.py): its functions replace "
                             "the package's of the same names")
    parser.add_argument("--only", help="compile only the variants whose label contains this text")
    args = parser.parse_args(argv)
    if backend() != TORCH_REFERENCE:
        raise BackendUnavailableError("run with KVLAB_KERNEL_BACKEND=torch, so that Triton compiles here")
    rows = compile_all(args.arch, args.kernel_files, args.only)
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            detail = f"shared {r['shared_bytes']} B, {r['seconds']:.1f} s" if r["ok"] else r["error"]
            print(f"sm_{args.arch} {r['variant']}: {'ok' if r['ok'] else 'FAILED'} ({detail})")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
