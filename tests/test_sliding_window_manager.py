"""The sliding-window manager keeps exactly the blocks the next token's window reaches, as vLLM 0.33.0 does.

The window convention is the kernel's and transformers': with window W the query at position q
sees keys q - W + 1 .. q. Every rule is checked at its edges, so a block freed one step too
early or too late, a window off by one, or the null block handed out as a real one, fails here.
"""

from __future__ import annotations

import pytest

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request, RequestStatus
from kvlab.core.single_type_kv_cache_manager import SlidingWindowManager
from kvlab.errors import KvlabValueError
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.units import cdiv


def sliding_manager(num_blocks=40, block_size=4, window=8, **kwargs):
    return KVCacheManager(num_blocks, block_size, hash_seed="sw",
                          kv_cache_groups=[SlidingWindowSpec(block_size, sliding_window=window)], **kwargs)


def run_prompt(manager, request, chunk):
    """Admit ``request`` and compute its prompt ``chunk`` tokens at a time; return the tables after each step."""
    hits, n, _ = manager.get_computed_blocks(request)
    first = min(chunk, request.num_tokens - n)
    assert manager.allocate_slots(request, first, n, hits) is not None
    request.num_computed_tokens, request.status = n + first, RequestStatus.RUNNING
    tables = [manager.get_block_ids(request.request_id)]
    while request.num_computed_tokens < request.num_tokens:
        step = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, step) is not None
        request.num_computed_tokens += step
        tables.append(manager.get_block_ids(request.request_id))
    return tables


def expected_nulls(num_computed, window, block_size):
    """Blocks wholly before the next token's window: those ending at or before num_computed - W + 1."""
    skipped = max(0, num_computed - window + 1)
    return skipped // block_size


@pytest.mark.parametrize(("window", "num_computed", "skipped"), [
    (4, 7, 4), (4, 3, 0), (4, 4, 1), (8, 7, 0), (8, 8, 1), (1, 5, 5), (8, 0, 0),
])
def test_skipped_tokens_are_those_before_the_next_tokens_window(window, num_computed, skipped):
    manager = SlidingWindowManager(SlidingWindowSpec(4, sliding_window=window),
                                   KVCacheManager(4, 4).block_pool, 0, True)
    assert manager.get_num_skipped_tokens(num_computed) == skipped


@pytest.mark.parametrize("window", [5, 8, 9, 12])
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_a_block_is_replaced_by_the_null_block_exactly_when_the_window_leaves_it(window, chunk):
    block_size = 4
    manager = sliding_manager(block_size=block_size, window=window)
    request = Request("r", list(range(37)))
    tables = run_prompt(manager, request, chunk)
    for k, table in enumerate(tables):  # call k frees on the k * chunk tokens computed before it
        before = min(k * chunk, request.num_tokens)
        nulls = expected_nulls(before, window, block_size)
        assert table[:nulls] == [0] * nulls, (k, table)
        assert 0 not in table[nulls:], (k, table)  # everything the window reaches is a real block
        assert len(table) == cdiv(min((k + 1) * chunk, request.num_tokens), block_size)


def test_blocks_that_slid_out_are_freed_to_the_queue_and_keep_their_hashes():
    manager = sliding_manager(num_blocks=12, block_size=4, window=8)
    request = Request("r", list(range(40)))
    run_prompt(manager, request, 4)
    table = manager.get_block_ids("r")
    held = [b for b in table if b]
    pool = manager.block_pool
    # 40 tokens computed: the last call freed on 36, so blocks ending at or before 29 went: 7 of them.
    assert table[:7] == [0] * 7 and len(held) == 3
    assert pool.get_num_free_blocks() == pool.num_usable_blocks - 3
    free = [b for b in pool.free_block_queue.get_all_free_blocks()]
    assert sum(b.block_hash is not None for b in free) == 7  # cached, so a later prefix hit can use them
    assert all(pool.blocks[b].ref_cnt == 1 for b in held)


