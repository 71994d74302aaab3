"""A request's life through vLLM's block pool, step by step: allocate, hit, free, evict.

``request_lifecycle`` runs a short, fixed story on a real ``KVCacheManager`` (block size 4, a
pool of 8 blocks with the null block, prefix caching on) and records one ``Step`` per event,
with a sentence saying what the manager did and a ``PoolSnapshot`` of the pool afterwards, the
same snapshot notebook 03's pictures draw:

1. A arrives: nothing is cached, so ``allocate_slots`` takes fresh blocks from the free
   queue's head and caches the full ones;
2. A finishes: ``free`` hands its blocks back last first: the partial block to the head, the
   cached ones to the tail, A's first block last of all;
3. B arrives with A's first 8 tokens: a prefix hit, and ``touch`` takes the two cached blocks
   back out of the queue;
4. B finishes; 5. C, unrelated and long, arrives: taking blocks from the head eventually
   reaches cached ones, and handing them out *is* their eviction; 6. C finishes;
7. D arrives with A's prompt again and hits only what survived; 8. D finishes.

``lifecycle_step_at(k)`` replays the first ``k`` events on a fresh manager, so stepping back
is a replay, as in ``kvlab.sim.block_scenarios``.
"""

from __future__ import annotations

import dataclasses

from kvlab._validate import checked, non_negative_int, one_of
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request, RequestStatus
from kvlab.errors import KvlabValueError
from kvlab.sim.block_scenarios import PoolSnapshot, Step, pool_snapshot
from kvlab.sim.prefix_sim import admit

BLOCK_SIZE = 4
NUM_BLOCKS = 8


@checked
@dataclasses.dataclass(frozen=True)
class Event:
    """``arrive`` (a request with its prompt) or ``finish`` (a live request leaves)."""

    kind: str
    request: str
    tokens: tuple[int, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        one_of("kind", self.kind, ("arrive", "finish"))


EVENTS: tuple[Event, ...] = (
    Event("arrive", "A", tuple(range(10)), "Its two full blocks are now in the prefix cache."),
    Event("finish", "A", note="Nobody holds A's blocks, but the two cached ones can still be hit."),
    Event("arrive", "B", tuple(range(8)) + tuple(range(100, 104)), "B shares A's first 8 tokens."),
    Event("finish", "B"),
    Event("arrive", "C", tuple(range(200, 224)), "C shares nothing and needs 6 blocks: more than the free queue "
          "holds without a hash."),
    Event("finish", "C"),
    Event("arrive", "D", tuple(range(10)), "D is A's prompt again: A's first block survived at the tail, its second "
          "did not, so D recomputes from there."),
    Event("finish", "D"),
)


def _ids(ids: list[int]) -> str:
    return ", ".join(str(i) for i in ids) if ids else "none"


def _blocks(ids: list[int]) -> str:
    """``block 3`` or ``blocks 1, 2``."""
    return f"block {ids[0]}" if len(ids) == 1 else f"blocks {_ids(ids)}"


class _Story:
    """The manager, its live requests and what each block last held, while the events run."""

    def __init__(self) -> None:
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, hash_seed="kvlab-lifecycle")
        self.live: dict[str, Request] = {}
        self.held: dict[int, tuple[int, ...]] = {}  # block id -> the tokens its slots hold (kept once freed)

    def snapshot(self) -> PoolSnapshot:
        tables = {name: self.manager.get_block_ids(name) for name in self.live}
        for name, table in tables.items():
            tokens = self.live[name].all_token_ids
            for j, block_id in enumerate(table):
                self.held[block_id] = tokens[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE]
        return pool_snapshot(self.manager.block_pool, tables, {n: r.all_token_ids for n, r in self.live.items()},
                             lambda block_id: self.held.get(block_id, ()), BLOCK_SIZE)

    def run(self, event: Event, before: PoolSnapshot) -> str:
        """Apply one event; return the sentence saying what the manager did."""
        if event.kind == "arrive":
            request = Request(event.request, event.tokens)
            hits = admit(self.manager, request)
            if hits is None:
                raise KvlabValueError(f"request {event.request} does not fit the lifecycle's pool")
            self.live[event.request] = request
            table = self.manager.get_block_ids(event.request)
            hit_blocks, fresh = table[: hits // BLOCK_SIZE], table[hits // BLOCK_SIZE:]
            evicted = [i for i in fresh if before.blocks[i].block_hash is not None]
            text = (f"{event.request} arrives with {len(event.tokens)} tokens. get_computed_blocks finds "
                    + (f"{hits} tokens cached in {_blocks(hit_blocks)}: a prefix hit, and touch takes "
                       f"{'it' if len(hit_blocks) == 1 else 'them'} out of the free queue (ref_cnt 1)."
                       if hits else "nothing cached.")
                    + f" allocate_slots takes {_blocks(fresh)} from the head of the free queue.")
            if evicted:
                count = len(evicted)
                text += (f" {_blocks(evicted).capitalize()} still had {'a hash' if count == 1 else 'hashes'}: handing "
                         f"{'it' if count == 1 else 'them'} out evicts {'it' if count == 1 else 'them'}.")
            return text
        request = self.live.pop(event.request)
        table = self.manager.get_block_ids(event.request)
        request.status = RequestStatus.FINISHED_STOPPED
        self.manager.free(request)
        cached = [i for i in reversed(table) if self.manager.block_pool.blocks[i].block_hash is not None]
        plain = [i for i in reversed(table) if i not in cached]
        return (f"{event.request} finishes. free hands its blocks back last first ({_ids(list(reversed(table)))}): "
                + (f"{_blocks(plain)} without a hash to the head of the queue, reused first; " if plain else "")
                + f"{_blocks(cached)} cached, to the tail, evicted last.")


@checked
def lifecycle_steps(stop: int | None = None) -> list[Step]:
    """The fresh pool's step, then one step per event (up to ``stop`` events), run on a fresh manager."""
    story = _Story()
    before = story.snapshot()
    steps = [Step(0, len(EVENTS), None, f"A fresh pool of {NUM_BLOCKS} blocks of {BLOCK_SIZE} slots, prefix "
                  "caching on. Block 0 is the null block; the free queue holds the other "
                  f"{len(before.free_queue)}.", before)]
    for index, event in enumerate(EVENTS[:stop], start=1):
        text = story.run(event, before)
        after = story.snapshot()
        steps.append(Step(index, len(EVENTS), None, f"{text} {event.note}".strip(), after))
        before = after
    return steps


@checked
def lifecycle_step_at(index: int) -> Step:
    """The state after the first ``index`` events, replayed from a fresh manager."""
    index = non_negative_int("index", index)
    if index > len(EVENTS):
        raise KvlabValueError(f"index must be between 0 and {len(EVENTS)}, got {index}")
    return lifecycle_steps(index)[-1]
