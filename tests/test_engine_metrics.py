"""vLLM's metrics as kvlab keeps and exports them: names, types, help and format as Prometheus' client writes them."""

import pytest

from kvlab.core.cache_stats import PrefixCacheStats
from kvlab.core.sched.output import SchedulerStats
from kvlab.engine.metrics import (
    FINISH_REASONS,
    LATENCY_HISTOGRAMS,
    METRICS,
    REQUEST_SUCCESS_HELP,
    EngineMetrics,
    LatencyMetrics,
    prometheus_text,
)
from kvlab.errors import KvlabValueError, RequestStateError

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
    with pytest.raises(KvlabValueError, match="finish_reason"):
        metrics.record_finished("done")
    with pytest.raises(KvlabValueError, match="finished_reason"):
        metrics.value("vllm:request_success")                 # a labelled counter needs its label


def test_the_text_is_what_prometheus_client_writes_for_the_same_metrics():
    prometheus_client = pytest.importorskip("prometheus_client")
    metrics = EngineMetrics()
    metrics.record(stats(0, 3, 4, 0.75, queries=120, hits=96, preempted=2), num_generated_tokens=5)
    for reason in ("stop", "stop", "abort", "error"):
        metrics.record_finished(reason)
    registry = prometheus_client.CollectorRegistry()
    for name, (kind, help_text) in METRICS.items():
        cls = prometheus_client.Gauge if kind == "gauge" else prometheus_client.Counter
        metric = cls(name, help_text, list(LABELS), registry=registry).labels(**LABELS)
        (metric.set if kind == "gauge" else metric.inc)(metrics.value(name))
    success = prometheus_client.Counter("vllm:request_success", REQUEST_SUCCESS_HELP, [*LABELS, "finished_reason"],
                                        registry=registry)
    for reason in FINISH_REASONS:                               # vLLM creates every series, zeros included
        success.labels(**LABELS, finished_reason=reason).inc(metrics.value("vllm:request_success", reason))
    assert metrics.value("vllm:request_success_total", "stop") == 2 and metrics.request_success["length"] == 0
    expected = [line for line in prometheus_client.generate_latest(registry).decode().splitlines()
                if "_created" not in line]
    assert prometheus_text(metrics, LABELS).splitlines() == expected


def test_latency_histograms_follow_each_request_from_arrival_to_its_last_token():
    latency = LatencyMetrics()
    latency.arrived(["a", "a#1"], now=10.0)                     # a request with n=2 and its second sample
    latency.arrived(["b"], now=10.5)
    latency.tokens("a", got_tokens=True, finished=False, now=11.0)     # prefill done: first tokens
    latency.tokens("a#1", got_tokens=True, finished=False, now=11.0)
    latency.tokens("b", got_tokens=False, finished=False, now=11.0)    # a prefill chunk: no token yet
    latency.tokens("a", got_tokens=True, finished=False, now=11.25)
    latency.tokens("b", got_tokens=True, finished=False, now=11.25)
    latency.tokens("a", got_tokens=True, finished=True, now=12.0)     # preempted in between: a long gap
    h = latency.histograms
    assert h["vllm:time_to_first_token_seconds"].values == [1.0, 1.0, 0.75]
    assert h["vllm:inter_token_latency_seconds"].values == [0.25, 0.75]
    assert h["vllm:e2e_request_latency_seconds"].values == [2.0]
    assert h["vllm:request_time_per_output_token_seconds"].values == [0.5]   # (12.0 - 11.0) / (3 - 1) tokens
    assert list(h) == list(LATENCY_HISTOGRAMS)
    assert latency.summary()["vllm:time_to_first_token_seconds"] == {"count": 3, "p50": 1.0, "p90": 1.0, "max": 1.0}
    assert latency.summary()["vllm:inter_token_latency_seconds"]["p50"] == 0.25
    assert LATENCY_HISTOGRAMS["vllm:time_to_first_token_seconds"][1][-1] == 2560.0     # vLLM's buckets


def test_latency_ids_are_checked_and_a_refused_arrival_changes_nothing():
    latency = LatencyMetrics()
    latency.arrived(["a"], now=0.0)
    with pytest.raises(RequestStateError, match=r"\['a'\]"):
        latency.arrived(["c", "a"], now=1.0)
    with pytest.raises(RequestStateError, match="never timed"):
        latency.tokens("c", got_tokens=True, finished=False, now=1.0)      # "c" was not taken either
    latency.tokens("a", got_tokens=False, finished=True, now=2.0)          # failed before any token
    assert {name: h.values for name, h in latency.histograms.items() if h.count} == {
        "vllm:e2e_request_latency_seconds": [2.0], "vllm:request_time_per_output_token_seconds": [0.0]}
    latency.arrived(["b"], now=3.0)
    latency.forget("b")                                                    # aborted: nothing is observed
    assert sum(h.count for h in latency.histograms.values()) == 2
    with pytest.raises(RequestStateError, match="never timed"):
        latency.forget("b")
    text = latency.prometheus_text(LABELS)
    assert 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="2.0",model_name="tiny"} 1.0' in text
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 0.0' in text
