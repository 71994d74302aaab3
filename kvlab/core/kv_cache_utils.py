"""Block metadata and the free queue: ``KVCacheBlock`` and ``FreeKVCacheBlockQueue``.

Mirrors the block half of ``vllm/v1/core/kv_cache_utils.py`` (vLLM 0.33.0); the hashing half of
that file is ``kvlab.core.hashing``. Free blocks and cached blocks share one doubly linked queue:
eviction is what happens when allocation reaches a block that still has a hash, and a prefix hit
takes a cached block out of the middle of the queue in O(1).
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Hashable, Iterable, Sequence
from typing import ClassVar, NamedTuple

from kvlab._validate import checked
from kvlab.errors import BlockStateError, OutOfBlocksError

#: The one block-hash type (vLLM's ``BlockHash`` is bytes): bytes from ``kvlab.core.hashing``'s functions, or any
#: hashable value but None from a teaching hash function. ``hashing``, the pool and the CPU tier all use this one.
BlockHash = Hashable


@checked
class KVCacheBlock:
    """Metadata of one physical KV block: its id, who uses it, what it caches, its queue links."""

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "_block_hash_num_tokens", "prev_free_block",
                 "next_free_block", "is_null", "_pool")

    #: The pools whose ``_journal`` is open (a step's ``Snapshot``): while there is one, every write to a block's
    #: slot goes through ``_note_then_set`` (``open_journal``); with none, writes cost nothing extra.
    _journalling: ClassVar[weakref.WeakSet] = weakref.WeakSet()

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # how many requests' block tables (or direct holders) point here
        self._block_hash: BlockHash | None = None  # set once the block is cached (full, or a partial entry)
        self._block_hash_num_tokens: int | None = None  # prefix tokens that hash covers
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False  # block 0 when reserved: a placeholder that never holds KV
        self._pool: object | None = None  # the pool that owns it, whose ``_journal`` hears of its changes

    @property
    def block_hash(self) -> BlockHash | None:
        """The hash of the prefix this block ends, or None while the block is uncached."""
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        """How many prefix tokens ``block_hash`` covers: the block's end, or less for a partial entry."""
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: BlockHash, num_tokens: int | None = None) -> None:
        """Give an uncached block its hash (vLLM's ``set_block_hash``); a cached block must be reset first."""
        if self._block_hash is not None:
            raise BlockStateError(f"block {self.block_id} already has a hash; reset it before caching again")
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        """Forget the cached content's identity (the block is being evicted or reused)."""
        self._block_hash = None
        self._block_hash_num_tokens = None

    @classmethod
    def _sentinel(cls) -> KVCacheBlock:
        """A bound of the free queue (id -1, never a real block): built past the door's check of ``block_id``."""
        block = cls.__new__(cls)
        cls.__init__.__wrapped__(block, -1)  # type: ignore[attr-defined]
        return block

    def __repr__(self) -> str:
        cached = "" if self._block_hash is None else f", hash={short_hash(self._block_hash)}"
        null = ", null" if self.is_null else ""
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{cached}{null})"


#: A block's slots as a tuple: the state an undo journal keeps (``kvlab.core.sched.snapshot``).
_BLOCK_STATE = operator.attrgetter(*KVCacheBlock.__slots__)


def _note_then_set(block: KVCacheBlock, name: str, value: object) -> None:
    """``KVCacheBlock.__setattr__`` while a journal is open: a block of a journalling pool notes its slots in the
    pool's journal before its first change, then the slot is set."""
    journal = getattr(getattr(block, "_pool", None), "_journal", None)
    if journal is not None and block not in journal:
        journal[block] = _BLOCK_STATE(block)
    object.__setattr__(block, name, value)


def open_journal(pool: object) -> dict[KVCacheBlock, tuple[object, ...]]:
    """Start an undo journal on ``pool`` (a fresh one replaces any left open); its blocks note themselves in it.

    The undo record of a step (``kvlab.core.sched.snapshot``) then costs the blocks the step changes,
    not the pool's size. Writes to blocks are noted only while some pool journals: the class's
    ``__setattr__`` is swapped in by the first journal opened and out when the last one closes.
    """
    pool._journal = journal = {}  # type: ignore[attr-defined]
    KVCacheBlock._journalling.add(pool)
    KVCacheBlock.__setattr__ = _note_then_set  # type: ignore[method-assign]
    return journal


def close_journal(pool: object) -> None:
    """End ``pool``'s journal (the step succeeded, or was undone); the last one closed makes writes plain again."""
    pool._journal = None  # type: ignore[attr-defined]
    KVCacheBlock._journalling.discard(pool)
    if not KVCacheBlock._journalling and "__setattr__" in KVCacheBlock.__dict__:
        del KVCacheBlock.__setattr__


