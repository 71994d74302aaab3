"""Seeded request-length workloads: ``(prompt_len, output_len)`` pairs for simulations.

``sharegpt_like`` and ``alpaca_like`` match the mean prompt and output lengths the
PagedAttention paper reports for its two datasets (Kwon et al., SOSP 2023, section 6.1,
Fig. 11); the long-tailed shapes (log-normal) and the length filter are documented in
``data/workloads/README.md``. ``fixed`` gives identical requests. Notebooks 02, 04, 06 and
07 draw their traffic from here, so the same seed always gives the same requests.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvlab._validate import MAX_OBJECTS, checked, non_negative_int, one_of, positive_int
from kvlab.data import DATA_DIR
from kvlab.errors import KvlabValueError

WORKLOADS_FILE = DATA_DIR / "workloads" / "paged_attention_sosp23.json"

Request = tuple[int, int]  # (prompt_len, output_len)


@functools.cache
def _stats() -> Mapping[str, Any]:
    return json.loads(WORKLOADS_FILE.read_text())


@checked
def workload_stats(name: str) -> dict[str, float]:
    """The paper's means and kvlab's chosen sigmas for workload ``name`` ("sharegpt" or "alpaca")."""
    workloads = _stats()["workloads"]
    return dict(workloads[one_of("name", name, workloads)])


@checked
def paper_results() -> dict[str, Any]:
    """The paper's measured figures the notebooks compare with: KV states per system, memory saved by sharing."""
    return json.loads(json.dumps(_stats()["results"]))  # a deep copy: the cached file stays as read


@checked
def length_filter() -> dict[str, int]:
    """The filter every generated pair passes (vLLM's benchmark rule): min/max prompt, min output, max total."""
    return {k: v for k, v in _stats()["filter"].items() if k != "source"}


def _rounded_lognormal_pmf(mu: float, sigma: float, kmax: int) -> np.ndarray:
    """P(round(X) = k) for k = 0..kmax, X log-normal(mu, sigma)."""
    edges = [0.0] + [math.log(k + 0.5) for k in range(kmax + 1)]
    cdf = [0.0] + [0.5 * (1 + math.erf((e - mu) / (sigma * math.sqrt(2)))) for e in edges[1:]]
    return np.diff(np.asarray(cdf))


def _filtered_means(mu_p: float, s_p: float, mu_o: float, s_o: float, f: Mapping[str, int]) -> tuple[float, float]:
    """Exact mean prompt and output lengths of the rounded, filtered log-normal pair."""
    pp = _rounded_lognormal_pmf(mu_p, s_p, f["max_prompt"])
    po = _rounded_lognormal_pmf(mu_o, s_o, f["max_total"])
    p = np.arange(pp.size)[:, None]
    o = np.arange(po.size)[None, :]
    ok = (p >= f["min_prompt"]) & (o >= f["min_output"]) & (p + o <= f["max_total"])
    weight = pp[:, None] * po[None, :] * ok  # [prompt_len, output_len]
    total = weight.sum()
    return float((weight * p).sum() / total), float((weight * o).sum() / total)


@checked
@functools.cache
def lognormal_mus(name: str) -> tuple[float, float]:
    """The log-normal locations (prompt, output) whose *filtered* means are the paper's.

    Solved by fixed-point iteration on exact sums over every allowed length, so nothing
    here is fitted by hand or by sampling.
    """
    s = workload_stats(name)
    f = length_filter()
    mu_p = math.log(s["mean_prompt"]) - s["sigma_prompt"] ** 2 / 2
    mu_o = math.log(s["mean_output"]) - s["sigma_output"] ** 2 / 2
    for _ in range(100):
        mean_p, mean_o = _filtered_means(mu_p, s["sigma_prompt"], mu_o, s["sigma_output"], f)
        if abs(mean_p - s["mean_prompt"]) < 1e-4 and abs(mean_o - s["mean_output"]) < 1e-4:
            break
        mu_p += math.log(s["mean_prompt"] / mean_p)
        mu_o += math.log(s["mean_output"] / mean_o)
    return mu_p, mu_o


def _draw(name: str, n: int, seed: int) -> list[Request]:
    n = non_negative_int("n", n)
    seed = non_negative_int("seed", seed)
    s = workload_stats(name)
    f = length_filter()
    mu_p, mu_o = lognormal_mus(name)
    rng = np.random.default_rng(seed)
    kept: list[np.ndarray] = []
    have = 0
    while have < n:
        batch = max(2 * (n - have), 64)
        prompt = np.rint(rng.lognormal(mu_p, s["sigma_prompt"], batch)).astype(np.int64)  # [batch]
        output = np.rint(rng.lognormal(mu_o, s["sigma_output"], batch)).astype(np.int64)  # [batch]
        ok = ((prompt >= f["min_prompt"]) & (prompt <= f["max_prompt"]) & (output >= f["min_output"])
              & (prompt + output <= f["max_total"]))
        pairs = np.stack([prompt[ok], output[ok]], axis=1)  # [kept, 2]
        kept.append(pairs)
        have += len(pairs)
    pairs = np.concatenate(kept)[:n] if kept else np.empty((0, 2), dtype=np.int64)
    return [(int(p), int(o)) for p, o in pairs]


@checked(at_most={"n": MAX_OBJECTS})
def sharegpt_like(n: int, seed: int = 0) -> list[Request]:
    """``n`` ShareGPT-like requests: mean prompt 161.31 and output 337.99 tokens, long-tailed, <= 2048 in all."""
    return _draw("sharegpt", n, seed)


@checked(at_most={"n": MAX_OBJECTS})
def alpaca_like(n: int, seed: int = 0) -> list[Request]:
    """``n`` Alpaca-like requests: mean prompt 19.31 and output 58.45 tokens, long-tailed, <= 2048 in all."""
    return _draw("alpaca", n, seed)


@checked(at_most={"n": MAX_OBJECTS})
def fixed(n: int, prompt_len: int, output_len: int) -> list[Request]:
    """``n`` identical requests of ``prompt_len`` prompt tokens and ``output_len`` generated tokens."""
    n = non_negative_int("n", n)
    pair = (positive_int("prompt_len", prompt_len), positive_int("output_len", output_len))
    return [pair] * n


@checked
def validate_requests(requests: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    """``requests`` as an ``[n, 2]`` int64 array of (prompt_len, output_len), each >= 1, or a clear error."""
    try:
        array = np.asarray(requests, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise KvlabValueError(f"requests must be (prompt_len, output_len) pairs of integers: {exc}") from None
    if array.size == 0:
        raise KvlabValueError("requests must hold at least one (prompt_len, output_len) pair")
    if array.ndim != 2 or array.shape[1] != 2:
        raise KvlabValueError(f"requests must be (prompt_len, output_len) pairs, got shape {array.shape}")
    if not np.array_equal(array, np.asarray(requests, dtype=np.float64)):
        raise KvlabValueError("requests must hold whole numbers of tokens")
    bad = np.flatnonzero((array < 1).any(axis=1))
    if bad.size:
        raise KvlabValueError(f"requests[{bad[0]}] = {tuple(array[bad[0]])}: prompt_len and output_len must be >= 1")
    return array


@checked
def summarize(requests: Sequence[Sequence[int]] | np.ndarray) -> dict[str, float]:
    """Count, mean and maximum of prompt, output and total lengths (for tables)."""
    array = validate_requests(requests)
    total = array.sum(axis=1)
    return {
        "requests": int(len(array)),
        "mean_prompt": float(array[:, 0].mean()),
        "mean_output": float(array[:, 1].mean()),
        "mean_total": float(total.mean()),
        "max_total": int(total.max()),
    }
