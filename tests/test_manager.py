"""KVCacheManager as vLLM V1 defines it: the issue's worked examples, isolation, stats, and failure atomicity."""

import pytest

from kvlab.capacity.models import get_model
from kvlab.capacity.sizing import kv_bytes
from kvlab.core.cache_stats import PrefixCacheStats
from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, Request, RequestStatus, find_longest_cache_hit
from kvlab.core.request import MultiModalFeatureSpec, PlaceholderRange
from kvlab.errors import KvlabValueError, RequestStateError, UnknownNameError
from kvlab.sim.collisions import find_block_collision, truncated_hash
from kvlab.sim.prefix_sim import admit
from kvlab.units import MiB


def ids(blocks):
    """The one group's block ids, of a ``KVCacheBlocks`` (what the manager returns) or of a block table."""
    return blocks.get_block_ids()[0] if isinstance(blocks, KVCacheBlocks) else [b.block_id for b in blocks]


def free_queue(manager):
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def snapshot(manager):
    pool = manager.block_pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        free_queue(manager),
        {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()},
        {r: ids(b) for r, b in manager.req_to_blocks.items()},
        dict(manager.num_cached_block),
        manager.prefix_cache_stats,
        manager.num_evicted_blocks,
    )


def tokens(start, n):
    return list(range(start, start + n))


# ----------------------------------------------------------------- the worked examples


