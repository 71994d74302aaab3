"""make bench: paged attention on a CPU, three ways: torch gather + SDPA, the torch reference, Triton interpreted.

Method: for each shape, a paged cache with scattered block tables (blocks handed out in random
order) holding random float32 K/V, a varlen batch (decodes, prefill chunks over cached context,
whole prompts), and the three functions of ``kvlab.kernels`` on the same tensors:
``paged_attention_torch`` (one batched gather, SDPA per group), ``paged_attention_ref`` (one
sequence at a time) and ``paged_attention`` on the ``triton-interpreter`` backend (every program
run in Python by Triton's interpreter). Each is called once untimed, then timed ``repeats`` times
(fewer for the interpreter); the figure is the median of wall time (``time.perf_counter``) and of
process CPU time (``time.process_time``, all threads) per call, checks included, as an engine pays
them; on a machine other jobs share, ``--threads 1`` avoids torch's threads waiting on each other.
Outputs are compared with the reference (relative error). The interpreter is skipped on shapes
where one call would take minutes. Machine, torch threads and load average are saved with
the rows to ``data/measurements/paged_attention_cpu.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

import kvlab.kernels as kernels  # first: sets Triton up before anything else imports it
import torch

from kvlab.machine import machine_line, save_measurement


@dataclasses.dataclass(frozen=True)
class Case:
    """A varlen batch: sequence ``i`` has ``seq_lens[i]`` tokens, its last ``query_lens[i]`` are queries."""

    name: str
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    interpret: bool = True           # small enough for Triton's interpreter


TINY = "tiny-pydoc-llama heads (4 q / 2 kv, head 64)"
CASES = (
    Case("decode b16 ctx256", (256,) * 16, (1,) * 16),
    Case("mixed: chunk 128 over 128 + 15 decodes", (256, *range(64, 512, 30)), (128,) + (1,) * 15),
    Case("prefill b4 x 128", (128,) * 4, (128,) * 4),
    Case("decode b64 ctx1024, Llama-3-8B heads", (1024,) * 64, (1,) * 64, 32, 8, 128, interpret=False),
    Case("prefill b2 x 512, Llama-3-8B heads", (512,) * 2, (512,) * 2, 32, 8, 128, interpret=False),
)


def make_args(case: Case, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``paged_attention``'s six tensors for a case (float32, CPU)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // case.block_size) for n in case.seq_lens]
    order = torch.randperm(sum(needed), generator=g)
    table = torch.zeros(len(needed), max(needed), dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = order[start:start + n]
        start += n
    shape = (sum(needed), case.block_size, case.num_kv_heads, case.head_size)
    key_cache, value_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    starts = torch.tensor([0, *torch.tensor(case.query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), case.num_q_heads, case.head_size, generator=g)
    return query, key_cache, value_cache, table, torch.tensor(case.seq_lens, dtype=torch.int32), starts


def time_call(fn: Callable[[], torch.Tensor], repeats: int) -> dict[str, float]:
    """Median wall and CPU milliseconds of ``fn`` after one untimed call."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return {"wall_ms": 1e3 * statistics.median(wall), "cpu_ms": 1e3 * statistics.median(cpu), "repeats": repeats}


def bench_case(case: Case, repeats: int) -> dict:
    args = make_args(case)
    ref = kernels.paged_attention_ref(*args)
    row: dict = {"case": case.name, "num_tokens": int(args[0].shape[0]), "num_seqs": len(case.seq_lens),
                 "heads": f"{case.num_q_heads}/{case.num_kv_heads}x{case.head_size}", "block_size": case.block_size}
    candidates = {"torch_sdpa": kernels.paged_attention_torch, "reference": kernels.paged_attention_ref}
    if case.interpret and kernels.backend() == kernels.TRITON_INTERPRETER:
        candidates["triton_interpreter"] = kernels.paged_attention
    for name, fn in candidates.items():
        runs = max(1, repeats // 5) if name == "triton_interpreter" else repeats
        row[name] = time_call(lambda fn=fn: fn(*args), runs)
        row[name]["relative_error"] = float((fn(*args) - ref).norm() / ref.norm())
    for name in ("reference", "triton_interpreter"):
        if name in row:
            row[f"torch_sdpa_speedup_over_{name}"] = row[name]["wall_ms"] / row["torch_sdpa"]["wall_ms"]
    return row


def format_row(row: dict) -> str:
    cells = [f"{row['case']:<42}"]
    for name in ("torch_sdpa", "reference", "triton_interpreter"):
        cells.append(f"{row[name]['wall_ms']:>10.2f} ms" if name in row else f"{'skipped':>13}")
    return " | ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per function (interpreter: a fifth)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    args = parser.parse_args(argv)
    repeats = args.repeats
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print("machine:", machine_line(), f"| torch threads {torch.get_num_threads()} | load {load_before[0]:.2f}")
    print(f"{'case':<42} | {'torch SDPA':>13} | {'reference':>13} | {'interpreter':>13}   (median wall per call)")
    rows = []
    for case in CASES:
        rows.append(bench_case(case, repeats))
        print(format_row(rows[-1]))
    results = {"rows": rows, "torch_threads": torch.get_num_threads(), "kernel_backend": kernels.backend(),
               "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
               "first_three_cases": TINY}
    path = save_measurement("paged_attention_cpu", results, __doc__.split("Method: ", 1)[1].strip())
    print("saved", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
