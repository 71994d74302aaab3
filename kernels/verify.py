"""A kernel bench for learners: run an attention function on packaged batches and say what broke, and where.

``check_kernel(fn)`` calls ``fn`` (``paged_attention``'s signature: a learner's edited kernel, a
mutant from ``kvlab.kernels.mutants``, the reference) on small batches that each probe one hard
path (decode and prefill, chunked prefill over a cached prefix, GQA ratios, tiles that span
blocks and blocks that span tiles, split-KV on and off, an FP8 cache, sliding windows), and
compares every output with ``paged_attention_ref``. The output buffer starts as NaN and the cache
holds NaN wherever no sequence lives, so a kernel that forgets a row or reads a foreign slot
fails too. Per batch it reports pass or fail, the relative error, and the worst
(sequence, query token, head) with its error; ``errors`` keeps the whole ``[tokens, heads]`` map
for ``kvlab.viz.paged_attention.figure_kernel_errors``. Shapes are tiny: on a CPU every program
runs through Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from kvlab.kernels.batches import TOLERANCE, Batch, fresh_seed, make_batch, poisoned_out, relative_error
from kvlab.kernels.fp8 import quantize_fp8
from kvlab.kernels.grid import KernelConfig
from kvlab.kernels.reference import paged_attention_ref

from kvlab.errors import KernelInputError


def _cfg(block_q: int, block_m: int = 16, tile_n: int = 16) -> KernelConfig:
    return KernelConfig(block_q=block_q, block_m=block_m, tile_n=tile_n)


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """One packaged batch: its sequences, shapes and call options, and the hard path it probes."""

    name: str
    probes: str
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_kv_heads: int = 2
    group: int = 2
    head_size: int = 32
    block_size: int = 16
    table: str = "scattered"
    config: KernelConfig | None = None
    num_kv_splits: int = 1
    sliding_window: int | None = None
    fp8_scales: tuple[float, float] | None = None     # (k_scale, v_scale) of an FP8 cache

    def build(self, seed: int) -> tuple[Batch, dict[str, Any]]:
        """The tensors (drawn from ``seed``) and the keyword arguments of the call."""
        batch = make_batch(self.seq_lens, self.query_lens, num_kv_heads=self.num_kv_heads, group=self.group,
                           head_size=self.head_size, block_size=self.block_size, table=self.table, seed=seed)
        kwargs: dict[str, Any] = dict(num_kv_splits=self.num_kv_splits, config=self.config)
        if self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        if self.fp8_scales is not None:
            k_scale, v_scale = self.fp8_scales
            batch.key_cache = quantize_fp8(batch.key_cache, k_scale)
            batch.value_cache = quantize_fp8(batch.value_cache, v_scale)
            kwargs.update(k_scale=k_scale, v_scale=v_scale)
        return batch, kwargs


#: The batches ``check_kernel`` runs by default, cheap ones and common paths first.
PACKAGED_BATCHES: tuple[BatchSpec, ...] = (
    BatchSpec("decode at block edges", "one query token per sequence, contexts of 1, 15, 16, 17 and 33 keys: "
              "around the edges of blocks and tiles of 16", (1, 15, 16, 17, 33), (1,) * 5, group=4, config=_cfg(4)),
    BatchSpec("prefill", "whole prompts of 5 and 40 tokens: causal masking inside the query block",
              (5, 40), (5, 40), config=_cfg(8)),
    BatchSpec("chunked prefill + decodes", "a 20-token chunk after 30 cached tokens, two decodes and a fresh "
              "prompt in one batch", (50, 17, 1, 9), (20, 1, 1, 9), group=4, config=_cfg(4)),
    BatchSpec("MHA (group 1)", "one query head per KV head: 16 tokens per program",
              (23, 40), (3, 1), num_kv_heads=3, group=1, config=_cfg(16)),
    BatchSpec("GQA group 3", "3 query heads per KV head: 4 tokens x 3 heads fill 12 of 16 rows",
              (40, 21), (6, 21), group=3, config=_cfg(4)),
    BatchSpec("MQA (one KV head)", "8 query heads share one KV head", (30, 7), (2, 7),
              num_kv_heads=1, group=8, config=_cfg(2)),
    BatchSpec("tile spans 4 blocks", "blocks of 4 tokens, tiles of 16 keys: each tile reads four blocks",
              (45, 6), (3, 6), block_size=4, config=_cfg(4, tile_n=16)),
    BatchSpec("block spans 2 tiles", "blocks of 32 tokens, tiles of 16 keys: two tiles per block",
              (70, 3), (1, 3), block_size=32, config=_cfg(4)),
    BatchSpec("shared prefix + long table", "sequences share their first physical block (a prefix hit); "
              "table columns past each sequence point at NaN blocks", (40, 33, 20), (1, 4, 1), table="shared",
              config=_cfg(4)),
    BatchSpec("split-KV, 3 splits", "decode with the keys cut across 3 programs (4 tiles: one split gets "
              "one tile, the short sequence leaves splits empty)", (60, 33, 1), (1, 1, 1), num_kv_splits=3,
              config=_cfg(4)),
    BatchSpec("split-KV, mixed batch", "a 40-token prompt in query blocks of 32 over 2 splits: the second "
              "split's keys are hidden from the block's first queries", (40, 18), (40, 1), num_kv_splits=2,
              config=_cfg(32, block_m=64)),
    BatchSpec("FP8 cache", "e4m3 caches with k_scale 0.05, v_scale 0.02: loads multiply by the scale",
              (37, 9), (1, 9), fp8_scales=(0.05, 0.02), config=_cfg(4)),
    BatchSpec("window inside a block", "sliding window of 10 (keys q - 9 .. q), its edge inside a block of 16; "
              "the last queries of a block see nothing of its first tile", (50, 37, 9), (1, 16, 9),
              sliding_window=10, config=_cfg(8)),
    BatchSpec("window longer than context", "a window of 64 over contexts of at most 40: nothing slides out",
              (40, 17), (3, 17), sliding_window=64, config=_cfg(4)),
    BatchSpec("window + split-KV", "window of 24 over a 70-token context, decode split over 2 programs",
              (70, 45), (1, 1), sliding_window=24, num_kv_splits=2, config=_cfg(4)),
)


@dataclasses.dataclass
class BatchResult:
    """How one batch went: pass or fail, the error, and where it was worst."""

    name: str
    probes: str
    passed: bool
    relative_error: float
    max_error: float                               # largest |out - ref| over every element (inf for NaN)
    worst: tuple[int, int, int] | None             # (sequence, query token within it, query head)
    errors: torch.Tensor | None                    # [num_tokens, num_q_heads]: largest |out - ref| per row
    token_seq: tuple[int, ...]                     # the sequence of each query token
    token_pos: tuple[int, ...]                     # each query token's index within its sequence's query
    seed: int
    exception: str | None = None

    def row(self) -> dict[str, Any]:
        """One line of the report's table."""
        seq, tok, head = self.worst or (None, None, None)
        return {"batch": self.name, "passed": self.passed, "relative error": self.relative_error,
                "max |error|": self.max_error, "worst sequence": seq, "worst query token": tok, "worst head": head,
                "raised": self.exception or "", "seed": self.seed}


