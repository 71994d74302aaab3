"""vLLM's serving metrics, kept as vLLM keeps them and written in Prometheus' text format.

The names, types and help texts are those of vLLM's ``PrometheusStatLogger``
(``vllm/v1/metrics/loggers.py``). Gauges describe the moment (requests running and waiting,
KV cache usage); counters only grow, and Prometheus' exposition adds ``_total`` to their
names, so ``vllm:prefix_cache_hits`` is scraped as ``vllm:prefix_cache_hits_total``. The hit
rate a dashboard shows is ``rate(vllm:prefix_cache_hits_total[5m]) /
rate(vllm:prefix_cache_queries_total[5m])``. Prefix-cache counters are in tokens, and
count only first admissions: a preempted request re-finding its own blocks is not a hit.

``LatencyMetrics`` keeps vLLM's request-latency histograms: time to first token, the time
between a request's consecutive tokens, and end-to-end latency, each read off one clock
reading per engine step, as vLLM reads them per engine-core iteration.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from kvlab.core.kv_cache_metrics import Histogram, prometheus_float
from kvlab.core.sched.output import SchedulerStats
from kvlab.errors import RequestStateError

#: name -> (type, help), in the order vLLM registers them.
METRICS: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prefix_cache_queries": ("counter", "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:num_preemptions": ("counter", "Cumulative number of preemption from the engine."),
    "vllm:generation_tokens": ("counter", "Number of generation tokens processed."),
}


@dataclasses.dataclass
class EngineMetrics:
    """The current gauges and the counters since start, updated once per step from ``SchedulerStats``."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    generation_tokens: int = 0

    def record(self, stats: SchedulerStats, num_generated_tokens: int) -> None:
        """Fold in one step: gauges are replaced, counters increased."""
        self.num_requests_running = stats.num_running_reqs
        self.num_requests_waiting = stats.num_waiting_reqs
        self.kv_cache_usage_perc = stats.kv_cache_usage
        self.prefix_cache_queries += stats.prefix_cache_stats.queries
        self.prefix_cache_hits += stats.prefix_cache_stats.hits
        self.num_preemptions += stats.num_preempted_reqs
        self.generation_tokens += num_generated_tokens

    def value(self, name: str) -> float:
        """A metric by its vLLM name (``"vllm:prefix_cache_hits"``, with or without ``_total``)."""
        return float(getattr(self, name.removeprefix("vllm:").removesuffix("_total")))


def prometheus_text(metrics: EngineMetrics, labels: dict[str, str]) -> str:
    """The metrics in Prometheus' text exposition format (what ``GET /metrics`` returns)."""
    label_text = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))  # sorted, as the client does
    lines = []
    for name, (kind, help_text) in METRICS.items():
        exposed = f"{name}_total" if kind == "counter" else name
        lines += [
            f"# HELP {exposed} {help_text}",
            f"# TYPE {exposed} {kind}",
            f"{exposed}{{{label_text}}} {prometheus_float(metrics.value(name))}",
        ]
    return "\n".join(lines) + "\n"


#: vLLM's latency buckets (``vllm/v1/metrics/loggers.py``), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
#: name -> (help, buckets), as vLLM registers them.
LATENCY_HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:time_per_output_token_seconds": ("Histogram of time per output token in seconds.", TPOT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
}


@dataclasses.dataclass
class _RequestTimes:
    arrival: float
    last_token: float | None = None


class LatencyMetrics:
    """Per-request timestamps folded into vLLM's three latency histograms.

    ``arrived`` when a request is queued; ``tokens`` once per step for each request that got
    tokens or finished, with that step's clock reading. The first token observes the time to
    first token (queueing and prefill, preemptions included); each later one the gap since the
    request's previous token (vLLM's ``time_per_output_token``, also called inter-token latency);
    finishing observes end-to-end latency. Seconds are whatever clock the caller reads.
    """

    def __init__(self) -> None:
        self.histograms = {name: Histogram(name, doc, buckets) for name, (doc, buckets) in LATENCY_HISTOGRAMS.items()}
        self._requests: dict[str, _RequestTimes] = {}

    def arrived(self, request_ids: Iterable[str], now: float) -> None:
        """Requests (a parent and its future parallel samples) queued at ``now``; all or none are taken."""
        ids = list(request_ids)
        clash = sorted({i for i, n in collections.Counter(ids).items() if n > 1 or i in self._requests})
        if clash:
            raise RequestStateError(f"request ids {clash} are already being timed")
        for request_id in ids:
            self._requests[request_id] = _RequestTimes(now)

    def tokens(self, request_id: str, got_tokens: bool, finished: bool, now: float) -> None:
        """One step's outcome for one request, at the step's clock reading ``now``."""
        times = self._requests.get(request_id)
        if times is None:
            raise RequestStateError(f"request id {request_id!r} was never timed: call arrived() first")
        if got_tokens:
            if times.last_token is None:
                self.histograms["vllm:time_to_first_token_seconds"].observe(now - times.arrival)
            else:
                self.histograms["vllm:time_per_output_token_seconds"].observe(now - times.last_token)
            times.last_token = now
        if finished:
            self.histograms["vllm:e2e_request_latency_seconds"].observe(now - times.arrival)
            del self._requests[request_id]

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        """Per histogram: how many observations, and the exact median, 90th percentile and maximum (seconds)."""
        return {name: {"count": h.count, "p50": h.quantile(0.5), "p90": h.quantile(0.9), "max": h.quantile(1.0)}
                for name, h in self.histograms.items()}

    def prometheus_text(self, labels: dict[str, str]) -> str:
        """The three histograms in Prometheus' text format, labelled like the other metrics."""
        return "\n".join(line for h in self.histograms.values() for line in h.prometheus_lines(labels)) + "\n"
