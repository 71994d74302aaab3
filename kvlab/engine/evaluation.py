"""Checking kvlab's engine against transformers, and measuring it: greedy references, agreement, throughput.

``hf_greedy`` is the reference every comparison uses: transformers' own ``generate`` with
``do_sample=False`` and its regular contiguous cache. ``kernel_timer`` says how much of a run
is spent inside the kernels. Throughput against concurrency (``Workload``, ``run_kvlab``,
``run_hf_serial``, ``run_hf_static``) lives in ``kvlab.engine.throughput``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvlab import kernels
from kvlab.engine.attention import BACKEND_KERNELS


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
    """Time every call of the attention kernels inside the block: ``seconds[name]``, one entry per call.

    The names are both backends' (``kvlab.engine.attention.BACKEND_KERNELS``): the Triton
    ``reshape_and_cache`` / ``paged_attention`` and the torch ``reshape_and_cache_ref`` /
    ``paged_attention_torch``.

    The engine's attention layer looks the kernels up on ``kvlab.kernels`` at each call, so
    wrapping them there for the duration of the block sees every launch, at the cost of two
    clock reads per call (a profiler would slow the interpreter's Python down many times over).
    On a GPU, launches return before the kernel ends, so each call is synchronised on both sides.
    """
    seconds: dict[str, list[float]] = {name: [] for pair in BACKEND_KERNELS.values() for name in pair}
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
