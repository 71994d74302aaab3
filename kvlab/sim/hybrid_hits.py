"""One request's prefix hit in a hybrid model, kind by kind: what full attention, a sliding window, and both accept.

``hit_walkthrough`` runs kvlab's real manager: request A computes a prompt in a model with a
sliding-window group beside a full-attention group, chosen blocks of A are evicted (as other
traffic would), and request B, which shares A's prompt, looks its prefix up. It reports what
each kind would hit on its own (``FullAttentionManager`` / ``SlidingWindowManager``
``find_longest_cache_hit``), the rounds of the coordinator's agreement, and the hit B gets.
Notebook 08's stepper shows it one step at a time.
"""

from __future__ import annotations

import dataclasses

from kvlab._validate import checked, non_negative_int, positive_int
from kvlab.core.kv_cache_coordinator import HybridKVCacheCoordinator
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request
from kvlab.errors import KvlabValueError
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

GROUP_NAMES = ("sliding window", "full attention")


@dataclasses.dataclass(frozen=True)
class HitWalkthrough:
    """What each group holds of A's prompt, what each kind accepts alone, and the agreed hit."""

    block_size: int
    sliding_window: int
    num_prompt_blocks: int  # full blocks of A's prompt (B may hit at most num_tokens - 1 tokens)
    max_hit_tokens: int
    cached: tuple[tuple[bool, ...], tuple[bool, ...]]  # per group, per block: still in the prefix cache
    alone: tuple[int, int]  # tokens each kind would hit on its own: (sliding window, full attention)
    rounds: tuple[tuple[int, str, int, int], ...]  # (round, kind, candidate tokens, tokens it accepts)
    hit_tokens: int  # the hybrid hit: the longest prefix both accept
    hit_block_ids: tuple[tuple[int, ...], tuple[int, ...]]  # B's hit per group (0: the null block)
    needed: int  # blocks in a row the window needs before a hit's end: cdiv(W - 1, block_size)

    @property
    def steps(self) -> list[str]:
        """The stepper's steps, in order."""
        return ["cached", "full attention alone", "sliding window alone", "agreement", "hit"]


@checked(at_most={"num_prompt_tokens": 10**5, "sliding_window": 10**5, "block_size": 10**5})
def hit_walkthrough(num_prompt_tokens: int = 40, sliding_window: int = 8, block_size: int = 4,
                    evict_sliding: tuple[int, ...] = (), evict_full: tuple[int, ...] = ()) -> HitWalkthrough:
    """A computes ``num_prompt_tokens`` tokens; its blocks ``evict_*`` (logical indices) are evicted; B, the same
    prompt plus one token, looks up its prefix. Every number comes from kvlab's ``KVCacheManager``."""
    num_prompt_tokens = positive_int("num_prompt_tokens", num_prompt_tokens)
    block_size = positive_int("block_size", block_size)
    window = positive_int("sliding_window", sliding_window)
    num_blocks = num_prompt_tokens // block_size
    for name, evict in (("evict_sliding", evict_sliding), ("evict_full", evict_full)):
        bad = [i for i in evict if non_negative_int(name, i) >= num_blocks]
        if bad:
            raise KvlabValueError(f"{name} names blocks {bad}; A's prompt has full blocks 0..{num_blocks - 1}")
    specs = [SlidingWindowSpec(block_size, sliding_window=window), FullAttentionSpec(block_size)]
    manager = KVCacheManager(2 * num_blocks + 4, block_size, hash_seed="08", kv_cache_groups=specs)
    prompt = [(7 * t + 3) % 101 for t in range(num_prompt_tokens)]
    a = Request("A", prompt)
    manager.allocate_slots(a, num_prompt_tokens)
    tables = manager.get_blocks("A")
    for group, evict in zip(tables, (evict_sliding, evict_full), strict=True):
        manager.block_pool.evict_blocks(sorted({group[i].block_id for i in evict}))
    b = Request("B", prompt + [1])
    hits, hit_tokens, _ = manager.get_computed_blocks(b)
    coordinator = manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    limit = b.num_tokens - 1
    alone = tuple(
        type(m).find_longest_cache_hit(b.block_hashes, limit, [g], manager.block_pool, m.kv_cache_spec,
                                       alignment_tokens=block_size)[1]
        for g, m in enumerate(coordinator.single_type_managers))
    rounds = tuple((r, GROUP_NAMES[ids[0]], candidate, accepted)
                   for r, ids, candidate, accepted in coordinator.last_rounds)
    return HitWalkthrough(
        block_size=block_size, sliding_window=window, num_prompt_blocks=num_blocks, max_hit_tokens=limit,
        cached=tuple(tuple(blk.block_hash is not None for blk in group) for group in tables),  # type: ignore[arg-type]
        alone=alone,  # type: ignore[arg-type]
        rounds=rounds, hit_tokens=hit_tokens,
        hit_block_ids=tuple(tuple(ids) for ids in hits.get_block_ids()),  # type: ignore[arg-type]
        needed=specs[0].num_contiguous_blocks_for_hit(),
    )
