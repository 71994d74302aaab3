"""The checks ``KVCacheManager`` runs before it changes anything: a linear list, kept apart from the logic.

vLLM trusts its scheduler and asserts; kvlab is called from notebooks, so every call is
checked completely first, once per call (never per token or per block when a cheaper whole
check exists), and a bad call raises a kvlab error naming the parameter, with nothing changed.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from kvlab._validate import checked, positive_int
from kvlab.core.block_pool import BlockPool
from kvlab.core.hashing import generate_block_hash_extra_keys
from kvlab.core.kv_cache_coordinator import KVCacheCoordinator
from kvlab.core.kv_cache_utils import KVCacheBlock, KVCacheBlocks
from kvlab.core.request import FINISHED, Request
from kvlab.errors import KvlabValueError, RequestStateError
from kvlab.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec
from kvlab.units import cdiv


@checked
class AllocationChecks:
    """Argument and state checks of the manager's public calls (a mixin of ``KVCacheManager``)."""

    block_size: int
    hash_block_size: int
    enable_caching: bool
    block_pool: BlockPool
    coordinator: KVCacheCoordinator
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    req_to_blocks: dict[str, list[KVCacheBlock]]
    _requests: dict[str, Request]
    _pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]]
    _block_content: dict[int, tuple[tuple[int, ...], Any]]
    num_rejected_hits: int
    _request_block_hasher: Any
    _no_hits: tuple[list[KVCacheBlock], ...]
    _last_lookup: tuple[Request, int, int, tuple[tuple[KVCacheBlock, ...], ...]] | None
    empty_kv_cache_blocks: KVCacheBlocks

    def _check_hash_block_size(self, hash_block_size: int | None, verify_hits: bool) -> int:
        if hash_block_size is None:
            return self.block_size
        hash_block_size = positive_int("hash_block_size", hash_block_size)
        if self.block_size % hash_block_size:
            raise KvlabValueError(f"hash_block_size={hash_block_size} must divide block_size={self.block_size}")
        if verify_hits and hash_block_size != self.block_size:
            raise KvlabValueError("verify_hits compares whole blocks: it needs hash_block_size == block_size")
        return hash_block_size

    def _check_groups(self, groups: tuple[KVCacheGroupSpec, ...], verify_hits: bool) -> None:
        """Several groups, or a sliding window, need block-sized hashes (no partial hits) and no verify_hits."""
        sliding = any(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups)
        if (len(groups) > 1 or sliding) and self.hash_block_size != self.block_size:
            raise KvlabValueError(f"hash_block_size={self.hash_block_size} must equal block_size={self.block_size} "
                                  "with several KV cache groups or a sliding window: their hits end on whole blocks")
        if len(groups) > 1 and verify_hits:
            raise KvlabValueError("verify_hits compares one block table's tokens: it needs one KV cache group")

    @staticmethod
    def _check_watermark(watermark: float, num_blocks: int) -> int:
        if isinstance(watermark, bool) or not isinstance(watermark, numbers.Real) or not 0 <= watermark < 1:
            raise KvlabValueError(f"watermark must be a share of the blocks in [0, 1), got {watermark!r}")
        return int(watermark * positive_int("num_blocks", num_blocks))

    def _check_request(self, request: Request) -> None:
        if type(request) is not Request and not isinstance(request, Request):
            raise KvlabValueError(f"request must be a kvlab Request, got {type(request).__name__}")
        if request.status in FINISHED:
            raise RequestStateError(
                f"request {request.request_id!r} is {request.status.value}; a finished request gets no blocks"
            )
        live = self._requests.get(request.request_id)
        if live is not None and live is not request:
            self._check_same_object(request)

    def _check_same_object(self, request: Request) -> None:
        live = self._requests.get(request.request_id)
        if live is not None and live is not request:
            raise RequestStateError(
                f"another request with id {request.request_id!r} holds blocks; request ids must be unique"
            )

    def _is_retained(self, block: KVCacheBlock) -> bool:
        """True for a partial hit's copy still waiting for ``take_kv_cache_block_copies`` (its extra reference)."""
        return any(copy is block for _, copy in self._pending_cow_copies)

    def _group_hits(self, new_computed_blocks: object) -> tuple[list[KVCacheBlock], ...]:
        """The hits as one list per group: a list (one group), a ``KVCacheBlocks`` or a tuple of lists (several)."""
        n = len(self.kv_cache_groups)
        if n == 1 and type(new_computed_blocks) is list:
            return (new_computed_blocks,)
        if new_computed_blocks is None or (isinstance(new_computed_blocks, (list, tuple)) and not new_computed_blocks):
            return ((),) * n  # type: ignore[return-value]
        if isinstance(new_computed_blocks, KVCacheBlocks):
            groups = new_computed_blocks.blocks
        elif n == 1:
            groups = (new_computed_blocks,)
        else:
            groups = new_computed_blocks  # type: ignore[assignment]
        if not isinstance(groups, (list, tuple)) or len(groups) != n or not (  # exact types in one C-level pass
                set(map(type, groups)) <= {list, tuple} or all(isinstance(g, (list, tuple)) for g in groups)):
            raise KvlabValueError(f"new_computed_blocks must hold one list of blocks per KV cache group ({n}); pass "
                                  "what get_computed_blocks returned")
        return tuple(map(list, groups))

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

    def _check_fork(self, parent: Request, child: Request) -> None:
        self._check_request(parent)
        self._check_request(child)
        if parent.request_id not in self.req_to_blocks:
            raise RequestStateError(f"request {parent.request_id!r} holds no blocks: there is nothing to fork")
        if child.request_id in self.req_to_blocks or child.num_computed_tokens:
            raise RequestStateError(f"request {child.request_id!r} already holds blocks; fork into a new request")
        if len(self.kv_cache_groups) > 1:
            raise KvlabValueError("fork shares one block table: it needs one KV cache group (a hybrid model's "
                                  "parallel samples are separate requests that share the prompt through the cache)")
        if child._hasher_owner not in (None, self):
            raise RequestStateError(f"request {child.request_id!r} was hashed by another KVCacheManager")
        computed = parent.num_computed_tokens
        if child.num_tokens < computed or child.token_ids(0, computed) != parent.token_ids(0, computed):
            raise KvlabValueError(
                f"child {child.request_id!r} must start with the {computed} tokens that parent "
                f"{parent.request_id!r} has computed"
            )

    def _check_allocation(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        num_encoder_tokens: int,
        reserved_blocks: int,
        skip_zeroing_group_ids: tuple[int, ...],
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Validate an ``allocate_slots`` call completely before anything changes.

        Returns the hit blocks (one list per group) and 1 if the hit ends inside its last block (a
        partial hit to copy), else 0.
        """
        # The counts are ints >= 0 and the request a Request (@checked saw them at the door).
        rid, num_computed = request.request_id, request.num_computed_tokens
        if request.status in FINISHED or self._requests.get(rid, request) is not request:
            self._check_request(request)
        if num_encoder_tokens:
            raise KvlabValueError("num_encoder_tokens must be 0: kvlab models no cross-attention (decoder-only)")
        if skip_zeroing_group_ids:
            raise KvlabValueError("skip_zeroing_group_ids must be empty: kvlab's worker zeroes no blocks")
        num_external = num_external_computed_tokens
        if num_new_tokens == 0 and num_external == 0 and num_new_computed_tokens == 0:
            raise KvlabValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        held = self.req_to_blocks.get(rid)
        if held is not None:  # a running request: no hits, no external tokens, no write into a shared block
            if new_computed_blocks or num_new_computed_tokens or num_external:
                self._refuse_hits_of_a_running_request(request, new_computed_blocks, num_new_computed_tokens,
                                                       num_external)
            if num_computed + num_new_tokens > len(request._all_token_ids):
                self._refuse_past_the_end(request, num_new_tokens, 0, 0)
            index, offset = divmod(num_computed, self.block_size)
            if offset and index < len(held) and held[index].ref_cnt > 1:
                self._check_not_writing_shared(request, held)
            return self._no_hits, 0
        if num_computed > 0:
            raise RequestStateError(
                f"request {rid!r} holds no blocks but has num_computed_tokens={num_computed}: it was freed. "
                "A preempted request restarts from num_computed_tokens = 0"
            )
        if self.enable_caching and request._hasher_owner not in (None, self):
            raise RequestStateError(
                f"request {rid!r} was hashed by another KVCacheManager (its own hash seed and "
                "function); create a new Request for this manager"
            )
        if (new_computed_blocks is None or new_computed_blocks is self.empty_kv_cache_blocks) \
                and not num_new_computed_tokens:
            computed, partial = self._no_hits, 0  # no hits: nothing to check against the lookup
        else:
            computed = self._group_hits(new_computed_blocks)
            partial = self._check_hits(request, computed, num_new_computed_tokens)
        if num_computed + num_new_computed_tokens + num_external + num_new_tokens > len(request._all_token_ids):
            self._refuse_past_the_end(request, num_new_tokens, num_new_computed_tokens, num_external)
        return computed, partial

    @staticmethod
    def _refuse_past_the_end(request: Request, num_new_tokens: int, num_new_computed_tokens: int,
                             num_external: int) -> None:
        computed = request.num_computed_tokens + num_new_computed_tokens + num_external
        raise KvlabValueError(
            f"request {request.request_id!r} has {request.num_tokens} tokens; computing num_new_tokens="
            f"{num_new_tokens} after {computed} computed (num_new_computed_tokens="
            f"{num_new_computed_tokens}, num_external_computed_tokens={num_external}) would pass its end "
            "(reserve slots for future tokens with num_lookahead_tokens)"
        )

    def _refuse_hits_of_a_running_request(self, request: Request, new_computed_blocks: object,
                                          num_new_computed_tokens: int, num_external: int) -> None:
        """A running request takes no hits and no external tokens (empty hits, as a list, are fine)."""
        if any(self._group_hits(new_computed_blocks)) or num_new_computed_tokens or num_external:
            raise RequestStateError(
                f"request {request.request_id!r} already holds blocks; prefix hits and external tokens are taken "
                "only at admission"
            )

    def _check_hits(self, request: Request, groups: tuple[list[KVCacheBlock], ...], num_tokens: int) -> int:
        """The hits must be exactly what ``get_computed_blocks`` returned for this request, in every group."""
        lookup = self._last_lookup  # O(1) in the usual case: the hits of the last lookup, with no eviction since
        if lookup is not None and lookup[0] is request and lookup[1] == self.block_pool.eviction_epoch \
                and lookup[2] == num_tokens and lookup[3] == tuple(map(tuple, groups)):  # C-level: no call per block
            return int(num_tokens % self.block_size != 0)
        for g, computed in enumerate(groups):
            if cdiv(num_tokens, self.block_size) != len(computed) or num_tokens % self.hash_block_size:
                where = f"new_computed_blocks[{g}]" if len(groups) > 1 else "new_computed_blocks"
                raise KvlabValueError(
                    f"num_new_computed_tokens={num_tokens} does not fit len({where})={len(computed)} blocks of "
                    f"{self.block_size} tokens (hits end on a multiple of hash_block_size={self.hash_block_size}); "
                    "pass exactly what get_computed_blocks returned"
                )
        if not any(groups):
            return 0
        if not self.enable_caching:
            raise KvlabValueError("new_computed_blocks must be empty when prefix caching is disabled")
        if request._hasher_owner is not self:
            raise KvlabValueError(f"request {request.request_id!r} was not looked up by this manager: pass the blocks "
                                  "get_computed_blocks returned for it")
        real = [b for computed in groups for b in computed if not getattr(b, "is_null", False)]
        for g, computed in enumerate(groups):
            self._check_group_hits(request, g, computed, num_tokens, len(groups) > 1)
        if len({b.block_id for b in real}) != len(real):
            raise KvlabValueError("new_computed_blocks lists a block twice; pass what get_computed_blocks returned")
        return int(num_tokens % self.block_size != 0)

    def _check_group_hits(self, request: Request, g: int, computed: list[KVCacheBlock], num_tokens: int,
                          several: bool) -> None:
        """Each hit is a cached block of this pool for its position; a sliding window's may be null, but not the
        last ``cdiv(W - 1, block_size)``: those its next token reads."""
        manager = self.coordinator.single_type_managers[g]
        spec = manager.kv_cache_spec
        must_be_real = len(computed) - min(spec.num_contiguous_blocks_for_hit(), len(computed)) \
            if isinstance(spec, SlidingWindowSpec) else 0
        scale = self.block_size // self.hash_block_size
        index = self.block_pool.cached_block_hash_to_block
        for i, block in enumerate(computed):
            fine = min((i + 1) * scale, num_tokens // self.hash_block_size) - 1
            if isinstance(block, KVCacheBlock) and block.is_null and block._pool is self.block_pool and \
                    i < must_be_real:
                continue  # slid out of the window: a placeholder
            if not (isinstance(block, KVCacheBlock) and block._pool is self.block_pool and not block.is_null
                    and fine < len(request.block_hashes)
                    and index.contain(manager.cache_key(request.block_hashes[fine]), block.block_id)):
                where = f"new_computed_blocks[{g}][{i}]" if several else f"new_computed_blocks[{i}]"
                raise KvlabValueError(
                    f"{where} ({block!r}) is not a cached block of this pool for the request's "
                    f"block {i}; pass exactly what get_computed_blocks returned"
                )

    def _check_cache_blocks(self, request: Request, num_tokens: int) -> None:
        """``cache_blocks`` caches blocks a live request holds: up to the slots it was allocated, no further."""
        self._check_request(request)
        held = self.req_to_blocks.get(request.request_id)
        if held is None:
            raise RequestStateError(f"request {request.request_id!r} holds no blocks: allocate_slots first, then "
                                    "cache_blocks")
        if num_tokens > len(held) * self.block_size:
            raise KvlabValueError(f"num_tokens must be at most the {len(held) * self.block_size} slots request "
                                  f"{request.request_id!r} was allocated, got {num_tokens}")

    def _check_not_writing_shared(self, request: Request, held: list[KVCacheBlock]) -> None:
        """A running request writes its next token in place: that block must be its own (fork: copy first)."""
        index, offset = divmod(request.num_computed_tokens, self.block_size)
        if offset and index < len(held) and held[index].ref_cnt > 1 and not self._is_retained(held[index]):
            raise RequestStateError(
                f"request {request.request_id!r} would write into block {held[index].block_id}, which "
                f"{held[index].ref_cnt} holders share; call copy_on_write(request) first"
            )