def test_eleven_block_pool_shares_a_prefix_and_frees_in_the_documented_order():
    manager = KVCacheManager(num_blocks=11, block_size=16)
    shared = tokens(1, 48)
    req0 = Request("0", shared + tokens(1000, 7))
    assert admit(manager, req0) == 0 and manager.get_block_ids("0") == [1, 2, 3, 4]
    req1 = Request("1", shared + tokens(2000, 5))
    computed, num_computed, _ = manager.get_computed_blocks(req1)
    assert ids(computed) == [1, 2, 3] and num_computed == 48
    new = manager.allocate_slots(req1, 5, 48, computed)
    assert ids(new) == [5] and manager.get_block_ids("1") == [1, 2, 3, 5]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    manager.free(req0)
    manager.free(req1)
    assert free_queue(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


def test_six_block_walk_second_half_b_hits_block_0_misses_block_1_and_waits():
    manager = KVCacheManager(num_blocks=6, block_size=16, reserve_null_block=False)
    a = Request("A", tokens(0, 40))  # two full blocks and a partial one
    assert admit(manager, a) == 0 and manager.get_block_ids("A") == [0, 1, 2]
    manager.free(a)
    c = Request("C", tokens(5000, 70))
    assert admit(manager, c) == 0
    assert manager.get_block_ids("C") == [2, 3, 4, 5, 1]  # block 1's hash is evicted on the way
    assert manager.num_evicted_blocks == 1
    b = Request("B", tokens(0, 32) + tokens(9000, 8))  # A's first two blocks, then its own tokens
    computed, num_computed, _ = manager.get_computed_blocks(b)
    assert ids(computed) == [0] and num_computed == 16  # block 0 survived at the tail; block 1 did not
    before = snapshot(manager)
    # B needs block 0 out of the free queue plus two new blocks; one block is free.
    assert manager.allocate_slots(b, 24, 16, computed) is None
    assert snapshot(manager) == before  # nothing changed: block 0 is still free and still cached
    manager.free(c)
    computed, num_computed, _ = manager.get_computed_blocks(b)
    new = manager.allocate_slots(b, 24, num_computed, computed)
    assert ids(computed) == [0] and len(ids(new)) == 2 and manager.get_block_ids("B")[0] == 0
    assert manager.num_blocks_evicted_before_reuse == 1  # block 1's content came back and had to be recomputed


@pytest.mark.parametrize("system_len, expected_hit, expected_computed", [(2000, 2000, 50), (2005, 2000, 55)])
def test_system_prompt_of_2000_tokens_is_125_blocks_and_only_full_blocks_hit(system_len, expected_hit,
                                                                            expected_computed):
    manager = KVCacheManager(num_blocks=300, block_size=16)
    system = tokens(10, system_len)
    admit(manager, Request("first", system + tokens(50_000, 50)))
    second = Request("second", system + tokens(60_000, 50))
    num_hits = admit(manager, second)
    assert len(second.block_hashes) == (system_len + 50) // 16
    assert num_hits == expected_hit == 125 * 16
    assert second.num_tokens - num_hits == expected_computed
    shared = manager.get_block_ids("first")[:125]
    assert manager.get_block_ids("second")[:125] == shared
    assert all(manager.block_pool.blocks[i].ref_cnt == 2 for i in shared)


def test_shared_blocks_of_llama_3_70b_hold_625_mib_once():
    assert kv_bytes(get_model("llama-3-70b"), 125 * 16, "bf16") == 625 * MiB


def test_a_fully_cached_prompt_still_computes_its_last_block():
    manager = KVCacheManager(num_blocks=300, block_size=16)
    system = tokens(10, 2000)
    admit(manager, Request("first", system))
    num_hits = admit(manager, Request("again", system))
    assert num_hits == 1984  # at most num_tokens - 1 = 1999 tokens, in whole blocks: 124
    num_hits = admit(manager, Request("plus-one", system + [7]))
    assert num_hits == 2000


def test_find_longest_cache_hit_stops_at_the_first_miss_and_at_max_length():
    cached = {"a": "A", "b": "B", "d": "D"}
    assert find_longest_cache_hit(["a", "b", "c", "d"], 100, 4, cached.get) == ["A", "B"]
    assert find_longest_cache_hit(["a", "b", "c", "d"], 7, 4, cached.get) == ["A"]


# ----------------------------------------------------------------- what must not be shared


def test_timestamp_first_hits_nothing_timestamp_after_hits_every_instruction_block():
    manager = KVCacheManager(num_blocks=200, block_size=16, hash_seed="t")
    rules = tokens(100, 480)  # 30 blocks of fixed instructions

    def prompt(stamp, first):
        stamp_tokens, question = tokens(stamp, 8), tokens(90_000 + stamp, 24)
        return (stamp_tokens + rules if first else rules + stamp_tokens) + question

    admit(manager, Request("t1-first", prompt(1, True)))
    assert admit(manager, Request("t2-first", prompt(2, True))) == 0
    admit(manager, Request("t1-after", prompt(1, False)))
    assert admit(manager, Request("t2-after", prompt(2, False))) == 480


@pytest.mark.parametrize("kwargs", [{"cache_salt": "tenant-b"}, {"lora_name": "sql-adapter"}])
def test_same_tokens_with_another_salt_or_adapter_do_not_hit(kwargs):
    manager = KVCacheManager(num_blocks=100, block_size=16)
    prompt = tokens(0, 200)
    admit(manager, Request("plain", prompt))
    other = Request("other", prompt, **kwargs)
    assert admit(manager, other) == 0
    assert admit(manager, Request("same", prompt, **kwargs)) == 192  # same salt / adapter: hits again


def test_a_lora_and_a_salt_of_one_value_do_not_share_block_0_nor_two_adapters_of_one_name():
    manager = KVCacheManager(num_blocks=100, block_size=16)
    prompt = tokens(0, 40)
    admit(manager, Request("salted", prompt, cache_salt="x"))
    assert admit(manager, Request("adapter", prompt, lora_name="x")) == 0  # tagged: ("lora", ..) != ("cache_salt", ..)
    assert admit(manager, Request("adapter moved", prompt, lora_name="x", lora_path="/other/x")) == 0
    assert admit(manager, Request("adapter again", prompt, lora_name="x")) == 32


def test_images_behind_identical_placeholders_do_not_share_blocks():
    manager = KVCacheManager(num_blocks=100, block_size=16)
    prompt = tokens(0, 20) + [7] * 40 + tokens(100, 20)  # 40 placeholder tokens from position 20

    def with_image(rid, image):
        return Request(rid, prompt, mm_features=[MultiModalFeatureSpec(image, PlaceholderRange(20, 40))])

    admit(manager, with_image("cat", "sha:cat"))
    assert admit(manager, with_image("dog", "sha:dog")) == 16  # block 0 (before the image) only
    assert admit(manager, with_image("cat-again", "sha:cat")) == 64


def test_a_second_manager_refuses_a_request_hashed_by_the_first():
    first, second = KVCacheManager(10, 4), KVCacheManager(10, 4)
    request = Request("r", tokens(0, 9))
    first.get_computed_blocks(request)
    with pytest.raises(RequestStateError, match="another KVCacheManager"):
        second.get_computed_blocks(request)


def test_sha256_managers_agree_by_default_xxhash_managers_only_when_they_share_a_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)

    def hashes(**kwargs):
        request = Request("r", tokens(0, 40))
        KVCacheManager(20, 16, **kwargs).get_computed_blocks(request)
        return request.block_hashes

    assert hashes(hash_seed="42") == hashes(hash_seed="42")
    assert hashes(hash_seed="42") != hashes(hash_seed="43")
    assert hashes(hash_seed="42", hash_fn="xxhash") != hashes(hash_seed="42")
    assert hashes() == hashes()  # 0.33.0: SHA-256 seeds every chain with the fixed "vllm-none-hash"
    assert hashes() == hashes(hash_seed="vllm-none-hash")
    assert hashes(hash_fn="xxhash") != hashes(hash_fn="xxhash")  # xxhash: a secret random seed per manager


