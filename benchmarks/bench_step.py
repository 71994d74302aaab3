"""Where one decode step's CPU goes, at 1, 4 and 16 running requests: kvlab's ``LLMEngine`` against transformers.

Method: the trained ``tiny-pydoc-llama`` (float32, 1 torch thread, kvlab's torch attention backend,
blocks of 16, a pool of N times the blocks one request needs, as ``bench_throughput.py`` sizes it),
N chat prompts of 26-34 tokens (``kvlab.engine.throughput.text_workload``) admitted at once and
prefilled, then decode steps, each timed phase by phase in process CPU time (``time.process_time``)
through wrappers put around kvlab's own functions for the measurement: the step's undo record
(``Snapshot``, opened and closed), ``Scheduler.schedule``, the model runner's input preparation (the
persistent batch updated from the step's new block ids, then positions, slot mapping, block tables,
sequence lengths and query start locations), the forward by layer (the attention's cache write, its
per-step plan (checks, gather indices, masks; built by the first layer and reused by the others),
its K/V gather and SDPA apart, and the rest of the layer: norms, projections, RoPE, MLP), the LM
head on the sampled rows, sampling, ``update_from_output`` with ``make_stats``, and the engine's own
bookkeeping (the rest of ``LLMEngine.step``: outputs, latency and metrics). transformers' ``generate``
runs the same N prompts (left-padded, greedy) with a stopping criterion that notes the CPU time at
each step and a forward hook that times the model's forward: its decode steps, split into the
forward and the rest of ``generate``'s step (logits processors, the cache, stopping). The two
alternate, ``ROUNDS`` rounds of ``STEPS`` decode steps each (a shared machine's load then falls on
both alike; kvlab's context keeps growing over the rounds, transformers' restarts at the prompt), and
each figure is the median over all the steps. The wrappers cost about a microsecond each, a few
dozen per step, and count in kvlab's phases. Printed, and returned by ``breakdown`` for
``bench_throughput.py``, which saves it with its ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import kvlab.kernels  # noqa: F401 - first: sets Triton up before transformers imports it
import torch

from kvlab.data import TINY_MODEL_DIR
from kvlab.units import cdiv

STEPS = 8  # decode steps per round
ROUNDS = 4
RUNNING = (1, 4, 16)


class Clock:
    """Per-phase CPU seconds of the current step, added up by wrappers (``wrap``)."""

    def __init__(self) -> None:
        self.step: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def add(self, phase: str, seconds: float) -> None:
        self.step[phase] = self.step.get(phase, 0.0) + seconds

    def timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.process_time() - started)
        return run

    def end_step(self) -> None:
        self.steps.append(self.step)
        self.step = {}

    def medians(self) -> dict[str, float]:
        """Median milliseconds per phase over the steps (0 where a step did not run the phase)."""
        phases = dict.fromkeys(p for s in self.steps for p in s)
        return {p: 1e3 * statistics.median(s.get(p, 0.0) for s in self.steps) for p in phases}


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name = value`` for the block, then the old value back (an instance's own attribute is deleted)."""
    own = name in getattr(obj, "__dict__", {})
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own or isinstance(obj, (type, types.ModuleType)):
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _instrument(engine: Any, clock: Clock, stack: contextlib.ExitStack) -> None:
    """Wrap the step's phases with ``clock``; every wrapper is removed when ``stack`` closes."""
    from kvlab.kernels import torch_attention

    from kvlab.core.sched import loop
    from kvlab.engine.attention import Attention

    runner, scheduler = engine.model_runner, engine.scheduler
    wraps = [(loop, "Snapshot", "snapshot"), (loop, "commit", "snapshot"),
             (scheduler, "schedule", "schedule"), (scheduler, "update_from_output", "update_from_output"),
             (scheduler, "make_stats", "update_from_output"), (engine.executor, "execute_model", "execute_model"),
             (runner, "prepare_inputs", "prepare_inputs"), (runner.model, "compute_logits", "lm_head"),
             (runner, "sample", "sampling"), (kvlab.kernels, "reshape_and_cache_torch", "attn_write"),
             (torch_attention, "plan_attention", "attn_plan"), (torch_attention, "gather_padded", "attn_gather"),
             (torch_attention, "check_attention", "attn_plan")]
    for obj, name, phase in wraps:
        if hasattr(obj, name):
            stack.enter_context(patched(obj, name, clock.timed(phase, getattr(obj, name))))
    sdpa = torch_attention.F.scaled_dot_product_attention
    stack.enter_context(patched(torch_attention, "F", types.SimpleNamespace(
        scaled_dot_product_attention=clock.timed("attn_sdpa", sdpa))))
    layers = runner.model.model.layers
    stack.enter_context(patched(runner.model, "forward", clock.timed("forward", runner.model.forward)))
    for layer in layers:
        stack.enter_context(patched(layer, "forward", clock.timed("layers", layer.forward)))
        attn = next(m for m in layer.modules() if isinstance(m, Attention))
        stack.enter_context(patched(attn, "forward", clock.timed("attention", attn.forward)))


