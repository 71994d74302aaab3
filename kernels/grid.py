"""The launch plan of the paged attention kernel, and a pure-Python mirror of its index arithmetic.

The grid is ``(q_blocks, num_kv_heads, num_kv_splits)``. Program ``(b, h, s)``:

* finds its sequence from the global query-block index ``b`` by binary search over
  ``query_start_loc`` (vLLM's ``find_seq_idx``): sequence ``i``'s query blocks start at
  ``query_start_loc[i] // BLOCK_Q + i``, so the grid, ``num_tokens // BLOCK_Q + num_seqs``, is an
  upper bound known without reading any tensor; programs past a sequence's last block exit;
* serves ``BLOCK_Q`` query tokens times all ``num_queries_per_kv`` query heads of KV head ``h``
  (GQA packing: one K/V tile read serves every query head that shares it), ``BLOCK_M`` rows;
* walks the keys it may see in tiles of ``TILE_N`` positions; position ``p`` lives in physical
  block ``block_table[seq, p // block_size]`` at offset ``p % block_size``. Causal attention ends
  at its last query's position; a sliding window of W starts at its first query's position - W + 1,
  and the tiles wholly before that are never visited, so a program reads about W + BLOCK_Q keys
  whatever the context length. With ``num_kv_splits`` > 1 the tiles it visits are cut into that
  many contiguous ranges and ``s`` takes range ``s``.

``program_reads`` replays exactly this arithmetic in Python. The tests run the kernel with its
trace switched on and check that it read the same (physical block, offset) pairs in the same order.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

from kvlab.kernels.checks import AttentionBatch

from kvlab.errors import KernelInputError
from kvlab.units import cdiv

#: Split-KV aims for this many waves of programs over the GPU's SMs before it stops splitting.
TARGET_WAVES = 2
#: Every split gets at least this many key tiles (fewer would spend more on the merge than it saves).
MIN_TILES_PER_SPLIT = 4
MAX_KV_SPLITS = 32


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (``triton.next_power_of_2``): tile sizes must be powers of two."""
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options. Every ``tl.dot`` dimension is >= 16, so it also compiles on a GPU."""

    block_q: int       # query tokens per program
    block_m: int       # rows per program: block_q * num_queries_per_kv, padded to a power of two >= 16
    tile_n: int        # key positions per loop iteration (may span several KV blocks, or part of one)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_q", "block_m", "tile_n", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise KernelInputError(f"KernelConfig.{name} must be an int, got {value!r}")
        for name in ("block_q", "block_m", "tile_n"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelInputError(f"KernelConfig.{name} must be a power of two, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise KernelInputError(
                f"KernelConfig.num_warps must be a power of two from 1 to 32 (a GPU block holds at most 1024 "
                f"threads), got {self.num_warps}"
            )
        if self.num_stages < 1:
            raise KernelInputError(f"KernelConfig.num_stages must be at least 1, got {self.num_stages}")
        if self.block_m < 16 or self.tile_n < 16:
            raise KernelInputError(
                f"KernelConfig needs block_m >= 16 and tile_n >= 16 (tl.dot's minimum on a GPU), "
                f"got block_m={self.block_m}, tile_n={self.tile_n}"
            )


def choose_config(num_queries_per_kv: int, max_query_len: int, head_size: int) -> KernelConfig:
    """Tiles for a batch: 16 rows for decode-only batches, 64 for prefill and mixed ones.

    Rows are ``BLOCK_Q`` tokens x ``num_queries_per_kv`` heads, ``BLOCK_Q = BLOCK_M // group``
    rounded down to a power of two (as vLLM). Decode is memory-bound: each sequence has one
    query token, so its program holds that token's heads and reads the sequence's K and V once
    for all of them. Prefill reuses each K/V tile across 64 rows. Keys come 64 per tile.
    """
    block_m = max(16 if max_query_len == 1 else 64, next_power_of_2(num_queries_per_kv))
    block_q = max(1, block_m // num_queries_per_kv)
    block_q = 1 << (block_q.bit_length() - 1)          # a power of two that fits
    num_warps = 8 if next_power_of_2(head_size) >= 256 else 4
    return KernelConfig(block_q=block_q, block_m=block_m, tile_n=64, num_warps=num_warps, num_stages=3)


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                         tile_n: int, num_sms: int) -> int:
    """How many programs share one sequence's keys (split-KV, vLLM's "3D" path).

    Only decode-only batches split, and only when ``num_seqs * num_kv_heads`` programs would
    leave the GPU's ``num_sms`` multiprocessors idle: then each sequence's tiles are cut into
    ranges so that about ``TARGET_WAVES * num_sms`` programs run, each with at least
    ``MIN_TILES_PER_SPLIT`` tiles. A power of two, at most ``MAX_KV_SPLITS``. (vLLM's Triton
    backend uses a fixed 16 segments below a batch-size threshold; this adapts to the context.)
    """
    if max_query_len > 1:
        return 1
    programs = num_seqs * num_kv_heads
    target = TARGET_WAVES * num_sms
    if programs >= target:
        return 1
    wanted = min(cdiv(target, programs), cdiv(max_seq_len, tile_n) // MIN_TILES_PER_SPLIT, MAX_KV_SPLITS)
    return 1 << (max(wanted, 1).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything the launcher decides on the host before the first program runs."""

    batch: AttentionBatch
    config: KernelConfig
    num_kv_splits: int

    @property
    def num_q_blocks(self) -> int:
        """Grid size along axis 0: an upper bound on the query blocks, ``num_tokens // BLOCK_Q + num_seqs``."""
        return self.batch.num_tokens // self.config.block_q + self.batch.num_seqs

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.num_q_blocks, self.batch.num_kv_heads, self.num_kv_splits)

    @property
    def max_tiles(self) -> int:
        """The most tiles any program can walk (sizes the optional trace)."""
        return cdiv(self.batch.max_seq_len, self.config.tile_n)