# ----------------------------------------------------------------- decode, caching as blocks fill, preemption


def test_output_tokens_are_hashed_and_cached_as_their_block_fills():
    manager = KVCacheManager(num_blocks=20, block_size=4)
    request = Request("r", tokens(0, 6))
    admit(manager, request)
    assert len(request.block_hashes) == 1 and manager.num_cached_block["r"] == 1
    for t in (100, 101):
        request.append_output_token_ids(t)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    assert len(request.block_hashes) == 2 and manager.num_cached_block["r"] == 2
    follow_up = Request("next", list(request.all_token_ids) + [5, 6])
    assert manager.get_computed_blocks(follow_up)[1] == 8  # the block finished by output tokens hits too


def test_preempted_request_frees_keeps_hashes_and_recomputes_through_its_own_cache():
    manager = KVCacheManager(num_blocks=20, block_size=4)
    request = Request("r", tokens(0, 10))
    admit(manager, request)
    request.append_output_token_ids([50, 51])
    manager.free(request)  # preemption: blocks back, full ones keep their hashes
    request.status, request.num_computed_tokens = RequestStatus.PREEMPTED, 0
    request.num_preemptions += 1
    num_hits = admit(manager, request)
    assert num_hits == 8 and request.num_computed_tokens == 12
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.preempted_requests, stats.preempted_queries,
            stats.preempted_hits) == (1, 10, 1, 12, 8)


# ----------------------------------------------------------------- statistics


def test_stats_count_tokens_at_admission_once_and_the_hit_rate_covers_a_window():
    manager = KVCacheManager(num_blocks=8, block_size=4, hit_rate_window=2)
    first = Request("a", tokens(0, 12))
    admit(manager, first)
    big = Request("big", tokens(0, 8) + tokens(100, 20))
    for _ in range(3):  # looked up three times while it cannot fit: counted once, when admitted
        hits, n, _ = manager.get_computed_blocks(big)
        assert n == 8 and manager.allocate_slots(big, big.num_tokens - n, n, hits) is None
    assert manager.prefix_cache_stats.requests == 1
    manager.free(first)
    admit(manager, big)
    assert (manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits) == (40, 8)
    assert manager.hit_rate == 8 / 40
    manager.free(big)
    admit(manager, Request("c", tokens(500, 5)))  # window of 2 requests: 'a' drops out
    assert manager.hit_rate == 8 / 33
    assert manager.prefix_cache_stats.queries >= manager.prefix_cache_stats.hits
    interval = manager.make_prefix_cache_stats()
    assert interval.requests == 3 and manager.make_prefix_cache_stats().requests == 0


def test_one_record_per_admission_feeds_the_since_start_and_the_per_step_stats(monkeypatch):
    """vLLM records an admitted lookup once (``record_prefix_cache_stats``); kvlab's totals add the steps up."""
    records = []
    real_record = PrefixCacheStats.record
    monkeypatch.setattr(PrefixCacheStats, "record", lambda self, *a, **k: (records.append(a), real_record(self, *a)))
    manager = KVCacheManager(num_blocks=8, block_size=4)
    admit(manager, Request("a", tokens(0, 12)))
    assert len(records) == 1
    step = manager.make_prefix_cache_stats()
    admit(manager, Request("b", tokens(0, 9)))
    assert len(records) == 2 and (step.requests, step.queries, step.hits) == (1, 12, 0)
    total = manager.prefix_cache_stats
    assert (total.requests, total.queries, total.hits) == (2, 21, 8)   # both steps, the open one included
    assert manager.make_prefix_cache_stats().queries == 9 and manager.prefix_cache_stats.queries == 21


def test_reset_prefix_cache_waits_for_every_request_to_free_its_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    request = Request("r", tokens(0, 9))
    admit(manager, request)
    assert manager.reset_prefix_cache() is False and manager.block_pool.cached_block_hash_to_block
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert not manager.block_pool.cached_block_hash_to_block and manager.caching_metrics.empty
    assert admit(manager, Request("again", tokens(0, 9))) == 0


