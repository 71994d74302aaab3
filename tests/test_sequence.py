"""Sequence: block tables, slot mapping, fork, copy-on-write and release, as worked examples and refusals."""

import pytest

from kvlab.core.block_pool import BlockPool
from kvlab.core.sequence import Sequence, compute_slot_mapping, contents_of
from kvlab.errors import KvlabValueError, OutOfBlocksError, RequestStateError
from kvlab.sim.block_scenarios import snapshot


def refs(pool):
    return {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt > 0 and not b.is_null}


def queue(pool):
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_walk_1_fork_then_copy_on_write_of_the_shared_partial_block():
    # Block size 4, no null block: A holds tokens 0-5 in blocks [0, 1].
    pool = BlockPool(8, reserve_null_block=False)
    a = Sequence(pool, 4)
    assert a.extend(range(6)) == []
    assert a.block_table == [0, 1] and len(a) == 6
    # Fork B: both tables [0, 1], every block referenced twice, still 2 physical blocks.
    b = a.fork()
    assert a.block_table == b.block_table == [0, 1]
    assert refs(pool) == {0: 2, 1: 2}
    # B appends 6: block 1 is shared and partly full, so it is copied to block 2 first.
    assert b.append(6) == [(1, 2)]
    assert (a.block_table, b.block_table) == ([0, 1], [0, 2])
    assert refs(pool) == {0: 2, 1: 1, 2: 1}
    assert a.token_ids() == [0, 1, 2, 3, 4, 5] and b.token_ids() == [0, 1, 2, 3, 4, 5, 6]
    # Release A: B keeps [0, 2]; release B: nothing is live.
    a.release()
    assert b.block_table == [0, 2] and refs(pool) == {0: 1, 2: 1}
    b.release()
    assert refs(pool) == {} and pool.get_num_free_blocks() == 8


def test_the_source_snapshot_table_physical_blocks_2_3_2_0():
    pool = BlockPool(8, reserve_null_block=False)
    a = Sequence(pool, 4)
    a.extend(range(6))
    b = a.fork()
    rows = [(a.block_table, b.block_table, len(refs(pool)), refs(pool))]
    b.append(6)
    rows.append((a.block_table, b.block_table, len(refs(pool)), refs(pool)))
    a.release()
    rows.append((None, b.block_table, len(refs(pool)), refs(pool)))
    b.release()
    rows.append((None, None, len(refs(pool)), refs(pool)))
    assert rows == [
        ([0, 1], [0, 1], 2, {0: 2, 1: 2}),
        ([0, 1], [0, 2], 3, {0: 2, 1: 1, 2: 1}),
        (None, [0, 2], 2, {0: 1, 2: 1}),
        (None, None, 0, {}),
    ]


def test_parallel_sampling_shares_three_blocks_and_copies_only_the_partial_one():
    pool = BlockPool(16)  # block 0 is the null block
    prompt = Sequence(pool, 16)
    prompt.extend(range(40))  # 2 full blocks + 8 tokens in the third
    samples = [prompt] + [prompt.fork() for _ in range(3)]
    assert len(refs(pool)) == 3 and 4 * len(prompt.block_table) == 12
    assert refs(pool) == {1: 4, 2: 4, 3: 4}
    assert samples[0].append(1000) == [(3, 4)]
    assert samples[0].block_table == [1, 2, 4] and refs(pool) == {1: 4, 2: 4, 3: 3, 4: 1}
    copies = [s.append(1000 * (i + 1)) for i, s in enumerate(samples[1:], start=1)]
    assert copies == [[(3, 5)], [(3, 6)], []]  # the last holder of block 3 writes in place
    for i, s in enumerate(samples):
        s.extend(range(1000 * (i + 1) + 1, 1000 * (i + 1) + 13))
        assert s.block_table[:2] == [1, 2]  # the two full prompt blocks are never copied
        assert s.token_ids() == list(range(40)) + list(range(1000 * (i + 1), 1000 * (i + 1) + 13))
    assert refs(pool)[1] == refs(pool)[2] == 4
    for s in samples[:3]:
        s.release()
        assert pool.blocks[1].ref_cnt >= 1 and pool.blocks[2].ref_cnt >= 1
    samples[3].release()
    assert refs(pool) == {}


