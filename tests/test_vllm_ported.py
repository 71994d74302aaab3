"""vLLM's own allocator tests, ported onto kvlab with their expected values kept.

From ``tests/v1/core/test_prefix_caching.py`` and ``tests/v1/core/test_kv_cache_utils.py``
(the closest revisions the project's search index holds: 003df29 and 002f10e). Both predate
0.33.0's tagged extra keys; where they expect bare keys (``("hash1", 0)``, ``("salt1",)``),
the port expects 0.33.0's tagged ones (``("mm", "hash1", 0)``, ``("cache_salt", "salt1")``),
which ``tests/vllm`` confirms against the installed vLLM 0.33.0. Adaptations: vLLM's
``KVCacheBlocks`` (one list per group) is a list, ``get_block_ids()`` a list, block hashes
carry no group id, and kvlab's ``BlockPool.cache_full_blocks`` takes the hashes instead of
the request. Tests that cannot pass, with the deliberate difference each hits:

* ``test_prefill_plp``, ``test_prefix_cache_stats_disabled``: kvlab has no prompt logprobs
  (``skip_reading_prefix_cache``) and always keeps its stats;
* the hybrid, sliding-window, Mamba, EAGLE, DCP and multi-group tests: one full-attention group;
* the KV-event tests (``test_kv_cache_events*``, ``test_block_stored_event*``,
  ``test_emit_cached_block_events*``, ``test_null_parent_block_hash``): kvlab emits no KV events;
* ``test_generate_block_hash_extra_keys_prompt_embeds*``: kvlab has no prompt embeddings;
* ``test_get_kv_cache_configs*`` and the other memory-planning tests: ``kvlab.capacity``'s domain.
"""

from __future__ import annotations

import pytest

from kvlab.core import hashing
from kvlab.core.block_pool import BlockHashToBlockMap, BlockPool
from kvlab.core.cache_stats import CachingMetrics, PrefixCacheStats
from kvlab.core.hashing import generate_block_hash_extra_keys, hash_block_tokens, sha256, sha256_cbor
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, KVCacheBlocks
from kvlab.core.request import MultiModalFeatureSpec, PlaceholderRange, Request
from kvlab.errors import OutOfBlocksError

SEED = "vllm-none-hash"  # 0.33.0's default seed: kvlab's chain starts where vLLM's does


def make_request(request_id, prompt_token_ids, mm_positions=None, mm_hashes=None, cache_salt=None):
    features = [MultiModalFeatureSpec(mm_hashes[j] if mm_hashes else f"hash_{j}", p)
                for j, p in enumerate(mm_positions or [])]
    return Request(request_id, prompt_token_ids, mm_features=features, cache_salt=cache_salt)


def manager(num_blocks, block_size=16, enable_caching=True, hash_fn="sha256"):
    return KVCacheManager(num_blocks, block_size, enable_caching, hash_fn, hash_seed=SEED)


def ids(blocks):
    """The one group's block ids, of a ``KVCacheBlocks`` (what the manager returns) or of a block table."""
    return blocks.get_block_ids()[0] if isinstance(blocks, KVCacheBlocks) else [b.block_id for b in blocks]


def nblocks(blocks):
    """How many blocks the one group of a ``KVCacheBlocks`` holds."""
    return len(blocks.blocks[0])


def free_ids(m):
    return ids(m.block_pool.free_block_queue.get_all_free_blocks())


NONE_HASH = sha256(SEED)


# ----------------------------------------------------------------- test_prefix_caching.py


