"""How long one move of notebook 02's budget panel takes: the pure function, then the in-place redraw.

Method: for each of 60 settings (utilization from 0.50 to 0.97, preset A otherwise), time
``panel_state`` (plan_kv_cache + building the figure) and ``redraw_memory`` into a live
``FigureWidget`` separately with ``time.perf_counter``; report the median and the 95th
percentile of each and of their sum. No browser is involved: the figure's update messages
are produced but not rendered, so this is the Python side of a slider move.
"""

import statistics
import time

from kvlab.machine import machine_line, save_measurement
from kvlab.viz.budget import panel_state, redraw_memory
from kvlab.viz.widgets import figure_widget

MOVES = 60


def main() -> None:
    widget = figure_widget(panel_state(gpu_memory_gib=160, weights_gib=130)["figure"])
    state_ms, redraw_ms = [], []
    for k in range(MOVES):
        start = time.perf_counter()
        state = panel_state(gpu_memory_gib=160, weights_gib=130, gpu_memory_utilization=0.50 + 0.47 * k / MOVES)
        middle = time.perf_counter()
        redraw_memory(widget, state["figure"])
        end = time.perf_counter()
        state_ms.append(1000 * (middle - start))
        redraw_ms.append(1000 * (end - middle))
    total_ms = [a + b for a, b in zip(state_ms, redraw_ms, strict=True)]

    def summary(values: list[float]) -> dict[str, float]:
        return {"median_ms": round(statistics.median(values), 2),
                "p95_ms": round(statistics.quantiles(values, n=20)[-1], 2)}

    results = {"moves": MOVES, "panel_state": summary(state_ms), "redraw": summary(redraw_ms),
               "total": summary(total_ms)}
    print(f"machine: {machine_line()}")
    print(f"{MOVES} slider moves of the budget panel (preset A, utilization 0.50..0.97)")
    for part in ("panel_state", "redraw", "total"):
        print(f"  {part:12s} median {results[part]['median_ms']:7.2f} ms   p95 {results[part]['p95_ms']:7.2f} ms")
    path = save_measurement("budget_panel", results, method=" ".join(__doc__.split("\n\n")[1].split()))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
