"""kvlab's KVCacheManager against vLLM 0.33.0's on the same traffic, in one process: operations per second.

Shapes: a scheduler-like loop over seeded traffic (requests sharing a few system prompts and
multi-turn histories, chunked prefill of 64 tokens, decode one token a step, finishing after
8-40 output tokens, preemption of the newest request when the pool is full), on a
2,000-block pool of 16-token blocks with prefix caching on and SHA-256 hashing. Both
managers see the same calls (they make identical decisions: ``make test-vllm`` proves it).
One operation is one call of ``get_computed_blocks``, ``allocate_slots`` or ``free``; each side builds its
``Request`` objects inside the timed loop, as its engine would. Besides that trace, ``RANDOM_SHAPES`` are
seeded random traces of other shapes (pool size, block size 4 or 16, caching on or off, each of the four
hash functions); their median ratio is reported beside the trace's.
Method: the whole trace run ``REPEAT`` times per manager, alternating; the median time. The Python calls
per operation (``sys.setprofile``, deterministic) and the share of them spent in validation (functions of
``kvlab/_validate.py`` and ``kvlab/core/manager_checks.py``, the checking wrappers ``@checked`` writes, and
kvlab functions named ``_check*``) are counted on one untimed run of every trace, in total and per kind of
call (building a ``Request``, a lookup, an allocation, a free). The machine is shared: ``uptime`` is saved
before and after, and the timings say only as much as the load allows; the call counts do not depend on it.
vLLM is imported from ``.venv-vllm`` (``make test-vllm`` builds it); without it only kvlab
is timed. Saved to ``data/measurements/manager_ops.json`` with the machine it ran on.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    import vllm.v1.core.kv_cache_manager  # noqa: F401
except ImportError:
    other = ROOT / ".venv-vllm" / "bin" / "python"
    if other.exists() and os.environ.get("KVLAB_BENCH_REEXEC") != "1":  # run both managers in one process
        os.environ["KVLAB_BENCH_REEXEC"] = "1"
        os.execv(str(other), [str(other), __file__])

from kvlab.core.kv_cache_manager import KVCacheManager  # noqa: E402
from kvlab.core.request import Request  # noqa: E402
from kvlab.machine import machine_line, save_measurement  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE, CHUNK = 2000, 16, 64
NUM_REQUESTS, REPEAT = 600, 5


class Shape(NamedTuple):
    """One trace: the pool, the traffic and the hash function both managers use."""

    seed: int
    num_blocks: int
    block_size: int
    caching: bool
    hash_fn: str
    num_requests: int
    system_lengths: tuple[int, ...]


BENCH = Shape(0, NUM_BLOCKS, BLOCK_SIZE, True, "sha256", NUM_REQUESTS, (200, 480, 900))
#: Seeded random traces of other shapes; every request fits the pool alone (the loop needs that).
RANDOM_SHAPES = (
    Shape(1, 64, 4, True, "sha256_cbor", 200, (20, 60, 90)),
    Shape(2, 180, 16, False, "xxhash", 200, (100, 300, 600)),
    Shape(3, 40, 16, True, "xxhash_cbor", 200, (50, 120, 200)),
    Shape(4, 400, 4, True, "sha256", 300, (40, 150, 400)),
    Shape(5, 120, 16, True, "xxhash", 250, (200, 480, 700)),
)


def workload(shape: Shape = BENCH) -> list[tuple[list[int], int]]:
    """(prompt, output length) per request: shared system prompts, follow-up turns, fresh questions."""
    rng = random.Random(shape.seed)
    systems = [[rng.randrange(32000) for _ in range(rng.choice(shape.system_lengths))] for _ in range(4)]
    longest = (shape.num_blocks - 1) * shape.block_size - 40 - shape.block_size  # a request alone always fits
    history: list[list[int]] = []
    out = []
    for _ in range(shape.num_requests):
        if history and rng.random() < 0.3:
            prompt = rng.choice(history) + [rng.randrange(32000) for _ in range(rng.randrange(20, 120))]
        else:
            prompt = rng.choice(systems) + [rng.randrange(32000) for _ in range(rng.randrange(10, 200))]
        prompt = prompt[-longest:]
        history = (history + [prompt])[-20:]
        out.append((prompt, rng.randrange(8, 40)))
    return out


class _Side:
    """The three manager calls the loop makes; both managers spell them the same way."""

    m: object

    def lookup(self, r):
        hits, n, _ = self.m.get_computed_blocks(r)
        return hits, n

    def allocate(self, r, n, hit=0, hits=None):
        return self.m.allocate_slots(r, n, hit, hits)

    def free(self, r):
        self.m.free(r)


class KvlabSide(_Side):
    name = "kvlab"

    def __init__(self, shape: Shape) -> None:
        self.m = KVCacheManager(shape.num_blocks, shape.block_size, shape.caching, shape.hash_fn, hash_seed="bench")

    def request(self, rid: str, prompt: list[int]) -> Request:
        return Request(rid, prompt)


class VllmSide(_Side):
    name = "vLLM 0.33.0"

    def __init__(self, shape: Shape) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request as VRequest

        hash_fn = get_hash_fn_by_name(shape.hash_fn)
        init_none_hash(hash_fn)
        spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(num_blocks=shape.num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.m = VManager(config, max_model_len=1 << 20, scheduler_block_size=shape.block_size,
                          hash_block_size=shape.block_size, enable_caching=shape.caching, log_stats=True)
        self.hasher = get_request_block_hasher(shape.block_size, hash_fn)
        self.params = SamplingParams(max_tokens=100_000)
        self.params.update_from_generation_config({}, eos_token_id=100_000)
        self.VRequest = VRequest

    def request(self, rid, prompt):
        return self.VRequest(rid, prompt, self.params, None, block_hasher=self.hasher)


def run(side, work) -> tuple[int, float, list]:
    """A first-come-first-served loop: admit while blocks last, chunk, decode, preempt the newest when full."""
    waiting = [(f"r{i}", p, n) for i, (p, n) in enumerate(work)]
    running: list[list] = []  # [request, tokens still to generate]
    ops, trace = 0, []
    start = time.perf_counter()
    while waiting or running:
        for entry in list(running):
            if entry not in running:  # preempted earlier in this step
                continue
            r = entry[0]
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids(7)
                entry[1] -= 1
            n = min(CHUNK, r.num_tokens - r.num_computed_tokens)
            while side.allocate(r, n) is None:  # preempt the newest running request
                victim = running.pop()
                side.free(victim[0])
                ops += 1
                victim[0].num_computed_tokens = 0
                victim[0].num_preemptions += 1
                waiting.insert(0, (None, victim[0], victim[1]))
                if victim is entry:
                    break
            ops += 1
            if entry not in running:
                continue
            r.num_computed_tokens += n
            if entry[1] == 0:
                side.free(r)
                ops += 1
                running.remove(entry)
        while waiting and len(running) < 64:
            rid, prompt, out = waiting[0]
            r = prompt if rid is None else side.request(rid, prompt)
            hits, hit = side.lookup(r)
            n = min(CHUNK, r.num_tokens - hit)
            new = side.allocate(r, n, hit, hits)
            ops += 2
            if new is None:
                assert running, "a request that fits no empty pool: the shape's prompts are too long"
                if rid is not None:
                    waiting[0] = (None, r, out)
                break
            waiting.pop(0)
            r.num_computed_tokens = hit + n
            running.append([r, out])
            trace.append(hit)
    return ops, time.perf_counter() - start, trace


def time_shape(shape: Shape, sides: list[type], repeat: int) -> dict[str, Any]:
    """Each side's operations per second on one trace (median of ``repeat`` alternating runs)."""
    work = workload(shape)
    times: dict[str, list[float]] = {s.name: [] for s in sides}
    counts, traces = {}, {}
    for _ in range(repeat):
        for cls in sides:
            ops, seconds, trace = run(cls(shape), work)
            times[cls.name].append(seconds)
            counts[cls.name], traces[cls.name] = ops, trace
    if len(traces) == 2:
        assert traces["kvlab"] == traces["vLLM 0.33.0"], f"the two managers disagreed on a hit ({shape})"
    rows = [{"manager": name, "operations": counts[name], "seconds_median": statistics.median(t),
             "ops_per_second": counts[name] / statistics.median(t)} for name, t in times.items()]
    ratio = rows[0]["ops_per_second"] / rows[1]["ops_per_second"] if len(rows) == 2 else None
    return {"shape": shape._asdict(), "rows": rows, "kvlab_over_vllm": ratio}


