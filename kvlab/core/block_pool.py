"""The physical block pool: every block, the free queue, and the index of cached full blocks.

Mirrors ``vllm/v1/core/block_pool.py`` (vLLM 0.33.0) for one KV cache group, so block hashes
carry no group id. ``KVCacheBlock`` and ``FreeKVCacheBlockQueue`` live in
``kvlab.core.kv_cache_utils``, as in vLLM.

Every operation checks its whole input before it changes anything, so a call that raises
leaves the pool exactly as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvlab._validate import non_negative_int, positive_int
from kvlab.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock
from kvlab.errors import BlockStateError, OutOfBlocksError


class BlockPoolObserver(Protocol):
    """What ``BlockPool`` tells its optional ``metrics_collector``, at the points vLLM's ``BlockPool`` calls it.

    ``kvlab.core.kv_cache_metrics.KVCacheMetricsCollector`` is one; the pool behaves the same with or without.
    """

    def on_block_allocated(self, block: KVCacheBlock) -> None: ...  # get_new_blocks handed the block out

    def on_block_accessed(self, block: KVCacheBlock) -> None: ...  # touch: a prefix hit took the block

    def on_block_evicted(self, block: KVCacheBlock) -> None: ...  # the free queue gave the block up for reuse

    def reset(self) -> None: ...  # reset_prefix_cache succeeded


class BlockPool:
    """All physical blocks, the free queue, and the index of cached (hashed) full blocks.

    ``reserve_null_block`` takes block 0 out at start, as vLLM does: it is the placeholder
    a block table can point at without holding KV, and it is never handed out, freed or
    cached. ``get_usage`` therefore counts ``num_blocks - 1`` usable blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        reserve_null_block: bool = True,
        *,
        metrics_collector: BlockPoolObserver | None = None,
    ) -> None:
        self.num_gpu_blocks = positive_int("num_blocks", num_blocks)
        if reserve_null_block and num_blocks < 2:
            raise OutOfBlocksError("num_blocks must be at least 2 when block 0 is reserved as the null block")
        self.enable_caching = bool(enable_caching)
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        for block in self.blocks:
            block._pool = self
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # block hash -> {block_id: block}. Several blocks may hold the same content (two
        # requests computed it before either was cached); any of them serves a hit.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block: KVCacheBlock | None = None
        # Optional observer (vLLM's KVCacheMetricsCollector); it sees the pool, never changes it.
        self.metrics_collector = metrics_collector
        if reserve_null_block:
            self.null_block = self.free_block_queue.popleft()
            self.null_block.is_null = True

    # ----------------------------------------------------------------- allocation

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-but-free ones included: they can be evicted)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Share of usable blocks in use, as vLLM reports ``kv_cache_usage``: 1 - free / usable."""
        usable = self.num_gpu_blocks - (1 if self.null_block is not None else 0)
        return 1.0 - self.get_num_free_blocks() / usable

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ``ref_cnt`` 1.

        A block that still carries a hash is evicted on the way: its hash leaves the index.
        Asking for more than are free raises ``OutOfBlocksError`` and takes nothing.
        """
        num_blocks = non_negative_int("num_blocks", num_blocks)
        if num_blocks > self.get_num_free_blocks():
            raise OutOfBlocksError(
                f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} are free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            if self.metrics_collector is not None:
                self.metrics_collector.on_block_allocated(block)
        return blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per listed block; blocks that reach 0 return to the free queue.

        Blocks without a hash go to the head (reused first, LIFO); cached blocks go to the tail
        (kept longest for prefix hits, LRU). Callers pass a request's blocks tail first, so its
        prompt-start blocks are the last to be evicted. A block freed more often than it is
        referenced, a foreign block or the null block raises ``BlockStateError``, changing nothing.
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
        for block in blocks:
            block.ref_cnt -= 1
        # A block listed twice (two references dropped in one call) re-enters the queue once,
        # at the place of its last reference: dict.fromkeys over the reversed list keeps that one.
        released = [b for b in reversed(dict.fromkeys(reversed(blocks))) if b.ref_cnt == 0]
        self.free_block_queue.prepend_n([b for b in released if b.block_hash is None])
        self.free_block_queue.append_n([b for b in released if b.block_hash is not None])

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a prefix hit); a block at 0 leaves the free queue."""
        blocks = list(blocks)
        self._check_own(blocks, "touch")
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if self.metrics_collector is not None:
                self.metrics_collector.on_block_accessed(block)

    # ----------------------------------------------------------------- the prefix-cache index

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block holding the content ``block_hash`` names, or None (a miss)."""
        candidates = self.cached_block_hash_to_block.get(block_hash)
        if not candidates:
            return None
        return next(iter(candidates.values()))

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Give blocks ``num_cached_blocks .. num_full_blocks - 1`` of a request their hashes.

        ``blocks`` is the request's block table and ``block_hashes`` its chained hashes (one
        per full block); blocks before ``num_cached_blocks`` are cached already.
        """
        if not self.enable_caching:
            raise BlockStateError("prefix caching is disabled for this pool: nothing can be cached")
        num_cached_blocks = non_negative_int("num_cached_blocks", num_cached_blocks)
        num_full_blocks = non_negative_int("num_full_blocks", num_full_blocks)
        if not num_cached_blocks <= num_full_blocks <= min(len(blocks), len(block_hashes)):
            raise BlockStateError(
                f"need num_cached_blocks <= num_full_blocks <= blocks and hashes; got {num_cached_blocks}, "
                f"{num_full_blocks}, {len(blocks)} blocks, {len(block_hashes)} hashes"
            )
        new = list(blocks[num_cached_blocks:num_full_blocks])
        self._check_own(new, "cache")
        for block, block_hash in zip(new, block_hashes[num_cached_blocks:num_full_blocks], strict=True):
            if block.block_hash is not None and block.block_hash != block_hash:
                raise BlockStateError(f"block {block.block_id} is cached under another hash")
        for block, block_hash in zip(new, block_hashes[num_cached_blocks:num_full_blocks], strict=True):
            if block.block_hash is None:
                block.block_hash = block_hash
                self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Withdraw blocks from the prefix cache by id (vLLM's ``evict_blocks``): their hashes leave the index.

        For blocks whose KV cannot be trusted (kvlab: those a failed step was to fill). A block
        stays where it is, held or free; one without a hash is left alone. Unlike vLLM, the
        observers are not told: the block is not given up for reuse, and kvlab's CPU tier, which
        stores what the pool evicts, must not store KV that was perhaps never written.
        """
        ids = list(block_ids)
        for block_id in ids:
            if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self.num_gpu_blocks:
                raise BlockStateError(f"cannot evict block {block_id!r}: block ids are 0 .. {self.num_gpu_blocks - 1}")
        for block_id in ids:
            self._uncache(self.blocks[block_id])

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """If ``block`` is cached, drop it from the index and forget its hash (the eviction)."""
        if self.metrics_collector is not None:  # vLLM reports every block leaving the free queue, hashed or not
            self.metrics_collector.on_block_evicted(block)
        return self._uncache(block)

    def _uncache(self, block: KVCacheBlock) -> bool:
        """Drop ``block`` from the hash index and forget its hash; False if it had none."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        candidates = self.cached_block_hash_to_block.get(block_hash, {})
        candidates.pop(block.block_id, None)
        if not candidates:
            self.cached_block_hash_to_block.pop(block_hash, None)
        block.reset_hash()
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (returns False) while any block is in use."""
        usable = self.num_gpu_blocks - (1 if self.null_block is not None else 0)
        if self.get_num_free_blocks() != usable:
            return False
        for block in self.blocks:
            block.reset_hash()
        self.cached_block_hash_to_block.clear()
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        return True

    # ----------------------------------------------------------------- checks

    def _check_own(self, blocks: Sequence[KVCacheBlock], action: str) -> None:
        for block in blocks:
            if not isinstance(block, KVCacheBlock) or block._pool is not self:
                raise BlockStateError(f"cannot {action} {block!r}: it does not belong to this pool")
            if block.is_null:
                raise BlockStateError(f"cannot {action} the null block (block {block.block_id})")
