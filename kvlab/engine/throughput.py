"""Throughput against concurrency: kvlab's engine, transformers one request at a time, and a padded static batch.

The same ``Workload`` (prompts and an output length per request, EOS ignored, greedy) runs
three ways. ``run_kvlab``: every request is queued at once into an engine that keeps at most
``concurrency`` running (``max_num_seqs``); a finished request's slot and blocks go to the next
one at the next step (continuous batching over the paged cache). ``run_hf_serial``:
transformers ``generate`` on each request in turn. ``run_hf_static``: the requests in
consecutive batches of ``concurrency``, each left-padded to its longest prompt and generating its
longest output for every member (the static batch waits for its longest member; its cache holds
``concurrency x (padded prompt + longest output)`` tokens); ``run_kvlab(..., static=True)`` makes kvlab's
engine batch that way too, so that the two ways of batching meet on one engine. Each returns wall and CPU seconds
(``time.process_time``: every thread of this process), the useful tokens (what was asked for,
not the padding) and the mean time per output token of a request. Timings belong in
``benchmarks/bench_throughput.py`` and never in a test.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kvlab._validate import positive_int
from kvlab.errors import KvlabValueError
from kvlab.units import cdiv

#: Output lengths, cycled over the requests: mixed, so a static batch waits for its longest member.
MIXED_OUTPUT_LENS = (8, 64, 16, 32)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests for a throughput run: prompt token ids and how many tokens each must generate (EOS ignored)."""

    prompts: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.prompts or len(self.prompts) != len(self.output_lens):
            raise KvlabValueError(f"a Workload needs one output length per prompt, got {len(self.prompts)} prompts "
                                  f"and {len(self.output_lens)} output_lens")
        for n in self.output_lens:
            positive_int("output_lens", n)

    @property
    def num_tokens(self) -> int:
        """The output tokens the requests asked for (what throughput counts)."""
        return sum(self.output_lens)


def text_workload(tokenizer: Any, num_requests: int, output_lens: Sequence[int] = MIXED_OUTPUT_LENS) -> Workload:
    """``num_requests`` chat prompts asking about pages of Python's documentation (``pydoc_data.topics``).

    Every prompt has the trained model's system prompt (``kvlab.data.chat_prompt``); the questions
    differ, so prompt lengths differ too. Output lengths cycle through ``output_lens``.
    """
    import pydoc_data.topics

    from kvlab.data import chat_prompt

    topics = sorted(pydoc_data.topics.topics)
    prompts = tuple(tuple(tokenizer(chat_prompt(f"What does the documentation say about {topics[i % len(topics)]}?"))
                          ["input_ids"]) for i in range(num_requests))
    return Workload(prompts, tuple(output_lens[i % len(output_lens)] for i in range(num_requests)))