def kvlab_phases(clock: Clock, num_layers: int) -> dict[str, float]:
    """Median CPU milliseconds per decode step of each phase, from ``clock``'s steps."""
    get = clock.medians().get
    attention_other = get("attention", 0) - get("attn_gather", 0) - get("attn_sdpa", 0) - get("attn_write", 0) \
        - get("attn_plan", 0)
    return {
        "step": get("step", 0),
        "snapshot": get("snapshot", 0),
        "schedule": get("schedule", 0),
        "prepare_inputs": get("prepare_inputs", 0),
        "forward": get("forward", 0),
        "layers": num_layers,
        "attn_write": get("attn_write", 0),
        "attn_plan": get("attn_plan", 0),
        "attn_gather": get("attn_gather", 0),
        "attn_sdpa": get("attn_sdpa", 0),
        "attn_other": attention_other,
        "layer_rest": get("layers", 0) - get("attention", 0),
        "embed_and_norm": get("forward", 0) - get("layers", 0),
        "lm_head": get("lm_head", 0),
        "sampling": get("sampling", 0),
        "runner_other": get("execute_model", 0) - get("prepare_inputs", 0) - get("forward", 0) - get("lm_head", 0)
        - get("sampling", 0),
        "update_from_output": get("update_from_output", 0),
        "engine_bookkeeping": get("step", 0) - get("snapshot", 0) - get("schedule", 0) - get("execute_model", 0)
        - get("update_from_output", 0),
    }


def phases(hf_model: Any, prompts: list[list[int]], rounds: int = ROUNDS, steps: int = STEPS
           ) -> tuple[dict[str, float], dict[str, float]]:
    """kvlab's phases and transformers' step, ``len(prompts)`` requests running, the two alternating."""
    from kvlab.engine.llm_engine import LLMEngine

    longest = max(map(len, prompts)) + rounds * steps + 2
    engine = LLMEngine(TINY_MODEL_DIR, attention_backend="torch", dtype="float32", block_size=16,
                       num_gpu_blocks=1 + len(prompts) * cdiv(longest, 16))  # sized as bench_throughput's pools
    engine.generate([prompts[0]], max_tokens=2, use_tqdm=False)  # warm-up, untimed
    for prompt in prompts:
        engine.add_request(prompt, max_tokens=rounds * steps + 2, ignore_eos=True)
    engine.step()  # the prefill
    hf_phases(hf_model, prompts, 2)  # warm-up, untimed
    clock, hf_steps, hf_forward = Clock(), [], []
    for _ in range(rounds):
        with contextlib.ExitStack() as stack:
            _instrument(engine, clock, stack)
            for _ in range(steps):
                started = time.process_time()
                engine.step()
                clock.add("step", time.process_time() - started)
                clock.end_step()
        step_ms, forward_ms = hf_phases(hf_model, prompts, steps)
        hf_steps += step_ms
        hf_forward += forward_ms
    hf = {"step": statistics.median(hf_steps), "forward": statistics.median(hf_forward)}
    hf["rest"] = hf["step"] - hf["forward"]
    return kvlab_phases(clock, len(engine.model.model.layers)), hf


def hf_phases(hf_model: Any, prompts: list[list[int]], steps: int, pad_token_id: int = 0
              ) -> tuple[list[float], list[float]]:
    """CPU milliseconds of each decode step of transformers' ``generate`` on the prompts (left-padded), and of each
    step's forward."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    marks: list[float] = []
    forward: list[float] = []

    class Mark(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            marks.append(time.process_time())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    started: list[float] = []
    pre = hf_model.register_forward_pre_hook(lambda *a: started.append(time.process_time()))
    post = hf_model.register_forward_hook(lambda *a: forward.append(time.process_time() - started[-1]))
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    try:
        with torch.no_grad():
            hf_model.generate(ids, attention_mask=mask, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                              do_sample=False, pad_token_id=pad_token_id,
                              stopping_criteria=StoppingCriteriaList([Mark()]))
    finally:
        pre.remove()
        post.remove()
    step_ms = [1e3 * (b - a) for a, b in zip(marks, marks[1:], strict=False)]  # decode steps only
    return step_ms, [1e3 * f for f in forward[1:]]


def breakdown(running: tuple[int, ...] = RUNNING, hf_model: Any = None) -> list[dict[str, Any]]:
    """One row per running count: kvlab's phases and transformers' step, CPU milliseconds per decode step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvlab.engine.throughput import text_workload, torch_threads

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    hf_model = hf_model or AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    rows = []
    with torch_threads(1):
        for n in running:
            prompts = [list(p) for p in text_workload(tokenizer, n).prompts]
            kvlab, transformers = phases(hf_model, prompts)
            rows.append({"running": n, "kvlab": kvlab, "transformers": transformers})
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    phases = [p for p in rows[0]["kvlab"] if p != "layers"]
    print(f"CPU ms per decode step (median of {ROUNDS} x {STEPS} steps); attention and layer rows are summed over "
          f"{rows[0]['kvlab']['layers']} layers")
    print(f"{'phase':>22} " + " ".join(f"{r['running']:>7} run" for r in rows))
    for phase in phases:
        print(f"{'kvlab ' + phase:>22} " + " ".join(f"{r['kvlab'][phase]:>11.3f}" for r in rows))
    for phase in rows[0]["transformers"]:
        print(f"{'transformers ' + phase:>22} " + " ".join(f"{r['transformers'][phase]:>11.3f}" for r in rows))


def main(argv: list[str] | None = None) -> None:
    from kvlab.machine import machine_line

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--running", type=int, nargs="*", default=list(RUNNING))
    args = parser.parse_args(argv)
    import os

    print(f"machine: {machine_line()}; load average (1 min) {os.getloadavg()[0]:.2f}", file=sys.stderr)
    print_rows(breakdown(tuple(args.running)))


if __name__ == "__main__":
    main()
