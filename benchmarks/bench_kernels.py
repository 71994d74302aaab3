"""make bench: paged attention against SDPA on a GPU (saved with the machine); on CPU a smoke run only.

On a CUDA machine: ``python benchmarks/bench_kernels.py [--out DIR] [--sweep]`` times every shape of
``kvlab.kernels.bench.gpu_shapes`` and saves ``paged_attention_gpu.json`` (``--sweep`` adds the tile
sweep at the goal shape, ``paged_attention_tiles_gpu.json``). Without a GPU it runs one tiny shape
through Triton's interpreter to show the benchmark works, says the figures are not performance,
and saves nothing.
"""

import argparse
import sys
from pathlib import Path

import kvlab.kernels as kernels  # first: sets Triton up before anything else imports it
from kvlab.kernels import bench

from kvlab.machine import MEASUREMENTS_DIR, machine_line, save_measurement

METHOD = (
    "kvlab.kernels.bench: triton.testing.do_bench median (warm-up 25 ms, 100 ms of repeats) of the kernel launch "
    "alone (plan and checks done once), rotating independent input sets to defeat L2; SDPA "
    "(enable_gqa=True) on a contiguous copy of the same K/V, fastest of torch's fused backends; bandwidth = "
    "(K + V + Q read + output written) / median time, as a share of a 1 GiB device-to-device copy timed in the "
    "same run; *_graph_us: the same calls captured in a CUDA graph (triton.testing.do_bench_cudagraph median, "
    "no launch overhead, no L2 flush between calls); scattered block tables; Llama-3-8B heads (32 q / 8 kv, "
    "head 128), bf16."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=MEASUREMENTS_DIR, help="where the JSON files go")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile sizes at batch 64 x 8K (GPU)")
    args = parser.parse_args(argv)
    print("machine:", machine_line())
    if kernels.backend() != kernels.TRITON_CUDA:
        bench.main(["--smoke"])
        print("No GPU: the smoke run above only shows that the benchmark runs; nothing was saved.")
        return 0
    partial = args.out / "paged_attention_gpu.rows.jsonl"
    partial.unlink(missing_ok=True)
    results = bench.main(["--rows-to", str(partial)])
    path = save_measurement("paged_attention_gpu", results, METHOD, path=args.out / "paged_attention_gpu.json")
    partial.unlink()                                 # the full JSON holds every row
    print("saved", path)
    if args.sweep:
        rows = bench.tile_sweep()
        for row in rows:
            print(bench.format_row(row), "| tile", row.get("tile_n"), "warps", row.get("num_warps"),
                  "stages", row.get("num_stages"))
        path = save_measurement("paged_attention_tiles_gpu", {"rows": rows}, "decode b64 ctx8K bs16; " + METHOD,
                                path=args.out / "paged_attention_tiles_gpu.json")
        print("saved", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
