"""make bench: throughput against concurrency on the trained tiny model, kvlab against transformers, and three goals.

Method: ``kvlab.engine.throughput`` on ``data/tiny-pydoc-llama`` (4.2M parameters, float32 on both sides,
CPU), 64 chat prompts of 26-34 tokens (the system prompt and a question about a page of Python's
documentation), output lengths cycling 8, 64, 16, 32 (1,920 tokens in all), greedy, EOS ignored.
For each concurrency c (1, 2, 4, ... 64): kvlab's ``LLMEngine`` (torch attention backend, blocks
of 16, prefix caching off, ``max_num_seqs=c``, all 64 queued at once, continuous batching) and
transformers ``generate`` on consecutive padded static batches of c (left-padded, each batch
generating its longest output); transformers on one request at a time does not depend on c and
is measured once per repeat. Beside them, the case with no queue: the first 16 prompts (the same
mix of lengths) admitted at once, kvlab with ``max_num_seqs=16`` against one static batch of 16.
For both cases at 16, kvlab's own engine also batches statically (``run_kvlab(static=True)``: batches of
16, each member generating its batch's longest output, the next batch once the last is done), which
splits each ratio against transformers into two factors that multiply to it: continuous against
static batching on kvlab's one engine (what the scheduling buys: the lesson), and kvlab's static
batches against transformers' (what kvlab's step costs against ``generate``'s on the same batches).
Each system is warmed up untimed; every figure is the median of ``--repeats`` runs (systems
interleaved, so each sees the same load; each goal's ratio is also saved repeat by repeat, with how many repeats
met it, since the machine's speed drifts between repeats), wall time (``time.perf_counter``) and process CPU time
(``time.process_time``), with torch on ``--threads`` threads. Tokens count what each request asked
for, never padding. Time per output token is a request's mean (kvlab: its decode time over its
tokens after the first, vLLM's ``request_time_per_output_token``; transformers: its batch's time over
the batch's steps). ``peak_kv_tokens``: kvlab's blocks in use at the fullest step, in tokens; the
static batch's cache at the end of its largest batch. The goals (issue 36): kvlab one request at a
time >= 1.0x transformers' ``generate`` one at a time; 16 admitted at once with no queue >= 1.1x the
padded static batch; 64 queued at 16 concurrent >= 2x the static batch. After the runs,
``bench_step.breakdown`` measures where a decode step's CPU goes at 1, 4 and 16 running requests,
kvlab's phases beside transformers' step (its docstring says how). The 1-minute load average is
read before every run. Saved to ``data/measurements/engine_throughput.json``.
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
NO_QUEUE = 16  # requests admitted at once, with nothing waiting behind them
#: name -> (what is compared, the ratio kvlab must reach)
GOALS = {
    "one_at_a_time": ("one request at a time: kvlab against transformers' generate one at a time", 1.0),
    "no_queue": (f"{NO_QUEUE} admitted at once, mixed output lengths, no queue: kvlab against one padded static "
                 f"batch of {NO_QUEUE}", 1.1),
    "queued": (f"{NUM_REQUESTS} queued at 16 concurrent: kvlab against padded static batches of 16", 2.0),
}
#: name -> the runs (system, concurrency) whose tokens per second each goal divides
GOAL_RUNS = {"one_at_a_time": (("kvlab", 1), ("one_at_a_time", 0)),
             "no_queue": (("no_queue_kvlab", NO_QUEUE), ("no_queue_static_batch", NO_QUEUE)),
             "queued": (("kvlab", 16), ("static_batch", 16))}
#: the cases whose ratio against transformers is split in two (``split``), and the concurrency of each
SPLIT = {"queued": 16, "no_queue": NO_QUEUE}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over the repeats (each repeat's run is one dict of numbers)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def kvlab_run(workload: Workload, c: int, static: bool = False) -> dict[str, Any]:
    return run_kvlab(TINY_MODEL_DIR, workload, c, static=static, attention_backend="torch", dtype="float32")


def measure(workload: Workload, concurrency: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """Every system at every concurrency and the no-queue case, ``repeats`` times interleaved; medians, and loads."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    warm = Workload(workload.prompts[:2], (2, 2))
    run_hf_serial(hf, warm), run_hf_static(hf, warm, 2), kvlab_run(warm, 2)   # warm-up, untimed
    no_queue = Workload(workload.prompts[:NO_QUEUE], workload.output_lens[:NO_QUEUE])
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    loads: list[float] = []
    for repeat in range(repeats):
        cases = [(system, c, run) for c in concurrency for system, run in (
            ("kvlab", lambda c=c: kvlab_run(workload, c)),
            ("static_batch", lambda c=c: run_hf_static(hf, workload, c)))]
        cases += [("one_at_a_time", 0, lambda: run_hf_serial(hf, workload)),
                  ("kvlab_static", SPLIT["queued"], lambda: kvlab_run(workload, SPLIT["queued"], static=True)),
                  ("no_queue_kvlab", NO_QUEUE, lambda: kvlab_run(no_queue, NO_QUEUE)),
                  ("no_queue_static_batch", NO_QUEUE, lambda: run_hf_static(hf, no_queue, NO_QUEUE)),
                  ("no_queue_kvlab_static", NO_QUEUE, lambda: kvlab_run(no_queue, NO_QUEUE, static=True))]
        for system, c, run in cases:
            loads.append(os.getloadavg()[0])
            runs.setdefault((system, c), []).append(run())
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
    kvlab, static = median_run(runs[("no_queue_kvlab", NO_QUEUE)]), median_run(runs[("no_queue_static_batch",
                                                                                     NO_QUEUE)])
    no_queue_row = {"requests": NO_QUEUE, "output_lens": list(no_queue.output_lens[:4]), "tokens": no_queue.num_tokens,
                    "kvlab": kvlab, "static_batch": static,
                    "kvlab_static": median_run(runs[("no_queue_kvlab_static", NO_QUEUE)]),
                    "kvlab_vs_static_batch": kvlab["tokens_per_s"] / static["tokens_per_s"],
                    "kvlab_vs_static_batch_cpu": kvlab["tokens_per_cpu_s"] / static["tokens_per_cpu_s"]}
    # each goal's ratio in every repeat apart (the two runs of a repeat ran one after the other, under the same load)
    by_repeat = {name: [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[mine], runs[theirs], strict=True)]
                 for name, (mine, theirs) in GOAL_RUNS.items()}
    return {"rows": rows, "no_queue": no_queue_row, "kvlab_static": median_run(runs[("kvlab_static", SPLIT["queued"])]),
            "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
            "ratios_by_repeat": by_repeat}


