"""make bench: MLA decode, decompressing (naive) against absorbed (the Triton kernel), with the bytes each reads.

On a CUDA machine: ``python benchmarks/bench_mla.py [--out DIR]`` times every shape of
``kvlab.kernels.mla_bench.gpu_shapes`` and saves ``mla_decode_gpu.json``. Each row gets the FLOPs
and bytes read of both paths from ``kvlab.capacity.mla`` (one layer, the shape's batch; weights
read once) and their ratios, and the absorbed path's achieved bandwidth on that count. Without a
GPU it runs one tiny shape through Triton's interpreter to show the benchmark works, says the
figures are not performance, and saves nothing.
"""

import argparse
import json
import sys
from pathlib import Path

import kvlab.kernels as kernels  # first: sets Triton up before anything else imports it
from kvlab.kernels import mla_bench

from kvlab.capacity.mla import MLADims, mla_attention_cost
from kvlab.machine import MEASUREMENTS_DIR, machine_line, save_measurement

METHOD = (
    "kvlab.kernels.mla_bench: triton.testing.do_bench medians (warm-up 25 ms, 100 ms of repeats), rotating "
    "independent input sets to overflow L2; naive = gather the latents through scattered block tables, decompress "
    "with W_UK/W_UV into per-head K [B, N, S, 192] and V [B, N, S, 128] (torch einsum), SDPA; absorbed = "
    "q_nope.W_UK, the mla_decode Triton kernel over the paged latents (plan and checks done once), o_latent.W_UV; "
    "kernel_us = mla_decode alone. DeepSeek-V3 shapes (kv_lora_rank 512, rope 64, nope 128, V 128), bf16, "
    "16 heads (TP 8) or 128; bytes_read_* and flops_* are kvlab.capacity.mla's count for one layer (unfused: "
    "each tensor crosses memory once per use, the weights once per step), not measured traffic."
)
COLUMNS = ("shape", "num_kv_splits", "naive_us", "absorbed_us", "kernel_us", "speedup", "bytes_read_ratio",
           "flops_ratio", "absorbed_GBps", "rel_error_vs_naive")


def with_counts(shape: mla_bench.MLAShape, row: dict) -> dict:
    """The row plus ``kvlab.capacity.mla``'s FLOPs and bytes read of both paths for this shape."""
    if "absorbed_us" not in row:
        return row
    dims = MLADims(num_heads=shape.num_heads, kv_lora_rank=shape.kv_lora_rank, qk_nope_head_dim=shape.nope_dim,
                   qk_rope_head_dim=shape.rope_dim, v_head_dim=shape.v_dim)
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[row["dtype"]]
    cost = mla_attention_cost(dims, 1, shape.context - 1, num_seqs=shape.batch, kv_dtype=dtype, act_dtype=dtype)
    return {**row, "bytes_read_naive": cost.naive.bytes_read, "bytes_read_absorbed": cost.absorbed.bytes_read,
            "bytes_read_ratio": cost.bytes_read_ratio, "flops_naive": cost.naive.flops,
            "flops_absorbed": cost.absorbed.flops, "flops_ratio": cost.flops_ratio,
            "absorbed_GBps": cost.absorbed.bytes_read / (row["absorbed_us"] * 1e-6) / 1e9}


def format_row(row: dict) -> str:
    if "absorbed_us" not in row:
        return f"{row['shape']}: {row.get('skipped') or row.get('error')}"
    return " | ".join(f"{row.get(k, ''):.3g}" if isinstance(row.get(k), float) else str(row.get(k, ""))
                      for k in COLUMNS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=MEASUREMENTS_DIR, help="where the JSON file goes")
    parser.add_argument("--smoke", action="store_true", help="one tiny shape (the default without a GPU)")
    args = parser.parse_args(argv)
    print("machine:", machine_line())
    smoke = args.smoke or kernels.backend() != kernels.TRITON_CUDA
    if smoke:
        print("SMOKE RUN: one tiny shape through", kernels.backend(), "- these timings are not performance figures.")
    print(" | ".join(COLUMNS))
    rows = []
    partial = None if smoke else args.out / "mla_decode_gpu.rows.jsonl"
    if partial:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.unlink(missing_ok=True)

    def on_row(shape: mla_bench.MLAShape, row: dict) -> None:
        rows.append(with_counts(shape, row))
        print(format_row(rows[-1]), flush=True)
        if partial:                                 # a run stopped by a time limit keeps the rows it finished
            with open(partial, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")

    results = mla_bench.run(mla_bench.smoke_shapes() if smoke else mla_bench.gpu_shapes(), on_row=on_row)
    results["rows"] = rows
    if smoke:
        print("No GPU: the smoke run above only shows that the benchmark runs; nothing was saved.")
        return 0
    path = save_measurement("mla_decode_gpu", results, METHOD, path=args.out / "mla_decode_gpu.json")
    partial.unlink()
    print("saved", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