@pytest.mark.parametrize("hash_fn", [sha256, sha256_cbor])
def test_prefill(hash_fn):
    m = manager(11, hash_fn=hash_fn)
    common_token_ids = [i for i in range(3) for _ in range(16)]
    all_token_ids = common_token_ids + [3] * 7
    req0 = make_request("0", all_token_ids)
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req0)
    assert len(req0.block_hashes) == 3 and not computed_blocks and num_computed_tokens == 0
    blocks = m.allocate_slots(req0, 55, nblocks(computed_blocks) * 16, computed_blocks)
    assert ids(blocks) == [1, 2, 3, 4]
    parent_block_hash = None
    none_hash = hash_fn(SEED)
    for block_id in (1, 2, 3):
        block_tokens = tuple(all_token_ids[(block_id - 1) * 16: block_id * 16])
        block_hash = hash_fn((parent_block_hash or none_hash, block_tokens, None))
        assert m.block_pool.blocks[block_id].block_hash == block_hash
        assert m.block_pool.blocks[block_id].ref_cnt == 1
        parent_block_hash = block_hash
    assert m.block_pool.blocks[4].block_hash is None and m.block_pool.blocks[4].ref_cnt == 1

    req1 = make_request("1", common_token_ids + [3] * 5)
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req1)
    assert len(req1.block_hashes) == 3 and ids(computed_blocks) == [1, 2, 3] and num_computed_tokens == 48
    blocks = m.allocate_slots(req1, 53 - 48, nblocks(computed_blocks) * 16, computed_blocks)
    assert ids(blocks) == [5]
    assert all(block.ref_cnt == 2 for block in computed_blocks.blocks[0])
    assert m.block_pool.free_block_queue.num_free_blocks == 5
    m.free(req0)
    m.free(req1)
    assert m.block_pool.free_block_queue.num_free_blocks == 10
    assert free_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    req2 = make_request("2", common_token_ids + [3] * 6)
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req2)
    assert ids(computed_blocks) == [1, 2, 3] and num_computed_tokens == 48
    blocks = m.allocate_slots(req2, 53 - 48, nblocks(computed_blocks) * 16, computed_blocks)
    assert ids(blocks) == [5]  # reuse partial [5]
    assert m.block_pool.free_block_queue.num_free_blocks == 6
    assert all(b.ref_cnt == 0 for b in m.block_pool.free_block_queue.get_all_free_blocks())
    m.free(req2)

    req3 = make_request("3", [99] * (16 * 10))
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req3)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = m.allocate_slots(req3, 16 * 10, nblocks(computed_blocks) * 16, computed_blocks)
    assert ids(blocks) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]  # also the eviction order
    queue = m.block_pool.free_block_queue
    assert queue.num_free_blocks == 0
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head


def test_decode():
    m = manager(11)
    req0 = make_request("0", [i for i in range(3) for _ in range(16)] + [3] * 7)
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req0)
    assert ids(m.allocate_slots(req0, 55, nblocks(computed_blocks) * 16, computed_blocks)) == [1, 2, 3, 4]
    req0.num_computed_tokens = 55
    for _ in range(4):
        req0.append_output_token_ids(8)
    new_blocks = m.allocate_slots(req0, 4, 0, [])
    assert new_blocks is not None and nblocks(new_blocks) == 0
    assert m.req_to_blocks[req0.request_id][-1].block_hash is None
    req0.num_computed_tokens = 59
    for _ in range(9 + 10):  # 9 tokens fill the previous block, 10 go into the next
        req0.append_output_token_ids(7)
    new_blocks = m.allocate_slots(req0, 19, 0, [])
    assert new_blocks is not None and nblocks(new_blocks) == 1
    assert m.req_to_blocks[req0.request_id][-2].block_hash is not None
    assert m.req_to_blocks[req0.request_id][-1].block_hash is None


def test_evict():
    m = manager(11)
    last_token_id = 5 * 16 + 7
    req0 = make_request("0", list(range(last_token_id)))
    assert nblocks(m.allocate_slots(req0, 5 * 16 + 7)) == 6  # 5 full + 1 partial
    req1 = make_request("1", list(range(last_token_id, last_token_id + 3 * 16)))
    assert nblocks(m.allocate_slots(req1, 3 * 16)) == 3
    assert m.block_pool.free_block_queue.num_free_blocks == 1
    m.free(req0)
    assert free_ids(m) == [6, 10, 5, 4, 3, 2, 1]  # partial blocks at the head, the rest at the tail (LRU)
    m.free(req1)
    assert free_ids(m) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    req2 = make_request("2", list(range(2 * 16 + 3)))
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req2)
    assert ids(computed_blocks) == [1, 2] and num_computed_tokens == 2 * 16
    assert ids(m.allocate_slots(req2, 3, nblocks(computed_blocks) * 16, computed_blocks)) == [6]
    assert m.block_pool.free_block_queue.num_free_blocks == 7


