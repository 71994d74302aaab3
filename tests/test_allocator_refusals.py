"""The allocator refuses by name, and a refused call changes nothing (issue 28 items 12-14, issue 27 item 4)."""

from __future__ import annotations

import pytest

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.core.request import Request
from kvlab.errors import BlockStateError, KvlabValueError, RequestStateError


def state(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (pool.get_num_free_blocks(), [b.ref_cnt for b in pool.blocks], sorted(manager.req_to_blocks),
            sorted(manager._requests), len(pool.cached_block_hash_to_block))


def test_allocating_a_request_another_manager_hashed_is_refused_and_changes_nothing() -> None:
    first, second = KVCacheManager(8, 4), KVCacheManager(8, 4, hash_fn="xxhash")
    request = Request("r", list(range(10)))
    first.get_computed_blocks(request)  # hashed with the first manager's seed and function
    before = state(second)
    with pytest.raises(RequestStateError, match="hashed by another KVCacheManager"):
        second.allocate_slots(request, 10)
    assert state(second) == before  # the free count stays 7 and the request is not tracked
    with pytest.raises(RequestStateError):  # and a retry is refused the same way
        second.allocate_slots(request, 10)


def shared_block(pool: BlockPool) -> list[KVCacheBlock]:
    table = pool.get_new_blocks(2)
    pool.touch([table[1]])  # a second holder: block table[1] is shared
    return table


def test_copy_on_write_refuses_a_free_block_as_the_copy() -> None:
    pool = BlockPool(8)
    table = shared_block(pool)
    free = pool.free_block_queue.get_all_free_blocks()[0]
    with pytest.raises(BlockStateError, match="copy must be a block the caller took"):
        pool.copy_on_write(table, 1, copy=free)
    assert free.ref_cnt == 0 and table[1].ref_cnt == 2


def test_copy_on_write_refuses_a_block_of_another_pool_as_the_copy() -> None:
    pool, other = BlockPool(8), BlockPool(8)
    table = shared_block(pool)
    (foreign,) = other.get_new_blocks(1)
    with pytest.raises(BlockStateError, match="copy must be a block of this pool"):
        pool.copy_on_write(table, 1, copy=foreign)
    assert table[1].ref_cnt == 2


def test_copy_on_write_refuses_an_index_past_the_table_by_name() -> None:
    pool = BlockPool(8)
    table = shared_block(pool)
    free = pool.get_num_free_blocks()
    with pytest.raises(KvlabValueError, match="index must be below len"):
        pool.copy_on_write(table, 5)
    assert pool.get_num_free_blocks() == free


def test_cache_blocks_refuses_a_request_that_holds_no_blocks() -> None:
    manager = KVCacheManager(8, 4)
    with pytest.raises(RequestStateError, match="holds no blocks"):
        manager.cache_blocks(Request("unknown", [1, 2, 3, 4]), 4)


def test_cache_blocks_refuses_tokens_past_what_was_allocated() -> None:
    manager = KVCacheManager(8, 4)
    request = Request("r", list(range(12)))
    manager.allocate_slots(request, 4, delay_cache_blocks=True)  # one block: 4 slots
    before = state(manager)
    with pytest.raises(KvlabValueError, match="num_tokens must be at most the 4 slots"):
        manager.cache_blocks(request, 12)
    assert state(manager) == before
    manager.cache_blocks(request, 4)  # what was allocated is fine
    assert len(manager.block_pool.cached_block_hash_to_block) == 1


def test_a_block_id_must_be_non_negative() -> None:
    with pytest.raises(KvlabValueError, match="block_id"):
        KVCacheBlock(-1)
