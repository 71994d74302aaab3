"""vLLM's serving metrics, kept as vLLM keeps them and written in Prometheus' text format.

The names, types and help texts are those of vLLM's ``PrometheusStatLogger``
(``vllm/v1/metrics/loggers.py``). Gauges describe the moment (requests running and waiting,
KV cache usage); counters only grow, and Prometheus' exposition adds ``_total`` to their
names, so ``vllm:prefix_cache_hits`` is scraped as ``vllm:prefix_cache_hits_total``. The hit
rate a dashboard shows is ``rate(vllm:prefix_cache_hits_total[5m]) /
rate(vllm:prefix_cache_queries_total[5m])``. Prefix-cache counters are in tokens, and
count only first admissions: a preempted request re-finding its own blocks is not a hit.

``vllm:request_success`` counts finished requests by ``finished_reason`` (stop, length, abort,
error, repetition: vLLM exports all five). A client's abort is never counted: vLLM 0.33.0's
``OutputProcessor.abort_requests`` drops the request before ``_update_stats_from_finished``, so
``LLMEngine`` leaves "abort" at 0, and kvlab never repeats-detects, so "repetition" stays 0 too.

``LatencyMetrics`` keeps vLLM's request-latency histograms: time to first token, the time
between a request's consecutive tokens (``vllm:inter_token_latency_seconds``), each request's
mean time per output token, and end-to-end latency, each read off one clock reading per engine
step, as vLLM reads them per engine-core iteration. vLLM 0.33.0 no longer exports the older
``vllm:time_per_output_token_seconds``: the per-token gaps are now the inter-token latency, and
the per-request mean is ``vllm:request_time_per_output_token_seconds``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from kvlab.core.kv_cache_metrics import Histogram, prometheus_float
from kvlab.core.sched.output import SchedulerStats
from kvlab.errors import KvlabValueError, RequestStateError

#: name -> (type, help), in the order vLLM registers them.
METRICS: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prefix_cache_queries": ("counter", "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:external_prefix_cache_queries": ("counter", "External prefix cache queries from KV connector cross-instance "
                                                      "cache sharing, in terms of number of queried tokens."),
    "vllm:external_prefix_cache_hits": ("counter", "External prefix cache hits from KV connector cross-instance cache "
                                                   "sharing, in terms of number of cached tokens."),
    "vllm:num_preemptions": ("counter", "Cumulative number of preemption from the engine."),
    "vllm:generation_tokens": ("counter", "Number of generation tokens processed."),
}
#: vLLM's finish reasons (``vllm/v1/engine/__init__.py``), the labels of ``vllm:request_success``.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
REQUEST_SUCCESS_HELP = "Count of successfully processed requests."


@dataclasses.dataclass
class EngineMetrics:
    """The current gauges and the counters since start, updated once per step from ``SchedulerStats``."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0  # tokens a KV connector was asked for, beyond the local hits
    external_prefix_cache_hits: int = 0  # of those, tokens it loaded
    num_preemptions: int = 0
    generation_tokens: int = 0
    request_success: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))

    def record(self, stats: SchedulerStats, num_generated_tokens: int) -> None:
        """Fold in one step: gauges are replaced, counters increased."""
        self.num_requests_running = stats.num_running_reqs
        self.num_requests_waiting = stats.num_waiting_reqs
        self.kv_cache_usage_perc = stats.kv_cache_usage
        self.prefix_cache_queries += stats.prefix_cache_stats.queries
        self.prefix_cache_hits += stats.prefix_cache_stats.hits
        if stats.connector_prefix_cache_stats is not None:  # vLLM counts new requests' lookups, not resumed ones'
            self.external_prefix_cache_queries += stats.connector_prefix_cache_stats.queries
            self.external_prefix_cache_hits += stats.connector_prefix_cache_stats.hits
        self.num_preemptions += stats.num_preempted_reqs
        self.generation_tokens += num_generated_tokens

    def record_finished(self, finish_reason: str | None) -> None:
        """One request finished (``vllm:request_success``, labelled by its finish reason)."""
        if finish_reason not in self.request_success:
            raise KvlabValueError(f"finish_reason must be one of {list(FINISH_REASONS)}, got {finish_reason!r}")
        self.request_success[finish_reason] += 1

    def value(self, name: str, finished_reason: str | None = None) -> float:
        """A metric by its vLLM name (``"vllm:prefix_cache_hits"``, with or without ``_total``);
        ``vllm:request_success`` also takes its ``finished_reason`` label."""
        field = name.removeprefix("vllm:").removesuffix("_total")
        if field == "request_success":
            if finished_reason not in self.request_success:
                raise KvlabValueError(f"finished_reason must be one of {list(FINISH_REASONS)}, got {finished_reason!r}")
            return float(self.request_success[finished_reason])
        return float(getattr(self, field))


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
    lines += ["# HELP vllm:request_success_total " + REQUEST_SUCCESS_HELP, "# TYPE vllm:request_success_total counter"]
    for reason in FINISH_REASONS:  # labelled as vLLM labels them: one series per finish reason
        pairs = sorted({**labels, "finished_reason": reason}.items())
        text = ",".join(f'{key}="{value}"' for key, value in pairs)
        lines.append(f"vllm:request_success_total{{{text}}} {prometheus_float(metrics.request_success[reason])}")
    return "\n".join(lines) + "\n"


