"""Seeded workloads: the paper's mean lengths, long tails, the length filter, determinism."""

import numpy as np
import pytest

from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.sim.workloads import (
    alpaca_like,
    fixed,
    length_filter,
    lognormal_mus,
    sharegpt_like,
    summarize,
    validate_requests,
    workload_stats,
)

GENERATORS = {"sharegpt": sharegpt_like, "alpaca": alpaca_like}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_large_samples_have_the_papers_means(name):
    stats = workload_stats(name)
    s = summarize(GENERATORS[name](100_000, seed=0))
    assert s["mean_prompt"] == pytest.approx(stats["mean_prompt"], rel=0.01)
    assert s["mean_output"] == pytest.approx(stats["mean_output"], rel=0.01)


def test_the_stated_means_are_the_papers():
    assert (workload_stats("sharegpt")["mean_prompt"], workload_stats("sharegpt")["mean_output"]) == (161.31, 337.99)
    assert (workload_stats("alpaca")["mean_prompt"], workload_stats("alpaca")["mean_output"]) == (19.31, 58.45)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_lengths_are_long_tailed_and_pass_the_filter(name):
    requests = np.array(GENERATORS[name](20_000, seed=1))
    f = length_filter()
    prompt, output = requests[:, 0], requests[:, 1]
    assert prompt.min() >= f["min_prompt"] and prompt.max() <= f["max_prompt"]
    assert output.min() >= f["min_output"] and (prompt + output).max() <= f["max_total"]
    for column in (prompt, output):  # long tail: the mean sits well above the median
        assert column.mean() > 1.15 * np.median(column)


def test_the_location_parameters_are_solved_not_stored():
    mu_p, mu_o = lognormal_mus("sharegpt")
    s = workload_stats("sharegpt")
    assert "mu_prompt" not in s
    # unfiltered, a log-normal's mean is exp(mu + sigma^2 / 2); the filter cuts the tail, so mu sits a little higher
    assert np.exp(mu_p + s["sigma_prompt"] ** 2 / 2) > s["mean_prompt"]


def test_same_seed_same_requests_different_seed_different_requests():
    assert sharegpt_like(500, seed=3) == sharegpt_like(500, seed=3)
    assert sharegpt_like(500, seed=3) != sharegpt_like(500, seed=4)
    assert len(sharegpt_like(50, seed=3)) == 50 and len(alpaca_like(7, seed=9)) == 7
    assert all(isinstance(x, int) for pair in alpaca_like(10) for x in pair)


def test_fixed_and_empty_workloads():
    assert fixed(3, 100, 20) == [(100, 20)] * 3
    assert sharegpt_like(0) == [] and fixed(0, 1, 1) == []


@pytest.mark.parametrize(("call", "parameter"), [
    (lambda: sharegpt_like(-1), "n"),
    (lambda: alpaca_like(10, seed=-2), "seed"),
    (lambda: fixed(2, 0, 10), "prompt_len"),
    (lambda: fixed(2, 10, 1.5), "output_len"),
])
def test_bad_arguments_are_named(call, parameter):
    with pytest.raises(KvlabValueError, match=parameter):
        call()


def test_validate_requests_refuses_what_is_not_a_length_pair():
    assert validate_requests([(1, 2), (3, 4)]).shape == (2, 2)
    for bad, text in (([(1, 2, 3)], "pairs"), ([(1.5, 2)], r"requests\[0\]\[0\] must be an integer"),
                      ([(3, 0)], r"requests\[0\]"), ([], "at least one"),
                      ([("a", 1)], r"requests\[0\]\[0\] must be an integer")):
        with pytest.raises(KvlabValueError, match=text):
            validate_requests(bad)
    with pytest.raises(UnknownNameError):
        workload_stats("lmsys")
