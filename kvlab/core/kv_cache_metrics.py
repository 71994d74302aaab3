"""Block lifetime metrics as vLLM V1 collects them: lifetime, idle time before eviction, and reuse gaps.

Mirrors ``vllm/v1/core/kv_cache_metrics.py`` (vLLM 0.33.0). A ``KVCacheMetricsCollector`` is
attached to a ``BlockPool`` (its ``metrics_collector``; further observers, such as the CPU
tier, sit beside it in ``observers``) and the pool calls it where vLLM's pool does:

* ``on_block_allocated`` when ``get_new_blocks`` hands a block out: a new life starts, with no
  accesses yet (and the block is sampled, or not, for the rest of that life);
* ``on_block_accessed`` when ``touch`` takes a block for a prefix hit: the hit is appended to
  the last ``ACCESS_HISTORY_LEN`` (4) accesses and becomes the block's last access;
* ``on_block_evicted`` when, with prefix caching on, the free queue gives a block up for
  reuse (hashed or not; with caching off 0.33.0 never calls it, so no life ends and nothing
  is observed): the life ends and three histograms are observed, ``vllm:kv_block_lifetime_seconds``
  (allocation to eviction), ``vllm:kv_block_idle_before_evict_seconds`` (last access, or
  allocation, to eviction) and ``vllm:kv_block_reuse_gap_seconds`` (one value per pair of
  consecutive recorded hits). Nothing is observed for a block that is never evicted.

kvlab adds the same three in scheduler steps (``kvlab:kv_block_*_steps``): a simulation has no
meaningful seconds, and steps compare runs made on different machines. The clock is a
parameter (``time.monotonic`` by default), so a simulation can give modelled seconds and say
so. vLLM samples 1 % of blocks by default (``--kv-cache-metrics-sample``); kvlab samples every
block unless told otherwise, and draws its sample from a seeded generator. vLLM clamps a
rate outside (0, 1]; kvlab refuses it.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from kvlab._validate import checked, non_negative_int, one_of
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.errors import KvlabValueError

Unit = Literal["seconds", "steps"]
ACCESS_HISTORY_LEN = 4  # vLLM keeps the last four accesses per block

#: vLLM's ``kv_cache_residency_buckets`` (``vllm/v1/metrics/loggers.py``), in seconds.
SECONDS_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800,
)
#: kvlab's step buckets: 1-2-5 steps, as vLLM's ``build_1_2_5_buckets`` spaces token counts.
STEPS_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

METRICS: tuple[tuple[str, str], ...] = (
    ("lifetime", "KV cache block lifetime from allocation to eviction."),
    ("idle_before_evict", "Idle time before KV cache block eviction (from its last access, or its allocation)."),
    ("reuse_gap", "Gaps between consecutive prefix-cache hits on a KV cache block (last 4 hits per block)."),
)


@checked
def metric_name(metric: str, unit: Unit) -> str:
    """``vllm:kv_block_<metric>_seconds`` as vLLM names it, or kvlab's ``kvlab:kv_block_<metric>_steps``."""
    one_of("metric", metric, [m for m, _ in METRICS])
    one_of("unit", unit, ("seconds", "steps"))
    return f"vllm:kv_block_{metric}_seconds" if unit == "seconds" else f"kvlab:kv_block_{metric}_steps"


@dataclasses.dataclass(frozen=True)
class Stamp:
    """When something happened: the scheduler step and the clock's seconds."""

    step: int
    seconds: float

    @checked
    def since(self, earlier: Stamp, unit: Unit) -> float:
        """The time from ``earlier`` to this stamp, in steps or seconds."""
        return self.step - earlier.step if unit == "steps" else self.seconds - earlier.seconds


class BlockMetricsState:
    """One sampled block's life so far: when it was allocated, last accessed, and its last four hits."""

    __slots__ = ("birth", "last_access", "access_history")

    def __init__(self, now: Stamp) -> None:
        self.birth = now
        self.last_access = now
        self.access_history: deque[Stamp] = deque(maxlen=ACCESS_HISTORY_LEN)

    @checked
    def record_access(self, now: Stamp) -> None:
        """A prefix hit at ``now``."""
        self.last_access = now
        self.access_history.append(now)

    @checked
    def reuse_gaps(self, unit: Unit) -> list[float]:
        """Gaps between consecutive recorded hits (none with fewer than two)."""
        history = list(self.access_history)
        return [b.since(a, unit) for a, b in zip(history, history[1:], strict=False)]


