"""Plausible wrong answers to notebook 07's exercises, each failing for a reason the checker names."""

import statistics


def compares_means(reuse_gaps, idle_before_evict):
    """Compares averages: one long gap tips it."""
    if not reuse_gaps or not idle_before_evict:
        return False
    return sum(reuse_gaps) / len(reuse_gaps) > sum(idle_before_evict) / len(idle_before_evict)


def interpolated_median(reuse_gaps, idle_before_evict):
    """Uses statistics' quantiles, which average or interpolate between values."""
    if not reuse_gaps or not idle_before_evict:
        return False
    p90 = max(reuse_gaps) if len(reuse_gaps) < 2 else statistics.quantiles(reuse_gaps, n=10, method="inclusive")[-1]
    return p90 > statistics.median(idle_before_evict)


def one_way_swap(model, computed_tokens, hit_tokens):
    """Counts the swap-out only, as if the KV came back for free."""
    swap = model.copy_seconds(computed_tokens)
    return "swap" if swap < model.recompute_seconds(computed_tokens, hit_tokens) else "recompute"


def recompute_without_context(model, computed_tokens, hit_tokens):
    """Prices the recomputed tokens as if they attended to nothing cached."""
    recompute = model.prefill_seconds(computed_tokens - hit_tokens)
    return "swap" if model.swap_seconds(computed_tokens, hit_tokens) < recompute else "recompute"


def numpy_median(reuse_gaps, idle_before_evict):
    """Uses numpy's interpolating percentiles, and returns numpy's bool."""
    import numpy as np

    if not reuse_gaps or not idle_before_evict:
        return np.False_
    return np.percentile(reuse_gaps, 90) > np.median(idle_before_evict)


def ties_to_swap(model, computed_tokens, hit_tokens):
    """Prices both ways right, but lets swap win a tie."""
    swap = model.swap_seconds(computed_tokens, hit_tokens)
    return "swap" if swap <= model.recompute_seconds(computed_tokens, hit_tokens) else "recompute"


def _quantile(bounds, counts, q, interpolate=True):
    rank = q * counts[-1]
    for i, bound in enumerate(bounds):
        if counts[i] >= rank:
            if not interpolate:
                return bound
            lower, below = (bounds[i - 1], counts[i - 1]) if i else (0.0, 0)
            return lower + (bound - lower) * (rank - below) / (counts[i] - below) if counts[i] > below else bound
    return bounds[-1]


def _bucket_rule(bounds, gaps, idle, interpolate=True):
    if not gaps[-1] or not idle[-1]:
        return False
    return _quantile(bounds, gaps, 0.9, interpolate) > _quantile(bounds, idle, 0.5, interpolate)


def upper_bounds(bounds, reuse_gap_counts, idle_counts):
    """Answers each quantile with the upper bound of its bucket, without interpolating."""
    return _bucket_rule(bounds, reuse_gap_counts, idle_counts, interpolate=False)


def counts_per_bucket(bounds, reuse_gap_counts, idle_counts):
    """Reads the cumulative counts as counts per bucket."""
    def cumulate(counts):
        out, total = [], 0
        for c in counts[:-1]:
            total += c
            out.append(total)
        return out + [total]
    return _bucket_rule(bounds, cumulate(reuse_gap_counts), cumulate(idle_counts))


def copies_everything_back(model, computed_tokens, hit_tokens):
    """Swap priced as copying all the KV out and all of it back, blocks still cached on the GPU included."""
    swap = 2 * model.copy_seconds(computed_tokens)
    return "swap" if swap < model.recompute_seconds(computed_tokens, hit_tokens) else "recompute"


WRONG = {
    "07.pool_too_small": [
        (compares_means, "not means"),
        (interpolated_median, "nearest-rank"),
        (numpy_median, "nearest-rank"),
    ],
    "07.pool_too_small_from_buckets": [
        (upper_bounds, "interpolates linearly inside the bucket"),
        (counts_per_bucket, "the bucket counts are cumulative"),
    ],
    "07.swap_or_recompute": [
        (one_way_swap, "swap pays twice"),
        (recompute_without_context, "attend to the cached ones"),
        (ties_to_swap, "a tie goes to recompute"),
        (copies_everything_back, "only computed_tokens - hit_tokens return"),
    ],
}