@dataclasses.dataclass
class KVCacheBlocks:
    """Blocks of one request, one list per KV cache group (vLLM's ``KVCacheBlocks``, from ``kv_cache_manager.py``).

    ``blocks[i][j]`` is block ``j`` of group ``i``. ``KVCacheManager.get_computed_blocks`` and
    ``allocate_slots`` always return this, whatever the number of groups, as vLLM 0.33.0's do.
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """The two results' blocks, group by group (this one's first)."""
        return KVCacheBlocks(tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=True)))

    def get_block_ids(self, allow_none: bool = False, *,
                      group_ids: Sequence[int] | None = None) -> tuple[list[int], ...] | None:
        """Each group's block ids: one block table per group (the null block is id 0).

        ``group_ids`` picks groups (all by default); ``allow_none`` gives None when every picked group is empty.
        """
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if allow_none and all(len(group) == 0 for group in groups):
            return None
        return tuple([block.block_id for block in group] for group in groups)

    def get_unhashed_block_ids(self) -> list[int]:
        """The ids of the blocks not cached yet (no hash), in the one group."""
        assert len(self.blocks) == 1, "Only one group is supported"
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        """A result with as many groups and no blocks."""
        return KVCacheBlocks(tuple(() for _ in range(len(self.blocks))))

    def __bool__(self) -> bool:
        """True when some group holds a block (kvlab's: vLLM's result is always true, callers compare with None)."""
        return any(self.blocks)


class KVCacheBlockCopy(NamedTuple):
    """A copy the worker makes on the KV tensors before the step's forward: block ``src`` into block ``dst``."""

    src_block_id: int
    dst_block_id: int


@checked
def short_hash(block_hash: BlockHash) -> str:
    """The first bytes of a hash in hex (or its repr), for pictures and messages."""
    return block_hash[:4].hex() if isinstance(block_hash, bytes) else repr(block_hash)[:10]


@checked
class FreeKVCacheBlockQueue:
    """The free blocks as a doubly linked list: O(1) at both ends and from the middle.

    The head is allocated first. A ``deque`` could pop the head, but a prefix hit must take a
    cached block out of the middle, which only the links make O(1). Two sentinel blocks
    (ids -1) bound the list, so no operation needs a special case for an empty end.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock._sentinel()
        self.fake_free_list_tail = KVCacheBlock._sentinel()
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for left, right in zip(chain, chain[1:], strict=False):
            left.next_free_block = right
            right.prev_free_block = left
        self.fake_free_list_head.prev_free_block = None
        self.fake_free_list_tail.next_free_block = None

    def popleft(self) -> KVCacheBlock:
        """Take the block at the head (the least recently freed)."""
        if self.num_free_blocks == 0:
            raise OutOfBlocksError("the pool is out of blocks: the free queue is empty")
        block = self.fake_free_list_head.next_free_block
        assert block is not None and block is not self.fake_free_list_tail
        self._unlink(block)
        return block

    @checked(inline=True)  # the allocator takes its blocks here on every step: the check costs no call
    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head, in queue order (one relinking, as vLLM's ``popleft_n``)."""
        if n > self.num_free_blocks:
            raise OutOfBlocksError(
                f"the pool is out of blocks: asked for {n}, only {self.num_free_blocks} are free"
            )
        out = []
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return out

    def peek_n(self, n: int, skip: frozenset[int] = frozenset()) -> list[KVCacheBlock]:
        """The ``n`` blocks ``popleft_n`` would take, leaving the queue as it is; blocks whose ids are in
        ``skip`` are passed over (they are about to leave the queue another way)."""
        if n > self.num_free_blocks:
            raise OutOfBlocksError(f"peek_n(n={n}): only {self.num_free_blocks} blocks are free")
        out = []
        block = self.fake_free_list_head.next_free_block
        while len(out) < n:
            assert block is not None and block is not self.fake_free_list_tail
            if block.block_id not in skip:
                out.append(block)
            block = block.next_free_block
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the middle of the queue (a prefix hit on a free cached block)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise BlockStateError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: it will be allocated last."""
        self._insert_before(self.fake_free_list_tail, block)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail, keeping their order."""
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` in front of the head, keeping their order: they are allocated next."""
        anchor = self.fake_free_list_head.next_free_block
        assert anchor is not None
        for block in blocks:
            self._insert_before(anchor, block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head to tail."""
        out = []
        block = self.fake_free_list_head.next_free_block
        while block is not None and block is not self.fake_free_list_tail:
            out.append(block)
            block = block.next_free_block
        return out

    def _link_before(self, anchor: KVCacheBlock, blocks: Sequence[KVCacheBlock]) -> None:
        """``_insert_before`` for blocks the pool knows are out of the queue (they just reached ``ref_cnt`` 0)."""
        prev = anchor.prev_free_block
        assert prev is not None
        for block in blocks:
            assert block.prev_free_block is None and block.next_free_block is None, block
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = anchor
        anchor.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def _insert_before(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise BlockStateError(f"block {block.block_id} is already in the free queue")
        prev = anchor.prev_free_block
        assert prev is not None
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = anchor
        anchor.prev_free_block = block
        self.num_free_blocks += 1


