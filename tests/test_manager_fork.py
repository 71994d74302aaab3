"""KVCacheManager.fork and copy_on_write: kvlab's addition for parallel sampling (vLLM V1 has neither)."""

import pytest

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request
from kvlab.errors import KvlabValueError, RequestStateError


def forked_pair(num_blocks=8, num_prompt=6, block_size=4):
    manager = KVCacheManager(num_blocks, block_size, hash_seed="0")
    parent = Request("p", list(range(num_prompt)))
    manager.allocate_slots(parent, num_prompt)
    parent.num_computed_tokens = num_prompt
    child = Request("c", list(range(num_prompt)))
    manager.fork(parent, child)
    child.num_computed_tokens = num_prompt
    return manager, parent, child


def ref_counts(manager, request_id):
    return [manager.block_pool.blocks[b].ref_cnt for b in manager.get_block_ids(request_id)]


def test_fork_shares_every_block_and_its_hashes():
    manager, parent, child = forked_pair()
    assert manager.get_block_ids("c") == manager.get_block_ids("p") == [1, 2]
    assert ref_counts(manager, "p") == [2, 2]
    assert child.block_hashes == parent.block_hashes and len(child.block_hashes) == 1  # one full block of 4


def test_the_first_write_into_a_shared_partial_block_copies_it_and_the_last_writer_keeps_it():
    manager, parent, child = forked_pair()  # 6 tokens: block 1 full, block 2 holds 2 of 4
    assert manager.copy_on_write(parent) == [(2, 3)]
    assert manager.get_block_ids("p") == [1, 3] and ref_counts(manager, "p") == [2, 1]
    assert manager.copy_on_write(child) == []  # block 2 is no longer shared: write in place
    assert manager.get_block_ids("c") == [1, 2] and ref_counts(manager, "c") == [2, 1]


def test_full_blocks_are_never_copied():
    manager, parent, child = forked_pair(num_prompt=8)  # two full blocks: the next token opens a new one
    assert manager.copy_on_write(parent) == [] and manager.copy_on_write(child) == []
    assert ref_counts(manager, "p") == [2, 2]


def test_a_copy_without_a_free_block_returns_none_and_changes_nothing():
    manager, parent, child = forked_pair(num_blocks=3)  # the null block plus the two shared ones
    before = (manager.get_block_ids("p"), manager.block_pool.get_num_free_blocks())
    assert manager.copy_on_write(parent) is None
    assert (manager.get_block_ids("p"), manager.block_pool.get_num_free_blocks()) == before


def test_freeing_both_returns_every_block():
    manager, parent, child = forked_pair()
    manager.copy_on_write(parent)
    manager.free(parent)
    manager.free(child)
    assert manager.usage == 0


def test_bad_forks_are_refused_and_change_nothing():
    manager, parent, child = forked_pair()
    with pytest.raises(RequestStateError, match="already holds blocks"):
        manager.fork(parent, child)
    with pytest.raises(KvlabValueError, match="must start with"):
        manager.fork(parent, Request("other", [9, 9, 9, 9, 9, 9]))
    with pytest.raises(RequestStateError, match="nothing to fork"):
        manager.fork(Request("new", [1]), Request("x", [1]))
    assert ref_counts(manager, "p") == [2, 2] and set(manager.req_to_blocks) == {"p", "c"}
