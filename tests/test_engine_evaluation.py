"""The helpers that compare kvlab's engine with transformers and time its kernels."""

import torch

from kvlab import kernels
from kvlab.engine.evaluation import kernel_timer, num_agreeing_tokens, relative_error


def test_agreeing_tokens_stop_at_the_first_difference():
    assert num_agreeing_tokens([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert num_agreeing_tokens([1, 2], [1, 2, 3]) == 2 and num_agreeing_tokens([5], [6]) == 0


def test_relative_error_is_a_norm_ratio():
    expected = torch.tensor([3.0, 4.0])
    assert abs(relative_error(expected + torch.tensor([0.0, 0.5]), expected) - 0.1) < 1e-7  # 0.5 / 5
    assert relative_error(expected, expected) == 0.0


def test_the_kernel_timer_counts_calls_and_puts_the_kernels_back():
    originals = (kernels.reshape_and_cache, kernels.paged_attention)
    key = torch.randn(2, 1, 16)
    cache = torch.zeros(2, 4, 1, 16)
    with kernel_timer() as seconds:
        kernels.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 5]))
    assert len(seconds["reshape_and_cache"]) == 1 and seconds["paged_attention"] == []
    assert (kernels.reshape_and_cache, kernels.paged_attention) == originals
    assert torch.equal(cache[1, 1], key[1])  # slot 5 = block 1, offset 1
