"""The hybrid coordinator: one pool for several KV cache groups, and one hit that every group can serve.

A full-attention hit needs every block of the prefix; a sliding-window hit only the blocks its
next token's window reaches; the hybrid hit is the longest prefix all groups accept, found by
0.33.0's fixed point (``HybridKVCacheCoordinator.find_longest_cache_hit``). The fixed point is
checked against a brute force over every length, on random caches.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvlab.core.request import Request, RequestStatus
from kvlab.errors import KvlabValueError, RequestStateError
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

BS = 4


def hybrid(num_blocks=80, windows=(8,), block_size=BS, **kwargs):
    groups = [SlidingWindowSpec(block_size, sliding_window=w) for w in windows] + [FullAttentionSpec(block_size)]
    return KVCacheManager(num_blocks, block_size, hash_seed="hybrid", kv_cache_groups=groups, **kwargs)


def compute_whole(manager, request):
    hits, n, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - n, n, hits) is not None
    request.num_computed_tokens, request.status = request.num_tokens, RequestStatus.RUNNING
    return manager.get_blocks(request.request_id)


def test_every_group_gets_its_own_table_from_the_one_pool():
    manager = hybrid()
    request = Request("r", list(range(21)))
    hits, n, boundary = manager.get_computed_blocks(request)
    assert isinstance(hits, KVCacheBlocks) and hits.get_block_ids() == ([], []) and (n, boundary) == (0, 0)
    new = manager.allocate_slots(request, 21)
    sliding, full = new.get_block_ids()
    assert len(sliding) == len(full) == 6 and not set(sliding) & set(full)
    assert manager.get_block_ids("r") == (sliding, full) == manager.get_block_ids_per_group("r")
    assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_usable_blocks - 12


def test_each_group_keys_the_same_prefix_apart():
    manager = hybrid()
    request = Request("r", list(range(8)))
    compute_whole(manager, request)
    sliding, full = manager.get_blocks("r")
    assert sliding[0].block_hash != full[0].block_hash
    assert sliding[0].block_hash[:-4] == full[0].block_hash[:-4] == request.block_hashes[0]  # + 4-byte group id
    assert (sliding[0].block_hash[-4:], full[0].block_hash[-4:]) == ((0).to_bytes(4, "big"), (1).to_bytes(4, "big"))


def test_the_hit_is_cut_where_the_sliding_window_lost_blocks_and_full_attention_is_trimmed_to_it():
    manager = hybrid(windows=(8,))
    prompt = list(range(41))
    compute_whole(manager, Request("a", prompt))
    sliding, full = manager.get_blocks("a")
    manager.block_pool.evict_blocks([sliding[8].block_id])  # the window of a hit at 40 needs blocks 8 and 9
    hits, n, boundary = manager.get_computed_blocks(Request("b", prompt + [1]))
    # full attention would hit 40 tokens; the window needs 2 blocks in a row: 7 and 6 after the gap -> 32
    assert n == 32 and boundary == 40
    s, f = hits.blocks
    assert [b.is_null for b in s] == [True] * 6 + [False] * 2 and len(f) == 8
    assert [b.block_id for b in f] == [b.block_id for b in full[:8]]


def test_a_full_attention_miss_caps_what_the_window_may_hit():
    manager = hybrid(windows=(8,))
    prompt = list(range(41))
    compute_whole(manager, Request("a", prompt))
    sliding, full = manager.get_blocks("a")
    manager.block_pool.evict_blocks([full[5].block_id])
    hits, n, boundary = manager.get_computed_blocks(Request("b", prompt + [1]))
    assert n == 20 and boundary == 0
    s, f = hits.blocks
    assert [b.block_id for b in s] == [0, 0, 0, sliding[3].block_id, sliding[4].block_id]
    assert [b.block_id for b in f] == [b.block_id for b in full[:5]]


def test_two_windows_and_full_attention_agree_after_several_rounds():
    manager = hybrid(windows=(4, 12))  # the small window needs 1 block, the large one 3
    prompt = list(range(49))
    compute_whole(manager, Request("a", prompt))
    small, large, full = manager.get_blocks("a")
    pool = manager.block_pool
    # Round 1 at 48 tokens: full 48; small needs block 11: 48; large needs 9..11, 10 is gone: 40 (7..9).
    # Round 2 at 40: small needs block 9, gone: 36; large at 36 needs 6..8, 6 is gone: 24 (3..5).
    # Round 3 at 24: every group accepts, the fixed point.
    pool.evict_blocks([large[10].block_id, small[9].block_id, large[6].block_id])
    hits, n, _ = manager.get_computed_blocks(Request("b", prompt))
    assert n == 24 == brute_force_hit(manager, Request("c", prompt), 48)
    assert [len(g) for g in hits.blocks] == [6, 6, 6]


def brute_force_hit(manager, request, limit):
    """The longest multiple of the block size up to ``limit`` that every group accepts, tried one by one."""
    manager.get_computed_blocks(request)  # hashes the request with this manager's seed
    pool = manager.block_pool

    def cached(group_id, index):
        manager_g = manager.coordinator.single_type_managers[group_id]
        return pool.cached_block_hash_to_block.get_one_block(manager_g.cache_key(request.block_hashes[index]))

    for length in range(limit // BS * BS, -1, -BS):
        ok = True
        for g, group in enumerate(manager.kv_cache_groups):
            spec, end = group.kv_cache_spec, length // BS
            start = max(0, end - spec.num_contiguous_blocks_for_hit()) if isinstance(spec, SlidingWindowSpec) else 0
            ok &= all(cached(g, i) is not None for i in range(start, end))
        if ok:
            return length
    return 0


@given(windows=st.lists(st.sampled_from([2, 3, 4, 8, 9, 13]), min_size=1, max_size=2),
       evicted=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 9)), max_size=8))
def test_the_fixed_point_finds_the_longest_prefix_every_group_accepts(windows, evicted):
    manager = hybrid(windows=tuple(windows))
    prompt = list(range(41))
    tables = compute_whole(manager, Request("a", prompt))
    manager.block_pool.evict_blocks([tables[g][i].block_id for g, i in evicted if g < len(tables)])
    request = Request("b", prompt + [5])
    _, n, _ = manager.get_computed_blocks(request)
    assert n == brute_force_hit(manager, request, 41)


def test_a_window_of_one_token_never_hits_as_in_vllm():
    """A one-token window needs no earlier block, so 0.33.0's reachable_block_mask caches none and it never hits."""
    manager = hybrid(windows=(1,))
    prompt = list(range(41))
    compute_whole(manager, Request("a", prompt))
    assert all(b.block_hash is None for b in manager.get_blocks("a")[0])
    assert manager.get_computed_blocks(Request("b", prompt))[1] == 0


