"""Checking kvlab's engine against transformers, and measuring it: greedy references, agreement, throughput.

``hf_greedy`` is the reference every comparison uses: transformers' own ``generate`` with
``do_sample=False`` and its regular contiguous cache. ``kernel_timer`` says how much of a run
is spent inside the kernels, and ``measure_throughput`` times one batch of prompts through
kvlab and through transformers with the kernels profiled (the MLA tests use it). Throughput
against concurrency, the lesson of notebook 06 (``Workload``, ``run_kvlab``, ``run_hf_serial``,
``run_hf_static``), lives in ``kvlab.engine.throughput``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvlab import kernels
from kvlab.engine.attention import BACKEND_KERNELS

#: The kernel entry points ``kernel_timer`` times (the K/V pair and MLA's pair), as ``kvlab.kernels`` names them.
KERNEL_CALLS = ("reshape_and_cache", "paged_attention", "concat_and_cache_mla", "mla_decode")


def hf_greedy(hf_model: Any, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """transformers' greedy generation for one prompt: the new token ids, up to and including an EOS."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([list(prompt)], device=hf_model.device), max_new_tokens=max_tokens,
                                do_sample=False)
    tokens = out[0, len(prompt):].tolist()
    eos = hf_model.generation_config.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    stop = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    return tokens if stop is None else tokens[: stop + 1]  # drop the padding transformers adds after EOS


def num_agreeing_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens two generations share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float32, on the CPU (the two may come from different devices)."""
    actual, expected = actual.to("cpu", torch.float32), expected.to("cpu", torch.float32)
    return float((actual - expected).norm() / expected.norm())


@contextlib.contextmanager
def kernel_timer() -> Iterator[dict[str, list[float]]]:
    """Time every call of the kernels inside the block: ``seconds[name]``, one entry per call.

    The names are ``KERNEL_CALLS`` (the Triton K/V pair and MLA's pair) and the torch backend's
    ``reshape_and_cache_ref`` / ``paged_attention_torch`` (``kvlab.engine.attention.BACKEND_KERNELS``).

    The engine's attention layer looks the kernels up on ``kvlab.kernels`` at each call, so
    wrapping them there for the duration of the block sees every launch, at the cost of two
    clock reads per call (a profiler would slow the interpreter's Python down many times over).
    On a GPU, launches return before the kernel ends, so each call is synchronised on both sides.
    """
    names = dict.fromkeys([*KERNEL_CALLS, *(name for pair in BACKEND_KERNELS.values() for name in pair)])
    seconds: dict[str, list[float]] = {name: [] for name in names}
    originals = {name: getattr(kernels, name) for name in seconds}
    on_gpu = kernels.backend() == kernels.TRITON_CUDA

    def timed(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if on_gpu:
                torch.cuda.synchronize()
            started = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                if on_gpu:
                    torch.cuda.synchronize()
                seconds[name].append(time.perf_counter() - started)

        return call

    try:
        for name in seconds:
            setattr(kernels, name, timed(name))
        yield seconds
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)


def measure_throughput(
    model_dir: str | os.PathLike, prompts: Sequence[Sequence[int]], max_tokens: int, **engine_kwargs: Any
) -> dict[str, Any]:
    """Generated tokens per second of kvlab's engine (batched) and of transformers (one prompt at a time).

    Both decode greedily to ``max_tokens`` with EOS ignored, on the same prompts in float32
    on the engine's device (``engine_kwargs["device"]``, by default where the kernels run),
    each after an untimed one-token warm-up. ``kernel_seconds`` is the
    time inside ``kvlab.kernels``' ``reshape_and_cache`` and ``paged_attention`` (for an MLA model
    ``concat_and_cache_mla`` and ``mla_decode``, ``mla_kernel_seconds``) (on CPU:
    Triton's interpreter running each program in Python); the rest is the model's torch
    operations, sampling and the scheduler.
    """
    from transformers import AutoModelForCausalLM

    from kvlab.engine.llm_engine import LLMEngine

    engine = LLMEngine(model_dir, **engine_kwargs)
    engine.generate(prompts[:1], max_tokens=1, use_tqdm=False)  # warm-up, untimed: first calls pay one-off costs
    warm_up_steps = len(engine.history)
    with kernel_timer() as kernel_seconds:
        started = time.perf_counter()
        outputs = engine.generate(prompts, max_tokens=max_tokens, ignore_eos=True, use_tqdm=False)
        kvlab_seconds = time.perf_counter() - started
    write_s, attend_s = sum(kernel_seconds["reshape_and_cache"]), sum(kernel_seconds["paged_attention"])
    mla_s = sum(kernel_seconds["concat_and_cache_mla"]) + sum(kernel_seconds["mla_decode"])

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(engine.device).eval()
    hf_greedy(hf_model, prompts[0], 1)  # warm-up, untimed (transformers imports and sets up on first use)
    hf_tokens = 0
    started = time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            out = hf_model.generate(torch.tensor([list(prompt)], device=engine.device), max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens, do_sample=False)
            hf_tokens += out.shape[1] - len(prompt)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()  # generate may return before the GPU is done
    hf_seconds = time.perf_counter() - started
    kvlab_tokens = sum(len(o) for o in outputs)
    return {
        "num_prompts": len(prompts), "max_tokens": max_tokens, "kernel_backend": kernels.backend(),
        "kvlab_tokens": kvlab_tokens, "kvlab_seconds": kvlab_seconds,
        "kvlab_tokens_per_s": kvlab_tokens / kvlab_seconds,
        "hf_tokens": hf_tokens, "hf_seconds": hf_seconds, "hf_tokens_per_s": hf_tokens / hf_seconds,
        "steps": len(engine.history) - warm_up_steps, "kernel_seconds": write_s + attend_s + mla_s,
        "kernel_share": (write_s + attend_s + mla_s) / kvlab_seconds,
        "kernel_calls": sum(len(calls) for calls in kernel_seconds.values()),
        "reshape_and_cache_seconds": write_s, "paged_attention_seconds": attend_s, "mla_kernel_seconds": mla_s,
    }
