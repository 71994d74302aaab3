"""The values a block-pool walk is made of: its operations, the scenario, and snapshots of the pool.

A leaf module (it imports no other part of ``kvlab.sim``), so that ``block_scenarios``, which runs the walks,
and ``block_narration``, which describes their steps, both import these without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping

from kvlab._validate import checked, non_negative_int, one_of, positive_int
from kvlab.errors import KvlabValueError

OP_KINDS = ("start", "append", "extend", "fork", "cache", "release")


@checked
@dataclasses.dataclass(frozen=True)
class Op:
    """One operation on the sequence called ``seq``.

    ``start`` creates it with ``tokens`` as its prompt; ``append`` writes one token, ``extend``
    several; ``fork`` creates ``seq`` as a child of ``parent``; ``cache`` hashes its full blocks
    into the prefix-cache index; ``release`` gives its blocks back. ``note`` is the scenario's
    own word on why the step matters, added after the generated description.
    """

    kind: str
    seq: str
    tokens: tuple[int, ...] = ()
    parent: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        one_of("kind", self.kind, OP_KINDS)
        if not isinstance(self.seq, str) or not self.seq:
            raise KvlabValueError(f"seq must be a non-empty name, got {self.seq!r}")
        object.__setattr__(self, "tokens", tuple(non_negative_int("tokens", t) for t in self.tokens))
        if (self.kind == "fork") != (self.parent is not None):
            raise KvlabValueError("parent is required for kind='fork' and only for it")
        if self.kind == "append" and len(self.tokens) != 1:
            raise KvlabValueError(f"kind='append' writes exactly one token, got {len(self.tokens)}")


@checked
@dataclasses.dataclass(frozen=True)
class Scenario:
    """A pool (``num_blocks``, ``block_size``, null block or not) and the operations to run on it."""

    name: str
    description: str
    num_blocks: int
    block_size: int
    ops: tuple[Op, ...]
    reserve_null_block: bool = True

    def __post_init__(self) -> None:
        positive_int("num_blocks", self.num_blocks)
        positive_int("block_size", self.block_size)
        object.__setattr__(self, "ops", tuple(self.ops))

    def __len__(self) -> int:
        return len(self.ops)


@dataclasses.dataclass(frozen=True)
class BlockView:
    """One physical block at one moment: what the picture draws in its cell."""

    block_id: int
    ref_cnt: int
    block_hash: Hashable | None
    is_null: bool
    num_tokens: int  # tokens its contents hold (0 unless some sequence wrote into it)
    holders: tuple[str, ...]  # live sequences whose table points here
    token_ids: tuple[int, ...] = ()  # what its slots hold, in slot order (a freed block keeps its content)

    @property
    def state(self) -> str:
        """``null``, ``in use`` (ref_cnt > 0), ``cached`` (free, still hashed) or ``free``."""
        if self.is_null:
            return "null"
        if self.ref_cnt > 0:
            return "in use"
        return "free" if self.block_hash is None else "cached"


@dataclasses.dataclass(frozen=True)
class PoolSnapshot:
    """The pool and its live sequences at one moment, as plain values (compare with ``==``)."""

    block_size: int
    blocks: tuple[BlockView, ...]
    free_queue: tuple[int, ...]  # head (allocated next) to tail
    tables: Mapping[str, tuple[int, ...]]
    num_tokens: Mapping[str, int]
    token_ids: Mapping[str, tuple[int, ...]]
    cached_index: Mapping[Hashable, tuple[int, ...]]  # block hash -> ids of the blocks holding it
    usage: float
    num_usable_blocks: int = 0  # the pool's blocks but the null block (BlockPool.num_usable_blocks)

    @property
    def ref_counts(self) -> dict[int, int]:
        """``{block_id: ref_cnt}`` of every block in use (the null block left out)."""
        return {b.block_id: b.ref_cnt for b in self.blocks if b.ref_cnt > 0 and not b.is_null}

    @property
    def num_live_blocks(self) -> int:
        """Physical blocks in use by some sequence or holder."""
        return len(self.ref_counts)

    @property
    def free_queue_labels(self) -> list[str]:
        """The free queue head to tail, a cached block marked ``*`` (as in ``[2][3][1*][0*]``)."""
        return [f"{i}*" if self.blocks[i].block_hash is not None else str(i) for i in self.free_queue]