@checked
def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile by nearest rank: the smallest value with at least ``q x n`` values at or below it.

    None for no values. ``q`` is in (0, 1]; 0.5 is the median, 0.9 the 90th percentile.
    """
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
        raise KvlabValueError(f"q must be in (0, 1], got {q!r}")
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[math.ceil(q * len(ordered)) - 1]


@checked
def prometheus_float(value: float) -> str:
    """A number as Prometheus' Python client writes it: ``3.0``, ``0.25``, ``+Inf``."""
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    return repr(float(value))


@checked
class Histogram:
    """A Prometheus histogram that also keeps its raw values, so exact quantiles sit beside bucket estimates."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise KvlabValueError(f"buckets must be strictly increasing and non-empty, got {buckets!r}")
        self.name = name
        self.documentation = documentation
        self.buckets = tuple(buckets)
        self.values: list[float] = []

    @checked
    def observe(self, value: float) -> None:
        """Record one value."""
        self.values.append(value)

    @property
    def count(self) -> int:
        return len(self.values)

    @property
    def sum(self) -> float:
        return float(sum(self.values))

    def cumulative_counts(self) -> list[int]:
        """Values at or below each bucket's upper bound, then the total (the ``+Inf`` bucket)."""
        ordered = sorted(self.values)
        return [bisect.bisect_right(ordered, bound) for bound in self.buckets] + [len(ordered)]

    @checked
    def quantile(self, q: float) -> float | None:
        """The exact ``q`` quantile of the observed values (nearest rank); None before any observation."""
        return nearest_rank(self.values, q)

    @checked
    def histogram_quantile(self, q: float) -> float | None:
        """Prometheus' ``histogram_quantile`` on the buckets: linear within the bucket holding rank ``q x n``.

        What a dashboard shows, and only as fine as the buckets; the largest finite bound when
        the rank falls in the ``+Inf`` bucket, as Prometheus returns.
        """
        nearest_rank([0.0], q)  # validates q
        if not self.values:
            return None
        counts, rank = self.cumulative_counts(), q * self.count
        for i, bound in enumerate(self.buckets):
            if counts[i] >= rank:
                lower = self.buckets[i - 1] if i else 0.0
                below = counts[i - 1] if i else 0
                inside = counts[i] - below
                return lower + (bound - lower) * (rank - below) / inside if inside else bound
        return self.buckets[-1]

    @checked
    def prometheus_lines(self, labels: dict[str, str] | None = None) -> list[str]:
        """The histogram in Prometheus' text format, as its Python client writes it: ``# HELP``, ``# TYPE``,
        cumulative buckets, ``_count``, ``_sum``; ``labels`` on every sample, sorted with ``le`` among them."""
        counts = self.cumulative_counts()
        bounds = [prometheus_float(b) for b in self.buckets] + ["+Inf"]

        def sample(suffix: str, value: float, le: str | None = None) -> str:
            pairs = sorted({**(labels or {}), **({"le": le} if le else {})}.items())
            text = ",".join(f'{key}="{val}"' for key, val in pairs)
            return f"{self.name}{suffix}{{{text}}} {prometheus_float(value)}" if text else \
                f"{self.name}{suffix} {prometheus_float(value)}"

        return [f"# HELP {self.name} {self.documentation}", f"# TYPE {self.name} histogram",
                *(sample("_bucket", c, le) for le, c in zip(bounds, counts, strict=True)),
                sample("_count", self.count), sample("_sum", self.sum)]