def test_caching_disabled_hashes_nothing_and_never_hits():
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    for rid in ("a", "b"):
        request = Request(rid, tokens(0, 9))
        assert admit(manager, request) == 0 and request.block_hashes == []
    assert manager.prefix_cache_stats.requests == 0


# ----------------------------------------------------------------- collisions and the per-hit guard


def test_a_weak_hash_lets_a_request_read_another_requests_block_unless_hits_are_verified():
    weak = truncated_hash("sha256", bits=16)
    for verify in (False, True):
        manager = KVCacheManager(num_blocks=10, block_size=16, hash_fn=weak, hash_seed="0", verify_hits=verify)
        collision = find_block_collision(weak, 16, manager.none_hash, seed=0)
        admit(manager, Request("A", list(collision.tokens_a) + [1, 2, 3]))
        b = Request("B", list(collision.tokens_b) + [1, 2, 3])
        hits, num_hits, _ = manager.get_computed_blocks(b)
        if verify:
            assert num_hits == 0 and manager.num_rejected_hits == 1
        else:  # B's first block differs from A's, yet B would attend over A's K and V
            assert ids(hits) == manager.get_block_ids("A")[:1] and num_hits == 16
        strong = KVCacheManager(num_blocks=10, block_size=16, hash_seed="0")
        admit(strong, Request("A", list(collision.tokens_a) + [1, 2, 3]))
        assert strong.get_computed_blocks(Request("B", list(collision.tokens_b) + [1, 2, 3]))[1] == 0


def test_verified_hits_still_hit_when_contents_agree():
    manager = KVCacheManager(num_blocks=10, block_size=4, verify_hits=True)
    admit(manager, Request("a", tokens(0, 10), lora_name="x"))
    assert admit(manager, Request("b", tokens(0, 10), lora_name="x")) == 8 and manager.num_rejected_hits == 0


# ----------------------------------------------------------------- bad calls raise and change nothing


def test_bad_calls_raise_a_kvlab_error_and_change_nothing():
    manager = KVCacheManager(num_blocks=12, block_size=4)
    live = Request("live", tokens(0, 10))
    admit(manager, live)
    other = Request("other", tokens(0, 10))
    hits, n, _ = manager.get_computed_blocks(other)
    reversed_hits = KVCacheBlocks((hits.blocks[0][::-1],))
    before = snapshot(manager)
    bad_calls = [
        (lambda: manager.allocate_slots(live, 0), KvlabValueError, "num_new_tokens"),
        (lambda: manager.allocate_slots(other, 3, n, hits), KvlabValueError, "pass its end"),
        (lambda: manager.allocate_slots(other, 2, 4, hits), KvlabValueError, "num_new_computed_tokens"),
        (lambda: manager.allocate_slots(other, 2, 8, reversed_hits), KvlabValueError, "new_computed_blocks"),
        (lambda: manager.allocate_slots(live, 1, 8, hits), RequestStateError, "admission"),
        (lambda: manager.allocate_slots(Request("live", tokens(0, 3)), 3), RequestStateError, "unique"),
        (lambda: manager.allocate_slots(live, 1, num_lookahead_tokens=-1), KvlabValueError, "num_lookahead"),
        (lambda: manager.get_block_ids("nobody"), RequestStateError, "holds no blocks"),
        (lambda: manager.allocate_slots("live", 1), KvlabValueError, "kvlab Request"),
    ]
    for call, error, text in bad_calls:
        with pytest.raises(error, match=text):
            call()
        assert snapshot(manager) == before


def test_allocating_for_a_freed_or_finished_request_raises():
    manager = KVCacheManager(num_blocks=12, block_size=4)
    request = Request("r", tokens(0, 10))
    admit(manager, request)
    manager.free(request)
    manager.free(request)  # freeing twice does nothing, as in vLLM
    before = snapshot(manager)
    with pytest.raises(RequestStateError, match="was freed"):
        manager.allocate_slots(request, 1)
    request.status = RequestStatus.FINISHED_STOPPED
    with pytest.raises(RequestStateError, match="finished"):
        manager.get_computed_blocks(request)
    with pytest.raises(RequestStateError, match="no more tokens"):
        request.append_output_token_ids(3)
    assert snapshot(manager) == before


def test_unknown_hash_function_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="sha256, sha256_cbor, xxhash, xxhash_cbor"):
        KVCacheManager(10, 16, hash_fn="md5")