def plan_launch(batch: AttentionBatch, num_kv_splits: int | None = None, config: KernelConfig | None = None,
                num_sms: int = 1) -> LaunchPlan:
    """Pick tiles and the split count for ``batch`` (``num_sms`` = 1 on CPU: no automatic split)."""
    config = config or choose_config(batch.num_queries_per_kv, batch.max_query_len, batch.head_size)
    if config.block_q * batch.num_queries_per_kv > config.block_m:
        raise KernelInputError(
            f"KernelConfig block_q={config.block_q} x num_queries_per_kv={batch.num_queries_per_kv} rows "
            f"exceed block_m={config.block_m}"
        )
    if num_kv_splits is None:
        keys = min(batch.max_seq_len, batch.sliding_window or batch.max_seq_len)   # what one decode program reads
        num_kv_splits = choose_num_kv_splits(batch.num_seqs, batch.num_kv_heads, batch.max_query_len,
                                             keys, config.tile_n, num_sms)
    return LaunchPlan(batch, config, num_kv_splits)


# --------------------------------------------------------------------------- the mirror


def find_seq_idx(query_start_loc: Sequence[int], q_block: int, block_q: int) -> int:
    """The sequence owning global query block ``q_block``: the last ``i`` with ``qsl[i] // BLOCK_Q + i <= q_block``."""
    lo, hi = 0, len(query_start_loc) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if query_start_loc[mid] // block_q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@dataclasses.dataclass(frozen=True)
class ProgramReads:
    """What one program does: its place in the grid, its rows, and where each key of each tile it reads lives."""

    program: tuple[int, int, int]                # (q_block, kv_head, split) = tl.program_id(0, 1, 2)
    seq: int
    q_block: int                                  # local query block within the sequence
    query_tokens: tuple[int, ...]                 # positions within the sequence's query
    tile_range: tuple[int, int]                   # [first, last) tile of this split
    tiles: tuple[tuple[int, ...], ...]            # physical block id of each key position; -1 = not read
    offsets: tuple[tuple[int, ...], ...] = ()     # offset inside that block of each key position; -1 = not read
    first_tile: int = 0                           # the first tile the program may visit (a window skips some)

    def keys_read(self) -> int:
        """How many key positions this program loads (the trace's entries that are not -1)."""
        return sum(block >= 0 for tile in self.tiles for block in tile)

    def key_reads(self) -> list[tuple[int, int]]:
        """The ``(physical block, offset)`` of every key this program loads, in the order it loads them."""
        return [(block, offset) for blocks, offsets in zip(self.tiles, self.offsets, strict=True)
                for block, offset in zip(blocks, offsets, strict=True) if block >= 0]

    def blocks_in_order(self) -> list[int]:
        """The distinct physical blocks this program reads, in the order it first touches them."""
        seen: list[int] = []
        for tile in self.tiles:
            for block in tile:
                if block >= 0 and block not in seen:
                    seen.append(block)
        return seen


