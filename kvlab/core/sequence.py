"""Block tables, forks and copy-on-write: ``Sequence`` on top of ``BlockPool``.

A ``Sequence`` is one stream of tokens kept in a paged KV cache. Its block table lists the
physical blocks that hold its tokens, in order; ``slot_mapping`` turns token positions into
the flat slots a kernel writes and reads (notebook 05 consumes exactly this array).

vLLM V1 keeps block tables in ``KVCacheManager`` (``req_to_blocks``) and shares a block
between requests through the prefix cache (notebook 04); ``n > 1`` sampling runs ``n``
requests that share the prompt's full blocks that way. Its only copy-on-write (0.33.0) is
for a prefix hit that ends inside a block (``KVCacheManager`` with ``hash_block_size`` <
``block_size``). kvlab keeps the PagedAttention paper's mechanism (vLLM's earlier block
manager had it too): ``fork`` shares every block, and the first write into a shared, partly
filled last block copies that block first (``BlockPool.copy_on_write``, the one home of that
copy). Full shared blocks are never copied, because nobody writes into a full block again.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from kvlab._validate import MAX_OBJECTS, checked, non_negative_int, positive_int
from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from kvlab.errors import BlockStateError, KvlabValueError, OutOfBlocksError, RequestStateError
from kvlab.units import cdiv

BlockCopy = KVCacheBlockCopy  # (src_block_id, dst_block_id): a copy the engine must make on the KV tensors


@checked(at_most={"num_blocks": MAX_OBJECTS})
class BlockContents:
    """The token ids each physical block holds: kvlab's stand-in for ``kv_cache[block_id]``.

    An engine keeps the K/V of a pool in tensors indexed by block id, next to the pool, which
    only does the bookkeeping. Here a block's "K/V" is the list of token ids written into it:
    enough to check that every sequence reads back exactly its own tokens and that a
    copy-on-write copy really is a copy. ``contents_of(pool)`` gives the one store of a pool,
    so forks and later sequences share it as they would share the GPU tensors.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = positive_int("block_size", block_size)
        self._tokens: list[list[int]] = [[] for _ in range(positive_int("num_blocks", num_blocks))]

    @checked
    def read(self, block_id: int) -> tuple[int, ...]:
        """The token ids block ``block_id`` holds, in slot order."""
        return tuple(self._tokens[self._block("block_id", block_id)])

    @checked
    def write(self, block_id: int, slot: int, token_id: int) -> None:
        """Write ``token_id`` into ``slot`` of a block; slots fill in order, as decoding does."""
        held = self._tokens[self._block("block_id", block_id)]
        if slot != len(held) or slot >= self.block_size:
            raise BlockStateError(f"block {block_id} holds {len(held)} token(s); slot {slot} is not the next free slot")
        held.append(token_id)

    @checked
    def copy(self, src_block_id: int, dst_block_id: int) -> None:
        """Copy a block's contents to another block (what the engine's ``copy_blocks`` does on K/V)."""
        source = self._tokens[self._block("src_block_id", src_block_id)]
        self._tokens[self._block("dst_block_id", dst_block_id)] = list(source)

    @checked
    def clear(self, block_id: int) -> None:
        """Forget what a block held: it was just handed out for new tokens."""
        self._tokens[self._block("block_id", block_id)] = []

    def _block(self, name: str, block_id: int) -> int:
        if block_id >= len(self._tokens):
            raise BlockStateError(f"{name}={block_id} is not a block of this pool (it has {len(self._tokens)})")
        return block_id


_CONTENTS: weakref.WeakKeyDictionary[BlockPool, BlockContents] = weakref.WeakKeyDictionary()


@checked
def contents_of(pool: BlockPool, block_size: int) -> BlockContents:
    """The one ``BlockContents`` of ``pool`` (made on first use), checked against ``block_size``.

    Kept beside the pool rather than in it, so ``BlockPool`` stays exactly vLLM's bookkeeping;
    the store lives as long as its pool does. A pool has one block size for all its sequences.
    """
    if not isinstance(pool, BlockPool):
        raise KvlabValueError(f"pool must be a kvlab.core.block_pool.BlockPool, got {type(pool).__name__}")
    block_size = positive_int("block_size", block_size)
    contents = _CONTENTS.get(pool)
    if contents is None:
        contents = _CONTENTS[pool] = BlockContents(pool.num_gpu_blocks, block_size)
    elif contents.block_size != block_size:
        raise KvlabValueError(
            f"block_size={block_size} differs from block_size={contents.block_size} that this pool's "
            "sequences already use; one pool has one block size"
        )
    return contents


