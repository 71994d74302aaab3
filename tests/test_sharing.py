"""Parallel sampling on kvlab's allocator: the blocks a shared prompt saves, counted step by step."""

import pytest

from kvlab.errors import KvlabValueError
from kvlab.sim.sharing import parallel_sampling_saving
from kvlab.sim.workloads import alpaca_like
from kvlab.units import cdiv


def test_one_request_by_hand():
    # 40-token prompt, blocks of 16: blocks 0-1 full and shared by all 4 samples; block 2 (8 tokens) is copied
    # by the first three writers and kept by the last; each sample then writes 4 tokens (positions 40..43).
    r = parallel_sampling_saving([(40, 4)], n=4, block_size=16)
    assert r.num_copies == 3
    assert r.shared_block_steps == 4 * (2 + 4)                          # 2 shared + 4 private tail blocks
    assert r.unshared_block_steps == 4 * 4 * cdiv(44, 16)
    assert r.saving == pytest.approx(1 - 24 / 48)


def test_one_sample_shares_nothing_and_more_samples_save_more():
    requests = alpaca_like(200, seed=1)
    savings = [parallel_sampling_saving(requests, n).saving for n in (1, 2, 4, 6)]
    assert savings[0] == 0 and savings == sorted(savings) and savings[-1] < 1


def test_bad_arguments_are_refused():
    with pytest.raises(KvlabValueError, match="n must be"):
        parallel_sampling_saving([(4, 4)], n=0)
    with pytest.raises(KvlabValueError, match="requests"):
        parallel_sampling_saving([], n=2)


def test_the_papers_figures_are_read_from_the_data():
    from kvlab.sim.workloads import paper_results

    results = paper_results()
    assert results["kv_token_states_percent"]["Orca (Oracle)"] == 38.2
    assert results["memory_saving_percent"]["beam search, Alpaca"] == [37.6, 55.2]
    results["kv_token_states_percent"].clear()
    assert paper_results()["kv_token_states_percent"]                  # a copy: the data stays as read
