"""A replica's ``/metrics`` through ``prometheus_client``: vLLM 0.33.0's names, types, labels and buckets.

Each ``ReplicaMetrics`` owns its ``CollectorRegistry`` (no global registry), holding one collector
that reads kvlab's own records at scrape time: ``EngineMetrics`` (gauges and counters),
``LatencyMetrics`` (the request latency histograms) and, when recorded, the
``KVCacheMetricsCollector``'s block lifetime histograms in seconds. Names, help texts and buckets
come from ``kvlab.engine.metrics`` and ``kvlab.core.kv_cache_metrics``, which mirror
``vllm/v1/metrics/loggers.py``; labels are vLLM's ``model_name`` and ``engine``. ``prometheus_client``
adds ``_total`` to counters when it writes them, as vLLM's scrape shows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvlab.core.kv_cache_metrics import SECONDS_BUCKETS, Histogram, KVCacheMetricsCollector, prometheus_float
from kvlab.engine.metrics import (
    FINISH_REASONS,
    LATENCY_HISTOGRAMS,
    METRICS,
    REQUEST_SUCCESS_HELP,
    EngineMetrics,
    LatencyMetrics,
)

LABELNAMES = ("model_name", "engine")
KV_BLOCK_HISTOGRAMS = ("vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
                       "vllm:kv_block_reuse_gap_seconds")


def declared_metrics() -> dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]]:
    """Every metric a replica serves: name -> (type, label names, buckets or None)."""
    out: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]] = {
        name: (kind, LABELNAMES, None) for name, (kind, _help) in METRICS.items()}
    out["vllm:request_success"] = ("counter", (*LABELNAMES, "finished_reason"), None)
    out.update({name: ("histogram", LABELNAMES, buckets) for name, (_h, buckets) in LATENCY_HISTOGRAMS.items()})
    out.update({name: ("histogram", LABELNAMES, SECONDS_BUCKETS) for name in KV_BLOCK_HISTOGRAMS})
    return out


class _EngineCollector(Collector):
    def __init__(self, owner: ReplicaMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        o, labels = self.owner, list(self.owner.labelvalues)
        for name, (kind, help_text) in METRICS.items():
            family_cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_cls(name, help_text, labels=list(LABELNAMES))
            family.add_metric(labels, o.engine_metrics.value(name))
            yield family
        success = CounterMetricFamily("vllm:request_success", REQUEST_SUCCESS_HELP,
                                      labels=[*LABELNAMES, "finished_reason"])
        for reason in FINISH_REASONS:
            success.add_metric([*labels, reason], o.engine_metrics.request_success[reason])
        yield success
        for histogram in o.latency.histograms.values():
            yield _family(histogram, labels)
        if o.kv_cache_metrics is not None:
            for name in KV_BLOCK_HISTOGRAMS:
                yield _family(o.kv_cache_metrics.histograms[name], labels)


def _family(histogram: Histogram, labels: list[str]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(histogram.name, histogram.documentation, labels=list(LABELNAMES))
    bounds = [prometheus_float(b) for b in histogram.buckets] + ["+Inf"]
    family.add_metric(labels, list(zip(bounds, histogram.cumulative_counts(), strict=True)), histogram.sum)
    return family


class ReplicaMetrics:
    """One replica's metrics registry: kvlab's records, scraped in vLLM's names.

    ``engine_metrics`` and ``latency`` are the objects the replica updates (an ``LLMEngine``'s own,
    or the fleet simulation's); ``kv_cache_metrics`` adds the block lifetime histograms.
    """

    def __init__(self, model_name: str, engine: int | str = 0, *, engine_metrics: EngineMetrics | None = None,
                 latency: LatencyMetrics | None = None,
                 kv_cache_metrics: KVCacheMetricsCollector | None = None) -> None:
        self.labelvalues = (str(model_name), str(engine))
        self.engine_metrics = engine_metrics if engine_metrics is not None else EngineMetrics()
        self.latency = latency if latency is not None else LatencyMetrics()
        self.kv_cache_metrics = kv_cache_metrics
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(self))

    def exposition(self) -> bytes:
        """The text a Prometheus scrape of ``/metrics`` receives."""
        return generate_latest(self.registry)


_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def parse_scrape(text: str) -> dict[str, float]:
    """A scrape's samples summed over their labels, by sample name (``vllm:prefix_cache_hits_total`` ...)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name = match["name"] if "le=" not in (match["labels"] or "") else f"{match['name']}{{{match['labels']}}}"
        out[name] = out.get(name, 0.0) + float(match["value"])
    return out


def hit_rate_between(before: dict[str, float], after: dict[str, float]) -> float:
    """Seed 002's ``rate(vllm:prefix_cache_hits) / rate(vllm:prefix_cache_queries)`` from two scrapes."""
    queries = after["vllm:prefix_cache_queries_total"] - before.get("vllm:prefix_cache_queries_total", 0.0)
    hits = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0.0)
    return hits / queries if queries else 0.0
