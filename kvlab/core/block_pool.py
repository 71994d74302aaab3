"""The physical block pool: every block, the free queue, and the index of cached blocks.

Mirrors ``vllm/v1/core/block_pool.py`` (vLLM 0.33.0). With one KV cache group keys are bare
hashes; with several, each carries its group id (``make_block_hash_with_group_id``).
``KVCacheBlock`` and ``FreeKVCacheBlockQueue`` live in
``kvlab.core.kv_cache_utils``, as in vLLM.

Every operation checks its whole input before it changes anything, so a call that raises leaves
the pool as it was. Observers (vLLM's ``metrics_collector``, kvlab's CPU tier) hear what the pool
is about to do *before* it does it: one that raises stops the operation with nothing changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from kvlab._validate import MAX_OBJECTS, checked, non_negative_int, positive_int
from kvlab.core.hashing import make_block_hash_with_group_id
from kvlab.core.kv_cache_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEventRecord
from kvlab.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheBlockCopy
from kvlab.errors import BlockStateError, KvlabValueError, OutOfBlocksError


class BlockPoolObserver(Protocol):
    """What ``BlockPool`` tells its observers, at the points vLLM's ``BlockPool`` tells its ``metrics_collector``.

    ``kvlab.core.kv_cache_metrics.KVCacheMetricsCollector`` is one; the pool behaves the same with or without.
    """

    def on_block_allocated(self, block: KVCacheBlock) -> None: ...  # get_new_blocks hands the block out

    def on_block_accessed(self, block: KVCacheBlock) -> None: ...  # touch: a prefix hit takes the block

    def on_block_evicted(self, block: KVCacheBlock) -> None: ...  # caching on: the block leaves the queue for reuse

    def reset(self) -> None: ...  # reset_prefix_cache is about to succeed


@checked
class BlockHashToBlockMap:
    """The prefix-cache index: block hash -> the blocks holding that content, as vLLM's ``BlockHashToBlockMap``.

    Several blocks may hold one hash (two requests computed the same prefix before either was
    cached: vLLM never de-duplicates); a hit takes the first. vLLM stores a lone block without
    its inner dict to spare the garbage collector; kvlab always keeps the dict.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHash) -> KVCacheBlock | None:
        """Any block cached under ``key`` (the first inserted), or None."""
        blocks = self._cache.get(key)
        return next(iter(blocks.values())) if blocks else None

    def contain(self, key: BlockHash, block_id: int) -> bool:
        """True if ``key`` maps to block ``block_id``."""
        blocks = self._cache.get(key)
        return blocks is not None and block_id in blocks

    def insert(self, key: BlockHash, block: KVCacheBlock) -> None:
        self._cache.setdefault(key, {})[block.block_id] = block

    def pop(self, key: BlockHash, block_id: int) -> KVCacheBlock | None:
        """Remove block ``block_id`` from ``key``; the key goes when no block is left."""
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[key]
        return block

    def block_ids(self, key: BlockHash) -> list[int]:
        """The ids of the blocks cached under ``key``, first-inserted first."""
        return list(self._cache.get(key, ()))

    def items(self) -> Iterator[tuple[BlockHash, dict[int, KVCacheBlock]]]:
        """``(hash, {block_id: block})`` for every cached hash (copies: reading never changes the index)."""
        return ((key, dict(blocks)) for key, blocks in self._cache.items())

    def values(self) -> Iterator[dict[int, KVCacheBlock]]:
        """``{block_id: block}`` for every cached hash (copies)."""
        return (dict(blocks) for blocks in self._cache.values())

    def clear(self) -> None:
        self._cache.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._cache

    def __len__(self) -> int:
        return len(self._cache)


