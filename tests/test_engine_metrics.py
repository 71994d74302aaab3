"""vLLM's metrics as kvlab keeps and exports them: names, types, help and format as Prometheus' client writes them."""

import pytest

from kvlab.cache_stats import PrefixCacheStats
from kvlab.engine.metrics import METRICS, EngineMetrics, prometheus_text
from kvlab.scheduler import SchedulerStats

LABELS = {"model_name": "tiny", "engine": "0"}


def stats(step, running, waiting, usage, queries, hits, preempted, resumed_hits=0):
    prefix = PrefixCacheStats(queries=queries, hits=hits, preempted_hits=resumed_hits)
    return SchedulerStats(step, running, waiting, usage, prefix, preempted, 0, 0, 0, 0)


def test_gauges_are_replaced_and_counters_grow():
    metrics = EngineMetrics()
    metrics.record(stats(0, 2, 1, 0.5, queries=40, hits=32, preempted=0), num_generated_tokens=2)
    metrics.record(stats(1, 1, 2, 0.25, queries=0, hits=0, preempted=1, resumed_hits=16), num_generated_tokens=1)
    assert (metrics.num_requests_running, metrics.num_requests_waiting, metrics.kv_cache_usage_perc) == (1, 2, 0.25)
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits, metrics.num_preemptions) == (40, 32, 1)
    assert metrics.value("vllm:prefix_cache_hits_total") == metrics.value("vllm:prefix_cache_hits") == 32.0
    assert metrics.generation_tokens == 3  # a resumed request's own blocks are not counted as hits


def test_the_text_is_what_prometheus_client_writes_for_the_same_metrics():
    prometheus_client = pytest.importorskip("prometheus_client")
    metrics = EngineMetrics()
    metrics.record(stats(0, 3, 4, 0.75, queries=120, hits=96, preempted=2), num_generated_tokens=5)
    registry = prometheus_client.CollectorRegistry()
    for name, (kind, help_text) in METRICS.items():
        cls = prometheus_client.Gauge if kind == "gauge" else prometheus_client.Counter
        metric = cls(name, help_text, list(LABELS), registry=registry).labels(**LABELS)
        (metric.set if kind == "gauge" else metric.inc)(metrics.value(name))
    expected = [line for line in prometheus_client.generate_latest(registry).decode().splitlines()
                if "_created" not in line]
    assert prometheus_text(metrics, LABELS).splitlines() == expected