@checked
class KVCacheMetricsCollector:
    """Samples blocks and records their lifetimes, idle time before eviction and reuse gaps, in steps and seconds.

    Attach it to a pool (``BlockPool(..., metrics_collector=collector)`` or
    ``pool.metrics_collector = collector``) and call ``advance()`` once per scheduler step.
    ``sample_rate`` is the share of allocations tracked (1.0: every block), drawn from
    ``random.Random(seed)``; ``clock`` returns seconds.
    """

    def __init__(self, sample_rate: float = 1.0, seed: int | None = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise KvlabValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if not callable(clock):
            raise KvlabValueError(f"clock must be a function returning seconds, got {type(clock).__name__}")
        self.sample_rate = float(sample_rate)
        self._rng = random.Random(seed)
        self.clock = clock
        self.step = 0
        self.block_metrics: dict[int, BlockMetricsState] = {}
        self.histograms: dict[str, Histogram] = {
            metric_name(metric, unit): Histogram(metric_name(metric, unit), doc + (" In scheduler steps (kvlab)."
                                                 if unit == "steps" else ""),
                                                 SECONDS_BUCKETS if unit == "seconds" else STEPS_BUCKETS)
            for unit in ("seconds", "steps") for metric, doc in METRICS
        }

    # ----------------------------------------------------------------- time

    def now(self) -> Stamp:
        """The current step and clock reading."""
        return Stamp(self.step, float(self.clock()))

    @checked
    def advance(self, steps: int = 1) -> None:
        """Count ``steps`` scheduler steps (call once per step)."""
        self.step += non_negative_int("steps", steps)

    # ----------------------------------------------------------------- what the pool calls

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        """A block starts a new life; it is tracked if the sample draws it."""
        if self.sample_rate >= 1 or self._rng.random() < self.sample_rate:
            self.block_metrics[block.block_id] = BlockMetricsState(self.now())
        else:
            self.block_metrics.pop(block.block_id, None)

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        """A prefix hit on a tracked block."""
        state = self.block_metrics.get(block.block_id)
        if state is not None:
            state.record_access(self.now())

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        """A tracked block's life ends: observe its lifetime, idle time and reuse gaps."""
        state = self.block_metrics.pop(block.block_id, None)
        if state is None:
            return
        now = self.now()
        for unit in ("seconds", "steps"):
            self.histograms[metric_name("lifetime", unit)].observe(now.since(state.birth, unit))
            self.histograms[metric_name("idle_before_evict", unit)].observe(now.since(state.last_access, unit))
            for gap in state.reuse_gaps(unit):
                self.histograms[metric_name("reuse_gap", unit)].observe(gap)

    def reset(self) -> None:
        """Forget the blocks being tracked (the prefix cache was reset); what was observed stays."""
        self.block_metrics.clear()

    # ----------------------------------------------------------------- reading

    @checked
    def histogram(self, metric: str, unit: Unit = "steps") -> Histogram:
        """The histogram of ``metric`` ("lifetime", "idle_before_evict", "reuse_gap") in ``unit``."""
        name = metric_name(metric, unit)
        if name not in self.histograms:
            raise KvlabValueError(f"no histogram {name!r}; metrics are {[m for m, _ in METRICS]}, units seconds/steps")
        return self.histograms[name]

    def metrics_text(self) -> str:
        """Every histogram in Prometheus text format."""
        return "\n".join(line for h in self.histograms.values() for line in h.prometheus_lines()) + "\n"

    @checked
    def diagnose(self, unit: Unit = "steps") -> PoolDiagnosis:
        """The source material's test on what was observed: is the pool too small?"""
        return diagnose_pool(self.histogram("reuse_gap", unit).values,
                             self.histogram("idle_before_evict", unit).values, unit)


@dataclasses.dataclass(frozen=True)
class PoolDiagnosis:
    """The block-lifetime diagnostic: p90 of reuse gaps against the median idle time before eviction."""

    unit: Unit
    reuse_gap_p90: float | None
    idle_before_evict_p50: float | None
    num_reuse_gaps: int
    num_evictions: int
    too_small: bool

    def __str__(self) -> str:
        if self.reuse_gap_p90 is None or self.idle_before_evict_p50 is None:
            return (f"Not enough to judge: {self.num_reuse_gaps} reuse gap(s), {self.num_evictions} eviction(s) "
                    "observed.")
        relation = ">" if self.too_small else "<="
        verdict = ("the pool is too small: blocks are evicted sooner than they are typically needed again"
                   if self.too_small else "blocks usually survive until they are needed again")
        return (f"p90 reuse gap {self.reuse_gap_p90:g} {self.unit} {relation} median idle before eviction "
                f"{self.idle_before_evict_p50:g} {self.unit}: {verdict}.")


@checked
def pool_too_small(reuse_gaps: Sequence[float], idle_before_evict: Sequence[float]) -> bool:
    """True when the 90th-percentile reuse gap exceeds the median idle time before eviction (nearest rank).

    With no reuse gaps or no evictions there is nothing to compare, and the answer is False.
    """
    p90, p50 = nearest_rank(reuse_gaps, 0.9), nearest_rank(idle_before_evict, 0.5)
    return p90 is not None and p50 is not None and p90 > p50


@checked
def diagnose_pool(reuse_gaps: Sequence[float], idle_before_evict: Sequence[float],
                  unit: Unit = "steps") -> PoolDiagnosis:
    """``pool_too_small`` with the figures behind it, for a notebook to print."""
    return PoolDiagnosis(unit, nearest_rank(reuse_gaps, 0.9), nearest_rank(idle_before_evict, 0.5),
                         len(reuse_gaps), len(idle_before_evict), pool_too_small(reuse_gaps, idle_before_evict))
