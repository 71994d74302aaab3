"""kvlab's KVCacheManager against vLLM 0.33.0's on the same traffic, in one process: operations per second.

Shapes: a scheduler-like loop over seeded traffic (requests sharing a few system prompts and
multi-turn histories, chunked prefill of 64 tokens, decode one token a step, finishing after
8-40 output tokens, preemption of the newest request when the pool is full), on a
2,000-block pool of 16-token blocks with prefix caching on and SHA-256 hashing. Both
managers see the same calls (they make identical decisions: ``make test-vllm`` proves it).
One operation is one call of ``get_computed_blocks``, ``allocate_slots`` or ``free``.
Method: the whole trace run ``REPEAT`` times per manager, alternating; the median time.
vLLM is imported from ``.venv-vllm`` (``make test-vllm`` builds it); without it only kvlab
is timed. Saved to ``data/measurements/manager_ops.json`` with the machine it ran on.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

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


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, output length) per request: shared system prompts, follow-up turns, fresh questions."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(rng.choice([200, 480, 900]))] for _ in range(4)]
    history: list[list[int]] = []
    out = []
    for _ in range(NUM_REQUESTS):
        if history and rng.random() < 0.3:
            prompt = rng.choice(history) + [rng.randrange(32000) for _ in range(rng.randrange(20, 120))]
        else:
            prompt = rng.choice(systems) + [rng.randrange(32000) for _ in range(rng.randrange(10, 200))]
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

    def __init__(self) -> None:
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, hash_seed="bench")

    def request(self, rid: str, prompt: list[int]) -> Request:
        return Request(rid, prompt)


class VllmSide(_Side):
    name = "vLLM 0.33.0"

    def __init__(self) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request as VRequest

        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.m = VManager(config, max_model_len=1 << 20, scheduler_block_size=BLOCK_SIZE,
                          hash_block_size=BLOCK_SIZE, enable_caching=True, log_stats=True)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
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
                if rid is not None:
                    waiting[0] = (None, r, out)
                break
            waiting.pop(0)
            r.num_computed_tokens = hit + n
            running.append([r, out])
            trace.append(hit)
    return ops, time.perf_counter() - start, trace


def main() -> None:
    work = workload()
    sides = [KvlabSide]
    try:
        import vllm  # noqa: F401
        sides.append(VllmSide)
    except ImportError:
        pass
    times: dict[str, list[float]] = {s.name: [] for s in sides}
    counts, traces = {}, {}
    for _ in range(REPEAT):
        for cls in sides:
            side = cls()
            ops, seconds, trace = run(side, work)
            times[cls.name].append(seconds)
            counts[cls.name], traces[cls.name] = ops, trace
    if len(traces) == 2:
        assert traces["kvlab"] == traces["vLLM 0.33.0"], "the two managers disagreed on a hit"
    rows = [{"manager": name, "operations": counts[name], "seconds_median": statistics.median(t),
             "ops_per_second": counts[name] / statistics.median(t)} for name, t in times.items()]
    ratio = rows[0]["ops_per_second"] / rows[1]["ops_per_second"] if len(rows) == 2 else None
    method = (f"one process; {NUM_REQUESTS} seeded requests (4 system prompts of 200-900 tokens, 30 % follow-up "
              f"turns), FCFS loop with {CHUNK}-token chunks, decode 8-40 tokens, preemption of the newest when "
              f"full; {NUM_BLOCKS:,}-block pool, block size {BLOCK_SIZE}, SHA-256, caching on; the same trace on "
              f"each manager, {REPEAT} runs each alternating, median")
    path = save_measurement("manager_ops", {"rows": rows, "kvlab_over_vllm": ratio}, method)
    print(f"KVCacheManager operations per second — {machine_line()}")
    for row in rows:
        print(f"{row['manager']:>12}: {row['operations']:,} operations in {row['seconds_median']:.3f} s = "
              f"{row['ops_per_second']:,.0f} ops/s")
    if ratio is None:
        print("vLLM is not installed here (make test-vllm builds .venv-vllm): kvlab alone")
    else:
        print(f"kvlab / vLLM = {ratio:.2f}x")
    print(f"saved to {path}")


if __name__ == "__main__":
    main()