def test_a_fork_at_a_block_boundary_copies_nothing():
    pool = BlockPool(6, reserve_null_block=False)
    a = Sequence(pool, 4)
    a.extend(range(8))
    b = a.fork()
    assert b.append(8) == [] and b.block_table == [0, 1, 2] and a.block_table == [0, 1]
    assert refs(pool) == {0: 2, 1: 2, 2: 1}


def test_extend_takes_a_block_only_when_the_last_one_is_full():
    pool = BlockPool(8, reserve_null_block=False)
    s = Sequence(pool, 4)
    tables = []
    for token in range(9):
        s.append(token)
        tables.append(len(s.block_table))
    assert tables == [1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert s.extend([]) == [] and len(s) == 9 and s.num_full_blocks == 2


def test_slot_mapping_is_the_kernel_formula():
    # The source's request: 45 tokens in blocks [7, 3, 12] of 16 slots.
    slots = compute_slot_mapping([7, 3, 12], 16, range(45))
    assert slots[:2] == [112, 113] and slots[16] == 48 and slots[44] == 12 * 16 + 12
    assert slots == [[7, 3, 12][p // 16] * 16 + p % 16 for p in range(45)]
    pool = BlockPool(8)
    s = Sequence(pool, 4)
    s.extend(range(6))
    assert s.slot_mapping() == [4, 5, 6, 7, 8, 9] and s.slot_mapping([5, 0]) == [9, 4]
    with pytest.raises(KvlabValueError, match=r"positions must lie in \[0, 6\)"):
        s.slot_mapping([6])
    with pytest.raises(KvlabValueError, match="positions"):
        compute_slot_mapping([1], 4, [-1])


def test_release_frees_tail_first_so_the_prompt_start_is_evicted_last():
    pool = BlockPool(6, reserve_null_block=False)
    s = Sequence(pool, 2)
    s.extend(range(5))  # blocks 0, 1 full, 2 partial
    pool.cache_full_blocks(s.blocks, ["h0", "h1"], 0, 2)
    s.release()
    assert queue(pool) == [2, 3, 4, 5, 1, 0]


def test_running_out_mid_extend_changes_nothing():
    pool = BlockPool(4, reserve_null_block=False)
    a = Sequence(pool, 4)
    a.extend(range(6))
    b = a.fork()
    other = Sequence(pool, 4)
    other.extend(range(4))
    before = snapshot(pool, {"a": a, "b": b, "other": other}, 4)
    # b needs a copy of block 1 plus one more block for 3 tokens; only 1 block is free.
    with pytest.raises(OutOfBlocksError, match="1 new block plus 1 for a copy-on-write copy"):
        b.extend([6, 7, 8])
    with pytest.raises(OutOfBlocksError, match="nothing was written"):
        other.extend(range(10))
    assert snapshot(pool, {"a": a, "b": b, "other": other}, 4) == before
    assert (len(b), b.block_table) == (6, [0, 1])


def test_every_use_after_release_is_refused_and_changes_nothing():
    pool = BlockPool(4)
    s = Sequence(pool, 2)
    s.extend([1, 2, 3])
    s.release()
    before = snapshot(pool, {}, 2)
    for use in (lambda: s.append(1), lambda: s.extend([1]), s.fork, s.release, s.token_ids, s.slot_mapping):
        with pytest.raises(RequestStateError, match="released sequence"):
            use()
    assert snapshot(pool, {}, 2) == before and s.block_table == [] and repr(s) == "Sequence(released)"


def test_bad_input_names_the_parameter_and_changes_nothing():
    pool = BlockPool(4)
    s = Sequence(pool, 2)
    s.extend([5])
    with pytest.raises(KvlabValueError, match="block_size"):
        Sequence(pool, 0)
    with pytest.raises(KvlabValueError, match="pool must be a kvlab BlockPool"):
        Sequence("pool", 2)
    for bad in ([1, -1], [1, "a"], [True]):
        with pytest.raises(KvlabValueError, match="token_ids"):
            s.extend(bad)
    assert s.token_ids() == [5] and s.block_table == [1]


def test_one_pool_has_one_block_size_and_one_contents_store():
    pool = BlockPool(4)
    a, b = Sequence(pool, 2), Sequence(pool, 2)
    assert a.contents is b.contents is contents_of(pool, 2)
    with pytest.raises(KvlabValueError, match="one pool has one block size"):
        Sequence(pool, 4)
    assert contents_of(BlockPool(4), 4) is not a.contents
