"""Block lifetime metrics: what vLLM's KVCacheMetricsCollector observes, on worked examples, and a pool that
behaves exactly the same with the collector attached."""

import random

import pytest

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_metrics import (
    SECONDS_BUCKETS,
    STEPS_BUCKETS,
    Histogram,
    KVCacheMetricsCollector,
    diagnose_pool,
    metric_name,
    nearest_rank,
    pool_too_small,
)
from kvlab.errors import KvlabValueError


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _pool(num_blocks=4, **kwargs):
    clock = FakeClock()
    collector = KVCacheMetricsCollector(clock=clock, **kwargs)
    return BlockPool(num_blocks, metrics_collector=collector), collector, clock


def _values(collector, metric, unit="steps"):
    return collector.histogram(metric, unit).values


# ----------------------------------------------------------------- worked examples


def test_one_block_allocated_hit_twice_and_evicted():
    pool, c, clock = _pool()
    (block,) = pool.get_new_blocks(1)                 # step 0, t = 0: a life starts
    pool.cache_full_blocks([block], ["h0"], 0, 1)
    pool.free_blocks([block])
    c.advance(3), setattr(clock, "t", 1.5)
    pool.touch([block])                               # hit at step 3
    pool.free_blocks([block])
    c.advance(2), setattr(clock, "t", 2.0)
    pool.touch([block])                               # hit at step 5
    pool.free_blocks([block])
    c.advance(4), setattr(clock, "t", 7.0)
    pool.get_new_blocks(3)                            # step 9: the free queue gives the block up
    assert (_values(c, "lifetime"), _values(c, "idle_before_evict"), _values(c, "reuse_gap")) == ([9], [4], [2])
    assert _values(c, "lifetime", "seconds") == [7.0] and _values(c, "reuse_gap", "seconds") == [0.5]
    assert _values(c, "idle_before_evict", "seconds") == [5.0]


def test_a_block_never_evicted_is_never_observed_and_a_first_allocation_ends_no_life():
    pool, c, _ = _pool()
    blocks = pool.get_new_blocks(3)
    c.advance(10)
    pool.free_blocks(blocks)
    assert all(h.count == 0 for h in c.histograms.values())
    assert set(c.block_metrics) == {b.block_id for b in blocks}


def test_an_unhashed_block_reused_ends_a_life_too_as_in_vllm():
    pool, c, _ = _pool()
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])                         # no hash: back to the head of the queue
    c.advance()
    assert pool.get_new_blocks(1) == [block]
    assert _values(c, "lifetime") == [1] and _values(c, "idle_before_evict") == [1] and _values(c, "reuse_gap") == []


def test_with_caching_off_no_block_is_ever_evicted_so_no_life_ends_as_in_vllm_0_33():
    collector = KVCacheMetricsCollector()
    pool = BlockPool(4, enable_caching=False, metrics_collector=collector)
    for _ in range(3):
        pool.free_blocks(reversed(pool.get_new_blocks(3)))
    assert collector.histogram("lifetime").count == 0 and len(collector.block_metrics) == 3


def test_only_the_last_four_hits_give_reuse_gaps():
    pool, c, _ = _pool()
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], ["h"], 0, 1)
    pool.free_blocks([block])
    for gap in (1, 2, 3, 4, 5):
        c.advance(gap)
        pool.touch([block])
        pool.free_blocks([block])
    pool.get_new_blocks(3)
    assert _values(c, "reuse_gap") == [3, 4, 5]       # hits at 1, 3, 6, 10, 15: the first is forgotten


def test_reset_prefix_cache_forgets_the_tracked_blocks():
    pool, c, _ = _pool()
    pool.free_blocks(pool.get_new_blocks(2))
    assert c.block_metrics
    assert pool.reset_prefix_cache() and not c.block_metrics