def test_hash_block_correct_reuse():
    m = manager(2)
    req = make_request("0", list(range(16)))
    assert nblocks(m.allocate_slots(req, 16)) == 1
    m.free(req)
    req = make_request("1", list(range(15)))
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req)
    assert not computed_blocks and num_computed_tokens == 0
    blocks = m.allocate_slots(req, 15)
    assert nblocks(blocks) == 1 and m.block_pool.blocks[ids(blocks)[0]].block_hash is None


def test_computed_blocks_not_evicted():
    m = manager(3)
    req0 = make_request("0", list(range(16)))
    assert ids(m.allocate_slots(req0, 16)) == [1]
    req1 = make_request("1", list(range(16, 32)))
    assert ids(m.allocate_slots(req1, 16)) == [2]
    m.free(req0)
    m.free(req1)
    req2 = make_request("2", list(range(32)))
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req2)
    assert ids(computed_blocks) == [1] and num_computed_tokens == 16
    assert ids(m.allocate_slots(req2, 16, 16, computed_blocks)) == [2]  # evicts block 2, not the hit


def test_basic_prefix_caching_disabled():
    m = manager(5, block_size=4, enable_caching=False)
    req1 = make_request("1", list(range(10)))
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req1)
    assert not computed_blocks and num_computed_tokens == 0
    assert nblocks(m.allocate_slots(req1, 10)) == 3
    m.free(req1)
    req2 = make_request("2", list(range(16)))
    assert m.get_computed_blocks(req2)[:2] == (m.empty_kv_cache_blocks, 0)
    assert nblocks(m.allocate_slots(req2, 16)) == 4
    req3 = make_request("3", list(range(4)))
    assert m.get_computed_blocks(req3)[:2] == (m.empty_kv_cache_blocks, 0)
    assert not m.allocate_slots(req3, 4)


@pytest.mark.parametrize("hash_fn", [sha256, sha256_cbor])
def test_cache_blocks(hash_fn):
    block_pool = BlockPool(5, enable_caching=True)
    req = make_request("0", list(range(14)))
    block_hashes = hashing.get_request_block_hasher(4, hash_fn, hash_fn(SEED))(req)
    blocks = block_pool.get_new_blocks(2)
    block_pool.cache_full_blocks(blocks, block_hashes, 0, 2, block_size=4)
    assert len(block_pool.cached_block_hash_to_block) == 2
    assert all(block.block_hash is not None for block in blocks)
    blocks += block_pool.get_new_blocks(1)
    block_pool.cache_full_blocks(blocks, block_hashes, 2, 3, block_size=4)
    assert len(block_pool.cached_block_hash_to_block) == 3
    assert blocks[0].block_hash is not None


