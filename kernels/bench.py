"""Time paged_attention against SDPA on a contiguous copy of the same K/V, as a share of copy bandwidth.

``python -m kvlab.kernels.bench`` on a CUDA machine runs Llama-3-8B's attention shape (32 query
heads, 8 KV heads, head 128, bf16): decode at batch 1/16/64/256 x context 1K/8K/32K x block 16/64,
one prefill, and decodes with a 4K sliding window over 32K contexts. Method, per shape:

* inputs: a paged cache whose blocks are handed out in random order (scattered block tables),
  one decode query per sequence (prefill: whole prompts), and for SDPA the same K/V copied into
  contiguous ``[batch, num_kv_heads, context, head]`` tensors (``enable_gqa=True``, no repeat);
  enough independent input sets are rotated that no call finds the previous one's data in L2;
* timing: ``triton.testing.do_bench`` (warm-up, then the median) of the kernel launch alone (the
  launch plan and the checks are done once, as an engine does per step), and of SDPA with each
  fused backend torch offers for the shape (flash, memory-efficient, cuDNN), keeping the fastest;
  ``do_bench`` times from the Python call, so a tiny shape measures launch overhead as much as the
  kernel: both are timed again inside a CUDA graph (``do_bench_cudagraph``), which leaves it out;
* bandwidth: bytes of K, V (a windowed decode: the window's) and Q read plus output written, over
  the median time, and its ratio to a device-to-device copy (read + write) timed the same way in
  the same run;
* correctness: the kernel's output against SDPA's, relative error, on the first input set.

The goal shape (batch 64 x 8K, block 16) runs first, so a run cut short still has it; a shape that
fails is recorded with its error and the others go on. ``verdict`` reads the issue's two goals off
the rows. On CPU there is no GPU to time: ``--smoke`` runs one tiny shape through the interpreter
and says so.
Depends on torch and triton only (``benchmarks/bench_kernels.py`` saves results with the machine);
the kernel module is imported on first use, so ``verdict`` and the shapes load without Triton.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from kvlab.kernels import TRITON_CUDA, backend, check_attention, plan_launch
from kvlab.kernels.checks import PagedTensors
from kvlab.kernels.grid import KernelConfig

from kvlab.errors import KernelInputError

GiB = 1024**3
#: The issue's goal: decode at batch 64 x 8K reaches this share of the measured copy bandwidth.
GOAL_COPY_FRACTION = 0.8


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark point: ``batch`` sequences of ``context`` tokens, each with ``query_len`` queries."""

    batch: int
    context: int
    block_size: int
    query_len: int = 1                 # 1: decode; == context: prefill of whole prompts
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: torch.dtype = torch.bfloat16
    sliding_window: int | None = None   # decode only: the query sees its last sliding_window keys

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.query_len != 1:
            raise KernelInputError("Shape.sliding_window is benchmarked on decode shapes only (query_len=1)")

    @property
    def kind(self) -> str:
        return "decode" if self.query_len == 1 else "prefill"

    @property
    def name(self) -> str:
        window = f" window{self.sliding_window}" if self.sliding_window else ""
        return f"{self.kind} b{self.batch} ctx{self.context} bs{self.block_size}{window}"

    @property
    def keys_read(self) -> int:
        """Keys each sequence's attention reads: the context, or the window of a windowed decode."""
        return min(self.context, self.sliding_window or self.context)

    @property
    def cache_bytes(self) -> int:
        """K and V of every sequence's whole context: what the cache holds (and SDPA's contiguous copy)."""
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def kv_bytes(self) -> int:
        """K and V the attention must read (the window's only, for a windowed decode)."""
        return 2 * self.batch * self.keys_read * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def q_bytes(self) -> int:
        return self.batch * self.query_len * self.num_q_heads * self.head_size * self.dtype.itemsize

    @property
    def bytes_moved(self) -> int:
        """K and V read, Q read, output written."""
        return self.kv_bytes + 2 * self.q_bytes

    @property
    def flops(self) -> float:
        """Multiply-adds of q k^T and p v, counted as 2 flops each (causal prefill: about half the pairs)."""
        pairs = self.keys_read if self.query_len == 1 else self.context * (self.context + 1) / 2
        return 4.0 * self.batch * self.num_q_heads * self.head_size * pairs