@checked(at_most={"num_blocks": MAX_OBJECTS})
class BlockPool:
    """All physical blocks, the free queue, and the index of cached (hashed) blocks.

    ``reserve_null_block`` takes block 0 out at start, as vLLM always does: it is the
    placeholder a block table can point at without holding KV, and it is never handed out,
    freed or cached. ``num_usable_blocks`` is the rest, and ``get_usage`` counts against it.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        reserve_null_block: bool = True,
        *,
        metrics_collector: BlockPoolObserver | None = None,
        observers: Iterable[BlockPoolObserver] = (),
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.num_gpu_blocks = positive_int("num_blocks", num_blocks)
        if reserve_null_block and num_blocks < 2:
            raise OutOfBlocksError("num_blocks must be at least 2 when block 0 is reserved as the null block")
        self.enable_caching = bool(enable_caching)
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        for block in self.blocks:
            block._pool = self
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.free_block_queue.fake_free_list_head._pool = self.free_block_queue.fake_free_list_tail._pool = self
        # While a step's ``Snapshot`` is open: every block a change reaches, with its slots before the first change.
        self._journal: dict[KVCacheBlock, tuple[Any, ...]] | None = None
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Hashes a block holds besides its primary ``block_hash``: a partial entry registered on a
        # block that already had a full hash (vLLM's ``cached_block_hashes_by_block``).
        self.cached_block_hashes_by_block: dict[int, set[BlockHash]] = {}
        self.null_block: KVCacheBlock | None = None
        # vLLM's one optional KVCacheMetricsCollector, then any number of further observers (the CPU tier):
        # each sees the pool, none changes it, and the order they were attached in does not matter.
        self.metrics_collector = metrics_collector
        self.observers: list[BlockPoolObserver] = list(observers)
        # kvlab's eviction counters, kept by the pool as it evicts: cached blocks whose hash allocation dropped,
        # and the evicted contents no other block holds that nobody has asked for since (the manager reads them).
        self.num_evicted_blocks = 0
        self.evicted_hashes: set[BlockHash] = set()
        # Bumped by every eviction: a lookup's hits, stamped with it, are still cached while it is unchanged.
        self.eviction_epoch = 0
        # vLLM's KV cache events: plain records queued here, handed over by take_events()
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.kv_event_queue: list[KVCacheEventRecord] = []
        if reserve_null_block:
            self.null_block = self.free_block_queue.popleft()
            self.null_block.is_null = True

    # ----------------------------------------------------------------- reading

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever hold: all of them but the null block."""
        return self.num_gpu_blocks - (self.null_block is not None)

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-but-free ones included: they can be evicted)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Share of usable blocks in use, as vLLM reports ``kv_cache_usage``: 1 - free / usable."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    @checked
    def add_observer(self, observer: BlockPoolObserver) -> None:
        """Attach one more observer (kept beside ``metrics_collector``, never instead of it)."""
        for name in ("on_block_allocated", "on_block_accessed", "on_block_evicted", "reset"):
            if not callable(getattr(observer, name, None)):
                raise KvlabValueError(f"observer must have a method {name}(), as BlockPoolObserver says")
        self.observers.append(observer)

    def _watchers(self) -> list[BlockPoolObserver]:
        return [self.metrics_collector, *self.observers] if self.metrics_collector is not None else self.observers

    # ----------------------------------------------------------------- allocation

    @checked
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ``ref_cnt`` 1.

        With caching on, a block that still carries a hash is evicted on the way: its hashes
        leave the index. Asking for more than are free raises ``OutOfBlocksError`` and takes nothing.
        """
        if num_blocks > self.get_num_free_blocks():
            raise OutOfBlocksError(f"cannot get num_blocks={num_blocks} blocks: only {self.get_num_free_blocks()} "
                                   "are free")
        return self._touch_and_get_new_blocks([], num_blocks)

    @checked
    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a prefix hit); a block at 0 leaves the free queue."""
        hits = list(blocks)
        self._check_own(hits, "touch")
        self._touch_and_get_new_blocks(hits, 0)

    @checked
    def touch_and_get_new_blocks(self, hit_blocks: Iterable[KVCacheBlock], num_new: int) -> list[KVCacheBlock]:
        """``touch(hit_blocks)`` then ``get_new_blocks(num_new)``, as one step that fails whole or not at all.

        The manager admits a request this way: the hits leave the free queue before the new
        blocks are taken, so no hit can be evicted to make room for its own request. Observers
        hear every call in vLLM's order (each hit accessed, then each new block evicted and
        allocated) before anything changes.
        """
        hits = list(hit_blocks)
        self._check_own(hits, "touch")
        free = self.get_num_free_blocks() - len({b.block_id for b in hits if b.ref_cnt == 0})
        if num_new > free:
            raise OutOfBlocksError(f"cannot get num_new={num_new} blocks: only {free} are free")
        return self._touch_and_get_new_blocks(hits, num_new)

    def _touch_and_get_new_blocks(self, hits: list[KVCacheBlock], num_new: int) -> list[KVCacheBlock]:
        """The algorithm of ``touch_and_get_new_blocks`` (kvlab's callers have checked what it takes)."""
        queue = self.free_block_queue
        watchers = self._watchers()
        if watchers:  # told first: one that raises stops the call with nothing changed
            leaving = frozenset(b.block_id for b in hits if b.ref_cnt == 0)
            new = queue.peek_n(num_new, leaving)
            for watcher in watchers:
                for block in hits:
                    watcher.on_block_accessed(block)
            for block in new:
                for watcher in watchers:
                    if self.enable_caching:
                        watcher.on_block_evicted(block)
                    watcher.on_block_allocated(block)
        for block in hits:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1
        taken = queue.popleft_n(num_new)
        for block in taken:
            if self.enable_caching and (block._block_hash is not None or block.block_id in
                                        self.cached_block_hashes_by_block):
                self._evict(block)
            block.ref_cnt = 1
        return taken

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a reused block's hashes from the index, counting the eviction (and the content, if now lost)."""
        primary = block._block_hash
        index = self.cached_block_hash_to_block
        if primary is None or block.block_id in self.cached_block_hashes_by_block:
            self._remove_cached_block_hashes(block)
        else:  # the usual case, inline: one hash to drop
            index.pop(primary, block.block_id)
            block._block_hash = block._block_hash_num_tokens = None
            self.eviction_epoch += 1
            if self.enable_kv_cache_events:  # vLLM: BlockRemoved for the evicted hash
                self.kv_event_queue.append(BlockRemoved((primary,)))
        if primary is not None:
            self.num_evicted_blocks += 1
            if primary not in index._cache:  # no other block holds the same content
                self.evicted_hashes.add(primary)

    @checked
    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per listed block; blocks that reach 0 return to the free queue.

        Blocks without a hash, and every block when caching is off, go to the head (reused
        first, LIFO); cached blocks go to the tail (kept longest for prefix hits, LRU). Callers
        pass a request's blocks tail first, so its prompt-start blocks are the last to be
        evicted. A block freed more often than it is referenced, a foreign block or the null
        block raises ``BlockStateError``, changing nothing (vLLM skips null blocks silently).
        """
        blocks = list(ordered_blocks)
        self._check_own(blocks, "free")
        for block_id, count in Counter(b.block_id for b in blocks).items():
            block = self.blocks[block_id]
            if block.ref_cnt < count:
                raise BlockStateError(
                    f"cannot free block {block_id} {count} time(s): its ref_cnt is {block.ref_cnt} "
                    "(a double free?)"
                )
        self._free_blocks(blocks)

    def _free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """The algorithm of ``free_blocks`` (kvlab's callers free only the blocks they hold)."""
        first, last = [], []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block._block_hash is None or not self.enable_caching else last).append(block)
        queue = self.free_block_queue
        if first:
            queue._link_before(queue.fake_free_list_head.next_free_block, first)  # type: ignore[arg-type]
        if last:
            queue._link_before(queue.fake_free_list_tail, last)

    @checked
    def copy_on_write(self, blocks: list[KVCacheBlock], index: int,
                      copy: KVCacheBlock | None = None) -> KVCacheBlockCopy:
        """Give a holder of the shared block ``blocks[index]`` a private copy: the one copy-on-write.

        Takes a new block, puts it at ``blocks[index]`` and drops the holder's reference to the
        shared one (whose other holders keep it). Returns the copy the worker must make on the
        KV tensors before anyone writes into the new block. The fork of ``kvlab.core.sequence``
        and of ``KVCacheManager`` both copy this way (the PagedAttention paper's mechanism).
        ``copy`` is a block the caller already took for it (so that one pool call takes all it needs).
        """
        self._check_copy_on_write(blocks, index, copy)
        shared = blocks[index]
        if copy is None:
            (copy,) = self.get_new_blocks(1)
        blocks[index] = copy
        shared.ref_cnt -= 1  # >= 1 left: the other holders keep it, out of the free queue
        return KVCacheBlockCopy(shared.block_id, copy.block_id)

    # ----------------------------------------------------------------- the prefix-cache index

    @checked
    def get_cached_block(self, block_hash: BlockHash | None, kv_cache_group_ids: Sequence[int] | None = None) -> Any:
        """A block holding the content ``block_hash`` names, or None (a miss); with ``kv_cache_group_ids``,
        vLLM's form: one block per group, keyed with its group id, or None if any group misses."""
        if block_hash is None:  # no hash: nothing can match
            return None
        return self._get_cached_block(block_hash, kv_cache_group_ids)

    def _get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int] | None) -> Any:
        if kv_cache_group_ids is None:
            return self.cached_block_hash_to_block.get_one_block(block_hash)
        blocks = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            blocks.append(block)
        return blocks

    @checked
    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int | None = None,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Give blocks ``num_cached_blocks .. num_full_blocks - 1`` of a request their hashes.

        ``blocks`` is the request's block table and ``block_hashes`` its chained hashes, one per
        full block (vLLM passes the request and resolves them itself). Blocks before
        ``num_cached_blocks`` are cached already. With ``block_size`` each entry records the
        prefix tokens it covers (``block_hash_num_tokens``), and a block holding a partial entry
        (a shorter prefix inside it) is promoted to its full hash. A block cached under another
        full hash, a hash that is None or unhashable, raise before anything changes. ``token_ids``
        (the request's tokens) fill the ``BlockStored`` event when events are on.
        """
        self._check_cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks, block_size)
        self._cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks, block_size, token_ids)

    def _check_cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                                 num_cached_blocks: int, num_full_blocks: int, block_size: int | None) -> None:
        if not self.enable_caching:
            raise BlockStateError("prefix caching is disabled for this pool: nothing can be cached")
        if block_size is not None:
            positive_int("block_size", block_size)
        if not num_cached_blocks <= num_full_blocks <= min(len(blocks), len(block_hashes)):
            raise BlockStateError(
                f"need num_cached_blocks <= num_full_blocks <= blocks and hashes; got {num_cached_blocks}, "
                f"{num_full_blocks}, {len(blocks)} blocks, {len(block_hashes)} hashes"
            )
        new = list(blocks[num_cached_blocks:num_full_blocks])
        hashes = list(block_hashes[num_cached_blocks:num_full_blocks])
        ends = [None if block_size is None else (i + 1) * block_size for i in range(num_cached_blocks, num_full_blocks)]
        self._check_own(new, "cache")
        if len({b.block_id for b in new}) != len(new):
            raise BlockStateError("a block appears twice among the blocks to cache")
        for i, (block, block_hash, end) in enumerate(zip(new, hashes, ends, strict=True), start=num_cached_blocks):
            _check_hash(f"block_hashes[{i}]", block_hash)
            if block.block_hash not in (None, block_hash) and not _is_partial(block, end):
                raise BlockStateError(f"block {block.block_id} is cached under another hash")

    def _cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                           num_cached_blocks: int, num_full_blocks: int, block_size: int | None = None,
                           token_ids: Sequence[int] = ()) -> None:
        """The algorithm of ``cache_full_blocks``: kvlab's managers pass their own blocks and hashes."""
        new = blocks[num_cached_blocks:num_full_blocks]
        hashes = block_hashes[num_cached_blocks:num_full_blocks]
        ends = [None if block_size is None else (i + 1) * block_size for i in range(num_cached_blocks, num_full_blocks)]
        index = self.cached_block_hash_to_block
        for block, block_hash, end in zip(new, hashes, ends, strict=True):
            if block._block_hash is None:  # the usual case, inline: an uncached block holds no other hash
                block._block_hash, block._block_hash_num_tokens = block_hash, end
                index.insert(block_hash, block)
                continue
            assert block._block_hash == block_hash or _is_partial(block, end), block
            if block._block_hash == block_hash:
                continue
            if block._block_hash is not None:  # a partial entry whose block is now full: promote it
                self._remove_cached_block_hashes(block)
            self._insert_block_hash(block_hash, block, end)
        if self.enable_kv_cache_events and hashes:
            size = block_size or 0
            self.kv_event_queue.append(BlockStored(
                tuple(hashes), block_hashes[num_cached_blocks - 1] if num_cached_blocks else None,
                tuple(token_ids[num_cached_blocks * size:num_full_blocks * size]), size))

    @checked
    def cache_partial_block(self, block: KVCacheBlock, block_hash: BlockHash, num_tokens: int) -> None:
        """Register a partial entry: ``block_hash`` names the prefix of ``num_tokens`` tokens ending inside ``block``.

        vLLM 0.33.0 does this for the prompt's last hash boundary when hashes are finer than
        blocks (``hash_block_size`` < ``block_size``), so that a later request sharing the prompt
        start can hit that prefix and copy the block (``_apply_cow``). An entry the block already
        holds for fewer tokens is replaced; one for more tokens stays, and this one joins it.
        """
        self._check_own([block], "cache")
        _check_hash("block_hash", block_hash)
        num_tokens = positive_int("num_tokens", num_tokens)
        if not self.enable_caching:
            raise BlockStateError("prefix caching is disabled for this pool: nothing can be cached")
        already = block._block_hash == block_hash or self.cached_block_hash_to_block.contain(block_hash, block.block_id)
        covered = block.block_hash_num_tokens
        if not already and block._block_hash is not None and covered is not None and covered < num_tokens:
            self._remove_cached_block_hashes(block)
        self._insert_block_hash(block_hash, block, num_tokens)

    def _insert_block_hash(self, block_hash: BlockHash, block: KVCacheBlock, num_tokens: int | None) -> None:
        if block._block_hash == block_hash or self.cached_block_hash_to_block.contain(block_hash, block.block_id):
            return
        if block._block_hash is None:
            block.set_block_hash(block_hash, num_tokens)
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(block_hash)
        self.cached_block_hash_to_block.insert(block_hash, block)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHash]:
        """Drop every hash ``block`` holds from the index and forget its primary hash (the eviction)."""
        self.eviction_epoch += 1  # a lookup's hits made before this may name a block that no longer holds them
        hashes = [] if block._block_hash is None else [block._block_hash]
        hashes.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        removed = [h for h in hashes if self.cached_block_hash_to_block.pop(h, block.block_id) is not None]
        block.reset_hash()
        if self.enable_kv_cache_events:  # vLLM: one BlockRemoved per hash
            self.kv_event_queue.extend(BlockRemoved((h,)) for h in removed)
        return removed

    @checked
    def evict_blocks(self, block_ids: Iterable[int], *, notify: bool = True) -> None:
        """Drop the listed blocks' hashes from the prefix cache (blocks in use stay in use), as vLLM does.

        vLLM tells its metrics collector of each block; ``notify=False`` tells no observer, for blocks
        whose KV cannot be trusted (kvlab: those a failed step was to fill), since kvlab's CPU tier
        stores what the pool evicts and must not store KV that was perhaps never written.
        """
        ids = [non_negative_int("block_ids", i) for i in block_ids]
        for block_id in ids:
            if block_id >= self.num_gpu_blocks:
                raise KvlabValueError(f"block_ids must be below num_blocks={self.num_gpu_blocks}, got {block_id}")
        for block_id in ids:
            block = self.blocks[block_id]
            for watcher in self._watchers() if notify else ():
                watcher.on_block_evicted(block)
            if notify:
                self._evict(block)
            else:
                self._remove_cached_block_hashes(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (returns False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for watcher in self._watchers():
            watcher.reset()
        for block in self.blocks:
            block.reset_hash()
        self.cached_block_hash_to_block.clear()
        self.cached_block_hashes_by_block.clear()
        self.evicted_hashes.clear()
        self.eviction_epoch += 1
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEventRecord]:
        """Hand over every queued KV cache event and start a new queue (vLLM's ``take_events``)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    # ----------------------------------------------------------------- checks

    def _check_copy_on_write(self, blocks: list[KVCacheBlock], index: int, copy: KVCacheBlock | None) -> None:
        if index >= len(blocks):
            raise KvlabValueError(f"index must be below len(blocks)={len(blocks)}, got {index}")
        self._check_own([blocks[index]], "copy")
        shared = blocks[index]
        if shared.ref_cnt < 2:
            raise BlockStateError(f"block {shared.block_id} is not shared (ref_cnt {shared.ref_cnt}): write in place")
        if copy is not None:
            if not isinstance(copy, KVCacheBlock) or copy._pool is not self or copy.is_null:
                raise BlockStateError(f"copy must be a block of this pool (not the null block), got {copy!r}")
            if copy.ref_cnt != 1 or any(b is copy for b in blocks):
                raise BlockStateError(f"copy must be a block the caller took for it (ref_cnt 1, not yet in blocks); "
                                      f"got {copy!r}")

    def _check_own(self, blocks: Sequence[KVCacheBlock], action: str) -> None:
        for block in blocks:
            if not isinstance(block, KVCacheBlock) or block._pool is not self:
                raise BlockStateError(f"cannot {action} {block!r}: it does not belong to this pool")
            if block.is_null:
                raise BlockStateError(f"cannot {action} the null block (block {block.block_id})")


def _is_partial(block: KVCacheBlock, end: int | None) -> bool:
    """True if the block's primary hash is a partial entry: fewer prefix tokens than the block's end."""
    covered = block.block_hash_num_tokens
    return covered is not None and (end is None or covered < end)


def _check_hash(name: str, block_hash: object) -> None:
    """A block hash must name something: not None, and hashable (bytes from ``kvlab.core.hashing``)."""
    if block_hash is None or not isinstance(block_hash, Hashable):
        raise KvlabValueError(f"{name} must be a block hash (bytes, or any hashable value but None), got "
                              f"{block_hash!r}")
    try:
        hash(block_hash)
    except TypeError as exc:  # a tuple holding a list is Hashable by type, not by value
        raise KvlabValueError(f"{name} must be hashable, got {block_hash!r}") from exc
