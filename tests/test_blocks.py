"""BlockPool and FreeKVCacheBlockQueue as vLLM V1 defines them: worked examples and failure atomicity."""

import pytest

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from kvlab.errors import BlockStateError, KvlabValueError, OutOfBlocksError


def ids(blocks):
    return [b.block_id for b in blocks]


def queue_ids(pool):
    return [(b.block_id, b.block_hash is not None) for b in pool.free_block_queue.get_all_free_blocks()]


def snapshot(pool):
    return (
        [(b.block_id, b.ref_cnt, b.block_hash, b.is_null) for b in pool.blocks],
        ids(pool.free_block_queue.get_all_free_blocks()),
        pool.get_num_free_blocks(),
        {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()},
    )


def test_queue_keeps_order_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4] and q.num_free_blocks == 5
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.prepend_n([blocks[2], blocks[0]])
    assert ids(q.get_all_free_blocks()) == [2, 0, 1, 3, 4]
    assert ids(q.popleft_n(2)) == [2, 0]
    q.append_n([blocks[2], blocks[0]])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2, 0] and q.num_free_blocks == 5


def test_popping_an_empty_queue_says_the_pool_is_out_of_blocks():
    q = FreeKVCacheBlockQueue([])
    with pytest.raises(OutOfBlocksError, match="out of blocks"):
        q.popleft()
    with pytest.raises(OutOfBlocksError, match="out of blocks"):
        FreeKVCacheBlockQueue([KVCacheBlock(0)]).popleft_n(2)


def test_null_block_is_reserved_and_excluded_from_usage():
    pool = BlockPool(10)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 9 and pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(9)
    assert 0 not in ids(blocks) and pool.get_usage() == 1.0


def test_six_block_walk_of_the_source_material():
    # T0: six free blocks, no null block.
    pool = BlockPool(6, reserve_null_block=False)
    # T1: request A takes three blocks from the head; 0 and 1 fill up and are cached.
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and [b.ref_cnt for b in a] == [1, 1, 1]
    pool.cache_full_blocks(a, [b"h0", b"h1"], num_cached_blocks=0, num_full_blocks=2)
    # T2: A finishes; its blocks are freed tail first.
    pool.free_blocks(reversed(a))
    assert queue_ids(pool) == [(2, False), (3, False), (4, False), (5, False), (1, True), (0, True)]
    # T3: request C takes five blocks; reaching block 1 evicts its hash.
    c = pool.get_new_blocks(5)
    assert ids(c) == [2, 3, 4, 5, 1]
    assert pool.blocks[1].block_hash is None and pool.get_cached_block(b"h1") is None
    assert queue_ids(pool) == [(0, True)]
    # (T4, the prefix hit of request B on block 0, is notebook 04's.)
    assert pool.get_cached_block(b"h0") is pool.blocks[0]


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(4, reserve_null_block=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, ["x", "y"], 0, 2)
    pool.free_blocks(reversed(blocks))
    pool.touch([pool.get_cached_block("x")])
    assert pool.blocks[0].ref_cnt == 1 and 0 not in ids(pool.free_block_queue.get_all_free_blocks())
    pool.touch([pool.blocks[0]])
    assert pool.blocks[0].ref_cnt == 2


def test_asking_for_too_many_blocks_changes_nothing():
    pool = BlockPool(5)
    pool.get_new_blocks(2)
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError) as info:
        pool.get_new_blocks(3)
    assert isinstance(info.value, ValueError) and "only 2 are free" in str(info.value)
    assert snapshot(pool) == before


def test_double_free_foreign_and_null_blocks_raise_and_change_nothing():
    pool, other = BlockPool(5), BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks([blocks[0]])
    before = snapshot(pool)
    for bad in ([blocks[1], blocks[0]], [blocks[1], blocks[1]], [other.blocks[1]], [pool.null_block]):
        with pytest.raises(BlockStateError):
            pool.free_blocks(bad)
        assert snapshot(pool) == before
    with pytest.raises(BlockStateError):
        pool.touch([pool.null_block])
    assert snapshot(pool) == before


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, ["a", "b"], 0, 2)
    assert pool.reset_prefix_cache() is False and pool.get_cached_block("a") is not None
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True and pool.get_cached_block("a") is None


def test_bad_sizes_are_refused():
    with pytest.raises(KvlabValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(KvlabValueError, match="num_blocks"):
        BlockPool(4).get_new_blocks(-1)


def test_a_block_listed_twice_returns_to_the_queue_once_where_its_last_reference_drops():
    pool = BlockPool(5, reserve_null_block=False)
    a, b, c = pool.get_new_blocks(3)
    pool.touch([a])  # a is held twice
    pool.free_blocks([a, b, a])
    assert a.ref_cnt == b.ref_cnt == 0
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 0, 3, 4]
    assert pool.get_num_free_blocks() == 4 and c.ref_cnt == 1