VALIDATION_FILES = (os.path.join("kvlab", "_validate.py"), os.path.join("kvlab", "core", "manager_checks.py"))
#: The loop's calls into a side, each one kind of call counted apart ("request" builds a Request).
OPERATIONS = ("request", "lookup", "allocate", "free")


def count_calls(side: _Side, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Python calls per operation on one run (deterministic, whatever the load), and the share spent validating.

    Besides the totals, ``per_call`` gives each kind of call the loop makes (``OPERATIONS``): how many there
    were and the Python calls (and validating calls) inside one, on average (the side's own method not counted).
    """
    calls = validating = 0
    per: dict[str, list[int]] = {op: [0, 0, 0] for op in OPERATIONS}  # calls of that kind, calls inside, validating
    bench_file = __file__
    stack: list[Any] = []  # the frames of the side's methods now running, and their kind

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls, validating
        code = frame.f_code
        if event == "return":
            if stack and stack[-1][0] is frame:
                stack.pop()
            return
        if event != "call":
            return
        calls += 1  # every Python call, the loop's own included (as counted before)
        if code.co_filename == bench_file:
            if code.co_name in per and isinstance(frame.f_locals.get("self"), _Side):
                per[code.co_name][0] += 1
                stack.append((frame, code.co_name))
            return
        checking = code.co_filename.endswith(VALIDATION_FILES) or code.co_filename.startswith("<checked") or (
            "kvlab" in code.co_filename and code.co_name.startswith(("_check", "check_")))
        validating += checking
        if stack:
            per[stack[-1][1]][1] += 1
            per[stack[-1][1]][2] += checking

    sys.setprofile(profile)
    try:
        ops, _, _ = run(side, work)
    finally:
        sys.setprofile(None)
    return {"python_calls": calls, "operations": ops, "calls_per_operation": calls / ops,
            "validation_calls": validating, "validation_share": validating / calls,
            "per_call": {op: {"calls": n, "python_calls_each": inside / n if n else 0.0,
                              "validation_calls_each": checking / n if n else 0.0}
                         for op, (n, inside, checking) in per.items()}}


def uptime() -> str:
    """``uptime``'s line (the load of this shared machine while it ran), or the load averages alone."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    sides: list[type] = [KvlabSide]
    try:
        import vllm  # noqa: F401
        sides.append(VllmSide)
    except ImportError:
        pass
    load_before = uptime()
    bench = time_shape(BENCH, sides, REPEAT)
    randoms = [time_shape(shape, sides, REPEAT) for shape in RANDOM_SHAPES]
    ratios = [r["kvlab_over_vllm"] for r in randoms if r["kvlab_over_vllm"] is not None]
    calls = {cls.name: count_calls(cls(BENCH), workload(BENCH)) for cls in sides}
    for trace in randoms:  # the load-free figure, per trace: calls per operation and the share validating
        shape = Shape(**trace["shape"])
        trace["calls"] = {cls.name: count_calls(cls(shape), workload(shape)) for cls in sides}
    load = os.getloadavg()
    shares = [calls["kvlab"]["validation_share"], *(t["calls"]["kvlab"]["validation_share"] for t in randoms)]
    results = {"rows": bench["rows"], "kvlab_over_vllm": bench["kvlab_over_vllm"],
               "random_traces": randoms,
               "random_traces_kvlab_over_vllm": ratios,
               "random_traces_median_kvlab_over_vllm": statistics.median(ratios) if ratios else None,
               "calls": calls, "largest_validation_share": max(shares),
               "load_average": list(load), "uptime_before": load_before, "uptime_after": uptime(),
               "note": (f"shared machine, loaded (load average {load[0]:.1f} on {os.cpu_count()} cores; other "
                        "sessions ran beside this one): the timings and their ratios are indicative only; the call "
                        "counts are exact and independent of the load")
               if load[0] > 0.5 * (os.cpu_count() or 1) else "quiet machine"}
    method = (f"one process; {NUM_REQUESTS} seeded requests (4 system prompts of 200-900 tokens, 30 % follow-up "
              f"turns), FCFS loop with {CHUNK}-token chunks, decode 8-40 tokens, preemption of the newest when "
              f"full; {NUM_BLOCKS:,}-block pool, block size {BLOCK_SIZE}, SHA-256, caching on; the same trace on "
              f"each manager, {REPEAT} runs each alternating, median; Requests built inside the timed loop; "
              f"plus {len(RANDOM_SHAPES)} seeded random traces (random_traces, their shapes listed) and their "
              "median ratio; calls per operation counted with sys.setprofile on one untimed run of every trace "
              "(calls: the bench trace; random_traces[i].calls: each random trace), per kind of call in per_call; "
              "validation: functions of kvlab/_validate.py and kvlab/core/manager_checks.py, @checked's wrappers "
              "and kvlab functions named _check*/check_*")
    path = save_measurement("manager_ops", results, method)
    print(f"KVCacheManager operations per second — {machine_line()}")
    for row in bench["rows"]:
        print(f"{row['manager']:>12}: {row['operations']:,} operations in {row['seconds_median']:.3f} s = "
              f"{row['ops_per_second']:,.0f} ops/s")
    for name, c in calls.items():
        each = ", ".join(f"{op} {v['python_calls_each']:.1f}" for op, v in c["per_call"].items())
        print(f"{name:>12}: {c['calls_per_operation']:.1f} Python calls per operation ({each} per call), "
              f"{c['validation_share']:.1%} of them in validation")
    print("validation share of kvlab's calls on the random traces: "
          + ", ".join(f"{t['calls']['kvlab']['validation_share']:.1%}" for t in randoms))
    if bench["kvlab_over_vllm"] is None:
        print("vLLM is not installed here (make test-vllm builds .venv-vllm): kvlab alone")
    else:
        median = results["random_traces_median_kvlab_over_vllm"]
        print(f"kvlab / vLLM = {bench['kvlab_over_vllm']:.2f}x on the trace; on the random traces: "
              + ", ".join(f"{r:.2f}x" for r in ratios) + f"; median {median:.2f}x")
    print(results["note"])
    print(f"saved to {path}")


if __name__ == "__main__":
    main()