def visible_keys(batch: AttentionBatch, seq: int, q_block: int, block_q: int) -> tuple[int, int]:
    """``[first_key, kv_len)``: the key positions query block ``q_block`` of ``seq`` may see (step 3 of the kernel)."""
    q_len = batch.query_lens[seq]
    seq_len = batch.seq_lens[seq]
    q_first = seq_len - q_len + q_block * block_q                 # the block's first query, in the sequence
    kv_len = min(seq_len, q_first + block_q) if batch.causal else seq_len
    first_key = max(q_first - batch.sliding_window + 1, 0) if batch.sliding_window else 0
    return first_key, kv_len


def program_reads(plan: LaunchPlan, block_table: Sequence[Sequence[int]]) -> list[ProgramReads]:
    """Replay the kernel's index arithmetic for every program that does work, in grid order."""
    batch, cfg, tile_n = plan.batch, plan.config, plan.config.tile_n
    qsl = batch.query_start_loc
    out = []
    for b in range(plan.num_q_blocks):
        seq = find_seq_idx(qsl, b, cfg.block_q)
        q_len = qsl[seq + 1] - qsl[seq]
        q_block = b - (qsl[seq] // cfg.block_q + seq)
        if q_block * cfg.block_q >= q_len:
            continue                                          # past this sequence's last block: exits
        first_key, kv_len = visible_keys(batch, seq, q_block, cfg.block_q)
        tile_start, num_tiles = first_key // tile_n, cdiv(kv_len, tile_n)
        per_split = cdiv(num_tiles - tile_start, plan.num_kv_splits)
        tokens = tuple(range(q_block * cfg.block_q, min((q_block + 1) * cfg.block_q, q_len)))
        for h in range(batch.num_kv_heads):
            for s in range(plan.num_kv_splits):
                lo = tile_start + s * per_split
                hi = min(lo + per_split, num_tiles)
                keys = [range(t * tile_n, (t + 1) * tile_n) for t in range(lo, hi)]
                tiles = tuple(tuple(block_table[seq][p // batch.block_size] if first_key <= p < kv_len else -1
                                    for p in tile) for tile in keys)
                offsets = tuple(tuple(p % batch.block_size if first_key <= p < kv_len else -1 for p in tile)
                                for tile in keys)
                out.append(ProgramReads((b, h, s), seq, q_block, tokens, (lo, max(lo, hi)), tiles, offsets,
                                        tile_start))
    return out


def trace_from_reads(plan: LaunchPlan, reads: Sequence[ProgramReads]) -> list:
    """The mirror laid out as the kernel's trace buffer: ``[q_blocks, kv_heads, splits, max_tiles, tile_n, 2]``.

    Each entry is ``[physical block, offset]``; ``[-1, -1]`` marks a position the program did not
    read, ``[-2, -2]`` a tile slot it never reached (the kernel's buffer starts filled with -2).
    """
    b_n, h_n, s_n = plan.grid
    empty = [[-2, -2]] * plan.config.tile_n
    trace = [[[[[list(e) for e in empty] for _ in range(plan.max_tiles)] for _ in range(s_n)] for _ in range(h_n)]
             for _ in range(b_n)]
    for r in reads:
        b, h, s = r.program
        for i, (blocks, offsets) in enumerate(zip(r.tiles, r.offsets, strict=True)):
            trace[b][h][s][i] = [[blk, off] for blk, off in zip(blocks, offsets, strict=True)]
    return trace
