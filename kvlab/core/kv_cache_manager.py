"""The KV cache manager: prefix-cache lookup, slot allocation and freeing for each request.

Mirrors ``vllm/v1/core/kv_cache_manager.py`` (vLLM 0.33.0). The manager checks each call and
keeps the statistics; the work is its coordinator's (``kvlab.core.kv_cache_coordinator``), which
runs one single-type manager per KV cache group (``kvlab.core.single_type_kv_cache_manager``:
full attention, sliding window) over one block pool. By default there is one full-attention
group; ``kv_cache_groups`` gives a hybrid model's groups (``kvlab.capacity.hybrid`` makes them).
The scheduler's calls are vLLM's: ``get_computed_blocks(request, max_cache_hit_length=None)``
(the longest cached prefix, its tokens, and the shared-prefix boundary; never the last token,
which the model must compute for the next token's logits), ``allocate_slots(...)`` (the new
blocks, or None), ``take_kv_cache_block_copies()`` and ``free(request)`` (tail first). Blocks
come back as vLLM's ``KVCacheBlocks`` (one list per group, ``blocks[0]`` with one group), whatever
the number of groups, as vLLM 0.33.0's do.

**Sliding windows.** Before it counts what a running request needs, ``allocate_slots`` frees the
blocks its window left behind (the null block takes their place), as vLLM does; a call that
then returns None has changed nothing else. **Partial hits.** With hashes finer than blocks
(``hash_block_size`` < ``block_size``, one full-attention group) a hit may end inside a block;
``allocate_slots`` copies that block and queues ``KVCacheBlockCopy(src, dst)`` for the worker.
vLLM 0.33.0 turns this on only beside Mamba layers in "align" mode; kvlab lets one group use it.

kvlab adds checks vLLM leaves to its scheduler (bad calls raise ``RequestStateError`` or
``KvlabValueError`` and change nothing; ``kvlab.core.manager_checks``), eviction counters, one
``NONE_HASH`` per manager (vLLM's is process state), ``fork`` and ``copy_on_write`` for parallel
sampling (``kvlab.core.manager_fork``, one group: the PagedAttention paper's mechanism, which V1
serves through the prefix cache instead) and ``verify_hits``, nano-vllm's per-hit comparison of
tokens (one group). vLLM's KV events, encoder blocks, Mamba and chunked local attention are not
modelled.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvlab._validate import MAX_OBJECTS, checked, positive_int
from kvlab.core.block_pool import BlockPool, BlockPoolObserver
from kvlab.core.cache_stats import CachingMetrics, PrefixCacheStats
from kvlab.core.hashing import (
    BlockHash,
    HashFn,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_fn_name,
    none_hash_from_seed,
)
from kvlab.core.kv_cache_coordinator import GroupBlocks, get_kv_cache_coordinator
from kvlab.core.kv_cache_events import KVCacheEventRecord
from kvlab.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy, KVCacheBlocks
from kvlab.core.manager_checks import AllocationChecks
from kvlab.core.manager_fork import ForkMixin
from kvlab.core.request import FINISHED, Request, RequestStatus
from kvlab.core.single_type_kv_cache_manager import find_longest_cache_hit
from kvlab.errors import RequestStateError
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVCacheSpec, as_group_specs

__all__ = ["KVCacheBlocks", "KVCacheManager", "Request", "RequestStatus", "find_longest_cache_hit"]


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
    requests the hit rate covers. ``kv_cache_groups`` (specs or ``KVCacheGroupSpec``s, each of
    ``block_size``) replaces the one full-attention group; ``max_in_flight_tokens`` (vLLM's: the
    tokens scheduled but not yet computed, at most) caps what a sliding-window group is counted
    to need when a whole request must fit. ``enable_kv_cache_events`` queues vLLM's KV cache events
    (``take_events``).
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
        kv_cache_groups: Sequence[KVCacheGroupSpec | KVCacheSpec] | None = None,
        max_in_flight_tokens: int | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.block_size = positive_int("block_size", block_size)
        self.hash_block_size = self._check_hash_block_size(hash_block_size, verify_hits)
        groups = as_group_specs([FullAttentionSpec(self.block_size)] if kv_cache_groups is None else
                                list(kv_cache_groups), self.block_size)
        self._check_groups(groups, verify_hits)
        self.kv_cache_groups: tuple[KVCacheGroupSpec, ...] = groups
        self.caching_hash_fn: HashFn = hash_fn if callable(hash_fn) else get_hash_fn_by_name(hash_fn)
        self.hash_fn_name = hash_fn_name(self.caching_hash_fn)
        self.max_model_len = None if max_model_len is None else positive_int("max_model_len", max_model_len)
        if max_in_flight_tokens is not None:
            positive_int("max_in_flight_tokens", max_in_flight_tokens)
        self.watermark_blocks = self._check_watermark(watermark, num_blocks)
        self.caching_metrics = CachingMetrics(hit_rate_window)
        self.block_pool = BlockPool(num_blocks, enable_caching, reserve_null_block, metrics_collector=metrics_collector,
                                    enable_kv_cache_events=enable_kv_cache_events)
        self.enable_caching = bool(enable_caching)
        self.coordinator = get_kv_cache_coordinator(groups, self.block_pool, self.enable_caching, self.hash_block_size,
                                                    max_model_len=self.max_model_len,
                                                    max_in_flight_tokens=max_in_flight_tokens)
        # Each request's block table in the first group (with one group: the block table).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = self.coordinator.single_type_managers[0].req_to_blocks
        self._no_hits: tuple[list[KVCacheBlock], ...] = ((),) * len(groups)  # type: ignore[assignment]
        # vLLM's: the one empty result, shared (nested tuples keep it immutable).
        self.empty_kv_cache_blocks = KVCacheBlocks(self._no_hits)
        # The last lookup (request, eviction epoch, hit tokens, hits): its result is checked in O(1) at admission.
        self._last_lookup: tuple[Request, int, int, tuple[tuple[KVCacheBlock, ...], ...]] | None = None
        self.verify_hits = bool(verify_hits)
        seed = hash_seed if hash_seed is not None else os.getenv("PYTHONHASHSEED")
        self.none_hash: BlockHash = none_hash_from_seed(self.caching_hash_fn, seed)
        self._request_block_hasher = get_request_block_hasher(self.hash_block_size, self.caching_hash_fn,
                                                              self.none_hash)
        self._requests: dict[str, Request] = {}  # the live requests holding blocks
        # One record per admission, into the open step's stats (vLLM's prefix_cache_stats); the steps taken by
        # make_prefix_cache_stats() are added up in _taken_stats, so the since-start totals need no second record.
        self._interval_stats = PrefixCacheStats()
        self._taken_stats = PrefixCacheStats()
        self.num_rejected_hits = 0  # hash hits whose tokens differed (verify_hits only)
        self.num_lost_hits = 0  # evicted contents a later request asked for again (num_blocks_evicted_before_reuse)
        self._block_content: dict[int, tuple[tuple[int, ...], Any]] = {}  # verify_hits: what each block holds

    # ----------------------------------------------------------------- what the scheduler reads

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.kv_cache_groups)

    @property
    def num_cached_block(self) -> dict[str, int]:
        """How many of each request's blocks are cached, in the first group."""
        return self.coordinator.single_type_managers[0].num_cached_block

    @property
    def _pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        return [pair for m in self.coordinator.single_type_managers for pair in m._pending_cow_copies]

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
        return self.block_pool.num_evicted_blocks

    @property
    def num_blocks_evicted_before_reuse(self) -> int:
        """Evicted blocks a later request asked for again, and recomputed (kvlab's counter)."""
        return self.num_lost_hits

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats since start (kvlab's): the steps ``make_prefix_cache_stats`` took, plus the open one."""
        return self._taken_stats + self._interval_stats

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats gathered since the previous call (then reset), as vLLM's scheduler takes them each step."""
        stats, self._interval_stats = self._interval_stats, PrefixCacheStats()
        self._taken_stats = self._taken_stats + stats
        return stats

    @checked
    def get_blocks_per_group(self, request_id: str) -> GroupBlocks:
        """The blocks of a live request in every group, in logical order (one block table per group)."""
        if request_id not in self.req_to_blocks:
            raise RequestStateError(
                f"request {request_id!r} holds no blocks: it is unknown, was never allocated, or was freed"
            )
        return self.coordinator.get_blocks(request_id)

    @checked
    def get_block_ids_per_group(self, request_id: str) -> tuple[list[int], ...]:
        """The block ids of a live request in every group: the rows of the block tables the kernels read."""
        if request_id not in self.req_to_blocks:
            self.get_blocks_per_group(request_id)  # raises: the request holds no blocks
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())]  # one pass, no copy of the blocks
                     for m in self.coordinator.single_type_managers)

    @checked
    def get_blocks(self, request_id: str) -> list[KVCacheBlock] | tuple[list[KVCacheBlock], ...]:
        """The blocks of a live request in logical order (its block table; one per group if there are several)."""
        groups = self.get_blocks_per_group(request_id)
        return groups[0] if len(groups) == 1 else groups

    @checked
    def get_block_ids(self, request_id: str) -> list[int] | tuple[list[int], ...]:
        """The block ids of a live request: the row of the block table the attention kernel reads (per group)."""
        groups = self.get_block_ids_per_group(request_id)
        return groups[0] if len(groups) == 1 else groups

    @checked
    def full_block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's hashes at block granularity: each block is named by the hash at its last boundary."""
        return self.coordinator.single_type_managers[0].full_block_hashes(request)

    def _create_kv_cache_blocks(self, blocks: GroupBlocks) -> KVCacheBlocks:
        """The blocks as a ``KVCacheBlocks``, or the shared empty one (vLLM's ``create_kv_cache_blocks``)."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # ----------------------------------------------------------------- prefix-cache lookup

    @checked(inline=True)  # the checks written into the method: a lookup per admission pays no wrapper's call
    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The cached blocks of the request's longest cached prefix, their tokens, and vLLM's shared-prefix boundary.

        At most ``max_cache_hit_length`` tokens hit, by default ``num_tokens - 1``: a fully
        cached prompt still computes its last token, and since hits end on hash boundaries, that
        means the last block (or hash block) is recomputed. With several groups the hit is the
        longest prefix every group can serve, and the third value is vLLM's
        ``shared_prefix_boundary``: where the longest single group's hit ended when that was
        further (else 0). The lookup changes nothing in the pool; the first one hashes the
        request with this manager's seed.
        """
        if request.status in FINISHED or self._requests.get(request.request_id, request) is not request:
            self._check_request(request)  # refuses: a finished request, or another one of the same id
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0, 0
        self._ensure_block_hashes(request)
        limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        groups, hit_length, uncached = self.coordinator.find_longest_cache_hit(request.block_hashes, limit)
        if self.verify_hits:
            groups = (self._verified(request, groups[0]),)
            hit_length = len(groups[0]) * self.block_size
        self._last_lookup = (request, self.block_pool.eviction_epoch, hit_length, tuple(map(tuple, groups)))
        return self._create_kv_cache_blocks(groups), hit_length, (hit_length + uncached if uncached else 0)

    # ----------------------------------------------------------------- allocation

    @checked(skip=("new_computed_blocks",), inline=True)  # _check_allocation says what each group needs
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for ``num_new_tokens`` tokens to compute; return the new blocks, or None.

        ``new_computed_blocks`` (``num_new_computed_tokens`` tokens) are the hits from
        ``get_computed_blocks``, and ``num_external_computed_tokens`` the tokens a KV connector
        (the CPU tier of notebook 07) will load, both for a request that holds no blocks yet.
        A running request first lets go of the blocks its sliding windows no longer reach. The
        pool must then supply the new blocks *and* the hit blocks that sit in the free queue
        (taking them out of it is what keeps them from eviction), and still leave
        ``reserved_blocks`` free (plus the ``watermark`` when admitting while others run); if it
        cannot, the call returns None and changes nothing more. ``full_sequence_must_fit`` asks
        that the whole request fit. Full blocks of tokens already known are cached (hashed and
        indexed) at once, unless ``delay_cache_blocks``. ``num_lookahead_tokens`` reserves slots
        for tokens not yet known (speculative decoding). The returned blocks hold the copy of a
        partial hit's tail block first, then the fresh blocks, as vLLM's do (blocks for
        external tokens are in the table but not returned). ``num_encoder_tokens`` and
        ``skip_zeroing_group_ids`` are vLLM's too; kvlab has no encoder and no zeroing, so they
        must keep their defaults.
        """
        computed, _ = self._check_allocation(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, num_encoder_tokens, reserved_blocks, skip_zeroing_group_ids)
        rid = request.request_id
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = num_local_computed_tokens + num_external_computed_tokens
        num_tokens_need_slot = total_computed_tokens + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            total_computed_tokens, num_tokens_need_slot = self._cap(total_computed_tokens), \
                self._cap(num_tokens_need_slot)
        num_tokens = len(request._all_token_ids)
        watermark = (self.watermark_blocks if has_scheduled_reqs and request.status in
                     (RequestStatus.WAITING, RequestStatus.PREEMPTED) else 0)
        coordinator = self.coordinator
        if full_sequence_must_fit:
            need = coordinator.get_num_blocks_to_allocate(rid, self._cap(num_tokens), computed,
                                                          total_computed_tokens, num_local_computed_tokens, True)
            if need + watermark > self.block_pool.get_num_free_blocks():
                return None
        # Blocks outside every sliding window go first, whatever happens next (vLLM frees them even when the
        # request then does not fit: they are dead, and freeing them first spares an eviction).
        coordinator.remove_skipped_blocks(rid, total_computed_tokens)
        need = coordinator.get_num_blocks_to_allocate(rid, num_tokens_need_slot, computed,
                                                      num_local_computed_tokens + num_external_computed_tokens,
                                                      num_local_computed_tokens)
        if need + watermark > self.block_pool.free_block_queue.num_free_blocks - reserved_blocks:
            return None

        admitted = rid not in self._requests
        plans = coordinator.plan_allocation(rid, computed, num_local_computed_tokens, num_external_computed_tokens,
                                            num_tokens_need_slot)
        new_blocks = coordinator.allocate_new_blocks(rid, plans, computed)
        if admitted:
            self._requests[rid] = request
            self._last_lookup = None
            if self.enable_caching:
                self._ensure_block_hashes(request)
                self._record_admission(request, num_new_computed_tokens, len(computed[0]))
        if self.enable_caching and not delay_cache_blocks:
            self._cache_blocks(request, min(total_computed_tokens + num_new_tokens, num_tokens))
        return self._create_kv_cache_blocks(new_blocks)

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

    def _cap(self, num_tokens: int) -> int:
        return num_tokens if self.max_model_len is None else min(num_tokens, self.max_model_len)

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """The copies queued since the last call, and the blocks they retain (vLLM's name).

        The caller hands the copies to the worker and, once they are made, frees the retained
        blocks with ``block_pool.free_blocks`` (kvlab's synchronous scheduler does so at once).
        """
        pending = self.coordinator.take_pending_cow_copies()
        copies = [KVCacheBlockCopy(source.block_id, copy.block_id) for source, copy in pending]
        return copies, [block for pair in pending for block in pair]

    @checked
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and index the request's full blocks among its first ``num_tokens`` tokens (and its partial tail)."""
        self._check_cache_blocks(request, num_tokens)
        self._cache_blocks(request, num_tokens)

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        evicted = self.block_pool.evicted_hashes
        for group_id, cached in self.coordinator.cache_blocks(request, num_tokens):
            if not cached or not (evicted or self.verify_hits):
                continue
            manager = self.coordinator.single_type_managers[group_id]
            hashes = manager.full_block_hashes(request)
            blocks = manager.req_to_blocks[request.request_id]
            for i in cached:
                evicted.discard(manager.cache_key(hashes[i]) if manager.keyed else hashes[i])  # computed again
                if self.verify_hits:
                    self._block_content[blocks[i].block_id] = self._content(request, i)

    def _record_admission(self, request: Request, num_hits: int, num_hit_blocks: int) -> None:
        """Count the request's lookup once, when it is admitted (vLLM counts at admission too)."""
        preempted = request.num_preemptions > 0
        self._interval_stats.record(request.num_tokens, num_hits, preempted)
        self.caching_metrics._observe_request(request.num_tokens, num_hits, preempted)
        evicted = self.block_pool.evicted_hashes
        if evicted:  # count the contents this request asked for again that eviction had lost, once each
            lost = set()
            for m in self.coordinator.single_type_managers:
                missed = m.full_block_hashes(request)[num_hit_blocks:]
                lost.update(evicted.intersection(map(m.cache_key, missed) if m.keyed else missed))
            self.num_lost_hits += len(lost)
            evicted -= lost

    # ----------------------------------------------------------------- freeing

    @checked(inline=True)
    def free(self, request: Request) -> None:
        """Release the request's blocks, group by group, last block first, so its prompt's start is evicted last.

        Blocks still shared with another request only lose a reference; full blocks keep their
        hashes in the free queue and can still be hit. Freeing a request that holds nothing
        (never allocated, or freed already) does nothing, as in vLLM.
        """
        if self._requests.get(request.request_id, request) is not request:
            self._check_same_object(request)  # refuses: another request of the same id holds the blocks
        self.coordinator.free(request.request_id)
        self._requests.pop(request.request_id, None)

    def take_events(self) -> list[KVCacheEventRecord]:
        """The KV cache events the pool queued since the last call (vLLM's ``KVCacheManager.take_events``)."""
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (after a weight update, say); refused (False) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._block_content.clear()
        self.caching_metrics.reset()
        self._taken_stats.reset = self._interval_stats.reset = True
        return True
