"""The KV cache manager: prefix-cache lookup, slot allocation and freeing for each request.

Mirrors ``vllm/v1/core/kv_cache_manager.py`` with one full-attention KV cache group, so the
work of ``single_type_kv_cache_manager.FullAttentionManager`` is folded in and vLLM's
``KVCacheBlocks`` (a tuple over groups) is a plain list. The scheduler's calls are vLLM's:

* ``get_computed_blocks(request)``: the longest cached prefix, stopping at the first miss and
  never covering the last token (the model must compute it to produce the next token's logits);
* ``allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
  num_lookahead_tokens)``: the new blocks, or ``None`` with nothing changed;
* ``free(request)``: the request's blocks back to the pool, tail first.

kvlab adds checks vLLM leaves to its scheduler (bad calls raise ``RequestStateError`` or
``KvlabValueError`` and change nothing), eviction counters, and ``verify_hits``: a per-hit
comparison of each block's tokens and extra keys, the cheap guard nano-vllm uses.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from kvlab._validate import non_negative_int, positive_int
from kvlab.core.block_pool import BlockPool
from kvlab.core.cache_stats import CachingMetrics, PrefixCacheStats
from kvlab.core.hashing import (
    BlockHash,
    HashFn,
    generate_block_hash_extra_keys,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_fn_name,
    none_hash_from_seed,
)
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.core.request import Request, RequestStatus
from kvlab.errors import KvlabValueError, RequestStateError
from kvlab.units import cdiv

__all__ = ["KVCacheManager", "Request", "RequestStatus", "find_longest_cache_hit"]


def find_longest_cache_hit(
    block_hashes: Sequence[BlockHash],
    max_cache_hit_length: int,
    block_size: int,
    get_cached_block: Callable[[BlockHash], Any],
) -> list[Any]:
    """Cached blocks for the longest prefix of ``block_hashes``, at most ``max_cache_hit_length`` tokens.

    The walk stops at the first miss: hashes are chained, so after a miss no later block of
    this request can be in the cache with the right prefix.
    """
    hits = []
    for block_hash in block_hashes[: max_cache_hit_length // block_size]:
        block = get_cached_block(block_hash)
        if block is None:
            break
        hits.append(block)
    return hits


class KVCacheManager:
    """Allocates a pool's blocks to requests and finds their cached prefixes, as vLLM V1's manager does.

    ``hash_fn`` is a name (``"sha256"``, ``"sha256_cbor"``, ``"xxhash"``, ``"xxhash_cbor"``) or
    a function of one object returning bytes. ``hash_seed`` plays ``PYTHONHASHSEED``: managers
    with the same seed and hash function compute the same block hashes; without one (and
    without ``PYTHONHASHSEED`` in the environment) each manager draws a random ``NONE_HASH``,
    as each vLLM process does. ``hit_rate_window`` is the number of recent requests the
    hit rate covers.
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
    ) -> None:
        self.block_size = positive_int("block_size", block_size)
        if callable(hash_fn):
            self.caching_hash_fn: HashFn = hash_fn
        else:
            self.caching_hash_fn = get_hash_fn_by_name(hash_fn)
        self.hash_fn_name = hash_fn_name(self.caching_hash_fn)
        self.caching_metrics = CachingMetrics(hit_rate_window)
        self.block_pool = BlockPool(num_blocks, enable_caching, reserve_null_block)
        self.enable_caching = bool(enable_caching)
        self.verify_hits = bool(verify_hits)
        seed = hash_seed if hash_seed is not None else os.getenv("PYTHONHASHSEED")
        self.none_hash: BlockHash = none_hash_from_seed(self.caching_hash_fn, seed)
        self._request_block_hasher = get_request_block_hasher(self.block_size, self.caching_hash_fn, self.none_hash)

        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # each request's block table
        self.num_cached_block: dict[str, int] = {}  # how many of a request's blocks are cached
        self._requests: dict[str, Request] = {}  # the live requests holding blocks

        self.prefix_cache_stats = PrefixCacheStats()  # since start (or the last reset)
        self._interval_stats = PrefixCacheStats()  # since the last make_prefix_cache_stats()
        self.num_evicted_blocks = 0  # cached blocks whose hash was dropped to reuse the block
        self.num_blocks_evicted_before_reuse = 0  # evicted blocks a later request asked for again
        self._evicted_hashes: set[BlockHash] = set()
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

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats gathered since the previous call (then reset), as vLLM's scheduler takes them each step."""
        stats, self._interval_stats = self._interval_stats, PrefixCacheStats()
        return stats

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The blocks of a live request, in logical order (its block table)."""
        if request_id not in self.req_to_blocks:
            raise RequestStateError(
                f"request {request_id!r} holds no blocks: it is unknown, was never allocated, or was freed"
            )
        return list(self.req_to_blocks[request_id])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block ids of a live request: the row of the block table the attention kernel reads."""
        return [block.block_id for block in self.get_blocks(request_id)]

    # ----------------------------------------------------------------- prefix-cache lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the request's longest cached prefix, and how many tokens they hold.

        At most ``num_tokens - 1`` tokens may hit: a fully cached prompt still computes its last
        token, and since hits are whole blocks, that means its whole last block. The lookup
        changes nothing; ``allocate_slots`` takes the blocks.
        """
        self._check_request(request)
        if not self.enable_caching:
            return [], 0
        self._ensure_block_hashes(request)
        hits = find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1, self.block_size, self.block_pool.get_cached_block
        )
        if self.verify_hits:
            hits = self._verified(request, hits)
        return hits, len(hits) * self.block_size

    def _verified(self, request: Request, hits: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Cut ``hits`` at the first block whose recorded tokens or extra keys differ from the request's."""
        for i, block in enumerate(hits):
            if self._block_content.get(block.block_id) != self._content(request, i):
                self.num_rejected_hits += 1
                return hits[:i]
        return hits

    def _content(self, request: Request, block_index: int) -> tuple[tuple[int, ...], Any]:
        start, end = block_index * self.block_size, (block_index + 1) * self.block_size
        return request.token_ids(start, end), generate_block_hash_extra_keys(request, start, end)[0]

    # ----------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` slots for ``num_new_tokens`` tokens to compute; return the new blocks, or None.

        ``new_computed_blocks`` (``num_new_computed_tokens`` tokens) are the hits from
        ``get_computed_blocks``, for a request that holds no blocks yet. The pool must supply the
        new blocks *and* the hit blocks that sit in the free queue (taking them out of it is
        what keeps them from eviction); if it cannot, the call returns None and changes
        nothing. Full blocks of tokens already known are cached (hashed and indexed) at once.
        ``num_lookahead_tokens`` reserves slots for tokens not yet known.
        """
        computed_blocks = self._check_allocation(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens
        )
        request_id = request.request_id
        held = self.req_to_blocks.get(request_id, [])
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_new_blocks = max(cdiv(num_tokens_need_slot, self.block_size) - len(computed_blocks) - len(held), 0)
        # A hit block that nobody holds sits in the free queue: taking it costs a free block too.
        num_evictable_computed_blocks = sum(block.ref_cnt == 0 for block in computed_blocks)
        if num_new_blocks + num_evictable_computed_blocks > self.block_pool.get_num_free_blocks():
            return None

        admitted = request_id not in self.req_to_blocks
        if admitted and self.enable_caching:
            self._record_admission(request, num_new_computed_tokens, len(computed_blocks))
        if computed_blocks:
            self.block_pool.touch(computed_blocks)
        blocks = self.req_to_blocks.setdefault(request_id, [])
        blocks.extend(computed_blocks)
        if admitted:
            self.num_cached_block[request_id] = len(computed_blocks)
            self._requests[request_id] = request
        new_blocks = self._get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return new_blocks

    def _get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the pool, counting the cached ones whose contents this evicts."""
        evicted = []
        block = self.block_pool.free_block_queue.fake_free_list_head.next_free_block
        for _ in range(num_blocks):
            assert block is not None
            if block.block_hash is not None:
                evicted.append(block.block_hash)
            block = block.next_free_block
        new_blocks = self.block_pool.get_new_blocks(num_blocks)
        self.num_evicted_blocks += len(evicted)
        # A hash still held by another block (the same content computed twice) is not lost.
        self._evicted_hashes.update(h for h in evicted if self.block_pool.get_cached_block(h) is None)
        return new_blocks

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and index the request's full blocks among its first ``num_tokens`` tokens."""
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block[request_id]
        num_full_blocks = num_tokens // self.block_size
        if num_full_blocks <= num_cached_blocks:
            return
        blocks = self.req_to_blocks[request_id]
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached_blocks, num_full_blocks)
        for i in range(num_cached_blocks, num_full_blocks):
            self._evicted_hashes.discard(request.block_hashes[i])
            if self.verify_hits:
                self._block_content[blocks[i].block_id] = self._content(request, i)
        self.num_cached_block[request_id] = num_full_blocks

    def _record_admission(self, request: Request, num_hits: int, num_hit_blocks: int) -> None:
        """Count the request's lookup once, when it is admitted (vLLM counts at admission too)."""
        preempted = request.num_preemptions > 0
        stats = PrefixCacheStats()
        stats.record(request.num_tokens, num_hits, preempted)
        self.prefix_cache_stats.record(request.num_tokens, num_hits, preempted)
        self._interval_stats.record(request.num_tokens, num_hits, preempted)
        self.caching_metrics.observe(stats)
        lost = {h for h in request.block_hashes[num_hit_blocks:] if h in self._evicted_hashes}
        self.num_blocks_evicted_before_reuse += len(lost)
        self._evicted_hashes -= lost  # each eviction is counted once, by the first request that misses it

    # ----------------------------------------------------------------- freeing

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first, so its prompt's start is evicted last.

        Blocks still shared with another request only lose a reference; full blocks keep their
        hashes in the free queue and can still be hit. Freeing a request that holds nothing
        (never allocated, or freed already) does nothing, as in vLLM.
        """
        if not isinstance(request, Request):
            raise KvlabValueError(f"request must be a kvlab Request, got {type(request).__name__}")
        self._check_same_object(request)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)

    # ----------------------------------------------------------------- kvlab's additions: fork and copy-on-write

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's block table, sharing every block (each ``ref_cnt`` + 1).

        For parallel sampling (``n > 1``). vLLM V1 has no fork; its earlier block manager had
        one, and kvlab keeps it so a learner can watch copy-on-write. Nothing is copied now:
        only a write into a shared, partly filled block copies it (``copy_on_write``). The child
        must be new to this manager and start with the tokens the parent has computed.
        """
        self._check_request(parent)
        self._check_request(child)
        if parent.request_id not in self.req_to_blocks:
            raise RequestStateError(f"request {parent.request_id!r} holds no blocks: there is nothing to fork")
        if child.request_id in self.req_to_blocks or child.num_computed_tokens:
            raise RequestStateError(f"request {child.request_id!r} already holds blocks; fork into a new request")
        computed = parent.num_computed_tokens
        if child.num_tokens < computed or child.token_ids(0, computed) != parent.token_ids(0, computed):
            raise KvlabValueError(
                f"child {child.request_id!r} must start with the {computed} tokens that parent "
                f"{parent.request_id!r} has computed"
            )
        blocks = self.req_to_blocks[parent.request_id]
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_block[child.request_id] = self.num_cached_block[parent.request_id]
        self._requests[child.request_id] = child
        if self.enable_caching:
            self._ensure_block_hashes(child)

    def copy_on_write(self, request: Request) -> list[tuple[int, int]] | None:
        """Before ``request`` writes its next token, give it a private copy of that token's block if it is shared.

        Returns the copies ``(src_block_id, dst_block_id)`` the engine must make on the KV tensors
        (empty when the block is private, full or not yet allocated), or None, changing nothing,
        when no block is free for the copy. The shared block loses one reference and the request's
        table points at the copy. Full blocks are never copied: nobody writes into them again.
        """
        self._check_request(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        index, offset = divmod(request.num_computed_tokens, self.block_size)
        if offset == 0 or index >= len(blocks) or blocks[index].ref_cnt == 1:
            return []
        if self.block_pool.get_num_free_blocks() < 1:
            return None
        shared = blocks[index]
        (copy,) = self._get_new_blocks(1)
        blocks[index] = copy
        self.block_pool.free_blocks([shared])  # its ref_cnt was above 1: the other holders keep it
        return [(shared.block_id, copy.block_id)]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (after a weight update, say); refused (False) while any request holds blocks."""
        if self.req_to_blocks or not self.block_pool.reset_prefix_cache():
            return False
        self._block_content.clear()
        self._evicted_hashes.clear()
        self.caching_metrics.reset()
        self.prefix_cache_stats.reset = self._interval_stats.reset = True
        return True

    # ----------------------------------------------------------------- checks

    def _ensure_block_hashes(self, request: Request) -> None:
        """Hash the request's full blocks the first time this manager sees it, and hook its hasher in."""
        if request._hasher_owner is None:
            request._hasher_owner = self
            request._block_hasher = self._request_block_hasher
            request.block_hashes.extend(self._request_block_hasher(request))
        elif request._hasher_owner is not self:
            raise RequestStateError(
                f"request {request.request_id!r} was hashed by another KVCacheManager (its own hash seed and "
                "function); create a new Request for this manager"
            )

    def _check_request(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise KvlabValueError(f"request must be a kvlab Request, got {type(request).__name__}")
        if request.is_finished():
            raise RequestStateError(
                f"request {request.request_id!r} is {request.status.value}; a finished request gets no blocks"
            )
        self._check_same_object(request)

    def _check_same_object(self, request: Request) -> None:
        live = self._requests.get(request.request_id)
        if live is not None and live is not request:
            raise RequestStateError(
                f"another request with id {request.request_id!r} holds blocks; request ids must be unique"
            )

    def _check_allocation(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None,
        num_lookahead_tokens: int,
    ) -> list[KVCacheBlock]:
        """Validate an ``allocate_slots`` call completely before anything changes; return the hit blocks."""
        self._check_request(request)
        num_new_tokens = positive_int("num_new_tokens", num_new_tokens)
        num_new_computed_tokens = non_negative_int("num_new_computed_tokens", num_new_computed_tokens)
        non_negative_int("num_lookahead_tokens", num_lookahead_tokens)
        computed = list(new_computed_blocks or [])
        held = request.request_id in self.req_to_blocks
        if not held and request.num_computed_tokens > 0:
            raise RequestStateError(
                f"request {request.request_id!r} holds no blocks but has num_computed_tokens="
                f"{request.num_computed_tokens}: it was freed. A preempted request restarts from "
                "num_computed_tokens = 0"
            )
        if len(computed) * self.block_size != num_new_computed_tokens:
            raise KvlabValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} must equal len(new_computed_blocks) x "
                f"block_size = {len(computed)} x {self.block_size}"
            )
        if computed:
            if held:
                raise RequestStateError(
                    f"request {request.request_id!r} already holds blocks; prefix hits are taken only at admission"
                )
            if not self.enable_caching:
                raise KvlabValueError("new_computed_blocks must be empty when prefix caching is disabled")
            self._ensure_block_hashes(request)
            for i, block in enumerate(computed):
                ok = (isinstance(block, KVCacheBlock) and i < len(request.block_hashes)
                      and block.block_hash == request.block_hashes[i]
                      and self.block_pool.cached_block_hash_to_block[block.block_hash].get(block.block_id) is block)
                if not ok:
                    raise KvlabValueError(
                        f"new_computed_blocks[{i}] ({block!r}) is not a cached block of this pool for the request's "
                        f"block {i}; pass exactly what get_computed_blocks returned"
                    )
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if total > request.num_tokens:
            raise KvlabValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens; computing {num_new_tokens} new "
                f"after {request.num_computed_tokens + num_new_computed_tokens} computed would pass its end "
                "(reserve slots for future tokens with num_lookahead_tokens)"
            )
        if self.enable_caching:
            self._ensure_block_hashes(request)
        return computed
