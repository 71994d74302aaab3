"""kvlab's fork and copy-on-write for parallel sampling, on ``KVCacheManager`` (a mixin).

The PagedAttention paper's mechanism, which vLLM's V0 block manager had: ``fork`` shares every
block of a request with a child, and the first write into a shared, partly filled block copies
it. vLLM V1 has neither: it runs ``n`` independent requests that share the prompt's full
blocks through the prefix cache, and its only copy-on-write (0.33.0) is for a prefix hit that
ends inside a block (``KVCacheManager.take_kv_cache_block_copies``). The copy itself is
``BlockPool.copy_on_write``, shared with ``kvlab.core.sequence``.
"""

from __future__ import annotations

from kvlab._validate import checked
from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from kvlab.core.request import Request


@checked
class ForkMixin:
    """``fork`` and ``copy_on_write`` on a manager's block tables."""

    block_size: int
    enable_caching: bool
    block_pool: BlockPool
    req_to_blocks: dict[str, list[KVCacheBlock]]
    num_cached_block: dict[str, int]
    _requests: dict[str, Request]

    @checked
    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's block table, sharing every block (each ``ref_cnt`` + 1).

        For parallel sampling (``n > 1``), as the PagedAttention paper (and vLLM's V0 block
        manager) did it. V1 has no fork: it runs ``n`` requests that share the prompt's full
        blocks through the prefix cache. Nothing is copied now: only a write into a shared,
        partly filled block copies it (``copy_on_write``). The child must be new to this
        manager and start with the tokens the parent has computed.
        """
        self._check_fork(parent, child)
        blocks = self.req_to_blocks[parent.request_id]
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_block[child.request_id] = self.num_cached_block[parent.request_id]
        self._requests[child.request_id] = child
        if self.enable_caching:
            self._ensure_block_hashes(child)

    @checked
    def copy_on_write(self, request: Request) -> list[KVCacheBlockCopy] | None:
        """Before ``request`` writes its next token, give it a private copy of that token's block if it is shared.

        Returns the copies ``(src_block_id, dst_block_id)`` the engine must make on the KV tensors
        (empty when the block is private, full or not yet allocated), or None, changing nothing,
        when no block is free for the copy. Full blocks are never copied: nobody writes into them
        again. The copy itself is ``BlockPool.copy_on_write``, shared with ``kvlab.core.sequence``.
        """
        self._check_request(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        index, offset = divmod(request.num_computed_tokens, self.block_size)
        if offset == 0 or index >= len(blocks) or blocks[index].ref_cnt == 1 or self._is_retained(blocks[index]):
            return []
        if self.block_pool.get_num_free_blocks() < 1:
            return None
        return [self.block_pool.copy_on_write(blocks, index)]
