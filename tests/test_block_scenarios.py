"""Recorded scenarios: the walks reproduce the source, replay equals recording, refusals change nothing."""

import pytest

from kvlab.core.hashing import hash_token_blocks
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.sim.block_scenarios import (
    SCENARIOS,
    Op,
    Scenario,
    get_scenario,
    parallel_sampling,
    random_workload,
    record,
    step_at,
    walk_fork,
    walk_free_queue,
)


def test_walk_1_snapshots_are_the_source_table():
    steps = record(walk_fork())
    rows = [(dict(s.snapshot.tables), s.snapshot.num_live_blocks, s.snapshot.ref_counts) for s in steps[2:]]
    assert rows == [
        ({"A": (0, 1), "B": (0, 1)}, 2, {0: 2, 1: 2}),
        ({"A": (0, 1), "B": (0, 2)}, 3, {0: 2, 1: 1, 2: 1}),
        ({"B": (0, 2)}, 2, {0: 1, 2: 1}),
        ({}, 0, {}),
    ]
    assert steps[3].copies == ((1, 2),) and "copy-on-write" in steps[3].text
    assert steps[3].snapshot.token_ids == {"A": tuple(range(6)), "B": tuple(range(7))}


def test_walk_2_free_queue_lifo_lru_and_eviction():
    steps = record(walk_free_queue())
    assert steps[1].snapshot.tables == {"A": (0, 1, 2)}
    assert [b.state for b in steps[2].snapshot.blocks][:3] == ["in use"] * 3
    assert steps[3].snapshot.free_queue_labels == ["2", "3", "4", "5", "1*", "0*"]
    assert steps[4].snapshot.tables == {"C": (2, 3, 4, 5, 1)}
    assert steps[4].snapshot.free_queue_labels == ["0*"] and steps[4].snapshot.blocks[1].block_hash is None
    assert list(steps[4].snapshot.cached_index.values()) == [(0,)]
    assert "evicts" in steps[4].text


def test_parallel_sampling_three_shared_blocks_and_one_copy_per_sample_but_the_last():
    steps = record(parallel_sampling())
    after_forks = steps[4].snapshot
    assert after_forks.num_live_blocks == 3 and sum(len(t) for t in after_forks.tables.values()) == 12
    assert [s.copies for s in steps[5:9]] == [((3, 4),), ((3, 5),), ((3, 6),), ()]
    for step in steps[5:-1]:
        assert all(t[:2] == (1, 2) for t in step.snapshot.tables.values())
    assert steps[-1].snapshot.num_live_blocks == 0


def test_replaying_any_prefix_gives_the_recorded_step():
    for scenario in (walk_fork(), walk_free_queue(), parallel_sampling(), random_workload(3), random_workload(8)):
        steps = record(scenario)
        assert len(steps) == len(scenario) + 1 and steps[0].op is None
        for k in (0, len(scenario) // 2, len(scenario)):
            assert step_at(scenario, k) == steps[k]


def test_a_refused_step_changes_nothing_and_says_so():
    scenario = Scenario("tiny", "", num_blocks=3, block_size=2, ops=(
        Op("start", "A", (1, 2, 3)), Op("start", "B", (4, 5, 6)), Op("release", "A"), Op("append", "A", (7,)),
    ))
    steps = record(scenario)
    assert steps[2].error.startswith("OutOfBlocksError") and steps[2].snapshot == steps[1].snapshot
    assert steps[4].error.startswith("RequestStateError") and steps[4].snapshot == steps[3].snapshot
    assert "Nothing changed" in steps[4].text


def test_random_workloads_are_seeded_and_differ_by_seed():
    assert random_workload(5) == random_workload(5)
    assert random_workload(5).ops != random_workload(6).ops
    kinds = {op.kind for seed in range(4) for op in random_workload(seed).ops}
    assert kinds == {"start", "append", "extend", "fork", "cache", "release"}


def test_every_named_scenario_builds_and_unknown_names_are_listed():
    assert [get_scenario(name).name.split(" (seed")[0] for name in SCENARIOS] == list(SCENARIOS)
    with pytest.raises(UnknownNameError, match="walk 1"):
        get_scenario("walk 3")


def test_bad_operations_and_indices_are_refused():
    with pytest.raises(UnknownNameError, match="kind"):
        Op("write", "A")
    with pytest.raises(KvlabValueError, match="parent"):
        Op("fork", "B")
    with pytest.raises(KvlabValueError, match="exactly one token"):
        Op("append", "A", (1, 2))
    with pytest.raises(KvlabValueError, match="index must be between 0 and 5"):
        step_at(walk_fork(), 6)


def test_stand_in_hashes_cover_full_blocks_only_and_chain():
    hashes = hash_token_blocks(list(range(10)), 4)
    assert len(hashes) == 2 and hashes[0] == hash_token_blocks([0, 1, 2, 3], 4)[0]
    assert hash_token_blocks([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != hashes[1]  # a different prefix
