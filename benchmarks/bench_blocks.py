"""How long BlockPool takes to hand out and take back blocks: O(1) per block, whatever the pool size.

Shapes: a 100,000-block pool (block 0 reserved as the null block, prefix caching on, no block
cached); one operation is ``get_new_blocks(n)`` followed by ``free_blocks`` of the same blocks,
tail first, for n = 10, 100 and 1,000. Method: ``timeit`` of ``NUMBER`` operations, ``REPEAT``
times; the median of the repeats, divided by ``NUMBER``, is the time per operation, and that
divided by n the time per block. A second series keeps n = 100 and grows the pool from 1,000
to 100,000 blocks: O(1) also means the pool's size does not matter. Saved to
``data/measurements/blocks_pool.json`` with the machine it ran on.
"""

from __future__ import annotations

import statistics
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.core.block_pool import BlockPool  # noqa: E402
from kvlab.machine import machine_line, save_measurement  # noqa: E402

POOL_BLOCKS = 100_000
SIZES = (10, 100, 1_000)
POOL_SIZES = (1_000, 10_000, 100_000)
REPEAT = 7


def measure(num_blocks: int, pool_blocks: int = POOL_BLOCKS) -> dict[str, float]:
    """Median µs per get+free operation (and per block) for ``num_blocks`` blocks at a time."""
    pool = BlockPool(pool_blocks)

    def operation() -> None:
        blocks = pool.get_new_blocks(num_blocks)
        pool.free_blocks(reversed(blocks))

    timer = timeit.Timer(operation)
    number, _ = timer.autorange()  # calls per repeat, so that one repeat lasts at least 0.2 s
    runs = timer.repeat(repeat=REPEAT, number=number)
    per_op = statistics.median(runs) / number
    spread = (min(runs) / number, max(runs) / number)
    assert pool.get_num_free_blocks() == pool_blocks - 1  # every block came back
    return {"blocks": num_blocks, "calls_per_repeat": number, "repeats": REPEAT,
            "us_per_operation": per_op * 1e6, "us_per_block": per_op * 1e6 / num_blocks,
            "us_per_operation_min": spread[0] * 1e6, "us_per_operation_max": spread[1] * 1e6}


def main() -> None:
    results = [measure(n) for n in SIZES]
    by_pool = [{"pool_blocks": size, **measure(100, size)} for size in POOL_SIZES]
    method = (f"timeit: get_new_blocks(n) then free_blocks(reversed(blocks)) on a {POOL_BLOCKS:,}-block BlockPool "
              f"(null block reserved, caching on, nothing cached); median of {REPEAT} repeats of enough calls to "
              "last about 0.2 s each; then n = 100 on pools of 1,000, 10,000 and 100,000 blocks; one process")
    path = save_measurement("blocks_pool", {"pool_blocks": POOL_BLOCKS, "rows": results, "by_pool_size": by_pool},
                            method)
    print(f"BlockPool get + free, pool of {POOL_BLOCKS:,} blocks — {machine_line()}")
    print(f"{'blocks':>7} {'µs / operation':>15} {'µs / block':>11} {'min–max µs / op':>18}")
    for row in results:
        print(f"{row['blocks']:>7,} {row['us_per_operation']:>15.1f} {row['us_per_block']:>11.3f} "
              f"{row['us_per_operation_min']:>8.1f}–{row['us_per_operation_max']:<8.1f}")
    print("n = 100 on pools of " + ", ".join(f"{r['pool_blocks']:,}: {r['us_per_operation']:.1f} µs" for r in by_pool))
    print(f"saved to {path}")


if __name__ == "__main__":
    main()
