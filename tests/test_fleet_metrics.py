"""A replica's /metrics: its own registry, vLLM's names as a scrape shows them, seed 002's hit rate from two scrapes."""

from __future__ import annotations

from kvlab.fleet.metrics import ReplicaMetrics, hit_rate_between, parse_scrape


def test_two_replicas_keep_separate_registries_and_label_their_engine():
    a, b = ReplicaMetrics("tiny", 0), ReplicaMetrics("tiny", 1)
    a.engine_metrics.prefix_cache_queries = 10
    text_a, text_b = a.exposition().decode(), b.exposition().decode()
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 10.0' in text_a
    assert 'vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 0.0' in text_b


def test_the_hit_rate_is_the_ratio_of_the_counters_increase_between_scrapes():
    m = ReplicaMetrics("tiny")
    m.engine_metrics.prefix_cache_queries, m.engine_metrics.prefix_cache_hits = 100, 90
    before = parse_scrape(m.exposition().decode())
    m.engine_metrics.prefix_cache_queries, m.engine_metrics.prefix_cache_hits = 300, 110
    after = parse_scrape(m.exposition().decode())
    assert hit_rate_between(before, after) == 20 / 200  # not 110 / 300: a rate, not the totals
    assert after["vllm:time_to_first_token_seconds_count"] == 0
