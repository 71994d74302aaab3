"""Parallel sampling on kvlab's allocator: the memory that sharing a prompt's blocks saves, measured.

The PagedAttention paper (Kwon et al., SOSP 2023, section 6.3 and Fig. 15) measures the memory
saving of ``n`` samples drawn from one prompt as the blocks saved by sharing over the blocks
needed without it. ``parallel_sampling_saving`` does the same with ``kvlab.core.sequence``: for
each request, one ``Sequence`` writes the prompt, ``n - 1`` forks share its blocks, and every
sample then writes its output one token per step, copying the shared partial block on its first
write (copy-on-write). The blocks held after every step are summed, with sharing (what the pool
really holds) and without (``n`` private copies of the same tokens).

vLLM V1 serves ``n > 1`` as ``n`` requests whose full prompt blocks the prefix cache shares and
whose partly filled last prompt block each computes for itself: after each sample's first token
that is exactly what copy-on-write leaves, so the two differ only in the prefill step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceABC

from kvlab._validate import checked, positive_int
from kvlab.core.block_pool import BlockPool
from kvlab.core.sequence import Sequence
from kvlab.sim.workloads import validate_requests
from kvlab.units import cdiv


@dataclasses.dataclass(frozen=True)
class SharingResult:
    """Block-steps held by ``n`` samples per request, shared and unshared, over every request's decode."""

    n: int
    block_size: int
    num_requests: int
    shared_block_steps: int  # blocks the pool held, summed over the decode steps
    unshared_block_steps: int  # n private copies, summed over the same steps
    num_copies: int  # copy-on-write copies made

    @property
    def saving(self) -> float:
        """The paper's memory saving: blocks saved by sharing / blocks without sharing."""
        return 1 - self.shared_block_steps / self.unshared_block_steps


@checked(at_most={"n": 10**4})
def parallel_sampling_saving(
    requests: SequenceABC[SequenceABC[int]], n: int, block_size: int = 16
) -> SharingResult:
    """Serve each ``(prompt_len, output_len)`` request as ``n`` samples of ``output_len`` tokens on kvlab's pool."""
    req = validate_requests(requests)
    n, block_size = positive_int("n", n), positive_int("block_size", block_size)
    longest = int((req[:, 0] + req[:, 1]).max())
    pool = BlockPool(n * cdiv(longest, block_size) + 2)  # the null block, and room for every private block
    usable = pool.get_num_free_blocks()
    shared = unshared = copies = 0
    for prompt_len, output_len in req.tolist():
        first = Sequence(pool, block_size)
        first.extend(range(prompt_len))
        samples = [first] + [first.fork() for _ in range(n - 1)]
        for step in range(1, output_len + 1):
            for i, sample in enumerate(samples):
                copies += len(sample.append(100_000 * (i + 1) + step))
            shared += usable - pool.get_num_free_blocks()
            unshared += n * cdiv(prompt_len + step, block_size)
        for sample in samples:
            sample.release()
    return SharingResult(n=n, block_size=block_size, num_requests=len(req), shared_block_steps=shared,
                         unshared_block_steps=unshared, num_copies=copies)