GOAL_SHAPE = Shape(64, 8192, 16)


def gpu_shapes() -> list[Shape]:
    """The issue's grid, the goal shape first: decode at batch 1/16/64/256 x 1K/8K/32K x block 16/64, one prefill;
    then sliding-window decodes of 4K over 32K contexts (they should cost what a 4K context costs)."""
    decode = [Shape(b, c, bs) for bs in (16, 64) for b in (1, 16, 64, 256) for c in (1024, 8192, 32768)]
    windowed = [Shape(b, 32768, 16, sliding_window=4096) for b in (1, 64)]
    return [GOAL_SHAPE] + [s for s in decode if s != GOAL_SHAPE] + [Shape(4, 2048, 16, query_len=2048)] + windowed


def smoke_shapes() -> list[Shape]:
    """Two tiny decode shapes, one with a sliding window: every line of the benchmark, through the interpreter."""
    tiny = dict(num_q_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return [Shape(2, 64, 16, **tiny), Shape(2, 64, 16, sliding_window=24, **tiny)]


@dataclasses.dataclass
class Inputs(PagedTensors):
    """One independent set of tensors for a shape: paged (for the kernel) and contiguous (for SDPA)."""

    out: torch.Tensor
    sdpa_q: torch.Tensor             # [batch, num_q_heads, query_len, head_size]
    sdpa_k: torch.Tensor             # [batch, num_kv_heads, context, head_size]
    sdpa_v: torch.Tensor


def make_inputs(shape: Shape, device: str, generator: torch.Generator) -> Inputs:
    """Random K/V scattered over a shuffled block pool, and the same values contiguous for SDPA."""
    s = shape
    blocks_per_seq = -(-s.context // s.block_size)
    num_blocks = s.batch * blocks_per_seq
    order = torch.randperm(num_blocks, generator=generator).to(device)
    block_table = order.reshape(s.batch, blocks_per_seq).to(torch.int32)                    # scattered
    sdpa_k = torch.randn(s.batch, s.num_kv_heads, s.context, s.head_size, device=device, dtype=s.dtype)
    sdpa_v = torch.randn_like(sdpa_k)
    key_cache = torch.empty(num_blocks, s.block_size, s.num_kv_heads, s.head_size, device=device, dtype=s.dtype)
    value_cache = torch.empty_like(key_cache)
    pad = blocks_per_seq * s.block_size - s.context
    for cache, contiguous in ((key_cache, sdpa_k), (value_cache, sdpa_v)):
        tokens = torch.nn.functional.pad(contiguous.transpose(1, 2), (0, 0, 0, 0, 0, pad))  # [B, T, Hkv, D]
        cache[block_table.long().flatten()] = tokens.reshape(-1, s.block_size, s.num_kv_heads, s.head_size)
    sdpa_q = torch.randn(s.batch, s.num_q_heads, s.query_len, s.head_size, device=device, dtype=s.dtype)
    query = sdpa_q.transpose(1, 2).reshape(-1, s.num_q_heads, s.head_size).contiguous()      # [tokens, Hq, D]
    seq_lens = torch.full((s.batch,), s.context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(0, s.batch + 1, device=device, dtype=torch.int32) * s.query_len
    return Inputs(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, torch.empty_like(query),
                  sdpa_q, sdpa_k, sdpa_v)


def sdpa_backends() -> list[tuple[str, Any]]:
    """SDPA's fused GPU backends (the unfused MATH one never wins here, and would copy K/V per query head)."""
    from torch.nn.attention import SDPBackend

    return [(name, getattr(SDPBackend, name)) for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
            if hasattr(SDPBackend, name)]


def sdpa_call(shape: Shape, x: Inputs) -> torch.Tensor:
    """SDPA on the contiguous copy; a windowed decode attends to the copy's last ``sliding_window`` keys only."""
    keys = slice(shape.context - shape.keys_read, shape.context)
    out = torch.nn.functional.scaled_dot_product_attention(x.sdpa_q, x.sdpa_k[:, :, keys], x.sdpa_v[:, :, keys],
                                                           is_causal=shape.query_len > 1, enable_gqa=True)
    return out.transpose(1, 2).reshape(-1, shape.num_q_heads, shape.head_size)                # [tokens, Hq, D]


def median_seconds(fn: Callable[[], Any], device: str) -> float:
    """``do_bench``'s median on a GPU; on CPU the median of 3 wall-clock runs after one warm-up."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def graph_seconds(fn: Callable[[], Any]) -> float | None:
    """Median seconds per call with the calls captured in a CUDA graph (no launch overhead); None if capture fails."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") / 1e3
    except Exception:  # a backend that cannot be captured just gets no graph figure
        return None


def rotating(sets: list[Inputs], call: Callable[[Inputs], Any]) -> Callable[[], Any]:
    """A no-argument function that runs ``call`` on the next input set each time (cold caches)."""
    state = {"i": 0}

    def step() -> Any:
        state["i"] = (state["i"] + 1) % len(sets)
        return call(sets[state["i"]])

    return step


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device)


def input_sets(shape: Shape, device: str, generator: torch.Generator) -> int:
    """How many independent sets to rotate: enough that what is read overflows L2 three times, within memory."""
    per_set = 2 * shape.cache_bytes + 3 * shape.q_bytes                 # the paged cache and SDPA's copy
    if device != "cuda":
        return 1
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 64 * 2**20)
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(8, math.ceil(3 * l2 / (shape.kv_bytes + shape.q_bytes)), int(0.8 * free) // per_set))


def bench_shape(shape: Shape, device: str, copy_bw: float, config: KernelConfig | None = None,
                num_kv_splits: int | None = None, with_sdpa: bool = True) -> dict[str, Any]:
    """Time one shape; returns a row of the results table (times in microseconds, bandwidths in GB/s)."""
    g = torch.Generator().manual_seed(0)
    if device == "cuda" and 2 * shape.cache_bytes + 3 * shape.q_bytes > 0.9 * torch.cuda.mem_get_info()[0]:
        return {"shape": shape.name, "skipped": "does not fit in free GPU memory"}
    sets = [make_inputs(shape, device, g) for _ in range(input_sets(shape, device, g))]
    x = sets[0]
    batch = check_attention(*x.args(), sliding_window=shape.sliding_window)
    from kvlab.kernels.attention import launch, num_sms  # here: importing it needs Triton

    plan = plan_launch(batch, num_kv_splits, config, num_sms(x.query.device))

    def kernel_call(s: Inputs) -> torch.Tensor:  # the launch alone: plan and checks were done once, above
        return launch(plan, *s.args(), s.out)

    kernel_out = kernel_call(x).float()
    row: dict[str, Any] = {
        "shape": shape.name, "kind": shape.kind,
        "batch": shape.batch, "context": shape.context, "block_size": shape.block_size,
        "sliding_window": shape.sliding_window,
        "dtype": str(shape.dtype).removeprefix("torch."), "input_sets": len(sets),
        "tile_n": plan.config.tile_n, "block_m": plan.config.block_m, "num_warps": plan.config.num_warps,
        "num_stages": plan.config.num_stages, "num_kv_splits": plan.num_kv_splits,
    }
    kernel_fn = rotating(sets, kernel_call)
    seconds = median_seconds(kernel_fn, device)
    row.update(kernel_us=seconds * 1e6, kernel_GBps=shape.bytes_moved / seconds / 1e9,
               kernel_TFLOPs=shape.flops / seconds / 1e12, copy_fraction=shape.bytes_moved / seconds / copy_bw)
    graph = graph_seconds(kernel_fn) if device == "cuda" else None
    if graph is not None:
        row.update(kernel_graph_us=graph * 1e6, graph_copy_fraction=shape.bytes_moved / graph / copy_bw)
    if with_sdpa:
        best = None
        for name, sdpa_backend in sdpa_backends() if device == "cuda" else [("default", None)]:
            try:
                with _sdpa_backend(sdpa_backend):
                    reference = sdpa_call(shape, x).float()
                    t = median_seconds(rotating(sets, lambda s: sdpa_call(shape, s)), device)
            except RuntimeError:                       # this backend does not take these inputs
                continue
            if best is None or t < best[1]:
                best = (name, t, reference, sdpa_backend)
        if best is not None:
            name, t, reference, sdpa_backend = best
            row.update(sdpa_backend=name, sdpa_us=t * 1e6, speedup_vs_sdpa=t / seconds,
                       rel_error_vs_sdpa=float((kernel_out - reference).norm() / reference.norm()))
            if graph is not None:
                with _sdpa_backend(sdpa_backend):
                    sdpa_graph = graph_seconds(rotating(sets, lambda s: sdpa_call(shape, s)))
                if sdpa_graph is not None:
                    row.update(sdpa_graph_us=sdpa_graph * 1e6, speedup_vs_sdpa_graph=sdpa_graph / graph)
    del sets
    return row


def _sdpa_backend(sdpa_backend: Any) -> Any:
    """``torch.nn.attention.sdpa_kernel(sdpa_backend)``, or no restriction for None (on CPU)."""
    import contextlib

    if sdpa_backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(sdpa_backend)


def run(shapes: Iterable[Shape], device: str | None = None,
        on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Benchmark ``shapes``; returns ``{"device", "copy_GBps", "rows"}`` (``on_row`` sees each row as it lands)."""
    device = device or ("cuda" if backend() == TRITON_CUDA else "cpu")
    copy_bw = copy_bandwidth(device, GiB if device == "cuda" else 64 * 2**20)
    rows = []
    for shape in shapes:
        try:
            row = bench_shape(shape, device, copy_bw)
        except Exception as exc:  # one failing shape (a compile error, memory) must not lose the rest
            row = {"shape": shape.name, "error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        if on_row:
            on_row(row)
        if device == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (Triton interpreter)"
    results = {"device": name, "backend": backend(), "copy_GBps": copy_bw / 1e9, "rows": rows,
               "performance": device == "cuda"}
    results["verdict"] = verdict(results)
    return results


def verdict(results: dict[str, Any], goal: str = GOAL_SHAPE.name) -> dict[str, Any]:
    """The issue's two goals read off a run: the goal shape's share of copy bandwidth, and every shape against SDPA.

    ``slower_than_sdpa`` lists shapes where SDPA's median beat the kernel's as a Python caller sees
    them (launch overhead included); ``slower_than_sdpa_in_graphs`` compares the kernels alone (None: not
    timed in graphs, as on CPU).
    ``failed`` lists shapes that raised or did not fit; ``wrong`` those whose output strayed from SDPA's.
    """
    rows = results["rows"]
    timed = [r for r in rows if "kernel_us" in r]
    row = next((r for r in timed if r["shape"] == goal), None)
    return {
        "goal_shape": goal,
        "goal_copy_fraction": row["copy_fraction"] if row else None,
        "goal_met": bool(row and row["copy_fraction"] >= GOAL_COPY_FRACTION),
        "slower_than_sdpa": [r["shape"] for r in timed if r.get("speedup_vs_sdpa", math.inf) < 1],
        "slower_than_sdpa_in_graphs": ([r["shape"] for r in timed if r.get("speedup_vs_sdpa_graph", math.inf) < 1]
                                       if any("speedup_vs_sdpa_graph" in r for r in timed) else None),
        "wrong": [r["shape"] for r in timed if r.get("rel_error_vs_sdpa", 0.0) > 1e-2],
        "failed": [r["shape"] for r in rows if "kernel_us" not in r],
    }


def tile_sweep(shape: Shape = Shape(64, 8192, 16)) -> list[dict[str, Any]]:
    """Decode at the goal shape under other tile sizes, warps and pipeline depths (GPU only)."""
    copy_bw = copy_bandwidth("cuda", GiB)
    rows = []
    configs = [KernelConfig(block_q=4, block_m=16, tile_n=t, num_warps=w, num_stages=st)
               for t in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    for config in configs:
        try:
            rows.append(bench_shape(shape, "cuda", copy_bw, config=config, with_sdpa=False))
        except Exception as exc:                        # e.g. out of shared memory for a deep pipeline
            rows.append({"tile_n": config.tile_n, "num_warps": config.num_warps, "num_stages": config.num_stages,
                         "error": f"{type(exc).__name__}: {exc}"[:200]})
    return rows


def verdict_line(v: dict[str, Any]) -> str:
    """``verdict`` in one sentence for a reader."""
    if v["goal_copy_fraction"] is None:
        goal = f"goal shape {v['goal_shape']}: not measured"
    else:
        goal = (f"goal shape {v['goal_shape']}: {v['goal_copy_fraction']:.0%} of copy bandwidth "
                f"(goal {GOAL_COPY_FRACTION:.0%}), {'met' if v['goal_met'] else 'NOT met'}")
    slower = ", ".join(v["slower_than_sdpa"]) or "no shape"
    graphs = v["slower_than_sdpa_in_graphs"]
    in_graphs = "not timed" if graphs is None else ", ".join(graphs) or "no shape"
    line = f"{goal}; slower than SDPA at {slower} (kernels alone, in CUDA graphs: {in_graphs})"
    if v["failed"] or v["wrong"]:
        line += f"; failed: {', '.join(v['failed']) or 'none'}; wrong output: {', '.join(v['wrong']) or 'none'}"
    return line


COLUMNS = ("shape", "num_kv_splits", "kernel_us", "sdpa_us", "sdpa_backend", "kernel_GBps", "copy_fraction",
           "speedup_vs_sdpa", "kernel_graph_us", "sdpa_graph_us", "speedup_vs_sdpa_graph", "rel_error_vs_sdpa")


def format_row(row: dict[str, Any]) -> str:
    """One line of the table."""
    if "skipped" in row or "error" in row:
        return f"{row.get('shape', row)}: {row.get('skipped') or row.get('error')}"
    cells = []
    for key in COLUMNS:
        value = row.get(key, "")
        cells.append(f"{value:.3g}" if isinstance(value, float) else str(value))
    return " | ".join(cells)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny shape (the default without a GPU)")
    parser.add_argument("--rows-to", metavar="FILE", help="also append each row to FILE as a JSON line, as it lands")
    args = parser.parse_args(argv)
    smoke = args.smoke or backend() != TRITON_CUDA
    if smoke:
        print("SMOKE RUN: one tiny shape through", backend(), "- these timings are not performance figures.")
    print(" | ".join(COLUMNS))

    def on_row(row: dict[str, Any]) -> None:
        print(format_row(row), flush=True)
        if args.rows_to:                      # a run stopped by a time limit keeps the rows it finished
            with open(args.rows_to, "a") as f:
                f.write(json.dumps(row) + "\n")

    results = run(smoke_shapes() if smoke else gpu_shapes(), on_row=on_row)
    print(f"device: {results['device']}; copy bandwidth {results['copy_GBps']:.3g} GB/s (read + write)")
    print("verdict:", verdict_line(results["verdict"]))
    return results


if __name__ == "__main__":
    main()
