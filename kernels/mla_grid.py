"""The launch plan of the MLA decode kernel, on the host: tiles, heads per program, the split count, the tile ranges.

``mla_decode_kernel`` (``mla_decode.py``) runs on a grid ``(num_seqs, head_blocks, num_kv_splits)``:
program ``(i, h, s)`` serves sequence ``i``'s one query token for ``BLOCK_H = config.block_m`` heads and
walks split ``s``'s range of its latent tiles. This module decides that grid and says which tiles each
split walks; it needs no Triton, so notebook 09 can show it anywhere (``grid.py`` does the same for the
K/V kernel).
"""

from __future__ import annotations

import dataclasses

from kvlab.kernels.grid import KernelConfig, choose_num_kv_splits
from kvlab.kernels.mla_checks import MLADecodeBatch

from kvlab.errors import KernelInputError
from kvlab.units import cdiv

#: vLLM's tiles for MLA decode: 16 heads per program, 32 latent positions per tile, 2 pipeline stages.
DEFAULT_MLA_CONFIG = KernelConfig(block_q=1, block_m=16, tile_n=32, num_warps=4, num_stages=2)


@dataclasses.dataclass(frozen=True)
class MLADecodePlan:
    """What the launcher decides on the host: tiles (``block_m`` = heads per program) and the split count."""

    batch: MLADecodeBatch
    config: KernelConfig
    num_kv_splits: int

    @property
    def num_head_blocks(self) -> int:
        return cdiv(self.batch.num_heads, self.config.block_m)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.batch.num_seqs, self.num_head_blocks, self.num_kv_splits)

    def tile_ranges(self, seq: int) -> list[range]:
        """The latent tiles each split of sequence ``seq`` walks, as steps 3 and 4 of the kernel compute them.

        The same for every head block; an empty range is a split with nothing to read (it stores
        ``m = -inf``, ``l = 0``, which the merge weighs by 0).
        """
        num_tiles = cdiv(self.batch.seq_lens[seq], self.config.tile_n)
        per_split = cdiv(num_tiles, self.num_kv_splits)
        return [range(min(s * per_split, num_tiles), min(s * per_split + per_split, num_tiles))
                for s in range(self.num_kv_splits)]


def plan_mla_decode(batch: MLADecodeBatch, num_kv_splits: int | None = None, config: KernelConfig | None = None,
                    num_sms: int = 1) -> MLADecodePlan:
    """Tiles and split count for ``batch`` (``num_sms`` = 1 on CPU: no automatic split).

    ``config.block_m`` is the number of heads one program serves (``block_q`` must be 1: one
    query token per sequence). The split count follows ``choose_num_kv_splits`` with one
    "KV head" per head block.
    """
    config = config or DEFAULT_MLA_CONFIG
    if config.block_q != 1:
        raise KernelInputError(f"mla_decode serves one query token per sequence: KernelConfig.block_q must be 1, "
                               f"got {config.block_q}")
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(batch.num_seqs, cdiv(batch.num_heads, config.block_m), 1,
                                             batch.max_seq_len, config.tile_n, num_sms)
    return MLADecodePlan(batch, config, num_kv_splits)
