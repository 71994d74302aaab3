"""The coordinator: one block pool, one single-type manager per KV cache group, and one answer for all of them.

Mirrors ``vllm/v1/core/kv_cache_coordinator.py`` (vLLM 0.33.0). ``KVCacheManager`` asks the
coordinator, which asks each group's manager and adds up (blocks to allocate) or agrees
(prefix hits):

* ``UnitaryKVCacheCoordinator``: one group (every layer full attention, or every layer one
  sliding window); its manager's hit is the hit.
* ``HybridKVCacheCoordinator``: several groups (gpt-oss, Gemma 2: sliding-window layers beside
  full ones). A prefix is a hit only if *every* group can serve it, so ``find_longest_cache_hit``
  runs a fixed point: each kind either accepts the candidate length or shortens it, and a
  shortening restarts the round, until no kind shortens it. Full attention goes first (its
  left-to-right scan gives the tightest first bound); with one full and one other kind a single
  round suffices, because a full-attention hit stays a hit at any shorter length.
* ``KVCacheCoordinatorNoPrefixCache``: prefix caching off; no lookup at all.

Every group draws from the same pool, so a block id belongs to one group at a time, and each
group's blocks are keyed in the prefix cache by hash *and* group id. kvlab takes a request's
blocks for all groups in one pool call (``allocate_new_blocks``), so that a call that fails
changes nothing; the blocks come out in vLLM's order (external-token blocks of every group,
then each group's copy and fresh blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvlab.core.block_pool import BlockPool
from kvlab.core.hashing import BlockHash
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.core.request import Request
from kvlab.core.single_type_kv_cache_manager import (
    AllocationPlan,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVCacheSpec
from kvlab.units import cdiv

__all__ = ["HybridKVCacheCoordinator", "KVCacheCoordinator", "KVCacheCoordinatorNoPrefixCache",
           "UnitaryKVCacheCoordinator", "get_kv_cache_coordinator"]

GroupBlocks = tuple[list[KVCacheBlock], ...]  # one list per KV cache group (vLLM's KVCacheBlocks.blocks)


class KVCacheCoordinator:
    """The managers of every KV cache group over one ``BlockPool`` (vLLM's ``KVCacheCoordinator``)."""

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], block_pool: BlockPool, enable_caching: bool,
                 hash_block_size: int, *, max_model_len: int | None = None,
                 max_in_flight_tokens: int | None = None) -> None:
        self.kv_cache_groups = tuple(kv_cache_groups)
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        keyed = len(self.kv_cache_groups) > 1
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, block_pool, i, enable_caching, keyed=keyed,
                                          hash_block_size=hash_block_size, max_model_len=max_model_len,
                                          max_in_flight_tokens=max_in_flight_tokens)
            for i, group in enumerate(self.kv_cache_groups))
        self.block_size = self.single_type_managers[0].block_size

    @property
    def num_groups(self) -> int:
        return len(self.single_type_managers)

    def empty(self) -> GroupBlocks:
        return tuple([] for _ in self.single_type_managers)

    # ----------------------------------------------------------------- counting and allocating

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: GroupBlocks,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   apply_admission_cap: bool = False) -> int:
        """Free blocks all groups take together (the sum over groups: they share one pool)."""
        num_blocks_to_allocate = 0
        for i, manager in enumerate(self.single_type_managers):
            num_blocks_to_allocate += manager.get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks[i], total_computed_tokens, num_local_computed_tokens,
                apply_admission_cap)
        return num_blocks_to_allocate

    def plan_allocation(self, request_id: str, new_computed_blocks: GroupBlocks, num_local_computed_tokens: int,
                        num_external_computed_tokens: int, num_tokens: int) -> list[AllocationPlan]:
        """Each group's share of the allocation, decided before anything changes."""
        plans = []
        for i, manager in enumerate(self.single_type_managers):
            plans.append(manager.plan_allocation(request_id, new_computed_blocks[i], num_local_computed_tokens,
                                                 num_external_computed_tokens, num_tokens))
        return plans

    def allocate_new_blocks(self, request_id: str, plans: list[AllocationPlan],
                            new_computed_blocks: GroupBlocks) -> GroupBlocks:
        """Touch every group's hits and take every group's new blocks in one pool call, then fill the tables.

        vLLM's ``allocate_new_computed_blocks`` (hits, then external-token blocks) and
        ``allocate_new_blocks`` (a partial hit's copy, then fresh blocks), group by group, in one
        step: either the pool has room for all of it, or nothing changes. Returns each group's new
        blocks (copy first), without the external-token ones, as vLLM's does.
        """
        hits: list[KVCacheBlock] = []
        num_external = num_taken = 0
        for plan in plans:
            hits += plan.hits
            num_external += plan.num_external
            num_taken += plan.num_external + plan.partial + plan.num_fresh
        taken = self.block_pool._touch_and_get_new_blocks(hits, num_taken) if (num_taken or hits) else []
        if len(plans) == 1:  # one group: every block taken is its own
            return (self.single_type_managers[0].apply_allocation(request_id, plans[0], new_computed_blocks[0],
                                                                   taken[:num_external], taken[num_external:]),)
        external, new = taken[:num_external], taken[num_external:]
        out = []
        for i, (manager, plan) in enumerate(zip(self.single_type_managers, plans, strict=True)):
            ext, external = external[:plan.num_external], external[plan.num_external:]
            mine, new = new[:plan.partial + plan.num_fresh], new[plan.partial + plan.num_fresh:]
            out.append(manager.apply_allocation(request_id, plan, new_computed_blocks[i], ext, mine))
        return tuple(out)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> list[tuple[int, range]]:
        """Cache every group's full blocks among the first ``num_computed_tokens``; return (group, indices cached)."""
        if not self.enable_caching:
            return []
        cached = []
        for i, manager in enumerate(self.single_type_managers):
            cached.append((i, manager.cache_blocks(request, num_computed_tokens)))
        return cached

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Free, in every group, the blocks no longer reachable once ``num_computed_tokens`` are computed."""
        freed: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            freed += manager.remove_skipped_blocks(request_id, num_computed_tokens)
        return freed

    def free(self, request_id: str) -> None:
        """Free the request's blocks group by group, each group's last block first (vLLM's order)."""
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        """The request's block table in every group (empty where it holds none)."""
        return tuple(list(manager.req_to_blocks.get(request_id, ())) for manager in self.single_type_managers)

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        return [pair for manager in self.single_type_managers for pair in manager.take_pending_cow_copies()]

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[GroupBlocks, int, int]:
        """Each group's hit blocks, the hit's tokens, and the tokens some group cached beyond it (0 unless hybrid)."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: nothing is ever a hit (vLLM's ``KVCacheCoordinatorNoPrefixCache``)."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[GroupBlocks, int, int]:
        return self.empty(), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group (vLLM's ``UnitaryKVCacheCoordinator``): its manager's hit is the hit, keyed by bare hashes."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[GroupBlocks, int, int]:
        manager = self.single_type_managers[0]
        # One group: hits may end on any hash boundary (kvlab lets its one group use partial hits).
        blocks, hit_length = type(manager).find_longest_cache_hit(
            block_hashes, max_cache_hit_length, None, self.block_pool, manager.kv_cache_spec,
            alignment_tokens=self.hash_block_size, hash_block_size=self.hash_block_size)
        return blocks, hit_length, 0


class SpecGroup(NamedTuple):
    """Groups of one spec, looked up together: a hash is a hit only if every one of them holds it."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV cache groups (vLLM's ``HybridKVCacheCoordinator``): the hit is the longest prefix all can serve."""

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], block_pool: BlockPool, enable_caching: bool,
                 hash_block_size: int, **kwargs: Any) -> None:
        super().__init__(kv_cache_groups, block_pool, enable_caching, hash_block_size, **kwargs)
        self.attention_groups: list[SpecGroup] = []
        for i, manager in enumerate(self.single_type_managers):
            for group in self.attention_groups:
                if group.spec == manager.kv_cache_spec and group.manager_cls is type(manager):
                    group.group_ids.append(i)
                    break
            else:
                self.attention_groups.append(SpecGroup(manager.kv_cache_spec, [i], type(manager)))
        # Full attention first: its left-to-right scan gives the tightest first bound.
        self.attention_groups.sort(key=lambda g: not isinstance(g.spec, FullAttentionSpec))
        # kvlab's record of the last lookup, for pictures: (round, group ids, candidate tokens, tokens accepted)
        self.last_rounds: list[tuple[int, tuple[int, ...], int, int]] = []

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[GroupBlocks, int, int]:
        """The fixed point: every kind accepts the candidate length or shortens it; a shortening starts a new round.

        It ends because the length only ever shrinks, and is bounded by 0. A full-attention group
        is looked up once: a full-attention hit is still a hit at any shorter length, so later
        rounds only trim it. With one full and one other kind, one round suffices.
        """
        hit_length = max_cache_hit_length
        longest = 0
        blocks_by_group: list[list[KVCacheBlock] | None] = [None] * self.num_groups
        length_by_group = [0] * self.num_groups
        simple = len(self.attention_groups) == 2 and isinstance(self.attention_groups[0].spec, FullAttentionSpec)
        self.last_rounds = []
        round_no = 0
        while True:
            round_no += 1
            curr = hit_length
            for spec, group_ids, manager_cls in self.attention_groups:
                first = group_ids[0]
                candidate = curr
                if isinstance(spec, FullAttentionSpec) and blocks_by_group[first] is not None:
                    curr = min(curr, length_by_group[first])
                    self.last_rounds.append((round_no, tuple(group_ids), candidate, curr))
                    continue
                blocks, curr = manager_cls.find_longest_cache_hit(block_hashes, curr, group_ids, self.block_pool,
                                                                  spec, alignment_tokens=self.block_size)
                self.last_rounds.append((round_no, tuple(group_ids), candidate, curr))
                for group_id, group_blocks in zip(group_ids, blocks, strict=True):
                    blocks_by_group[group_id], length_by_group[group_id] = group_blocks, curr
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if simple:
                break
        for spec, group_ids, _ in self.attention_groups:  # trim full attention to the agreed length
            if isinstance(spec, FullAttentionSpec):
                for group_id in group_ids:
                    del blocks_by_group[group_id][cdiv(hit_length, self.block_size):]  # type: ignore[index]
        return tuple(b or [] for b in blocks_by_group), hit_length, longest - hit_length


def get_kv_cache_coordinator(kv_cache_groups: Sequence[KVCacheGroupSpec], block_pool: BlockPool,
                             enable_caching: bool, hash_block_size: int, **kwargs: Any) -> KVCacheCoordinator:
    """The coordinator vLLM picks: none for lookups without caching, unitary for one group, hybrid for several."""
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(kv_cache_groups, block_pool, enable_caching, hash_block_size, **kwargs)
    if len(kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_groups, block_pool, enable_caching, hash_block_size, **kwargs)
    return HybridKVCacheCoordinator(kv_cache_groups, block_pool, enable_caching, hash_block_size, **kwargs)
