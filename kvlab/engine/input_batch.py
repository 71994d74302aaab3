"""The executor's persistent batch: each running request's block tables, kept from step to step.

Mirrors ``vllm/v1/worker/block_table.py`` (``BlockTable``, ``MultiGroupBlockTable``) and the part of
``vllm/v1/worker/gpu_input_batch.py``'s ``InputBatch`` that maps request ids to rows. The scheduler
sends a request's whole block table once (a new or resumed request: ``ScheduledRequest.whole_table``)
and afterwards only the blocks each step adds, usually none; the executor writes those into its row
of a preallocated table (``append_row``), so a step copies block ids only when a request gets a new
block. Each step then reads the rows of the requests it runs, in the step's order, in one indexing
(``InputBatch.prepare``), and computes positions and slots without a Python loop over tokens.

Where kvlab simplifies: a row stays where it was put (vLLM condenses the batch and reorders it, so its
rows are the step's order); the table grows when a request needs more columns or rows than it has
(vLLM sizes it once, for ``max_num_seqs`` requests of ``max_model_len`` tokens); the host arrays are
numpy, as vLLM's, and a step's tensors are copied to the device when the model is not on the CPU
(vLLM's ``CpuGpuBuffer``). A sliding-window group keeps the ids of blocks that slid out (vLLM's worker
does too): the attention never reads them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvlab.core.sched.output import SchedulerOutput
from kvlab.errors import KvlabValueError


class BlockTable:
    """One KV cache group's block tables: a row of block ids per request, written only where it changes."""

    def __init__(self, max_num_reqs: int = 8, max_num_blocks_per_req: int = 16) -> None:
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)  # [rows, columns]
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)  # [rows]

    def _fit(self, row: int, num_blocks: int) -> None:
        """Grow the table (doubling) until it has ``row`` and ``num_blocks`` columns."""
        rows, columns = self.block_table.shape
        if row < rows and num_blocks <= columns:
            return
        while row >= rows:
            rows *= 2
        while num_blocks > columns:
            columns *= 2
        grown = np.zeros((rows, columns), dtype=np.int32)
        grown[:self.block_table.shape[0], :self.block_table.shape[1]] = self.block_table
        self.block_table = grown
        self.num_blocks_per_row = np.concatenate(
            [self.num_blocks_per_row, np.zeros(rows - len(self.num_blocks_per_row), dtype=np.int32)])

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Add ``block_ids`` after the row's blocks (vLLM's ``append_row``)."""
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row]) if row < len(self.num_blocks_per_row) else 0
        self._fit(row, start + len(block_ids))
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks_per_row[row] = start + len(block_ids)

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Make ``block_ids`` the row's whole table (vLLM's ``add_row``)."""
        self._fit(row, len(block_ids))
        self.clear_row(row)
        self.append_row(block_ids, row)

    def clear_row(self, row: int) -> None:
        """Empty the row; its columns go back to block 0, the null block, which pads every row."""
        self.block_table[row, :self.num_blocks_per_row[row]] = 0
        self.num_blocks_per_row[row] = 0


class InputBatch:
    """Which row holds which request, and every KV cache group's ``BlockTable`` (vLLM's ``InputBatch``, trimmed)."""

    def __init__(self, num_groups: int) -> None:
        self.block_tables = [BlockTable() for _ in range(num_groups)]
        self.req_id_to_index: dict[str, int] = {}
        self._free_rows: list[int] = []  # rows freed by finished requests, reused lowest first

    @property
    def num_groups(self) -> int:
        return len(self.block_tables)

    def add_request(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> int:
        """Give ``request_id`` a row (its own again, if it has one) holding ``block_ids``, one table per group."""
        row = self.req_id_to_index.get(request_id)
        if row is None:
            row = self._free_rows.pop(0) if self._free_rows else len(self.req_id_to_index)
            self.req_id_to_index[request_id] = row
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.add_row(ids, row)
        return row

    def append_block_ids(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """Add a step's new block ids to the request's tables (most decode steps add none)."""
        row = self.req_id_to_index.get(request_id)
        if row is None:
            raise KvlabValueError(
                f"request {request_id!r} is not in the executor's batch: its first step must send its whole block "
                "table (ScheduledRequest.whole_table)")
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.append_row(ids, row)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget finished (or preempted) requests; their rows are reused. Unknown ids are ignored."""
        for request_id in request_ids:
            row = self.req_id_to_index.pop(request_id, None)
            if row is not None:
                for table in self.block_tables:
                    table.clear_row(row)
                self._free_rows.append(row)
        self._free_rows.sort()

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a step's changes (vLLM's ``_update_states``): finished and preempted requests leave, new and
        resumed ones get rows, running ones append the blocks they were given."""
        self.remove_requests(itertools.chain(scheduler_output.finished_req_ids, scheduler_output.preempted_req_ids))
        for s in scheduler_output.scheduled:
            if s.whole_table:
                self.add_request(s.request_id, s.new_block_ids)
            elif any(s.new_block_ids):
                self.append_block_ids(s.request_id, s.new_block_ids)
            elif s.request_id not in self.req_id_to_index:
                self.append_block_ids(s.request_id, s.new_block_ids)  # raises: its table was never sent

    def prepare(self, scheduler_output: SchedulerOutput, block_size: int) -> StepInputs:
        """The step's host arrays, requests in the scheduler's order: token ids, positions, per-request lengths,
        and per group the block-table rows and each token's slot."""
        scheduled = scheduler_output.scheduled
        num_reqs = len(scheduled)
        index = self.req_id_to_index
        rows = np.array([index[s.request_id] for s in scheduled], dtype=np.int64)
        num_computed = np.array([s.num_computed_tokens for s in scheduled], dtype=np.int64)
        num_scheduled = np.array([len(s.token_ids) for s in scheduled], dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if num_tokens == num_reqs:  # one token each (decodes): nothing to expand
            req_of_token, positions = np.arange(num_reqs), num_computed
        else:
            req_of_token = np.repeat(np.arange(num_reqs), num_scheduled)  # [num_tokens]
            positions = np.arange(num_tokens) - (query_start_loc[:-1] - num_computed)[req_of_token]
        if num_tokens == num_reqs:
            token_ids = np.array([s.token_ids[0] for s in scheduled], dtype=np.int64)
        else:  # the tokens are chained and copied at C speed, not looped over in Python
            token_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in scheduled), np.int64, num_tokens)
        tables, slots = [], []
        for table in self.block_tables:
            width = max(int(table.num_blocks_per_row[rows].max()), 1)
            rows_of_batch = table.block_table[rows, :width]  # [num_reqs, width]: one indexing, a copy
            tables.append(rows_of_batch)
            slots.append(rows_of_batch[req_of_token, positions // block_size].astype(np.int64) * block_size
                         + positions % block_size)  # [num_tokens]
        return StepInputs(token_ids, positions, (num_computed + num_scheduled).astype(np.int32), query_start_loc,
                          tuple(tables), tuple(slots))


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's host arrays, built by ``InputBatch.prepare``."""

    token_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    seq_lens: np.ndarray  # [num_reqs] int32: tokens each request attends to, this step's included
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    block_tables: tuple[np.ndarray, ...]  # per group [num_reqs, max_blocks_per_req] int32
    slot_mappings: tuple[np.ndarray, ...]  # per group [num_tokens] int64

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a CPU tensor (no copy)."""
        return torch.from_numpy(np.ascontiguousarray(array))
