"""make bench: throughput against concurrency on the trained tiny model, kvlab against transformers.

Method: ``kvlab.engine.throughput`` on ``data/tiny-pydoc-llama`` (4.2M parameters, float32, CPU),
64 chat prompts of 26-30 tokens (the system prompt and a question about a page of Python's
documentation), output lengths cycling 8, 64, 16, 32 (1,920 tokens in all), greedy, EOS ignored.
For each concurrency c (1, 2, 4, ... 64): kvlab's ``LLMEngine`` (torch attention backend, blocks
of 16, prefix caching off, ``max_num_seqs=c``, all 64 queued at once, continuous batching) and
transformers ``generate`` on consecutive padded static batches of c (left-padded, each batch
generating its longest output); transformers on one request at a time does not depend on c and
is measured once per repeat. Each system is warmed up untimed; every figure is the median of
``--repeats`` runs (systems interleaved, so each sees the same load), wall time
(``time.perf_counter``) and process CPU time (``time.process_time``), with torch on ``--threads``
threads. Tokens count what each request asked for, never padding. Time per output token is a
request's mean (kvlab: its decode time over its tokens after the first, vLLM's
``request_time_per_output_token``; transformers: its batch's time over the batch's steps).
``peak_kv_tokens``: kvlab's blocks in use at the fullest step, in tokens; the static batch's cache at
the end of its largest batch. The 1-minute load average is read before every run. Saved to
``data/measurements/engine_throughput.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import kvlab.kernels  # noqa: F401 - first: sets Triton up before transformers imports it
import torch

from kvlab.data import TINY_MODEL_DIR
from kvlab.engine.throughput import Workload, run_hf_serial, run_hf_static, run_kvlab, text_workload
from kvlab.machine import machine_line, save_measurement

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
NUM_REQUESTS = 64
GOAL_CONCURRENCY, GOAL_VS_SERIAL, GOAL_VS_STATIC = 16, 3.0, 1.0


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over the repeats (each repeat's run is one dict of numbers)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def measure(workload: Workload, concurrency: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """Every system at every concurrency, ``repeats`` times interleaved; medians, and the loads seen."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    warm = Workload(workload.prompts[:2], (2, 2))
    run_hf_serial(hf, warm), run_hf_static(hf, warm, 2), run_kvlab(TINY_MODEL_DIR, warm, 2)   # warm-up, untimed
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    loads: list[float] = []
    for repeat in range(repeats):
        for c in concurrency:
            for system, run in (("kvlab", lambda c=c: run_kvlab(TINY_MODEL_DIR, workload, c,
                                                                 attention_backend="torch")),
                                ("static_batch", lambda c=c: run_hf_static(hf, workload, c))):
                loads.append(os.getloadavg()[0])
                runs.setdefault((system, c), []).append(run())
        loads.append(os.getloadavg()[0])
        runs.setdefault(("one_at_a_time", 0), []).append(run_hf_serial(hf, workload))
        print(f"repeat {repeat + 1}/{repeats} done, load {loads[-1]:.2f}", file=sys.stderr)
    serial = median_run(runs[("one_at_a_time", 0)])
    rows = []
    for c in concurrency:
        kvlab, static = median_run(runs[("kvlab", c)]), median_run(runs[("static_batch", c)])
        rows.append({"concurrency": c, "kvlab": kvlab, "static_batch": static, "one_at_a_time": serial,
                     "kvlab_vs_one_at_a_time": kvlab["tokens_per_s"] / serial["tokens_per_s"],
                     "kvlab_vs_static_batch": kvlab["tokens_per_s"] / static["tokens_per_s"],
                     "kvlab_vs_one_at_a_time_cpu": kvlab["tokens_per_cpu_s"] / serial["tokens_per_cpu_s"],
                     "kvlab_vs_static_batch_cpu": kvlab["tokens_per_cpu_s"] / static["tokens_per_cpu_s"]})
    return {"rows": rows, "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}}


def goal(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goal at 16 concurrent requests: kvlab >= 3x one at a time and >= 1x the static batch."""
    row = next(r for r in rows if r["concurrency"] == GOAL_CONCURRENCY)
    met = {kind: row[f"kvlab_vs_one_at_a_time{kind}"] >= GOAL_VS_SERIAL and row[f"kvlab_vs_static_batch{kind}"]
           >= GOAL_VS_STATIC for kind in ("", "_cpu")}
    return {"concurrency": GOAL_CONCURRENCY, "vs_one_at_a_time": GOAL_VS_SERIAL, "vs_static_batch": GOAL_VS_STATIC,
            "met_wall": met[""], "met_cpu": met["_cpu"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    workload = text_workload(AutoTokenizer.from_pretrained(TINY_MODEL_DIR), NUM_REQUESTS)
    result = measure(workload, CONCURRENCY, args.repeats)
    result.update(goal=goal(result["rows"]), repeats=args.repeats, torch_threads=args.threads,
                  num_requests=NUM_REQUESTS, output_lens=list(workload.output_lens[:4]),
                  prompt_lens=[min(map(len, workload.prompts)), max(map(len, workload.prompts))],
                  tokens=workload.num_tokens)
    print(f"tiny-pydoc-llama, {NUM_REQUESTS} requests, {workload.num_tokens} tokens, on {machine_line()}")
    print(f"load average (1 min) {result['load_1min']}; torch threads {args.threads}")
    print(f"{'c':>3} {'kvlab tok/s':>12} {'static':>8} {'serial':>8}   (wall; CPU in brackets)")
    for r in result["rows"]:
        print(f"{r['concurrency']:>3} " + " ".join(
            f"{r[s]['tokens_per_s']:>8.0f} ({r[s]['tokens_per_cpu_s']:.0f})" for s in
            ("kvlab", "static_batch", "one_at_a_time")))
    print(f"goal at c={GOAL_CONCURRENCY}: {result['goal']}")
    path = save_measurement("engine_throughput", result, method=__doc__.split("Method: ", 1)[1].strip())
    print(f"saved to {path}")


if __name__ == "__main__":
    main()
