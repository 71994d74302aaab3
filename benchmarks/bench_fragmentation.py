"""How long kvlab.sim.fragmentation.simulate takes for 10,000 ShareGPT-like requests, per policy.

Method: ``sharegpt_like(10_000, seed=0)`` served from a pool of 56,256 token slots (preset A's
usable tokens) with ``max_model_len=2048`` and block size 16; each policy is run 5 times in
this process and the best and median wall times (``time.perf_counter``, one core, Python)
are reported, with the simulation's own step count. The target is under 2 s per run.
"""

import statistics
import time

from kvlab.machine import machine_line, save_measurement
from kvlab.sim.fragmentation import POLICIES, simulate
from kvlab.sim.workloads import sharegpt_like

N, POOL, MAX_MODEL_LEN, REPEATS = 10_000, 56_256, 2048, 5


def main() -> None:
    requests = sharegpt_like(N, seed=0)
    results = {"requests": N, "pool_tokens": POOL, "max_model_len": MAX_MODEL_LEN, "block_size": 16, "policies": {}}
    print(f"machine: {machine_line()}")
    print(f"{N:,} ShareGPT-like requests, pool {POOL:,} slots, max_model_len {MAX_MODEL_LEN}, best of {REPEATS}")
    for policy in POLICIES:
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            result = simulate(requests, pool_tokens=POOL, max_model_len=MAX_MODEL_LEN, policy=policy)
            times.append(time.perf_counter() - start)
        results["policies"][policy] = {"best_s": round(min(times), 4), "median_s": round(statistics.median(times), 4),
                                       "steps": result.num_steps}
        print(f"  {policy:7s} best {min(times):6.3f} s   median {statistics.median(times):6.3f} s   "
              f"({result.num_steps:,} steps simulated)")
        if min(times) >= 2.0:
            raise SystemExit(f"{policy}: {min(times):.2f} s, over the 2 s target")
    path = save_measurement("fragmentation_simulate", results, method=" ".join(__doc__.split("\n\n")[1].split()))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
