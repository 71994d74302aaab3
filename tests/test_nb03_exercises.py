"""Notebook 03's exercise references agree with kvlab's own Sequence and BlockPool."""

import random

from kvlab.exercises import check, self_test
from kvlab.exercises.nb03 import cow_append
from kvlab.sim.block_scenarios import Op, Scenario, random_workload, record


def test_the_cow_append_reference_is_what_sequence_append_does():
    rng = random.Random(7)
    for _ in range(40):
        workload = random_workload(rng.randrange(1000), num_ops=rng.randint(3, 20), block_size=rng.randint(2, 4))
        steps = record(workload)
        k = rng.randrange(len(steps))
        snap = steps[k].snapshot
        if not snap.tables or not snap.free_queue:
            continue
        name = rng.choice(sorted(snap.tables))
        extended = Scenario("x", "", workload.num_blocks, workload.block_size,
                            workload.ops[:k] + (Op("append", name, (10**6,)),))
        last = record(extended)[-1]
        assert last.error is None
        expected = cow_append({n: list(t) for n, t in snap.tables.items()}, name, snap.num_tokens[name],
                              list(snap.free_queue), snap.block_size)
        assert (list(last.snapshot.tables[name]), list(last.copies)) == expected


def test_a_tuple_answer_is_as_good_as_a_list():
    def as_tuples(tables, name, num_tokens, free, block_size):
        table, copies = cow_append(tables, name, num_tokens, free, block_size)
        return tuple(table), tuple(copies)

    assert check("03.cow_append", as_tuples, seed=3).passed


def test_self_test_values_are_the_sources_numbers():
    quiz = self_test("03")
    v = quiz["03.q1"].values()
    assert (v["blocks_after_fork"], v["blocks_without_sharing"], v["blocks_after_one_token_each"], v["copies"]) == (
        3, 12, 6, 3)
    v = quiz["03.q2"].values()       # V1's way: four requests, full blocks shared through the prefix cache
    assert (v["blocks_v1"], v["hits_v1"], v["computed_v1"]) == (6, [0, 32, 32, 32], 41 + 3 * 9)
    assert (v["blocks_cow"], v["copies_cow"]) == (6, 3)
    assert quiz["03.q3"].values() == {"queue": ["2", "3", "4", "5", "1*", "0*"], "table_c": [2, 3, 4, 5, 1]}


def test_failure_messages_name_each_input_even_with_commas_inside_type_hints():
    def no_copy(tables, name, num_tokens, free, block_size):
        return list(tables[name]), []

    message = check("03.cow_append", no_copy, seed=1).message
    expected = "tables={'A': [0, 1], 'B': [0, 1]}, name='B', num_tokens=6, free=[2, 3, 4], block_size=4"
    assert f"inputs:   {expected}" in message
