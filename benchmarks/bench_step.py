"""Where one decode step's CPU goes in kvlab's ``LLMEngine``, at 1, 4 and 16 running requests (issue 36 item 1).

Method: the trained ``tiny-pydoc-llama`` (float32, 1 torch thread, torch attention backend, the default
pool), N prompts admitted and prefilled, then decode steps timed phase by phase with
``time.process_time``: the step's ``Snapshot``, ``Scheduler.schedule``, the executor's ``execute_model``
(input preparation, forward and sampling together), ``update_from_output``. Medians over the steps.
A first cut: the runner's own phases and transformers' per-step time are not split out yet. On a
shared, loaded machine the figures are not final. Prints only; saves nothing.
"""

from __future__ import annotations

import statistics
import time

import kvlab.kernels  # noqa: F401 - first: sets Triton up before transformers imports it
import torch

from kvlab.core.sched.snapshot import Snapshot
from kvlab.data import TINY_MODEL_DIR


def phases(num_requests: int, steps: int = 20) -> dict[str, float]:
    """Median milliseconds of CPU per decode step for each phase, with ``num_requests`` running."""
    from kvlab.engine.llm_engine import LLMEngine

    engine = LLMEngine(TINY_MODEL_DIR, attention_backend="torch")
    for i in range(num_requests):
        engine.add_request(f"def f{i}(x):\n    return x + {i}", max_tokens=steps + 4, ignore_eos=True)
    engine.step()  # the prefill
    scheduler, executor = engine.scheduler, engine.executor
    times: dict[str, list[float]] = {"snapshot": [], "schedule": [], "execute_model": [], "update_from_output": []}
    for _ in range(steps):
        t0 = time.process_time()
        snapshot = Snapshot(scheduler)
        t1 = time.process_time()
        out = scheduler.schedule()
        t2 = time.process_time()
        result = executor.execute_model(out)
        t3 = time.process_time()
        scheduler.update_from_output(out, result)
        t4 = time.process_time()
        snapshot.close()
        for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[name].append(dt * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    for n in (1, 4, 16):
        row = phases(n)
        print(f"{n:>2} running: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()))


if __name__ == "__main__":
    main()