@dataclasses.dataclass
class KernelReport:
    """``check_kernel``'s answer: one ``BatchResult`` per batch run, in order."""

    function: str
    results: list[BatchResult]
    tolerance: float

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[BatchResult]:
        return [r for r in self.results if not r.passed]

    def rows(self) -> list[dict[str, Any]]:
        """The report as table rows (``pd.DataFrame(report.rows())``)."""
        return [r.row() for r in self.results]

    def __getitem__(self, name: str) -> BatchResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def __str__(self) -> str:
        head = (f"{self.function}: {len(self.results) - len(self.failed)} of {len(self.results)} batches pass "
                f"(relative error < {self.tolerance:g})")
        lines = [head]
        for r in self.failed:
            where = (f"worst at sequence {r.worst[0]}, query token {r.worst[1]}, head {r.worst[2]}: "
                     f"|error| {r.max_error:.3g}") if r.worst else ""
            lines.append(f"  ✗ {r.name}: {r.exception or f'relative error {r.relative_error:.3g}; {where}'}")
        return "\n".join(lines)

    __repr__ = __str__


def _token_owners(query_start_loc: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """For every query token: its sequence and its index within that sequence's query."""
    seqs, pos = [], []
    for i, (a, b) in enumerate(zip(query_start_loc, query_start_loc[1:], strict=False)):
        seqs += [i] * (b - a)
        pos += list(range(b - a))
    return tuple(seqs), tuple(pos)


def compare_outputs(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, torch.Tensor]:
    """``(relative error, errors [tokens, heads])``; NaN or inf anywhere counts as an infinite error."""
    diff = (out.double().cpu() - ref.double().cpu()).abs()                 # [num_tokens, num_q_heads, head_size]
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf))
    errors = diff.amax(dim=-1)                                             # [num_tokens, num_q_heads]
    rel = relative_error(out, ref)
    return (math.inf if not math.isfinite(rel) else rel), errors


