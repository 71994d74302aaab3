"""vLLM's serving metrics, kept as vLLM keeps them and written in Prometheus' text format.

The names, types and help texts are those of vLLM's ``PrometheusStatLogger``
(``vllm/v1/metrics/loggers.py``). Gauges describe the moment (requests running and waiting,
KV cache usage); counters only grow, and Prometheus' exposition adds ``_total`` to their
names, so ``vllm:prefix_cache_hits`` is scraped as ``vllm:prefix_cache_hits_total``. The hit
rate a dashboard shows is ``rate(vllm:prefix_cache_hits_total[5m]) /
rate(vllm:prefix_cache_queries_total[5m])``. Prefix-cache counters are in tokens, and
count only first admissions: a preempted request re-finding its own blocks is not a hit.
"""

from __future__ import annotations

import dataclasses

from kvlab.scheduler import SchedulerStats

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


def _go_float(value: float) -> str:
    """Numbers as Prometheus' Python client writes them: ``3.0``, ``0.25``, ``+Inf``."""
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


def prometheus_text(metrics: EngineMetrics, labels: dict[str, str]) -> str:
    """The metrics in Prometheus' text exposition format (what ``GET /metrics`` returns)."""
    label_text = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))  # sorted, as the client does
    lines = []
    for name, (kind, help_text) in METRICS.items():
        exposed = f"{name}_total" if kind == "counter" else name
        lines += [
            f"# HELP {exposed} {help_text}",
            f"# TYPE {exposed} {kind}",
            f"{exposed}{{{label_text}}} {_go_float(metrics.value(name))}",
        ]
    return "\n".join(lines) + "\n"
