"""One KV cache group's block tables: which blocks each request holds, needs, caches and may let go.

Mirrors ``vllm/v1/core/single_type_kv_cache_manager.py`` (vLLM 0.33.0): ``FullAttentionManager``
keeps a block for every ``block_size`` tokens until the request ends; ``SlidingWindowManager``
keeps only the blocks the next token's window can still reach. A block that slid out of the
window is freed at the next ``allocate_slots`` (``remove_skipped_blocks``) and its place in the
block table is taken by the **null block**, so that positions stay where they were: block ``i``
of the table still holds tokens ``i * block_size ..``. The kernel never reads a null block,
because every key in it is outside the window.

A prefix hit differs by kind (``find_longest_cache_hit``): full attention needs every block of the
prefix, scanned from the left until the first miss; a sliding window needs only the last
``cdiv(W - 1, block_size)`` blocks before the hit's end, scanned from the right, with null
blocks standing in for the rest. ``kvlab.core.kv_cache_coordinator`` agrees on one length.

kvlab's split, so that a call fails whole or not at all: a manager *plans* what an allocation
takes (``plan_allocation``), the coordinator takes every group's blocks in one pool call, and
each manager *applies* its share (``apply_allocation``); vLLM makes the same pool calls one by
one (``add_local_computed_blocks``, ``allocate_external_computed_blocks``, ``allocate_new_blocks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from kvlab.core.block_pool import BlockPool
from kvlab.core.hashing import BlockHash, make_block_hash_with_group_id
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.core.request import Request
from kvlab.errors import KvlabValueError
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, SlidingWindowSpec
from kvlab.units import cdiv

__all__ = ["FullAttentionManager", "SingleTypeKVCacheManager", "SlidingWindowManager", "find_longest_cache_hit",
           "get_manager_for_kv_cache_spec"]


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


@dataclasses.dataclass
class AllocationPlan:
    """What one group's share of an ``allocate_slots`` takes from the pool, decided before anything changes."""

    admitted: bool  # the request holds no blocks yet in this group
    hits: list[KVCacheBlock]  # prefix-hit blocks to touch (never the null block)
    num_null: int  # leading null blocks for the skipped part of the hit (sliding window)
    partial: int  # 1 if the hit ends inside its last block: that block is copied (full attention)
    num_external: int  # blocks for tokens a KV connector loads
    num_fresh: int  # blocks for the tokens to compute (and lookahead)

    @property
    def num_new(self) -> int:
        """Blocks this group takes from the free queue besides its hits."""
        return self.num_external + self.partial + self.num_fresh


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group (vLLM's ``SingleTypeKVCacheManager``), over a pool all groups share.

    ``keyed`` makes the group's prefix-cache keys carry its group id (several groups); a single
    group keys by the bare hash. ``max_admission_blocks_per_request`` caps what a request is
    counted to need when the whole request must fit (vLLM sets it for sliding windows).
    """

    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int,
                 enable_caching: bool, *, keyed: bool = False, hash_block_size: int | None = None,
                 max_admission_blocks_per_request: int | None = None) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.hash_block_size = hash_block_size or self.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = bool(enable_caching)
        self.keyed = keyed
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self._null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # each request's block table in this group
        self.num_cached_block: dict[str, int] = {}  # how many of a request's blocks are cached
        # Partial hits' copies for the worker: (source, copy), both holding an extra reference until taken.
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the next token's attention window: none for full attention."""
        return 0

    def cache_key(self, block_hash: BlockHash) -> Any:
        """The prefix cache's key for ``block_hash`` in this group (``make_block_hash_with_group_id``)."""
        return make_block_hash_with_group_id(block_hash, self.kv_cache_group_id) if self.keyed else block_hash

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   apply_admission_cap: bool = False) -> int:
        """Free blocks this group takes to give the request ``num_tokens`` slots (vLLM's rule).

        New blocks for the part of the request its window still reaches, plus the hit blocks that
        sit in the free queue (taking them out of it costs a free block each), plus one for a
        partial hit's copy. A running request gets no new hits.
        """
        num_required = -(-num_tokens // self.block_size)  # cdiv
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        held = self.req_to_blocks.get(request_id)
        if held is not None:
            return max(num_required - len(held), 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped_blocks, len(new_computed_blocks)), 0)
        num_evictable = 0
        for block in new_computed_blocks[num_skipped_blocks:]:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        partial = int(len(new_computed_blocks) > 0 and num_local_computed_tokens % self.block_size != 0)
        return num_new + partial + num_evictable

    def plan_allocation(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                        num_local_computed_tokens: int, num_external_computed_tokens: int,
                        num_tokens: int) -> AllocationPlan:
        """What this group takes for the request (``add_local_computed_blocks``,
        ``allocate_external_computed_blocks`` and ``allocate_new_blocks``, counted), changing nothing."""
        held = self.req_to_blocks.get(request_id)
        if held is not None:
            return AllocationPlan(False, [], 0, 0, 0, max(-(-num_tokens // self.block_size) - len(held), 0))
        total = num_local_computed_tokens + num_external_computed_tokens
        num_null = self.get_num_skipped_tokens(total) // self.block_size
        kept = list(new_computed_blocks[num_null:])
        partial = int(bool(kept) and num_local_computed_tokens % self.block_size != 0)
        table = max(num_null, len(new_computed_blocks))
        num_external = 0
        if num_external_computed_tokens:
            skipped = self.get_num_skipped_tokens(total)
            loaded = min(total - skipped, num_external_computed_tokens) if skipped else num_external_computed_tokens
            if loaded > 0:
                num_external = max(0, cdiv(total, self.block_size) - table)
        num_fresh = max(cdiv(num_tokens, self.block_size) - table - num_external, 0)
        return AllocationPlan(True, [b for b in kept if not b.is_null], num_null, partial, num_external, num_fresh)

    def apply_allocation(self, request_id: str, plan: AllocationPlan, new_computed_blocks: Sequence[KVCacheBlock],
                         external: list[KVCacheBlock], new: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Put the blocks the pool gave for ``plan`` into the table; return the new ones (a partial hit copy first)."""
        if plan.admitted:
            table = [self._null_block] * plan.num_null + list(new_computed_blocks[plan.num_null:])
            self.req_to_blocks[request_id] = table
            self.num_cached_block[request_id] = len(table) - plan.partial
        else:
            table = self.req_to_blocks[request_id]
        table.extend(external)
        if plan.partial:  # the hit's last block, which the request would write into: a private copy
            self._apply_cow(table, len(new_computed_blocks) - 1, new[0])
        table.extend(new[plan.partial:])
        return new

    def _apply_cow(self, blocks: list[KVCacheBlock], index: int, copy: KVCacheBlock) -> None:
        """Point a partial hit's tail at its private copy; source and copy stay referenced until taken."""
        source = blocks[index]
        blocks[index] = copy
        copy.ref_cnt += 1
        self._pending_cow_copies.append((source, copy))

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """The (source, copy) pairs queued since the last call."""
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    def cache_blocks(self, request: Request, num_tokens: int) -> range:
        """Hash and index the request's full blocks among its first ``num_tokens`` tokens; return the indices cached.

        Null blocks (a sliding window's skipped part) hold nothing and are passed over, as vLLM's
        ``cache_full_blocks`` passes them over.
        """
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = min(num_tokens, len(request.block_hashes) * self.hash_block_size) // self.block_size
        if num_cached >= num_full:
            return range(0)
        blocks = self.req_to_blocks[request_id]
        if self._caches_blocks():
            keys: Sequence[Any] = self.full_block_hashes(request)
            if self.keyed:  # only the entries from num_cached on are read
                keys = [None] * num_cached + [self.cache_key(h) for h in keys[num_cached:num_full]]
            start, events = num_cached, self.block_pool.enable_kv_cache_events
            for i in range(num_cached, num_full + 1):  # runs of real blocks, between null ones
                if i == num_full or blocks[i].is_null:
                    if start < i:
                        self.block_pool._cache_full_blocks(blocks, keys, start, i, self.block_size,
                                                           request.all_token_ids if events else ())
                    start = i + 1
        self.num_cached_block[request_id] = num_full
        return range(num_cached, num_full)

    def _caches_blocks(self) -> bool:
        return True

    def full_block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's hashes at block granularity: each block is named by the hash at its last boundary."""
        scale = self.block_size // self.hash_block_size
        hashes = request.block_hashes
        return hashes if scale == 1 else hashes[scale - 1::scale]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Free the blocks wholly before the next token's window and put the null block in their place.

        Walks back from the last skipped block and stops at the first null one (those before it
        went earlier), freeing in that order, as vLLM's ``_remove_blocks_in_range``. Returns the
        blocks freed. Full attention skips nothing.
        """
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return []
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return []
        freed = []
        for i in range(min(num_skipped_tokens // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool._free_blocks(freed)
        return freed

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; return its blocks in table order without the null ones (not yet freed)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        return [b for b in blocks if not b.is_null]

    def free(self, request_id: str) -> None:
        """Free the request's blocks, last block first, so its prompt's start is evicted last."""
        self.block_pool._free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int] | None, block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, alignment_tokens: int,
                               hash_block_size: int | None = None) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The hit blocks of each group in ``kv_cache_group_ids`` (None: one group, bare keys) and the hit's tokens."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    """A group of full-attention layers: every block of a request stays until the request ends."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Full attention reads every earlier token: nothing is ever skipped."""
        return []

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int] | None, block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, alignment_tokens: int,
                               hash_block_size: int | None = None) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Phase 1: the longest run of cached whole blocks from the start, stopping at the first miss.

        Phase 2, with hashes finer than blocks (``hash_block_size`` < ``block_size``, kvlab's one
        group only): the longest hash boundary inside the next block, probed high to low; the hit
        then ends inside a block, which ``allocate_slots`` copies.
        """
        block_size, hbs = kv_cache_spec.block_size, hash_block_size or kv_cache_spec.block_size
        scale = block_size // hbs
        full_hashes = block_hashes if scale == 1 else block_hashes[scale - 1::scale]
        lookup = block_pool.cached_block_hash_to_block.get_one_block if kv_cache_group_ids is None else \
            (lambda h: block_pool._get_cached_block(h, kv_cache_group_ids))
        per_block = find_longest_cache_hit(full_hashes, max_length, block_size, lookup)
        hit_length = len(per_block) * block_size
        if scale > 1:
            first = len(per_block) * scale
            last = min(first + scale - 1, max_length // hbs, len(block_hashes))
            for fine_idx in range(last - 1, first - 1, -1):
                tail = block_pool._get_cached_block(block_hashes[fine_idx], kv_cache_group_ids)
                if tail is not None:
                    per_block.append(tail)
                    hit_length = (fine_idx + 1) * hbs
                    break
        hit_length -= hit_length % alignment_tokens
        per_block = per_block[:cdiv(hit_length, block_size)]
        return _by_group(per_block, kv_cache_group_ids), hit_length

    def cache_blocks(self, request: Request, num_tokens: int) -> range:
        cached = super().cache_blocks(request, num_tokens)
        if self.hash_block_size != self.block_size and self.enable_caching:
            self._cache_partial_tail_block(request, num_tokens)
        return cached

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        """Register the prompt's last hash boundary when it ends inside a block (vLLM's partial entry)."""
        hbs = self.hash_block_size
        boundary = min((request.num_prompt_tokens - 1) // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        index = boundary // self.block_size
        if index < len(blocks):
            key = self.cache_key(request.block_hashes[boundary // hbs - 1])
            self.block_pool.cache_partial_block(blocks[index], key, boundary)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A group of sliding-window layers: a request keeps only the blocks its next token's window reaches."""

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int,
                 enable_caching: bool, **kwargs: Any) -> None:
        if block_pool.null_block is None:
            raise KvlabValueError("a sliding-window group needs the null block for the slots that slid out of the "
                                  "window: create the manager with reserve_null_block=True")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens the next token's window no longer reaches: ``max(0, num_computed_tokens - W + 1)``.

        With W = 4 and 7 tokens computed, the next token (position 7) sees positions 4..7, so
        positions 0..3 are skipped: ``get_num_skipped_tokens(7) == 4``.
        """
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def _caches_blocks(self) -> bool:
        # vLLM's reachable_block_mask with hits aligned to blocks: a block can serve a hit only if a hit needs
        # any block at all, which a window of one token (it sees only itself) never does.
        return self.kv_cache_spec.num_contiguous_blocks_for_hit() > 0  # type: ignore[attr-defined]

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int] | None, block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, alignment_tokens: int,
                               hash_block_size: int | None = None) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Scan from the right for ``cdiv(W - 1, block_size)`` cached blocks in a row; nulls stand for those before.

        The hit ends where that run ends: the blocks after it are trimmed. With no such run, the
        run of cached blocks at the very start (shorter than needed, but all a short prefix
        needs) is the hit. E.g. block size 4, window 8 (two blocks): ``[NULL, NULL, 7, 8]``.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        need = kv_cache_spec.num_contiguous_blocks_for_hit()
        num_blocks = max_length // block_size
        null: Any = block_pool.null_block if kv_cache_group_ids is None else \
            [block_pool.null_block] * len(kv_cache_group_ids)
        computed: list[Any] = [null] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            cached = block_pool._get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                run = 0
                continue
            computed[i] = cached
            run += 1
            if run >= need:
                del computed[i + run:]
                break
        else:
            del computed[run:]
        while len(computed) * block_size % alignment_tokens:
            computed.pop()
        return _by_group(computed, kv_cache_group_ids), len(computed) * block_size


def _by_group(per_block: list[Any], kv_cache_group_ids: Sequence[int] | None) -> tuple[list[KVCacheBlock], ...]:
    """Hits listed block by block (a block, or one block per group) as one list per group."""
    if kv_cache_group_ids is None:
        return (list(per_block),)
    return tuple([entry[g] for entry in per_block] for g in range(len(kv_cache_group_ids)))


#: vLLM's KVCacheSpecRegistry, for the kinds kvlab serves (an MLA layer is full attention to the manager).
MANAGER_FOR_SPEC: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int,
                                  enable_caching: bool, *, max_model_len: int | None = None,
                                  max_in_flight_tokens: int | None = None, **kwargs: Any) -> SingleTypeKVCacheManager:
    """The manager class for a spec, with the admission cap vLLM gives sliding windows (when the limits are known)."""
    manager_class = MANAGER_FOR_SPEC.get(type(kv_cache_spec))
    if manager_class is None:
        known = sorted(c.__name__ for c in MANAGER_FOR_SPEC)
        raise KvlabValueError(f"no manager for {type(kv_cache_spec).__name__}; kvlab manages {known}")
    if isinstance(kv_cache_spec, SlidingWindowSpec) and max_in_flight_tokens is not None:
        limit = max_model_len if max_model_len is not None else kv_cache_spec.sliding_window - 1 + max_in_flight_tokens
        kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_admission_blocks_per_request(
            max_in_flight_tokens, limit)
    return manager_class(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching, **kwargs)