def test_mm_prefix_caching():
    m = manager(11)
    common_token_ids = list(range(10)) + [-1] * 6
    common_token_ids += [-1] * 4 + list(range(10, 20)) + [-1] * 2
    common_token_ids += [-1] * 16
    common_token_ids = [t % 1000 for t in common_token_ids]  # kvlab refuses negative token ids
    common_mm_positions = [PlaceholderRange(offset=11, length=10), PlaceholderRange(offset=30, length=18)]
    all_token_ids = common_token_ids + [999] * 7 + [100] * 4
    req0 = make_request("0", all_token_ids, common_mm_positions + [PlaceholderRange(offset=48, length=7)],
                        ["aaa", "bbb", "ccc"])
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req0)
    assert not computed_blocks and num_computed_tokens == 0
    block_hashes = req0.block_hashes
    assert len(block_hashes) == 3
    assert block_hashes[0] == sha256((NONE_HASH, tuple(all_token_ids[:16]), (("mm", "aaa", 11),)))
    assert block_hashes[1] == sha256((block_hashes[0], tuple(all_token_ids[16:32]),
                                      (("mm", "aaa", -5), ("mm", "bbb", 14))))
    assert block_hashes[2] == sha256((block_hashes[1], tuple(all_token_ids[32:48]), (("mm", "bbb", -2),)))
    assert ids(m.allocate_slots(req0, 59, 0, computed_blocks)) == [1, 2, 3, 4]
    req0.num_computed_tokens = 59
    for _ in range(5):
        req0.append_output_token_ids(8)
    new_blocks = m.allocate_slots(req0, 5, 0, [])
    assert new_blocks is not None and nblocks(new_blocks) == 0
    assert len(block_hashes) == 4
    assert block_hashes[3] == sha256((block_hashes[2], tuple(all_token_ids[48:] + [8] * 5), (("mm", "ccc", 0),)))
    req1 = make_request("1", common_token_ids + [999] * 7 + [200] * 5,
                        common_mm_positions + [PlaceholderRange(offset=48, length=7)], ["aaa", "bbb", "ccc"])
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req1)
    assert nblocks(computed_blocks) == 3 and num_computed_tokens == 48


def test_cache_key_salting():
    m = manager(11)
    common_token_ids = [i for i in range(3) for _ in range(16)]
    token_ids = common_token_ids + [3] * 11
    req0 = make_request("0", token_ids, cache_salt="salt1")
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req0)
    assert not computed_blocks and num_computed_tokens == 0
    block_hashes = req0.block_hashes
    assert block_hashes[0] == sha256((NONE_HASH, tuple(token_ids[:16]), (("cache_salt", "salt1"),)))
    assert block_hashes[1] == sha256((block_hashes[0], tuple(token_ids[16:32]), None))
    assert block_hashes[2] == sha256((block_hashes[1], tuple(token_ids[32:48]), None))
    assert ids(m.allocate_slots(req0, 59, 0, computed_blocks)) == [1, 2, 3, 4]
    req0.num_computed_tokens = 59
    for _ in range(5):
        req0.append_output_token_ids(8)
    assert nblocks(m.allocate_slots(req0, 5, 0, [])) == 0
    assert block_hashes[3] == sha256((block_hashes[2], tuple(token_ids[48:] + [8] * 5), None))
    req1 = make_request("1", common_token_ids + [4] * 11, cache_salt="salt1")
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req1)
    assert nblocks(computed_blocks) == 3 and num_computed_tokens == 48
    token_ids = common_token_ids + [4] * 11
    req2 = make_request("2", token_ids, cache_salt="salt2")
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req2)
    assert nblocks(computed_blocks) == 0 and num_computed_tokens == 0
    assert req2.block_hashes[0] == sha256((NONE_HASH, tuple(token_ids[:16]), (("cache_salt", "salt2"),)))


def test_prefill_not_enough_free_blocks_with_computed_blocks():
    m = manager(11)
    common_token_ids = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", common_token_ids)
    m.allocate_slots(req0, 48)
    block_part0 = m.req_to_blocks[req0.request_id]
    req1 = make_request("1", common_token_ids * 2)
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req1)
    assert computed_blocks.blocks[0] == block_part0 and num_computed_tokens == 48
    m.allocate_slots(req1, 48, 48, computed_blocks)
    block_part1 = m.req_to_blocks[req1.request_id]
    m.free(req1)
    assert {block.ref_cnt for block in block_part1[:3]} == {1}
    assert {block.ref_cnt for block in block_part1[3:]} == {0}
    req2 = make_request("2", [7] * 16 * 2)
    m.allocate_slots(req2, 32)
    assert m.block_pool.free_block_queue.num_free_blocks == 5
    req3 = make_request("3", common_token_ids * 3)
    computed_blocks, num_computed_tokens, _ = m.get_computed_blocks(req3)
    assert computed_blocks.blocks[0] == block_part1 and num_computed_tokens == 6 * 16
    assert m.allocate_slots(req3, 48, nblocks(computed_blocks) * 16, computed_blocks) is None
    assert {block.ref_cnt for block in block_part1[:3]} == {1}
    assert {block.ref_cnt for block in block_part1[3:]} == {0}


