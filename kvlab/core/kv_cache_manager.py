"""The KV cache manager: prefix-cache lookup, slot allocation and freeing for each request.

Mirrors ``vllm/v1/core/kv_cache_manager.py`` (vLLM 0.33.0) with one full-attention KV cache
group: the work of ``UnitaryKVCacheCoordinator`` and ``FullAttentionManager`` is folded in, and
vLLM's ``KVCacheBlocks`` (a tuple over groups) is a plain list. The scheduler's calls are vLLM's:
``get_computed_blocks(request, max_cache_hit_length=None)`` (the longest cached prefix, its
tokens, and the shared-prefix boundary, always 0 with one group; never the last token, which
the model must compute for the next token's logits), ``allocate_slots(...)`` (the new blocks,
or None with nothing changed), ``take_kv_cache_block_copies()`` and ``free(request)`` (tail first).

**Partial hits.** With hashes finer than blocks (``hash_block_size`` < ``block_size``) a hit may
end inside a block. The request cannot write into that shared block, so ``allocate_slots`` takes
one more block, points the table at it and queues ``KVCacheBlockCopy(src, dst)`` for the worker;
both keep an extra reference until the scheduler takes the copies. vLLM 0.33.0 turns this on only
for hybrid models whose Mamba layers cache in "align" mode; kvlab lets one group use it.

kvlab adds checks vLLM leaves to its scheduler (bad calls raise ``RequestStateError`` or
``KvlabValueError`` and change nothing; ``kvlab.core.manager_checks``), eviction counters, one
``NONE_HASH`` per manager (vLLM's is process state), ``fork`` and ``copy_on_write`` for parallel
sampling (``kvlab.core.manager_fork``: the PagedAttention paper's mechanism, which V1 serves
through the prefix cache instead) and ``verify_hits``, nano-vllm's per-hit comparison of tokens.
vLLM's KV events, encoder blocks and sliding windows are not modelled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from kvlab._validate import MAX_OBJECTS, checked, non_negative_int, positive_int
from kvlab.core.block_pool import BlockPool, BlockPoolObserver
from kvlab.core.cache_stats import CachingMetrics, EvictionCounter, PrefixCacheStats
from kvlab.core.hashing import (
    BlockHash,
    HashFn,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_fn_name,
    none_hash_from_seed,
)
from kvlab.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from kvlab.core.manager_checks import AllocationChecks
from kvlab.core.manager_fork import ForkMixin
from kvlab.core.request import Request, RequestStatus
from kvlab.errors import KvlabValueError, RequestStateError
from kvlab.units import cdiv

__all__ = ["KVCacheManager", "Request", "RequestStatus", "find_longest_cache_hit"]


@checked
def find_longest_cache_hit(
    block_hashes: Sequence[BlockHash],
    max_cache_hit_length: int,
    block_size: int,
    get_cached_block: Callable[[BlockHash], Any],
) -> list[Any]:
    """Cached blocks for the longest prefix of ``block_hashes``, at most ``max_cache_hit_length`` tokens.

    The walk stops at the first miss: hashes are chained, so after a miss no later block of
    this request can be in the cache with the right prefix. (vLLM's
    ``FullAttentionManager.find_longest_cache_hit``, phase 1: whole blocks.)
    """
    hits = []
    for block_hash in block_hashes[: max_cache_hit_length // block_size]:
        block = get_cached_block(block_hash)
        if block is None:
            break
        hits.append(block)
    return hits


@checked(at_most={"num_blocks": MAX_OBJECTS})
class KVCacheManager(ForkMixin, AllocationChecks):
    """Allocates a pool's blocks to requests and finds their cached prefixes, as vLLM V1's manager does.

    ``hash_fn`` is a name (``"sha256"``, ``"sha256_cbor"``, ``"xxhash"``, ``"xxhash_cbor"``) or
    a function of one object returning bytes. ``hash_seed`` plays ``PYTHONHASHSEED``; without
    it (and without ``PYTHONHASHSEED``) SHA-256 managers all share 0.33.0's fixed seed and
    agree on every hash, while each xxhash manager draws a secret random one. ``hash_block_size``
    (default ``block_size``, which it must divide) is the granularity of hashes and hits;
    ``max_model_len`` caps the slots a request gets (default: no cap); ``watermark`` is the
    share of blocks kept free when admitting; ``hit_rate_window`` is the number of recent
    requests the hit rate covers.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: str | HashFn = "sha256",
        reserve_null_block: bool = True,
        *,
        hash_seed: str | None = None,
        verify_hits: bool = False,
        hit_rate_window: int = 1000,
        hash_block_size: int | None = None,
        max_model_len: int | None = None,
        watermark: float = 0.0,
        metrics_collector: BlockPoolObserver | None = None,
    ) -> None:
        self.block_size = positive_int("block_size", block_size)
        self.hash_block_size = self._check_hash_block_size(hash_block_size, verify_hits)
        self.caching_hash_fn: HashFn = hash_fn if callable(hash_fn) else get_hash_fn_by_name(hash_fn)
        self.hash_fn_name = hash_fn_name(self.caching_hash_fn)
        self.max_model_len = None if max_model_len is None else positive_int("max_model_len", max_model_len)
        self.watermark_blocks = self._check_watermark(watermark, num_blocks)
        self.caching_metrics = CachingMetrics(hit_rate_window)
        self.block_pool = BlockPool(num_blocks, enable_caching, reserve_null_block, metrics_collector=metrics_collector)
        self._eviction_counter = EvictionCounter(self.block_pool)
        self.enable_caching = bool(enable_caching)
        self.verify_hits = bool(verify_hits)
        seed = hash_seed if hash_seed is not None else os.getenv("PYTHONHASHSEED")
        self.none_hash: BlockHash = none_hash_from_seed(self.caching_hash_fn, seed)
        self._request_block_hasher = get_request_block_hasher(self.hash_block_size, self.caching_hash_fn,
                                                              self.none_hash)
        self._scale = self.block_size // self.hash_block_size  # hashes per block

        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # each request's block table
        self.num_cached_block: dict[str, int] = {}  # how many of a request's blocks are cached
        self._requests: dict[str, Request] = {}  # the live requests holding blocks
        # The copies partial hits queued for the worker: (source, copy), both holding an extra reference until
        # taken. (vLLM notes the tail in _partial_hit_reqs and redirects it later in the same allocate_slots.)
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []

        self.prefix_cache_stats = PrefixCacheStats()  # since start (or the last reset)
        self._interval_stats = PrefixCacheStats()  # since the last make_prefix_cache_stats()
        self.num_rejected_hits = 0  # hash hits whose tokens differed (verify_hits only)
        self._block_content: dict[int, tuple[tuple[int, ...], Any]] = {}  # verify_hits: what each block holds

    # ----------------------------------------------------------------- what the scheduler reads

    @property
    def usage(self) -> float:
        """Share of usable blocks in use (vLLM's ``kv_cache_usage``)."""
        return self.block_pool.get_usage()

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens over the last ``hit_rate_window`` admitted requests."""
        return self.caching_metrics.hit_rate

    @property
    def num_evicted_blocks(self) -> int:
        """Cached blocks whose hash was dropped to reuse the block (kvlab's counter)."""
        return self._eviction_counter.num_evicted_blocks

    @property
    def num_blocks_evicted_before_reuse(self) -> int:
        """Evicted blocks a later request asked for again, and recomputed (kvlab's counter)."""
        return self._eviction_counter.num_blocks_evicted_before_reuse

    @checked
    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats gathered since the previous call (then reset), as vLLM's scheduler takes them each step."""
        stats, self._interval_stats = self._interval_stats, PrefixCacheStats()
        return stats

    @checked
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The blocks of a live request, in logical order (its block table)."""
        if request_id not in self.req_to_blocks:
            raise RequestStateError(
                f"request {request_id!r} holds no blocks: it is unknown, was never allocated, or was freed"
            )
        return list(self.req_to_blocks[request_id])

    @checked
    def get_block_ids(self, request_id: str) -> list[int]:
        """The block ids of a live request: the row of the block table the attention kernel reads."""
        return [block.block_id for block in self.get_blocks(request_id)]

    @checked
    def full_block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's hashes at block granularity: each block is named by the hash at its last boundary."""
        hashes = request.block_hashes
        return hashes if self._scale == 1 else hashes[self._scale - 1::self._scale]

    # ----------------------------------------------------------------- prefix-cache lookup

    @checked
    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[list[KVCacheBlock], int, int]:
        """The cached blocks of the request's longest cached prefix, their tokens, and 0 (vLLM's three values).

        At most ``max_cache_hit_length`` tokens hit, by default ``num_tokens - 1``: a fully
        cached prompt still computes its last token, and since hits end on hash boundaries, that
        means the last block (or hash block) is recomputed. The third value is vLLM's
        ``shared_prefix_boundary``, which only hybrid models set. The lookup changes nothing
        in the pool; the first one hashes the request with this manager's seed.
        """
        self._check_request(request)
        if max_cache_hit_length is not None:
            max_cache_hit_length = non_negative_int("max_cache_hit_length", max_cache_hit_length)
        if not self.enable_caching:
            return [], 0, 0
        self._ensure_block_hashes(request)
        limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        get = self.block_pool.cached_block_hash_to_block.get_one_block
        hits = find_longest_cache_hit(self.full_block_hashes(request), limit, self.block_size, get)
        hit_length = len(hits) * self.block_size
        if self._scale > 1:  # phase 2: the longest hash boundary inside the next block, probed high to low
            first = len(hits) * self._scale
            last = min(first + self._scale - 1, limit // self.hash_block_size, len(request.block_hashes))
            for fine_idx in range(last - 1, first - 1, -1):
                block = get(request.block_hashes[fine_idx])
                if block is not None:
                    hits.append(block)
                    hit_length = (fine_idx + 1) * self.hash_block_size
                    break
        if self.verify_hits:
            hits = self._verified(request, hits)
            hit_length = len(hits) * self.block_size
        return hits, hit_length, 0

    # ----------------------------------------------------------------- allocation

    @checked
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` slots for ``num_new_tokens`` tokens to compute; return the new blocks, or None.

        ``new_computed_blocks`` (``num_new_computed_tokens`` tokens) are the hits from
        ``get_computed_blocks``, and ``num_external_computed_tokens`` the tokens a KV connector
        (the CPU tier of notebook 07) will load, both for a request that holds no blocks yet.
        The pool must supply the new blocks *and* the hit blocks that sit in the free queue
        (taking them out of it is what keeps them from eviction), and still leave
        ``reserved_blocks`` free (plus the ``watermark`` when admitting while others run); if it
        cannot, the call returns None and changes nothing. ``full_sequence_must_fit`` asks that
        the whole request fit. Full blocks of tokens already known are cached (hashed and
        indexed) at once, unless ``delay_cache_blocks``. ``num_lookahead_tokens`` reserves slots
        for tokens not yet known (speculative decoding). The returned list holds the copy of a
        partial hit's tail block first, then the fresh blocks, as vLLM's does (blocks for
        external tokens are in the table but not in the list). ``num_encoder_tokens`` and
        ``skip_zeroing_group_ids`` are vLLM's too; kvlab has no encoder and no zeroing, so they
        must keep their defaults.
        """
        computed, partial = self._check_allocation(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, num_encoder_tokens, reserved_blocks, skip_zeroing_group_ids)
        held = self.req_to_blocks.get(request.request_id)
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = self._cap(num_local_computed_tokens + num_external_computed_tokens)
        watermark = (self.watermark_blocks if has_scheduled_reqs and request.status in
                     (RequestStatus.WAITING, RequestStatus.PREEMPTED) else 0)
        free = self.block_pool.get_num_free_blocks()
        if full_sequence_must_fit:
            need = self._num_blocks_to_allocate(held, self._cap(request.num_tokens), computed, partial)
            if need + watermark > free:
                return None
        num_tokens_need_slot = self._cap(total_computed_tokens + num_new_tokens + num_lookahead_tokens)
        if self._num_blocks_to_allocate(held, num_tokens_need_slot, computed, partial) + watermark > \
                free - reserved_blocks:
            return None

        return self._commit_allocation(request, held, computed, partial, num_tokens_need_slot,
                                       num_new_computed_tokens, num_external_computed_tokens,
                                       None if delay_cache_blocks else min(total_computed_tokens + num_new_tokens,
                                                                           request.num_tokens))

    def _commit_allocation(self, request: Request, held: list[KVCacheBlock] | None, computed: list[KVCacheBlock],
                           partial: int, num_tokens_need_slot: int, num_new_computed_tokens: int,
                           num_external_computed_tokens: int, num_tokens_to_cache: int | None) -> list[KVCacheBlock]:
        """``allocate_slots`` once every check passed: from here on the call succeeds.

        The pool takes the hits and every new block in one step (external-token blocks, the partial
        hit's copy, the fresh blocks, in vLLM's order); then the table, the copy, the stats, the cache.
        """
        request_id, admitted = request.request_id, held is None
        num_table = (0 if held is None else len(held)) + len(computed)
        num_external_blocks = 0
        if admitted and num_external_computed_tokens:
            num_external_blocks = max(0, cdiv(request.num_computed_tokens + num_new_computed_tokens +
                                              num_external_computed_tokens, self.block_size) - num_table)
        num_fresh = max(cdiv(num_tokens_need_slot, self.block_size) - num_table - num_external_blocks, 0)
        num_taken = num_external_blocks + partial + num_fresh
        if num_taken or computed:  # (a decode step inside its last block takes nothing: no pool call, as in vLLM)
            with self._eviction_counter.counting():
                taken = self.block_pool.touch_and_get_new_blocks(computed, num_taken)
        else:
            taken = []
        if held is None:
            held = self.req_to_blocks[request_id] = list(computed)
            self._requests[request_id] = request
            self.num_cached_block[request_id] = len(computed) - partial
            if self.enable_caching:
                self._ensure_block_hashes(request)
        held.extend(taken[:num_external_blocks])
        new_blocks = taken[num_external_blocks:]
        if partial:
            self._apply_cow(held, len(computed) - 1, new_blocks[0])
        held.extend(new_blocks[partial:])
        if admitted and self.enable_caching:
            self._record_admission(request, num_new_computed_tokens, len(computed))
        if self.enable_caching and num_tokens_to_cache is not None:
            self.cache_blocks(request, num_tokens_to_cache)
        return new_blocks

    def _cap(self, num_tokens: int) -> int:
        return num_tokens if self.max_model_len is None else min(num_tokens, self.max_model_len)

    def _num_blocks_to_allocate(self, held: list[KVCacheBlock] | None, num_tokens: int,
                                computed: list[KVCacheBlock], partial: int) -> int:
        """Free blocks the call takes (vLLM's ``get_num_blocks_to_allocate``): new ones, plus hits in the queue."""
        num_required = cdiv(num_tokens, self.block_size)
        if held is not None:  # a running request: no new hits
            return max(num_required - len(held), 0)
        # A hit block that nobody holds sits in the free queue: taking it costs a free block too.
        num_evictable = sum(block.ref_cnt == 0 for block in computed)
        return max(num_required - len(computed), 0) + partial + num_evictable

    def _apply_cow(self, blocks: list[KVCacheBlock], index: int, copy: KVCacheBlock) -> None:
        """Point a partial hit's tail at its private copy; source and copy stay referenced until taken."""
        source = blocks[index]
        blocks[index] = copy
        copy.ref_cnt += 1
        self._pending_cow_copies.append((source, copy))

    @checked
    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """The copies queued since the last call, and the blocks they retain (vLLM's name).

        The caller hands the copies to the worker and, once they are made, frees the retained
        blocks with ``block_pool.free_blocks`` (kvlab's synchronous scheduler does so at once).
        """
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        copies = [KVCacheBlockCopy(source.block_id, copy.block_id) for source, copy in pending]
        return copies, [block for pair in pending for block in pair]

    @checked
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and index the request's full blocks among its first ``num_tokens`` tokens (and its partial tail)."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_hashed_tokens = len(request.block_hashes) * self.hash_block_size
        num_full_blocks = min(num_tokens, num_hashed_tokens) // self.block_size
        blocks = self.req_to_blocks[request_id]
        if num_cached_blocks < num_full_blocks:
            hashes = self.full_block_hashes(request)
            self.block_pool.cache_full_blocks(blocks, hashes, num_cached_blocks, num_full_blocks, self.block_size)
            for i in range(num_cached_blocks, num_full_blocks):
                self._eviction_counter.evicted_hashes.discard(hashes[i])
                if self.verify_hits:
                    self._block_content[blocks[i].block_id] = self._content(request, i)
            self.num_cached_block[request_id] = num_full_blocks
        if self._scale > 1:
            self._cache_partial_tail_block(request, num_tokens, blocks)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int, blocks: list[KVCacheBlock]) -> None:
        """Register the prompt's last hash boundary when it ends inside a block (vLLM's partial entry)."""
        hbs = self.hash_block_size
        boundary = min((request.num_prompt_tokens - 1) // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        index = boundary // self.block_size
        if index < len(blocks):
            self.block_pool.cache_partial_block(blocks[index], request.block_hashes[boundary // hbs - 1], boundary)

    def _record_admission(self, request: Request, num_hits: int, num_hit_blocks: int) -> None:
        """Count the request's lookup once, when it is admitted (vLLM counts at admission too)."""
        preempted = request.num_preemptions > 0
        stats = PrefixCacheStats()
        stats.record(request.num_tokens, num_hits, preempted)
        self.prefix_cache_stats.record(request.num_tokens, num_hits, preempted)
        self._interval_stats.record(request.num_tokens, num_hits, preempted)
        self.caching_metrics.observe(stats)
        self._eviction_counter.missed(self.full_block_hashes(request)[num_hit_blocks:])

    # ----------------------------------------------------------------- freeing

    @checked
    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first, so its prompt's start is evicted last.

        Blocks still shared with another request only lose a reference; full blocks keep their
        hashes in the free queue and can still be hit. Freeing a request that holds nothing
        (never allocated, or freed already) does nothing, as in vLLM.
        """
        if not isinstance(request, Request):
            raise KvlabValueError(f"request must be a kvlab Request, got {type(request).__name__}")
        self._check_same_object(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)

    @checked
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (after a weight update, say); refused (False) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._block_content.clear()
        self._eviction_counter.evicted_hashes.clear()
        self.caching_metrics.reset()
        self.prefix_cache_stats.reset = self._interval_stats.reset = True
        return True
