"""Which heads a rank holds, and where a rank of another engine finds them (vLLM 0.33.0's ``kv_connector/utils.py``
``TransferTopology`` and ``nixl/tp_mapping.py``'s ``compute_tp_mapping``).

A prefill engine and a decode engine may run at different tensor-parallel sizes. Rank ``r`` of ``tp`` ranks
holds the KV heads ``[r * H // tp, r * H // tp + max(1, H // tp))`` of a model with ``H`` KV heads (with
fewer heads than ranks, ``tp / H`` consecutive ranks hold copies of one head, ``QKVParallelLinear``'s
replicas); an MLA rank holds the whole latent, whatever ``tp``. So a decode rank that holds more heads
than a prefill rank (``P_TP > D_TP``) reads each of its heads from the prefill rank that holds it, and
writes it at that head's place in its own blocks: the heads are re-sliced on arrival. vLLM's NIXL
connector does the same by RDMA: ``compute_tp_mapping`` picks the source ranks (one per distinct head,
``np.unique``), and each read lands in a head slot of the local block (``rank_to_attention_slot``),
which is why it needs a layout whose heads are contiguous within a block (``HND``). kvlab copies with
torch on a CPU, so its ``[num_blocks, block_size, num_kv_heads, head_size]`` layout needs nothing.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HeadSource:
    """One remote rank's part in filling a local rank's blocks: its heads ``[remote_start, remote_start + count)``
    land in the local heads ``[local_start, local_start + count)`` (for MLA, ``count == 0``: the whole latent)."""

    remote_rank: int
    local_start: int
    remote_start: int
    count: int


@dataclasses.dataclass(frozen=True)
class TransferTopology:
    """This rank's place in its engine: its TP rank and size, the model's KV heads, and whether it is MLA.

    vLLM's ``TransferTopology`` keeps more (block size, the attention backends, DCP, remote engines); kvlab
    keeps what picks the heads.
    """

    tp_rank: int = 0
    tp_size: int = 1
    total_num_kv_heads: int = 1
    is_mla: bool = False

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size and self.total_num_kv_heads >= 1

    @property
    def local_physical_heads(self) -> int:
        """KV heads in this rank's cache (vLLM's name): ``max(1, H // tp)``."""
        return max(1, self.total_num_kv_heads // self.tp_size)

    def first_head(self, rank: int, tp_size: int) -> int:
        """The first KV head rank ``rank`` of ``tp_size`` holds (consecutive ranks share a head when H < tp)."""
        return rank * self.total_num_kv_heads // tp_size

    def tp_ratio(self, remote_tp_size: int) -> int:
        """``tp_size // remote_tp_size`` when this side has at least as many ranks, else ``-(remote // local)``
        (vLLM's sign convention); the sizes must divide one another."""
        if self.tp_size >= remote_tp_size:
            assert self.tp_size % remote_tp_size == 0
            return self.tp_size // remote_tp_size
        assert remote_tp_size % self.tp_size == 0
        return -(remote_tp_size // self.tp_size)

    def head_sources(self, remote_tp_size: int) -> list[HeadSource]:
        """The remote ranks this rank reads from, and which heads each gives (``compute_tp_mapping``): every local
        head from the first remote rank that holds it; MLA's latent whole from rank ``tp_rank * remote // tp``."""
        self.tp_ratio(remote_tp_size)  # the sizes divide one another
        if self.is_mla:
            return [HeadSource(self.tp_rank * remote_tp_size // self.tp_size, 0, 0, 0)]
        remote_heads = max(1, self.total_num_kv_heads // remote_tp_size)
        start = self.first_head(self.tp_rank, self.tp_size)
        sources: list[HeadSource] = []
        head = start
        for rank in range(remote_tp_size):  # the remote ranks in order; a replica of a head already taken is skipped
            first = self.first_head(rank, remote_tp_size)
            lo, hi = max(head, first), min(start + self.local_physical_heads, first + remote_heads)
            if lo < hi:
                sources.append(HeadSource(rank, lo - start, lo - first, hi - lo))
                head = hi
        assert head == start + self.local_physical_heads, "every local head has a source"
        return sources