def goals(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each goal with the ratio it asks for and the measured ones (wall and CPU), and whether they reach it."""
    at = {r["concurrency"]: r for r in result["rows"]}
    measured = {"one_at_a_time": (at[1]["kvlab_vs_one_at_a_time"], at[1]["kvlab_vs_one_at_a_time_cpu"]),
                "no_queue": (result["no_queue"]["kvlab_vs_static_batch"],
                             result["no_queue"]["kvlab_vs_static_batch_cpu"]),
                "queued": (at[16]["kvlab_vs_static_batch"], at[16]["kvlab_vs_static_batch_cpu"])}
    by_repeat = result["ratios_by_repeat"]
    return {name: {"what": what, "target": target, "ratio": measured[name][0], "ratio_cpu": measured[name][1],
                   "met_wall": measured[name][0] >= target, "met_cpu": measured[name][1] >= target,
                   "ratio_by_repeat": by_repeat[name], "met_repeats": sum(r >= target for r in by_repeat[name])}
            for name, (what, target) in GOALS.items()}


def split(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each ``SPLIT`` case's ratio against transformers as the product of two: continuous against static batching on
    kvlab's engine (``batching``), times kvlab's static batches against transformers' (``step``); wall and CPU."""
    at = {r["concurrency"]: r for r in result["rows"]}
    runs = {"queued": (at[SPLIT["queued"]]["kvlab"], result["kvlab_static"], at[SPLIT["queued"]]["static_batch"]),
            "no_queue": (result["no_queue"]["kvlab"], result["no_queue"]["kvlab_static"],
                         result["no_queue"]["static_batch"])}
    out = {}
    for name, (continuous, kvlab_static, hf_static) in runs.items():
        out[name] = {"steps": {"continuous": continuous["steps"], "static": kvlab_static["steps"]}}
        for suffix, key in (("", "tokens_per_s"), ("_cpu", "tokens_per_cpu_s")):
            out[name]["batching" + suffix] = continuous[key] / kvlab_static[key]
            out[name]["step" + suffix] = kvlab_static[key] / hf_static[key]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench_step import ROUNDS, STEPS, breakdown, print_rows
    from transformers import AutoTokenizer

    workload = text_workload(AutoTokenizer.from_pretrained(TINY_MODEL_DIR), NUM_REQUESTS)
    result = measure(workload, CONCURRENCY, args.repeats)
    result.update(goals=goals(result), split=split(result), repeats=args.repeats, torch_threads=args.threads,
                  num_requests=NUM_REQUESTS, output_lens=list(workload.output_lens[:4]),
                  prompt_lens=[min(map(len, workload.prompts)), max(map(len, workload.prompts))],
                  tokens=workload.num_tokens)
    load = os.getloadavg()[0]
    result["step_breakdown"] = {"steps": ROUNDS * STEPS, "unit": "CPU ms per decode step (median over the steps)",
                                "load_1min": load, "rows": breakdown()}
    print(f"tiny-pydoc-llama, {NUM_REQUESTS} requests, {workload.num_tokens} tokens, on {machine_line()}")
    print(f"load average (1 min) {result['load_1min']}; torch threads {args.threads}")
    print(f"{'c':>3} {'kvlab tok/s':>12} {'static':>8} {'serial':>8}   (wall; CPU in brackets)")
    for r in result["rows"]:
        print(f"{r['concurrency']:>3} " + " ".join(
            f"{r[s]['tokens_per_s']:>8.0f} ({r[s]['tokens_per_cpu_s']:.0f})" for s in
            ("kvlab", "static_batch", "one_at_a_time")))
    for name, g in result["goals"].items():
        print(f"goal {name}: {g['what']}: {g['ratio']:.2f}x wall, {g['ratio_cpu']:.2f}x CPU (>= {g['target']}x: "
              f"{'met' if g['met_wall'] else 'not met'} in wall time, {'met' if g['met_cpu'] else 'not met'} in CPU); "
              f"repeat by repeat {min(g['ratio_by_repeat']):.2f}x to {max(g['ratio_by_repeat']):.2f}x wall, met in "
              f"{g['met_repeats']} of {len(g['ratio_by_repeat'])}")
    for name, f in result["split"].items():
        print(f"goal {name} = continuous/static batching on kvlab {f['batching']:.2f}x (steps "
              f"{f['steps']['static']} -> {f['steps']['continuous']}) x kvlab's static batches/transformers' "
              f"{f['step']:.2f}x (wall; CPU: "
              f"{f['batching_cpu']:.2f}x x {f['step_cpu']:.2f}x)")
    print_rows(result["step_breakdown"]["rows"])
    path = save_measurement("engine_throughput", result, method=__doc__.split("Method: ", 1)[1].strip())
    print(f"saved to {path}")


if __name__ == "__main__":
    main()