def test_the_null_block_is_never_handed_out_nor_freed():
    manager = sliding_manager(num_blocks=8, block_size=2, window=3)
    null = manager.block_pool.null_block
    for i in range(6):
        request = Request(f"r{i}", [i % 2] * 9 + list(range(7)))  # a pool of 7 blocks for 16 tokens
        hits, n, _ = manager.get_computed_blocks(request)
        new = manager.allocate_slots(request, 2, n, hits)
        assert new is not None and null not in new.blocks[0]
        request.num_computed_tokens, request.status = n + 2, RequestStatus.RUNNING
        while request.num_computed_tokens < request.num_tokens:
            step = min(2, request.num_tokens - request.num_computed_tokens)
            new = manager.allocate_slots(request, step)
            assert null not in new.blocks[0]
            request.num_computed_tokens += step
        for _ in range(5):
            request.append_output_token_ids(1)
            new = manager.allocate_slots(request, 1)
            assert null not in new.blocks[0]
            request.num_computed_tokens += 1
        manager.free(request)
        assert null.ref_cnt == 0 and null not in manager.block_pool.free_block_queue.get_all_free_blocks()
    assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_usable_blocks


@pytest.mark.parametrize(("window", "need"), [(2, 1), (5, 1), (6, 2), (8, 2), (9, 2), (10, 3)])
def test_a_hit_needs_the_blocks_the_window_of_the_next_token_reaches(window, need):
    """cdiv(W - 1, block_size) blocks before the hit's end: the next token sees W - 1 earlier tokens."""
    block_size = 4
    assert SlidingWindowSpec(block_size, sliding_window=window).num_contiguous_blocks_for_hit() == need
    manager = sliding_manager(num_blocks=40, block_size=block_size, window=window)
    prompt = list(range(41))
    first = Request("a", prompt)
    run_prompt(manager, first, 41)  # one chunk: every block was real, and is cached
    manager.free(first)
    pool = manager.block_pool
    blocks = [pool.get_cached_block(h) for h in manager.full_block_hashes(first)]
    # Evict block 10 - need (the block just before the run a hit at 40 tokens needs): the hit at 40 survives.
    pool.evict_blocks([blocks[9 - need].block_id])
    result, n, _ = manager.get_computed_blocks(Request("b", prompt + [7]))
    hits = result.blocks[0]
    assert n == 40 and [b.block_id for b in hits[10 - need:]] == [b.block_id for b in blocks[10 - need:10]]
    assert all(b.is_null for b in hits[:10 - need])
    # Evict the first block of that run too: the hit falls back to where the next full run ends.
    pool.evict_blocks([blocks[10 - need].block_id])
    hits, n, _ = manager.get_computed_blocks(Request("c", prompt + [7]))
    assert n == (9 - need) * block_size


def test_without_a_long_enough_run_the_hit_is_the_cached_run_at_the_start():
    manager = sliding_manager(num_blocks=40, block_size=4, window=16)  # needs cdiv(15, 4) = 4 blocks
    prompt = list(range(33))
    run_prompt(manager, Request("a", prompt), 33)  # one chunk: all eight full blocks are real and cached
    blocks = manager.get_blocks("a")
    manager.block_pool.evict_blocks([blocks[2].block_id, blocks[5].block_id])
    # runs: [0, 1], [3, 4], [6, 7]: none of four; the start's run of two is a hit of 8 tokens
    hits, n, _ = manager.get_computed_blocks(Request("b", prompt))
    assert n == 8 and hits.get_block_ids()[0] == [blocks[0].block_id, blocks[1].block_id]