def run_batch(fn: Callable, spec: BatchSpec, seed: int, tolerance: float) -> BatchResult:
    """Run ``fn`` on one packaged batch and compare it with the reference."""
    batch, kwargs = spec.build(seed)
    ref = paged_attention_ref(*batch.args(), **kwargs)
    seqs, pos = _token_owners(batch.query_start_loc.tolist())
    out = poisoned_out(batch)
    try:
        with warnings.catch_warnings():       # a broken kernel's nan/inf is the finding, not a numpy warning
            warnings.simplefilter("ignore", RuntimeWarning)
            returned = fn(*batch.args(), out=out, **kwargs)
    except Exception as exc:  # the learner's kernel failing is reported, per batch
        return BatchResult(spec.name, spec.probes, False, math.inf, math.inf, None, None, seqs, pos, seed,
                           f"{type(exc).__name__}: {exc}")
    if isinstance(returned, torch.Tensor) and returned.shape == out.shape:
        out = returned
    rel, errors = compare_outputs(out, ref)
    token, head = divmod(int(errors.flatten().argmax()), errors.shape[1])
    return BatchResult(spec.name, spec.probes, rel < tolerance, rel, float(errors.max()),
                       (seqs[token], pos[token], head), errors, seqs, pos, seed)


def check_kernel(fn: Callable, batches: Sequence[BatchSpec] | None = None, *, seed: int | None = None,
                 tolerance: float = TOLERANCE[torch.float32], stop_at_first_failure: bool = False) -> KernelReport:
    """Run ``fn`` (``paged_attention``'s signature) on every batch and report what passed and what broke.

    ``batches`` defaults to ``PACKAGED_BATCHES``; ``seed`` fixes the data (default: fresh, and
    kept in each result). A batch passes when ``‖out − ref‖ / ‖ref‖ < tolerance`` (float32: 1e-4).
    With ``stop_at_first_failure`` the run ends at the first batch that fails (the tests' use).
    """
    if not callable(fn):
        raise KernelInputError(f"fn must be a function with paged_attention's signature, got {type(fn).__name__}")
    batches = PACKAGED_BATCHES if batches is None else tuple(batches)
    seed = fresh_seed() if seed is None else seed
    results = []
    for i, spec in enumerate(batches):
        results.append(run_batch(fn, spec, seed + i, tolerance))
        if stop_at_first_failure and not results[-1].passed:
            break
    return KernelReport(getattr(fn, "__qualname__", repr(fn)), results, tolerance)
