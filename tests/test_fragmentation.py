"""Contiguous reservation against paging: worked examples, invariants, and the two engines agreeing.

``simulate`` skips the steps in which nothing but growth happens (``kvlab.sim.fragmentation_fast``);
``simulate(..., step_by_step=True)`` walks every step the way the module docstring states the rules (and
the way vLLM's scheduler loop reads: oldest first, ``running.pop()`` when a block is missing),
so the two must agree slot for slot.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.sim.fragmentation import CATEGORIES, reservation, simulate
from kvlab.sim.fragmentation_fast import FirstFit
from kvlab.sim.workloads import alpaca_like, fixed, sharegpt_like
from kvlab.units import cdiv


def check_against_reference(requests, pool_tokens, max_model_len, policy, block_size, seed):
    """The event-driven result is the step-by-step one: every counter, every share of the pool."""
    kw = dict(pool_tokens=pool_tokens, max_model_len=max_model_len, policy=policy, block_size=block_size, seed=seed)
    fast, reference = simulate(requests, **kw), simulate(requests, step_by_step=True, **kw)
    assert dataclasses.replace(fast, breakdown={}, mean_running=0) == dataclasses.replace(
        reference, breakdown={}, mean_running=0)
    assert fast.mean_running == pytest.approx(reference.mean_running)
    for k in CATEGORIES:
        assert fast.breakdown[k] == pytest.approx(reference.breakdown[k], abs=1e-12), k
    return fast


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle", "paged"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_event_driven_simulation_matches_the_step_by_step_reference(policy, block_size):
    requests = sharegpt_like(60, seed=3)
    requests = [(max(1, p // 16), max(1, o // 16)) for p, o in requests]  # keep the reference fast
    check_against_reference(requests, 256, 128, policy, block_size, seed=5)


@given(
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=20),
    extra=st.integers(0, 200), block_size=st.sampled_from([1, 2, 4, 16]),
    policy=st.sampled_from(["max", "pow2", "oracle", "paged"]), seed=st.sampled_from([None, 0, 7]),
)
def test_any_small_workload_matches_the_reference(requests, extra, block_size, policy, seed):
    max_model_len = 96
    pool = cdiv(max_model_len, block_size) * block_size + extra
    result = check_against_reference(requests, pool, max_model_len, policy, block_size, seed)
    assert sum(result.breakdown.values()) == pytest.approx(1.0)
    assert all(v >= 0 for v in result.breakdown.values()) and 0 < result.utilization <= 1


def test_worked_example_max_reserves_twice_what_the_request_needs():
    # Four requests of 8 + 8 tokens, 32-slot reservations in a 64-slot pool: two run, two wait
    # through steps 0..8; each holds 8..16 tokens, reserves 16..0 more, wastes 16 it never fills.
    r = simulate(fixed(4, 8, 8), pool_tokens=64, max_model_len=32, policy="max", seed=None)
    assert r.measured_steps == 9 and r.max_running == 2 and r.num_steps == 18
    assert r.breakdown == pytest.approx({"used": 216 / 576, "reserved": 72 / 576, "internal": 288 / 576,
                                         "external": 0, "free": 0})


def test_worked_example_oracle_and_paged_fit_everything_and_are_measured_over_the_whole_run():
    oracle = simulate(fixed(4, 8, 8), pool_tokens=64, max_model_len=32, policy="oracle")
    assert oracle.max_running == 4 and oracle.num_steps == 9
    assert oracle.breakdown == pytest.approx({"used": 0.75, "reserved": 0.25, "internal": 0, "external": 0,
                                              "free": 0})
    paged = simulate(fixed(4, 8, 8), pool_tokens=64, max_model_len=32, policy="paged", block_size=4)
    # per request: tokens 8..16 over 9 steps (108 slot-steps), blocks 8,12,12,12,12,16,16,16,16 slots (120)
    assert paged.breakdown == pytest.approx({"used": 432 / 576, "reserved": 48 / 576, "internal": 0,
                                             "external": 0, "free": 96 / 576})


def test_worked_example_of_external_fragmentation():
    # Pool of 10: A (3 slots) | B (4) | C (3). A and C leave after step 1: 6 slots free, but
    # as two holes of 3, so D (6 slots) waits until B leaves after step 3.
    requests = [(2, 1), (1, 3), (2, 1), (5, 1)]
    r = simulate(requests, pool_tokens=10, max_model_len=6, policy="oracle", seed=None)
    assert r.breakdown["external"] == pytest.approx(2 * 6 / (4 * 10))
    assert r.measured_steps == 4 and r.num_steps == 6


def test_paged_with_one_token_blocks_wastes_nothing_inside_requests():
    r = simulate(sharegpt_like(300, seed=1), pool_tokens=4096, max_model_len=2048, policy="paged", block_size=1)
    assert r.breakdown["reserved"] == r.breakdown["internal"] == r.breakdown["external"] == 0


def test_oracle_has_no_internal_and_max_no_external_fragmentation():
    requests = sharegpt_like(500, seed=2)
    assert simulate(requests, pool_tokens=8192, max_model_len=2048, policy="oracle").breakdown["internal"] == 0
    # equal reservations in a pool that is a multiple of them leave holes that always fit the next one
    assert simulate(requests, pool_tokens=8192, max_model_len=2048, policy="max").breakdown["external"] == 0


def test_the_source_material_headline_on_a_sharegpt_like_workload():
    requests = sharegpt_like(2000, seed=0)
    util = {p: simulate(requests, pool_tokens=32768, max_model_len=2048, policy=p).utilization
            for p in ("max", "pow2", "oracle", "paged")}
    assert util["max"] < 0.40 and util["paged"] > 0.96
    assert util["max"] < util["pow2"] < util["oracle"] < util["paged"]


def test_paging_batches_more_requests_and_finishes_sooner():
    requests = sharegpt_like(1000, seed=4)
    runs = {p: simulate(requests, pool_tokens=16384, max_model_len=2048, policy=p) for p in ("max", "paged")}
    assert runs["paged"].mean_running > 3 * runs["max"].mean_running
    assert runs["paged"].num_steps < runs["max"].num_steps


def test_same_seed_same_result_and_none_keeps_the_given_order():
    requests = sharegpt_like(400, seed=5)
    kw = dict(pool_tokens=8192, max_model_len=2048, policy="paged")
    assert simulate(requests, seed=3, **kw) == simulate(requests, seed=3, **kw)
    assert simulate(requests, seed=None, **kw) == simulate(list(requests), seed=None, **kw)
    shuffled = [requests[i] for i in np.random.default_rng(3).permutation(len(requests))]
    assert simulate(shuffled, seed=None, **kw) == simulate(requests, seed=3, **kw)


def test_pow2_reservations_round_up_and_stop_at_max_model_len():
    assert list(reservation(np.array([1, 2, 3, 64, 65, 1500, 2048]), "pow2", 2048)) == [1, 2, 4, 64, 128, 2048, 2048]
    assert list(reservation(np.array([1500]), "pow2", 1600)) == [1600]
    assert list(reservation(np.array([5, 9]), "max", 100)) == [100, 100]
    with pytest.raises(KvlabValueError, match="paged"):
        reservation(np.array([5]), "paged", 100)


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 30)), max_size=60))
def test_first_fit_never_overlaps_and_merges_its_holes(ops):
    space, live = FirstFit(100), []
    for allocate, size in ops:
        if allocate or not live:
            expected = next((s for s, n in space.holes if n >= size), None)  # the lowest hole that fits
            start = space.allocate(size)
            assert start == expected
            if start is None:
                continue
            assert start + size <= 100 and not any(s < start + size and start < s + n for s, n in live)
            live.append((start, size))
        else:
            space.release(*live.pop(size % len(live)))
        assert space.free + sum(n for _, n in live) == 100
        assert all(a[0] + a[1] < b[0] for a, b in zip(space.holes, space.holes[1:], strict=False)), space.holes


def test_first_fit_takes_the_lowest_hole_that_fits():
    space = FirstFit(10)
    a, b, c = space.allocate(3), space.allocate(4), space.allocate(3)
    assert (a, b, c) == (0, 3, 7) and space.allocate(1) is None
    space.release(a, 3)
    space.release(c, 3)
    assert space.holes == [[0, 3], [7, 3]] and space.allocate(6) is None and space.allocate(2) == 0
    space.release(0, 2)
    space.release(b, 4)
    assert space.holes == [[0, 10]]


def test_bad_input_is_named():
    ok = dict(pool_tokens=4096, max_model_len=2048, policy="paged")
    with pytest.raises(KvlabValueError, match=r"requests\[1\].*max_model_len=2048"):
        simulate([(10, 10), (2000, 100)], **ok)
    with pytest.raises(KvlabValueError, match="pool_tokens=2000"):
        simulate([(10, 10)], **{**ok, "pool_tokens": 2000})
    with pytest.raises(KvlabValueError, match="blocks of 64"):
        simulate([(10, 10)], **{**ok, "pool_tokens": 2050, "max_model_len": 2050, "block_size": 64})
    with pytest.raises(UnknownNameError, match="policy"):
        simulate([(10, 10)], **{**ok, "policy": "buddy"})
    with pytest.raises(KvlabValueError, match="prompt_len and output_len"):
        simulate([(0, 10)], **ok)
    with pytest.raises(KvlabValueError, match=r"requests\[0\] must be a sequence"):
        simulate([1, 2, 3], **ok)
    with pytest.raises(KvlabValueError, match="at least one"):
        simulate([], **ok)
    with pytest.raises(KvlabValueError, match="seed"):
        simulate([(10, 10)], seed=-1, **ok)


def test_preemption_counts_the_tokens_it_throws_away():
    requests = sharegpt_like(1000, seed=4)
    paged = simulate(requests, pool_tokens=16384, max_model_len=2048, policy="paged")
    assert paged.num_preemptions > 0 and paged.recomputed_tokens > paged.num_preemptions   # whole requests, redone
    assert simulate(requests, pool_tokens=16384, max_model_len=2048, policy="max").recomputed_tokens == 0


def test_short_requests_run_fewer_at_once_with_larger_blocks():
    """Notebook 02's block-size figure: each request holds at least one block, however short it is."""
    requests = alpaca_like(500, seed=0)
    running = [simulate(requests, pool_tokens=16384, max_model_len=2048, policy="paged", block_size=b).mean_running
               for b in (16, 64, 256)]
    assert running == sorted(running, reverse=True) and running[0] > 3 * running[-1]