@contextmanager
def timed() -> Iterator[dict[str, float]]:
    """Wall and CPU seconds of the block, in the yielded dict once it ends (``wall_s``, ``cpu_s``)."""
    times: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield times
    finally:
        times.update(wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with torch on ``n`` threads, then restore the count.

    On a machine whose cores other jobs keep busy, torch's threads wait for each other: measured
    here at load 4 on 2 cores, a small run took ten times the CPU on 2 threads that it took on 1.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _result(times: dict[str, float], tokens: int, tpot: Sequence[float], **extra: Any) -> dict[str, Any]:
    return {**times, "tokens": tokens, "tokens_per_s": tokens / times["wall_s"],
            "tokens_per_cpu_s": tokens / times["cpu_s"], "tpot_ms": 1e3 * sum(tpot) / len(tpot), **extra}


def run_kvlab(model_dir: str | os.PathLike, workload: Workload, concurrency: int, *, static: bool = False,
              **engine_kwargs: Any) -> dict[str, Any]:
    """Serve the workload through a fresh ``LLMEngine`` with at most ``concurrency`` requests running.

    The pool holds ``concurrency`` of the longest requests (no preemption) and prefix caching is
    off, so the run measures batching alone. After an untimed two-token warm-up, every request
    is queued and the engine steps until all finish. Besides the common figures: ``steps``,
    ``executor_cpu_s`` (CPU inside the model runner: the forward, the kernels, sampling; the rest
    is the scheduler and the engine's Python) and ``peak_kv_tokens`` (blocks in use at the fullest
    step, in tokens).

    ``static``: the same engine made to batch as ``run_hf_static`` does, so that continuous batching can
    be weighed on one engine's step: the requests go in consecutive batches of ``concurrency``, the next
    only once the last has finished, and every member generates its batch's longest output (only what
    it asked for counts). Prompts stay unpadded: kvlab's flat batch has no rows to pad.
    """
    from kvlab.engine.llm_engine import LLMEngine

    block_size = engine_kwargs.pop("block_size", 16)
    longest = max(len(p) for p in workload.prompts) + max(workload.output_lens)
    engine = LLMEngine(model_dir, max_num_seqs=concurrency, enable_prefix_caching=False, block_size=block_size,
                       num_gpu_blocks=1 + concurrency * cdiv(longest, block_size), **engine_kwargs)
    engine.generate([workload.prompts[0]], max_tokens=2, use_tqdm=False)     # warm-up, untimed
    tpot = engine.latency.histograms["vllm:request_time_per_output_token_seconds"]
    before, steps_before = (tpot.sum, tpot.count), len(engine.history)
    executor_cpu = _cpu_counter(engine.executor, "execute_model")
    batch = concurrency if static else len(workload.prompts)
    ids = []
    with timed() as times:
        for first in range(0, len(workload.prompts), batch):
            lens = workload.output_lens[first:first + batch]
            ids += [engine.add_request(list(prompt), max_tokens=max(lens) if static else n, ignore_eos=True)
                    for prompt, n in zip(workload.prompts[first:first + batch], lens, strict=True)]
            while engine.has_unfinished_requests():
                engine.step()
    history = engine.history[steps_before:]
    tokens = sum(min(len(engine.outputs[i]), n) for i, n in zip(ids, workload.output_lens, strict=True))
    mean_tpot = (tpot.sum - before[0]) / (tpot.count - before[1])
    peak = max(s.kv_cache_usage for s in history) * engine.kv_cache_manager.block_pool.num_usable_blocks
    return _result(times, tokens, [mean_tpot], steps=len(history), executor_cpu_s=executor_cpu[0],
                   peak_kv_tokens=round(peak) * block_size)


def _cpu_counter(obj: Any, method: str) -> list[float]:
    """Wrap ``obj.method`` (on the instance) to add its CPU seconds into the returned one-element list."""
    total = [0.0]
    inner: Callable[..., Any] = getattr(obj, method)

    def counted(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            total[0] += time.process_time() - started

    setattr(obj, method, counted)
    return total


def run_hf_serial(hf_model: Any, workload: Workload, pad_token_id: int = 0) -> dict[str, Any]:
    """transformers ``generate`` on one request at a time, each to its own length (EOS ignored).

    With an attention mask, as a tokenizer's output has and as the static batch passes.
    """
    seconds = []
    with timed() as times, torch.no_grad():
        for prompt, n in zip(workload.prompts, workload.output_lens, strict=True):
            started = time.perf_counter()
            ids = torch.tensor([list(prompt)])                                          # [1, prompt_len]
            hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=pad_token_id)
            seconds.append((time.perf_counter() - started) / n)
    return _result(times, workload.num_tokens, seconds)


def run_hf_static(hf_model: Any, workload: Workload, concurrency: int, pad_token_id: int = 0) -> dict[str, Any]:
    """transformers ``generate`` on consecutive batches of ``concurrency`` requests, left-padded.

    Each batch generates its longest output for every member; only what each request asked for
    counts as a token, and every member's time per output token is its batch's step time.
    ``peak_kv_tokens``: the largest batch's cache at its end, ``rows x (padded prompt + longest output)``.
    """
    tpot, peak = [], 0
    with timed() as times, torch.no_grad():
        for first in range(0, len(workload.prompts), concurrency):
            prompts = workload.prompts[first:first + concurrency]
            longest_out = max(workload.output_lens[first:first + concurrency])
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts])  # [rows, width]
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            started = time.perf_counter()
            hf_model.generate(ids, attention_mask=mask, max_new_tokens=longest_out, min_new_tokens=longest_out,
                              do_sample=False, pad_token_id=pad_token_id)
            tpot += [(time.perf_counter() - started) / longest_out] * len(prompts)
            peak = max(peak, len(prompts) * (width + longest_out))
    return _result(times, workload.num_tokens, tpot, peak_kv_tokens=peak)
