"""The fleet simulation at scale: hit rate and prefilled tokens against replica count and pool size, and its speed.

Method: ``kvlab.fleet.simulation.simulate_fleet`` over ``customer_workload`` (customers each with a
256-token context and queries of 16 fresh tokens, arriving as a Poisson stream), every replica a
``KVCacheManager`` with KV events on. Curves: 20,480 requests from 512 customers, for the random,
approximate (llm-d, routing history) and precise (llm-d, KV events) routers, over 8, 16, 32 and 64
replicas of 200 blocks, and over pools of 100 to 800 blocks at 16 replicas. Speed: 102,400 requests
(2,560 customers) at 64 replicas, CPU seconds by ``time.process_time`` (the process's own CPU time, so
other load on a shared machine adds little). The small case (1,280 requests, 8 replicas) is the one
notebook 10 recomputes and compares with these saved numbers. The load average is saved beside.
"""

from __future__ import annotations

import os
import time

from kvlab.fleet.routers import make_router
from kvlab.fleet.simulation import customer_workload, simulate_fleet
from kvlab.machine import machine_line, save_measurement

ROUTERS = ("random", "approximate", "precise")
REPLICAS = (8, 16, 32, 64)
POOLS = (100, 200, 400, 800)
CURVE_WORKLOAD = {"num_customers": 512, "queries_per_customer": 40, "context_tokens": 256, "query_tokens": 16,
                  "rate": 4000.0, "seed": 0}
BIG_WORKLOAD = {**CURVE_WORKLOAD, "num_customers": 2560}
SMALL_WORKLOAD = {"num_customers": 64, "queries_per_customer": 20, "context_tokens": 256, "query_tokens": 16,
                  "rate": 400.0, "seed": 0}


def run(router: str, num_replicas: int, workload: list, num_blocks: int) -> dict:
    """One simulation: its hit rate, prefilled tokens and CPU seconds."""
    started = time.process_time()
    result = simulate_fleet(make_router(router, num_replicas, seed=0), workload, num_blocks=num_blocks)
    return {"router": router, "replicas": num_replicas, "num_blocks": num_blocks, "requests": len(workload),
            "hit_rate": round(result.hit_rate, 6), "prefilled_tokens": result.prefilled_tokens,
            "cpu_seconds": round(time.process_time() - started, 3)}


def main() -> None:
    print(f"machine: {machine_line()}; load {os.getloadavg()[0]:.2f}")
    small = customer_workload(**SMALL_WORKLOAD)
    results: dict = {"small": [run(r, 8, small, 200) for r in ("random", "precise")],
                     "small_workload": SMALL_WORKLOAD, "curve_workload": CURVE_WORKLOAD}
    curve = customer_workload(**CURVE_WORKLOAD)
    results["by_replicas"] = [run(r, n, curve, 200) for n in REPLICAS for r in ROUTERS]
    results["by_pool"] = [run(r, 16, curve, nb) for nb in POOLS for r in ROUTERS]
    for row in results["by_replicas"] + results["by_pool"]:
        print(f"  {row['router']:12s} {row['replicas']:3d} replicas x {row['num_blocks']:4d} blocks: hit rate "
              f"{row['hit_rate']:.3f}, {row['prefilled_tokens']:>9,} tokens prefilled, {row['cpu_seconds']:6.2f} s CPU")
    del curve
    big = customer_workload(**BIG_WORKLOAD)
    results["big_workload"] = BIG_WORKLOAD
    results["big"] = [run(r, 64, big, 200) for r in ("random", "precise")]
    for row in results["big"]:
        print(f"  {row['requests']:,} requests, 64 replicas, {row['router']}: {row['cpu_seconds']:.1f} s CPU, "
              f"hit rate {row['hit_rate']:.3f}")
    results["load_average"] = round(os.getloadavg()[0], 2)
    path = save_measurement("fleet_scale", results, method=" ".join(__doc__.split("\n\n")[1].split()))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