def test_a_new_request_needs_per_group_what_its_window_keeps():
    manager = hybrid(windows=(8,))
    prompt = list(range(40))
    compute_whole(manager, Request("a", prompt))
    request = Request("b", prompt + list(range(100, 120)))
    hits, n, _ = manager.get_computed_blocks(request)
    assert n == 40
    c = manager.coordinator
    # full: 15 blocks for 60 tokens, 10 of them hits (held by "a", so not in the free queue): 5 new.
    # sliding: the 33..39 window keeps hits 8 and 9; 5 new for tokens 40..59 (none skipped before computing).
    need = [m.get_num_blocks_to_allocate("b", 60, hits.blocks[i], 40, 40) for i, m in enumerate(c.single_type_managers)]
    assert need == [5, 5]
    new = manager.allocate_slots(request, 20, n, hits)
    assert [len(g) for g in new.blocks] == [5, 5]
    assert [b.is_null for b in manager.get_blocks("b")[0]] == [True] * 8 + [False] * 7


def test_hybrid_managers_refuse_what_needs_one_table():
    manager = hybrid()
    parent = Request("p", list(range(9)))
    compute_whole(manager, parent)
    with pytest.raises(KvlabValueError, match="one KV cache group"):
        manager.fork(parent, Request("c", list(range(9))))
    with pytest.raises(KvlabValueError, match="hash_block_size"):
        hybrid(hash_block_size=2)
    request = Request("x", list(range(9)))
    hits, n, _ = manager.get_computed_blocks(request)
    with pytest.raises(KvlabValueError, match="one list of blocks per KV cache group"):
        manager.allocate_slots(request, 1, n, [hits.blocks[0]])
    with pytest.raises(RequestStateError):
        manager.get_blocks("nobody")


def test_hits_must_be_what_the_lookup_returned_in_every_group():
    manager = hybrid(windows=(8,))
    prompt = list(range(41))
    compute_whole(manager, Request("a", prompt))
    request = Request("b", prompt + [1])
    hits, n, _ = manager.get_computed_blocks(request)
    sliding, full = hits.blocks
    null = manager.block_pool.null_block
    swapped = KVCacheBlocks((full, sliding))  # each group's blocks are keyed with its own id
    holed_window = KVCacheBlocks((sliding[:-1] + [null], full))  # the window's last block must be real
    holed_full = KVCacheBlocks((sliding, [null] + full[1:]))
    for bad in (swapped, holed_window, holed_full):
        with pytest.raises(KvlabValueError, match="not a cached block"):
            manager.allocate_slots(request, 2, n, bad)
    assert "b" not in manager.req_to_blocks
    assert manager.allocate_slots(request, 2, n, hits) is not None