def test_reset_prefix_cache():
    m = manager(11)
    full_block_token_ids = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", full_block_token_ids + [3] * 7)
    assert ids(m.allocate_slots(req0, 55)) == [1, 2, 3, 4]
    req1 = make_request("1", full_block_token_ids + [4] * 7)
    computed_blocks, _, _ = m.get_computed_blocks(req1)
    assert len(req1.block_hashes) == 3 and nblocks(computed_blocks) == 3
    assert ids(m.allocate_slots(req1, 7, nblocks(computed_blocks) * 16, computed_blocks)) == [5]
    assert not m.reset_prefix_cache()
    assert m.block_pool.cached_block_hash_to_block
    m.free(req0)
    m.free(req1)
    assert m.reset_prefix_cache()
    assert not m.block_pool.cached_block_hash_to_block
    assert all(blk.block_hash is None for blk in m.block_pool.blocks)


def test_maybe_evict_cached_block():
    pool = BlockPool(4, enable_caching=True, reserve_null_block=False)  # vLLM: block 0 reserved, but filled by hand
    block_hash0, block_hash1, block_hash2 = b"10", b"20", b"30"
    for block, block_hash in zip(pool.blocks, [block_hash0, block_hash1, block_hash2, block_hash0], strict=True):
        block.set_block_hash(block_hash)
        pool.cached_block_hash_to_block.insert(block_hash, block)
    block0, block1, block2, block3 = pool.blocks

    def index():
        return {h: list(d) for h, d in pool.cached_block_hash_to_block.items()}

    assert index() == {block_hash0: [0, 3], block_hash1: [1], block_hash2: [2]}
    pool._remove_cached_block_hashes(block1)
    assert index() == {block_hash0: [0, 3], block_hash2: [2]}
    pool._remove_cached_block_hashes(block0)  # block3 still holds block_hash0
    assert index() == {block_hash0: [3], block_hash2: [2]}
    pool._remove_cached_block_hashes(block2)
    assert index() == {block_hash0: [3]}
    pool._remove_cached_block_hashes(block3)
    assert index() == {}


def test_block_lookup_cache_single_block_per_key():
    cache = BlockHashToBlockMap()
    key0, key1, key2 = b"hash0", b"hash1", b"hash2"
    block0, block1 = KVCacheBlock(0), KVCacheBlock(1)
    assert cache.get_one_block(key0) is None and cache.get_one_block(key1) is None
    cache.insert(key0, block0)
    assert cache.get_one_block(key0) is block0 and cache.get_one_block(key1) is None
    cache.insert(key1, block1)
    assert cache.get_one_block(key0) is block0 and cache.get_one_block(key1) is block1
    assert cache.pop(key0, 100) is None  # block id mismatch
    assert cache.get_one_block(key0) is block0
    assert cache.pop(key0, 0) is block0
    assert cache.get_one_block(key0) is None and cache.get_one_block(key1) is block1
    assert cache.pop(key0, 1) is None
    assert cache.pop(key1, 1) is block1
    assert cache.get_one_block(key1) is None and cache.get_one_block(key2) is None


def test_block_lookup_cache_multi_blocks_per_key():
    cache = BlockHashToBlockMap()
    key0, key1 = b"hash0", b"hash1"
    block00, block01, block10, block11 = KVCacheBlock(0), KVCacheBlock(1), KVCacheBlock(10), KVCacheBlock(11)
    for key, block in [(key0, block00), (key0, block01), (key1, block10), (key1, block11)]:
        cache.insert(key, block)
    assert cache.get_one_block(key0) is block00
    assert cache.pop(key0, 0) is block00
    assert cache.get_one_block(key0) is block01
    assert cache.pop(key0, 1) is block01
    assert cache.get_one_block(key0) is None and cache.pop(key0, 2) is None
    assert cache.get_one_block(key1) is block10
    assert cache.pop(key1, 10) is block10 and cache.get_one_block(key1) is block11
    assert cache.pop(key1, 11) is block11 and cache.get_one_block(key1) is None and cache.pop(key1, 12) is None