@checked
def compute_slot_mapping(
    block_table: Iterable[int], block_size: int, positions: Iterable[int], num_tokens: int | None = None
) -> list[int]:
    """The flat KV slot of each token position: ``block_table[pos // block_size] * block_size + pos % block_size``.

    This is the ``slot_mapping`` vLLM's ``BlockTable.compute_slot_mapping`` builds for the
    attention kernel: slot ``s`` is row ``s`` of a KV tensor viewed as
    ``[num_blocks * block_size, num_kv_heads, head_size]``. Positions must lie in
    ``[0, num_tokens)`` (default: every slot the table covers).
    """
    table = list(block_table)
    block_size = positive_int("block_size", block_size)
    limit = len(table) * block_size if num_tokens is None else non_negative_int("num_tokens", num_tokens)
    slots = []
    for pos in positions:
        pos = non_negative_int("positions", pos)
        if pos >= limit:
            covered = (f"block_table covers {len(table)} blocks of block_size={block_size}" if num_tokens is None
                       else f"num_tokens={num_tokens}")
            raise KvlabValueError(f"positions must lie in [0, {limit}) ({covered}), got {pos}")
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@checked
class Sequence:
    """One token stream in a paged KV cache: a block table, a length, forks and copy-on-write.

    ``append`` / ``extend`` take a new block from the pool only when the last one is full,
    and return the copies ``(src_block_id, dst_block_id)`` they caused (empty when none).
    Every operation checks first and changes nothing when it raises: a write the pool
    cannot hold raises ``OutOfBlocksError``; any use after ``release`` raises
    ``RequestStateError``.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.contents = contents_of(pool, block_size)
        self.pool = pool
        self.block_size = self.contents.block_size
        self.blocks: list[KVCacheBlock] = []  # the block table, as block objects (vLLM's req_to_blocks)
        self.num_tokens = 0
        self.released = False

    # ----------------------------------------------------------------- reading

    @property
    def block_table(self) -> list[int]:
        """The physical block ids holding this sequence's tokens, logical block 0 first."""
        return [block.block_id for block in self.blocks]

    @property
    def num_full_blocks(self) -> int:
        """Blocks whose every slot is written: the only ones a prefix cache may hash."""
        return self.num_tokens // self.block_size

    def __len__(self) -> int:
        return self.num_tokens

    def token_ids(self) -> list[int]:
        """The sequence's tokens, read back through its block table (the stand-in for its K/V)."""
        self._check_live("read")
        return [token for block in self.blocks for token in self.contents.read(block.block_id)]

    @checked
    def slot_mapping(self, positions: Iterable[int] | None = None) -> list[int]:
        """The KV slot of each position (default: every token), as the attention kernel indexes it."""
        self._check_live("map")
        positions = range(self.num_tokens) if positions is None else positions
        return compute_slot_mapping(self.block_table, self.block_size, positions, self.num_tokens)

    # ----------------------------------------------------------------- writing

    @checked
    def append(self, token_id: int) -> list[BlockCopy]:
        """Write one token; return the copy-on-write copies it caused (at most one)."""
        self._check_live("append to")
        return self.extend([token_id])

    @checked
    def extend(self, token_ids: Iterable[int]) -> list[BlockCopy]:
        """Write tokens in order; return the copies ``(src, dst)`` the engine must make first.

        Only the first token can meet a shared, partly filled last block, so at most one
        copy results. All blocks needed (the copy and the fresh ones) are counted before
        anything is taken: if the pool cannot give them all, nothing is written.
        """
        self._check_live("extend")
        tokens = [non_negative_int("token_ids", token) for token in token_ids]
        if not tokens:
            return []
        copy_first = self._last_block_shared_and_partial()
        fresh = cdiv(self.num_tokens + len(tokens), self.block_size) - cdiv(self.num_tokens, self.block_size)
        free = self.pool.get_num_free_blocks()
        if fresh + copy_first > free:
            need = _count(fresh, "new block") + (" plus 1 for a copy-on-write copy" if copy_first else "")
            raise OutOfBlocksError(
                f"cannot write {_count(len(tokens), 'token')}: {need} needed, but only {_count(free, 'block')} "
                f"{'is' if free == 1 else 'are'} free; nothing was written (release a sequence to free blocks)"
            )
        taken = self.pool.get_new_blocks(copy_first + fresh)  # one pool call: it succeeds whole or changes nothing
        copies = [self._copy_last_block(taken[0])] if copy_first else []
        for block in taken[copy_first:]:
            self.contents.clear(block.block_id)
            self.blocks.append(block)
        for pos, token in enumerate(tokens, start=self.num_tokens):
            self.contents.write(self.blocks[pos // self.block_size].block_id, pos % self.block_size, token)
        self.num_tokens += len(tokens)
        return copies

    def _last_block_shared_and_partial(self) -> bool:
        return self.num_tokens % self.block_size != 0 and self.blocks[-1].ref_cnt > 1

    def _copy_last_block(self, block: KVCacheBlock) -> BlockCopy:
        """Copy-on-write into ``block``: the last block becomes a private copy (the pool drops the shared one)."""
        copy = self.pool.copy_on_write(self.blocks, len(self.blocks) - 1, block)
        self.contents.copy(copy.src_block_id, copy.dst_block_id)
        return copy

    # ----------------------------------------------------------------- sharing and releasing

    def fork(self) -> Sequence:
        """A child sharing every block (each ``ref_cnt`` + 1): no KV is copied until a write needs it."""
        self._check_live("fork")
        self.pool.touch(self.blocks)
        child = Sequence(self.pool, self.block_size)
        child.blocks = list(self.blocks)
        child.num_tokens = self.num_tokens
        return child

    def release(self) -> None:
        """Give every block back, tail first, so the blocks nearest the prompt start are evicted last."""
        self._check_live("release")
        self.pool.free_blocks(reversed(self.blocks))
        self.blocks = []
        self.num_tokens = 0
        self.released = True

    def _check_live(self, action: str) -> None:
        if self.released:
            raise RequestStateError(
                f"cannot {action} a released sequence: its blocks are back in the pool (fork before releasing, "
                "or start a new Sequence)"
            )

    def __repr__(self) -> str:
        if self.released:
            return "Sequence(released)"
        return f"Sequence(block_table={self.block_table}, num_tokens={self.num_tokens})"
