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


WRONG = {
    "07.pool_too_small": [
        (compares_means, "not means"),
        (interpolated_median, "nearest-rank"),
    ],
    "07.swap_or_recompute": [
        (one_way_swap, "swap pays twice"),
        (recompute_without_context, "attend to the cached ones"),
    ],
}