# ----------------------------------------------------------------- test_kv_cache_utils.py


@pytest.mark.parametrize("hash_fn", [sha256, sha256_cbor])
def test_none_hash(monkeypatch, hash_fn):
    monkeypatch.setattr(hashing, "NONE_HASH", hashing.NONE_HASH)  # restored afterwards
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    none_hash = hashing.init_none_hash(hash_fn)
    assert isinstance(none_hash, bytes) and none_hash != b""
    assert none_hash == hash_fn(hashing.DEFAULT_NONE_HASH_SEED)
    assert hashing.init_none_hash(hash_fn) == none_hash  # deterministic across re-initialization
    monkeypatch.setenv("PYTHONHASHSEED", "python hash seed")
    assert hashing.init_none_hash(hash_fn) == hash_fn("python hash seed") == hashing.NONE_HASH


@pytest.mark.parametrize("non_crypto_fn", [hashing.xxhash, hashing.xxhash_cbor])
def test_none_hash_seed_random_for_non_crypto(monkeypatch, non_crypto_fn):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    seeds = {hashing.resolve_none_hash_seed(non_crypto_fn, None) for _ in range(5)}
    assert len(seeds) == 5 and hashing.DEFAULT_NONE_HASH_SEED not in seeds
    assert hashing.resolve_none_hash_seed(non_crypto_fn, "12345") == "12345"  # PYTHONHASHSEED, as kvlab's argument


@pytest.mark.parametrize("hash_fn", [sha256, sha256_cbor])
def test_none_hash_seed_deterministic_for_crypto(hash_fn):
    seed = hashing.resolve_none_hash_seed(hash_fn, None)
    assert seed == hashing.DEFAULT_NONE_HASH_SEED == hashing.resolve_none_hash_seed(hash_fn, None)


def test_kv_cache_block():
    block = KVCacheBlock(block_id=0)
    assert block.block_id == 0 and block.ref_cnt == 0 and block.block_hash is None
    block.ref_cnt += 1
    assert block.ref_cnt == 1
    block.ref_cnt -= 1
    block.set_block_hash(b"abc")
    assert block.block_hash == b"abc"
    block.reset_hash()
    assert block.block_hash is None


def test_kv_cache_block_uses_slots():
    block = KVCacheBlock(block_id=0)
    assert not hasattr(block, "__dict__")
    with pytest.raises(AttributeError):
        block.unexpected_field = True


def test_free_kv_cache_block_queue_initialization():
    block = KVCacheBlock(block_id=0)
    queue = FreeKVCacheBlockQueue([block])
    assert queue.num_free_blocks == 1
    assert queue.fake_free_list_head.next_free_block is block
    assert queue.fake_free_list_tail.prev_free_block is block