def test_sampling_is_seeded_and_tracks_about_the_rate():
    def tracked(seed):
        pool, c, _ = _pool(num_blocks=2001, sample_rate=0.25, seed=seed)
        pool.get_new_blocks(2000)
        return set(c.block_metrics)

    assert tracked(1) == tracked(1) != tracked(2)
    assert 400 < len(tracked(1)) < 600


@pytest.mark.parametrize("rate", [0, -0.1, 1.5, True])
def test_a_sample_rate_outside_0_1_is_refused(rate):
    with pytest.raises(KvlabValueError, match="sample_rate"):
        KVCacheMetricsCollector(sample_rate=rate)


# ----------------------------------------------------------------- the pool is unchanged by its observer


def _snapshot(pool):
    return ([(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()})


@pytest.mark.parametrize("seed", range(5))
def test_a_pool_with_a_collector_behaves_exactly_like_one_without(seed):
    rng = random.Random(seed)
    plain, observed = BlockPool(12), BlockPool(12, metrics_collector=KVCacheMetricsCollector())
    held = []  # (block ids) held by pretend requests
    for step in range(300):
        op = rng.choice(["get", "get", "free", "touch"])
        if op == "get" and plain.get_num_free_blocks():
            n = rng.randint(1, plain.get_num_free_blocks())
            a, b = plain.get_new_blocks(n), observed.get_new_blocks(n)
            assert [x.block_id for x in a] == [x.block_id for x in b]
            hashes = [f"h{rng.randrange(30)}" for _ in a]
            if len(set(hashes)) == len(hashes):
                plain.cache_full_blocks(a, hashes, 0, len(a))
                observed.cache_full_blocks(b, hashes, 0, len(b))
            held.append([x.block_id for x in a])
        elif op == "free" and held:
            ids = held.pop(rng.randrange(len(held)))
            plain.free_blocks(plain.blocks[i] for i in reversed(ids))
            observed.free_blocks(observed.blocks[i] for i in reversed(ids))
        elif op == "touch":
            h = f"h{rng.randrange(30)}"
            a, b = plain.get_cached_block(h), observed.get_cached_block(h)
            assert (a is None) == (b is None)
            if a is not None:
                plain.touch([a]), observed.touch([b])
                held.append([a.block_id])
        observed.metrics_collector.advance()
        assert _snapshot(plain) == _snapshot(observed), step


# ----------------------------------------------------------------- histograms


def test_histograms_are_named_like_vllms_with_its_buckets():
    c = KVCacheMetricsCollector()
    assert set(c.histograms) == {
        "vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
        "vllm:kv_block_reuse_gap_seconds", "kvlab:kv_block_lifetime_steps",
        "kvlab:kv_block_idle_before_evict_steps", "kvlab:kv_block_reuse_gap_steps"}
    assert c.histogram("lifetime", "seconds").buckets == SECONDS_BUCKETS and SECONDS_BUCKETS[-1] == 1800
    assert c.histogram("reuse_gap").buckets == STEPS_BUCKETS
    assert metric_name("reuse_gap", "seconds") == "vllm:kv_block_reuse_gap_seconds"
    with pytest.raises(KvlabValueError, match="lifetime"):
        c.histogram("age")


def test_prometheus_text_has_cumulative_buckets_sum_and_count():
    h = Histogram("vllm:kv_block_lifetime_seconds", "doc", (1, 5, 10))
    for v in (0.5, 3, 3, 7, 100):
        h.observe(v)
    assert h.cumulative_counts() == [1, 3, 4, 5]
    lines = h.prometheus_lines()
    assert lines[0] == "# HELP vllm:kv_block_lifetime_seconds doc"
    assert lines[1] == "# TYPE vllm:kv_block_lifetime_seconds histogram"
    assert 'vllm:kv_block_lifetime_seconds_bucket{le="5.0"} 3.0' in lines
    assert 'vllm:kv_block_lifetime_seconds_bucket{le="+Inf"} 5.0' in lines
    assert lines[-2:] == ["vllm:kv_block_lifetime_seconds_count 5.0", "vllm:kv_block_lifetime_seconds_sum 113.5"]


@pytest.mark.parametrize("labels", [{}, {"model_name": "tiny", "engine": "0"}])
def test_histogram_text_is_what_prometheus_client_writes(labels):
    prometheus_client = pytest.importorskip("prometheus_client")
    values, buckets = (0.5, 3, 3, 7, 100, 2.25), (1, 5, 10, 2560.0)
    ours = Histogram("vllm:kv_block_lifetime_seconds", "Lifetime of KV blocks.", buckets)
    registry = prometheus_client.CollectorRegistry()
    theirs = prometheus_client.Histogram(ours.name, ours.documentation, list(labels), buckets=buckets,
                                         registry=registry)
    theirs = theirs.labels(**labels) if labels else theirs
    for v in values:
        ours.observe(v)
        theirs.observe(v)
    expected = [line for line in prometheus_client.generate_latest(registry).decode().splitlines()
                if "_created" not in line]
    assert ours.prometheus_lines(labels) == expected


def test_exact_quantiles_are_nearest_rank_and_bucket_quantiles_interpolate_like_prometheus():
    assert nearest_rank([5, 1, 3, 2, 4], 0.5) == 3 and nearest_rank([5, 1, 3, 2, 4], 0.9) == 5
    assert nearest_rank([7], 0.1) == 7 and nearest_rank([], 0.5) is None
    h = Histogram("x", "doc", (1, 5, 10))
    for v in (0.5, 3, 3, 7):
        h.observe(v)
    assert h.histogram_quantile(0.5) == pytest.approx(1 + 4 * (2 - 1) / 2)  # rank 2 falls in (1, 5]
    h.observe(100)
    assert h.histogram_quantile(0.99) == 10                                  # the +Inf bucket: the last bound
    with pytest.raises(KvlabValueError, match="q must be"):
        nearest_rank([1], 0)


# ----------------------------------------------------------------- the diagnostic


def test_the_pool_is_too_small_when_p90_reuse_gap_exceeds_median_idle_before_eviction():
    assert pool_too_small(reuse_gaps=[2, 3, 40], idle_before_evict=[5, 6, 7])      # p90 40 > p50 6
    assert not pool_too_small(reuse_gaps=[2, 3, 4], idle_before_evict=[5, 6, 7])
    assert not pool_too_small(reuse_gaps=[6], idle_before_evict=[6])               # equal is not "exceeds"
    assert not pool_too_small([], [1, 2]) and not pool_too_small([1], [])          # nothing to compare


def test_diagnosis_reads_like_a_sentence():
    d = diagnose_pool([2, 3, 40], [5, 6, 7])
    assert d.too_small and (d.reuse_gap_p90, d.idle_before_evict_p50) == (40, 6)
    assert "too small" in str(d) and "40 steps > median idle before eviction 6 steps" in str(d)
    assert "Not enough to judge" in str(diagnose_pool([], [1]))


def test_the_lifetime_figure_marks_the_two_quantiles_the_diagnostic_compares():
    from kvlab.viz.lifetimes import figure_hit_rates, figure_lifetime_histograms

    c = KVCacheMetricsCollector()
    for v in (2, 3, 40):
        c.histogram("reuse_gap").observe(v)
    for v in (5, 6, 7):
        c.histogram("idle_before_evict").observe(v)
    fig = figure_lifetime_histograms(c, "worked example")
    assert [list(t.x) for t in fig.data if t.type == "histogram"] == [[2, 3, 40], [5, 6, 7]]
    assert [t.name for t in fig.data if t.type == "scatter"] == [
        "p90 reuse gap: 40 steps", "median idle before eviction: 6 steps"]   # named in the legend
    assert [shape.x0 for shape in fig.layout.shapes] == [40, 6] and "too small" in fig.layout.title.text
    bars = figure_hit_rates({"small": {"gpu": 0.4}, "tiered": {"gpu": 0.4, "cpu": 0.3}})
    assert [list(t.y) for t in bars.data] == [[40.0, 40.0], [0.0, 30.0]]
