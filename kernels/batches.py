"""Random paged batches that catch a kernel reading what it should not: the tests' and ``check_kernel``'s inputs.

``make_batch`` lays out real sequences in a cache whose spare blocks hold NaN, and so do the
slots past each sequence's last token: a kernel that reads a block it should not (an unused
block-table entry, a position past the sequence) returns NaN. Every call draws fresh non-zero
data unless given a seed; the seed is kept so that a failure can be replayed.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import torch
from kvlab.kernels._backend import default_device
from kvlab.kernels.checks import PagedTensors

from kvlab.errors import UnknownNameError

#: ``‖out − ref‖ / ‖ref‖`` a correct kernel stays under, by activation dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
#: FP8 (e4m3, scale 1.0) against the unquantized reference on standard-normal K/V: the largest error
#: measured over 200 seeds was 0.040 (median 0.035, see tests/test_kernels_attention.py); the bound
#: leaves 1.5x headroom.
FP8_BOUND = 0.06
TABLES = ("scattered", "shared", "overlong")


def fresh_seed() -> int:
    """A new seed per call (reported in failure messages so a failure can be replayed)."""
    return random.randrange(2**31)


@dataclasses.dataclass
class Batch(PagedTensors):
    """Everything ``paged_attention`` takes, plus the seed that drew it (to replay a failure)."""

    seed: int


def _block_rows(needed: Sequence[int], table: str, g: torch.Generator) -> tuple[list[list[int]], int]:
    """Each sequence's physical blocks (real ones, then NaN padding) and the number of real blocks."""
    extra = 2 if table == "overlong" else 0
    max_blocks = max(needed) + extra
    shared = min(needed) - 1 if table == "shared" else 0          # full blocks every sequence shares
    own = [n - shared for n in needed]
    num_real = shared + sum(own)
    order = torch.randperm(num_real, generator=g).tolist()
    prefix, rest = order[:shared], order[shared:]
    nan_ids = [num_real, num_real + 1]
    rows = []
    for n in own:
        ids, rest = prefix + rest[:n], rest[n:]
        rows.append(ids + [nan_ids[len(rows) % 2]] * (max_blocks - len(ids)))
    return rows, num_real


def make_batch(seq_lens: Sequence[int], query_lens: Sequence[int], *, num_kv_heads: int = 2, group: int = 2,
               head_size: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32,
               table: str = "scattered", index_dtype: torch.dtype = torch.int32, seed: int | None = None,
               device: str | torch.device | None = None) -> Batch:
    """A varlen batch: sequence ``i`` has ``seq_lens[i]`` tokens, the last ``query_lens[i]`` are queries.

    ``group`` query heads share each of the ``num_kv_heads`` KV heads. ``table``: ``scattered``
    (blocks in random order), ``shared`` (every sequence starts with the same physical blocks as
    sequence 0: a prefix-cache hit; sequence 0 must be the longest) or ``overlong`` (two extra
    columns per row pointing at NaN blocks, as well as the unused tail). Tensors go to ``device``
    (default: where this process's kernels run).
    """
    if table not in TABLES:
        raise UnknownNameError("table", table, TABLES)
    seed = fresh_seed() if seed is None else seed
    device = default_device() if device is None else device
    g = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    rows, num_real = _block_rows(needed, table, g)
    shape = (num_real + 2, block_size, num_kv_heads, head_size)   # two NaN blocks for the padding columns
    key_cache = torch.randn(shape, generator=g)
    value_cache = torch.randn(shape, generator=g)
    key_cache[num_real:] = float("nan")
    value_cache[num_real:] = float("nan")
    for i, (row, length) in enumerate(zip(rows, seq_lens, strict=True)):  # slots past each sequence: NaN too
        tail = needed[i] * block_size - length
        if tail:                                                      # the last block is never a shared one
            key_cache[row[needed[i] - 1], block_size - tail:] = float("nan")
            value_cache[row[needed[i] - 1], block_size - tail:] = float("nan")
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_kv_heads * group, head_size, generator=g)
    return Batch(
        query.to(dtype).to(device), key_cache.to(dtype).to(device), value_cache.to(dtype).to(device),
        torch.tensor(rows, dtype=index_dtype, device=device), torch.tensor(seq_lens, dtype=index_dtype, device=device),
        torch.tensor(starts, dtype=index_dtype, device=device), seed,
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64; NaN anywhere in ``out`` makes it NaN."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


def poisoned_out(batch: PagedTensors) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel forgets to write fails the comparison."""
    return torch.full_like(batch.query, float("nan"))