def test_free_kv_cache_block_queue_operations():
    blocks = [KVCacheBlock(block_id=i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert queue.fake_free_list_head.next_free_block is blocks[0]
    assert queue.fake_free_list_tail.prev_free_block is blocks[4]
    assert queue.popleft() == blocks[0] and queue.num_free_blocks == 4
    queue.remove(blocks[2])
    assert queue.num_free_blocks == 3 and blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    queue.append(blocks[2])
    assert queue.num_free_blocks == 4 and queue.fake_free_list_tail.prev_free_block is blocks[2]
    assert blocks[2].prev_free_block is blocks[4] and blocks[2].next_free_block is queue.fake_free_list_tail
    for _ in range(4):
        queue.popleft()
    assert queue.num_free_blocks == 0
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    with pytest.raises(OutOfBlocksError):  # vLLM: ValueError("No free blocks available"); kvlab's is one
        queue.popleft()


def test_free_kv_cache_block_queue_append_n_and_prepend_n():
    queue = FreeKVCacheBlockQueue([])
    blocks = [KVCacheBlock(block_id=i) for i in range(6)]
    queue.append_n([])
    assert queue.num_free_blocks == 0
    queue.append_n(blocks[0:1])
    queue.append_n(blocks[4:6])
    queue.append_n(blocks[1:4])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 4, 5, 1, 2, 3]
    assert blocks[3].next_free_block is queue.fake_free_list_tail
    queue = FreeKVCacheBlockQueue([b := KVCacheBlock(0)])
    more = [KVCacheBlock(i) for i in range(1, 6)]
    queue.prepend_n([])
    queue.prepend_n(more[3:5])
    assert [x.block_id for x in queue.get_all_free_blocks()] == [4, 5, 0] and b.next_free_block is \
        queue.fake_free_list_tail
    queue.prepend_n(more[0:2])
    assert [queue.popleft().block_id for _ in range(5)] == [1, 2, 4, 5, 0]


def test_free_kv_cache_block_queue_popleft_n():
    blocks = [KVCacheBlock(block_id=i) for i in range(6)]
    queue = FreeKVCacheBlockQueue([blocks[1], blocks[3], blocks[5], blocks[4], blocks[0], blocks[2]])
    assert len(queue.popleft_n(0)) == 0 and queue.num_free_blocks == 6
    assert queue.popleft_n(1) == [blocks[1]] and queue.num_free_blocks == 5
    assert queue.popleft_n(2) == [blocks[3], blocks[5]] and queue.num_free_blocks == 3
    popped = queue.popleft_n(3)
    assert popped == [blocks[4], blocks[0], blocks[2]] and queue.num_free_blocks == 0
    assert all(b.prev_free_block is None and b.next_free_block is None for b in blocks)


def test_free_kv_cache_block_queue_get_all_free_blocks():
    blocks = [KVCacheBlock(block_id=i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.get_all_free_blocks() == blocks
    queue.popleft()
    assert queue.get_all_free_blocks() == blocks[1:]
    queue.remove(blocks[2])
    assert queue.get_all_free_blocks() == blocks[1:2] + blocks[3:]
    queue.append(blocks[2])
    assert queue.get_all_free_blocks() == blocks[1:2] + blocks[3:] + [blocks[2]]


def test_generate_block_hash_extra_keys():
    request = make_request("0", list(range(20)), [PlaceholderRange(0, 5), PlaceholderRange(10, 5)], ["hash1", "hash2"])
    assert generate_block_hash_extra_keys(request, 0, 5, 0) == ((("mm", "hash1", 0),), 1)
    assert generate_block_hash_extra_keys(request, 3, 8, 0) == ((("mm", "hash1", -3),), 1)
    assert generate_block_hash_extra_keys(request, 6, 10, 0) == (None, 1)
    assert generate_block_hash_extra_keys(request, 0, 15, 0) == ((("mm", "hash1", 0), ("mm", "hash2", 10)), 2)


def test_generate_block_hash_extra_keys_no_mm_inputs():
    assert generate_block_hash_extra_keys(make_request("0", list(range(6))), 0, 5, 0) == (None, 0)


def test_generate_block_hash_extra_keys_cache_salt():
    request = make_request("0", list(range(6)), cache_salt="salt")
    assert generate_block_hash_extra_keys(request, 0, 1, 0)[0] == (("cache_salt", "salt"),)
    assert generate_block_hash_extra_keys(request, 0, 10, 0)[0] == (("cache_salt", "salt"),)
    assert generate_block_hash_extra_keys(request, 1, 2, 0)[0] is None
    assert generate_block_hash_extra_keys(request, 6, 10, 0)[0] is None
    request_mm = make_request("0", list(range(20)), [PlaceholderRange(0, 5)], ["hash1"], cache_salt="salt")
    assert generate_block_hash_extra_keys(request_mm, 0, 5, 0) == ((("mm", "hash1", 0), ("cache_salt", "salt")), 1)


def test_generate_block_hash_extra_keys_lora():
    request = Request("0", list(range(6)), lora_name="test_lora_adapter", lora_path="/path/to/lora")
    assert generate_block_hash_extra_keys(request, 0, 3, 0)[0] == (("lora", "test_lora_adapter", "/path/to/lora"),)
    assert generate_block_hash_extra_keys(Request("1", list(range(6))), 0, 3, 0)[0] is None


@pytest.mark.parametrize("hash_fn", [sha256, sha256_cbor])
def test_hash_block_tokens(hash_fn):
    parent_block_hash, curr_block_token_ids, extra_keys = b"123", (1, 2, 3), ("key1", "key2")
    assert hash_block_tokens(hash_fn, parent_block_hash, curr_block_token_ids, extra_keys) == \
        hash_fn((parent_block_hash, curr_block_token_ids, extra_keys))


@pytest.mark.parametrize("hash_fn", [sha256, sha256_cbor])
def test_request_block_hasher(hash_fn):
    request = make_request("0", list(range(6)), [PlaceholderRange(0, 3), PlaceholderRange(3, 3)], ["hash1", "hash2"])
    none_hash = hash_fn(SEED)
    block_hashes = hashing.get_request_block_hasher(3, hash_fn, none_hash)(request)
    assert len(block_hashes) == 2
    assert block_hashes[0] == hash_fn((none_hash, (0, 1, 2), (("mm", "hash1", 0),)))
    assert block_hashes[1] == hash_fn((block_hashes[0], (3, 4, 5), (("mm", "hash2", 0),)))


@pytest.mark.parametrize("hash_fn", [sha256, sha256_cbor])
def test_hash_tokens_different_mm_input(hash_fn):
    hasher = hashing.get_request_block_hasher(3, hash_fn, hash_fn(SEED))
    positions = [PlaceholderRange(0, 3), PlaceholderRange(3, 3)]
    hashes1 = hasher(make_request("0", list(range(6)), positions, ["hash1", "hash2"]))
    hashes2 = hasher(make_request("1", list(range(6)), positions, ["hash3", "hash2"]))
    assert hashes1[0] != hashes2[0] and hashes1[1] != hashes2[1]


@pytest.mark.parametrize("hash_fn", [sha256, sha256_cbor])
def test_hash_request_tokens_no_mm_inputs(hash_fn):
    none_hash = hash_fn(SEED)
    block_hashes = hashing.get_request_block_hasher(3, hash_fn, none_hash)(make_request("0", list(range(6))))
    assert block_hashes == [hash_fn((none_hash, (0, 1, 2), None)),
                            hash_fn((hash_fn((none_hash, (0, 1, 2), None)), (3, 4, 5), None))]


def _stats(requests, queries, hits):
    return PrefixCacheStats(requests=requests, queries=queries, hits=hits)


def test_metrics():
    metrics = CachingMetrics(max_recent_requests=5)
    assert metrics.hit_rate == 0.0
    metrics.observe(_stats(1, 20, 9))
    assert metrics.hit_rate == 0.45
    metrics.observe(_stats(4, 80, 16))
    assert metrics.hit_rate == 0.25
    metrics.observe(_stats(1, 10, 2))
    assert (metrics.aggregated_requests, metrics.aggregated_query_total, metrics.aggregated_query_hit) == (5, 90, 18)
    assert metrics.hit_rate == 0.2
    metrics.reset()
    assert metrics.hit_rate == 0.0 and metrics.aggregated_requests == 0 and not metrics.query_queue


def test_metrics_empty_stats():
    metrics = CachingMetrics(max_recent_requests=5)
    for stats in [_stats(0, 0, 0), _stats(1, 20, 9), _stats(0, 0, 0), _stats(4, 80, 16), _stats(0, 0, 0),
                  _stats(1, 10, 2)]:
        metrics.observe(stats)
    assert (metrics.aggregated_requests, metrics.aggregated_query_total, metrics.aggregated_query_hit) == (5, 90, 18)
    assert metrics.hit_rate == 0.2
    metrics.observe(_stats(11, 20, 10))
    assert (metrics.aggregated_requests, metrics.aggregated_query_total, metrics.hit_rate) == (11, 20, 0.5)
    metrics.observe(_stats(22, 40, 30))
    assert (metrics.aggregated_requests, metrics.aggregated_query_total, metrics.hit_rate) == (22, 40, 0.75)