def test_an_admitted_hit_keeps_only_what_the_window_reaches_and_touches_only_that():
    manager = sliding_manager(num_blocks=40, block_size=4, window=8)
    prompt = list(range(40))
    run_prompt(manager, Request("a", prompt), 40)
    request = Request("b", prompt + [1, 2, 3])
    hits, n, _ = manager.get_computed_blocks(request)
    assert n == 40 and sum(b.is_null for b in hits.blocks[0]) == 8
    before = [b.ref_cnt for b in hits.blocks[0][8:]]
    new = manager.allocate_slots(request, 3, n, hits)
    table = manager.get_blocks("b")
    # 40 tokens hit: the next token (40) sees 33..40, so blocks ending at or before 33 are skipped: 8 of them
    assert [b.is_null for b in table] == [True] * 8 + [False] * 3 and len(new.blocks[0]) == 1
    assert [b.ref_cnt for b in table[8:10]] == [c + 1 for c in before]


def test_a_preempted_request_comes_back_through_its_cached_window():
    manager = sliding_manager(num_blocks=20, block_size=4, window=8)
    request = Request("r", list(range(30)))
    run_prompt(manager, request, 8)
    manager.free(request)  # preempted: everything goes back to the queue, cached
    request.status, request.num_computed_tokens, request.num_preemptions = RequestStatus.PREEMPTED, 0, 1
    hits, n, _ = manager.get_computed_blocks(request)
    assert n == 28  # the last full block before the last token: blocks 5 and 6 survive as the window
    assert manager.allocate_slots(request, 2, n, hits) is not None
    assert manager.prefix_cache_stats.preempted_hits == 28


def test_a_call_that_does_not_fit_frees_only_what_slid_out():
    manager = sliding_manager(num_blocks=6, block_size=4, window=4)
    request = Request("r", list(range(12)))
    run_prompt(manager, request, 12)  # three blocks, nothing freed yet (freeing follows computed tokens)
    assert manager.get_block_ids("r") == [1, 2, 3]
    request.append_output_token_ids(5)
    assert manager.allocate_slots(Request("o", [9] * 8), 8) is not None  # the pool is now full
    # 12 computed: tokens 0..8 are skipped for token 12, so blocks 0 and 1 go, even when the call is refused
    assert manager.allocate_slots(request, 1, reserved_blocks=5) is None
    assert manager.get_block_ids("r") == [0, 0, 3] and manager.block_pool.get_num_free_blocks() == 2
    assert manager.allocate_slots(request, 1) is not None
    assert manager.get_block_ids("r")[:3] == [0, 0, 3]


def test_a_full_sequence_admission_counts_the_window_cap_when_in_flight_tokens_are_known():
    spec = SlidingWindowSpec(4, sliding_window=8)
    # cdiv(min(8 - 1 + 4, max_model_len), 4) + 1 = 4 blocks, whatever the prompt's length
    assert spec.max_admission_blocks_per_request(4, 1000) == 4
    capped = KVCacheManager(7, 4, kv_cache_groups=[spec], max_model_len=1000, max_in_flight_tokens=4)
    uncapped = KVCacheManager(7, 4, kv_cache_groups=[spec], max_model_len=1000)
    for manager in (capped, uncapped):
        request = Request("r", list(range(40)))
        fits = manager.allocate_slots(request, 4, full_sequence_must_fit=True)
        assert (fits is not None) == (manager is capped)


def test_sliding_groups_refuse_what_they_cannot_serve():
    with pytest.raises(KvlabValueError, match="hash_block_size"):
        KVCacheManager(8, 4, hash_block_size=2, kv_cache_groups=[SlidingWindowSpec(4, sliding_window=8)])
    with pytest.raises(KvlabValueError, match="null block"):
        KVCacheManager(8, 4, reserve_null_block=False, kv_cache_groups=[SlidingWindowSpec(4, sliding_window=8)])
    with pytest.raises(KvlabValueError, match="block_size"):
        KVCacheManager(8, 4, kv_cache_groups=[SlidingWindowSpec(8, sliding_window=8)])
    with pytest.raises(KvlabValueError, match="sliding_window"):
        SlidingWindowSpec(4, sliding_window=0)
    with pytest.raises(KvlabValueError, match="verify_hits"):
        KVCacheManager(8, 4, verify_hits=True,
                       kv_cache_groups=[FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=8)])