#: vLLM's latency buckets (``vllm/v1/metrics/buckets.py``), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
#: name -> (help, buckets), as vLLM registers them.
LATENCY_HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.",
                                                   INTER_TOKEN_LATENCY_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
}


@dataclasses.dataclass
class _RequestTimes:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


class LatencyMetrics:
    """Per-request timestamps folded into vLLM's latency histograms.

    ``arrived`` when a request is queued; ``tokens`` once per step for each request that got
    tokens or finished, with that step's clock reading. The first token observes the time to
    first token (queueing and prefill, preemptions included); each later one the gap since the
    request's previous token (the inter-token latency); finishing observes the end-to-end
    latency and the request's mean time per output token (the decode time over its tokens after
    the first; 0 with one token, as vLLM records it). ``forget`` drops an aborted request without
    observing anything, as vLLM drops it. Seconds are whatever clock the caller reads.
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
        times = self._timed(request_id)
        if got_tokens:
            if times.last_token is None:
                self.histograms["vllm:time_to_first_token_seconds"].observe(now - times.arrival)
                times.first_token = now
            else:
                self.histograms["vllm:inter_token_latency_seconds"].observe(now - times.last_token)
            times.last_token = now
            times.num_tokens += 1
        if finished:
            self.histograms["vllm:e2e_request_latency_seconds"].observe(now - times.arrival)
            decode = (times.last_token - times.first_token) / (times.num_tokens - 1) if times.num_tokens > 1 else 0.0
            self.histograms["vllm:request_time_per_output_token_seconds"].observe(decode)
            del self._requests[request_id]

    def forget(self, request_id: str) -> None:
        """Stop timing an aborted request: nothing is observed for it."""
        self._timed(request_id)
        del self._requests[request_id]

    def _timed(self, request_id: str) -> _RequestTimes:
        times = self._requests.get(request_id)
        if times is None:
            raise RequestStateError(f"request id {request_id!r} was never timed: call arrived() first")
        return times

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        """Per histogram: how many observations, and the exact median, 90th percentile and maximum (seconds)."""
        return {name: {"count": h.count, "p50": h.quantile(0.5), "p90": h.quantile(0.9), "max": h.quantile(1.0)}
                for name, h in self.histograms.items()}

    def prometheus_text(self, labels: dict[str, str]) -> str:
        """The histograms in Prometheus' text format, labelled like the other metrics."""
        return "\n".join(line for h in self.histograms.values() for line in h.prometheus_lines(labels)) + "\n"
