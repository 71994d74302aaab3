"""Random traffic through a hybrid KVCacheManager (sliding-window groups beside full attention) keeps its books.

Requests share prefixes, are admitted with their hits in chunks, decode, finish, are preempted
or dropped; calls that must fail are interleaved. After every step, in every group:

* no table misses a block it can still see: after each allocation, every block from the one
  holding position ``p - W + 1`` on, where ``p`` is the step's first new position (a sliding
  window of W; for full attention, every block), is a real block; the null block appears only
  at a table's head;
* freed blocks are unreachable: a block is in the free queue exactly when no table holds it,
  its ``ref_cnt`` counts the tables that do, and no hit ever hands out a block whose content
  (checked against a shadow record) is not the request's own prefix in that group;
* a call that raises changes nothing, and one that returns None changes nothing but the blocks
  that slid out of a window (vLLM frees those first, whatever follows).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvlab.core.request import Request, RequestStatus
from kvlab.errors import KvlabError
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.units import cdiv

PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (5,) * 12]


class HybridMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 30), block_size=st.sampled_from([2, 4]),
                windows=st.lists(st.integers(2, 9), min_size=1, max_size=2), full_first=st.booleans())
    def setup(self, num_blocks, block_size, windows, full_first):
        specs = [SlidingWindowSpec(block_size, sliding_window=w) for w in windows]
        specs = [FullAttentionSpec(block_size), *specs] if full_first else [*specs, FullAttentionSpec(block_size)]
        self.manager = KVCacheManager(num_blocks, block_size, hash_seed="hybrid-machine", kv_cache_groups=specs)
        self.specs, self.block_size = specs, block_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.shadow: dict[int, tuple] = {}  # block id -> (group, every token up to the block's end)
        self.count = 0

    # ----------------------------------------------------------------- helpers

    def _identity(self, group, request, index):
        return group, request.token_ids(0, (index + 1) * self.block_size)

    def _record(self, request, new):
        for block in (b for group in new.blocks for b in group):
            self.shadow.pop(block.block_id, None)
        for g, table in enumerate(self.manager.get_blocks(request.request_id)):
            for j in range(request.num_computed_tokens // self.block_size):
                if not table[j].is_null:
                    identity = self._identity(g, request, j)
                    assert self.shadow.setdefault(table[j].block_id, identity) == identity

    def _check_step_can_read_its_windows(self, request, first_position):
        """The step that computes from ``first_position`` on reads keys from ``first_position - W + 1``: all real."""
        for spec, table in zip(self.specs, self.manager.get_blocks(request.request_id), strict=True):
            first = 0
            if isinstance(spec, SlidingWindowSpec):
                first = max(0, first_position - spec.sliding_window + 1) // self.block_size
            assert all(not b.is_null for b in table[first:]), (spec, first_position, table)

    def _tables(self):
        return {r: [[b.block_id for b in g] for g in self.manager.coordinator.get_blocks(r)]
                for r in self.manager.req_to_blocks}

    def _snapshot(self):
        pool = self.manager.block_pool
        return ([(b.ref_cnt, b.block_hash) for b in pool.blocks],
                [b.block_id for b in pool.free_block_queue.get_all_free_blocks()], self._tables(),
                vars(self.manager.prefix_cache_stats).copy())

    def _refused_changed_only_the_window(self, before_tables):
        """After a None: each table is as before, except real blocks that became null (slid out)."""
        after = self._tables()
        assert after.keys() == before_tables.keys()
        for rid, groups in after.items():
            for old, new in zip(before_tables[rid], groups, strict=True):
                assert len(old) == len(new) and all(o == n or n == 0 for o, n in zip(old, new, strict=True))

    # ----------------------------------------------------------------- traffic

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def arrive(self, prefix, tail):
        self.count += 1
        self.waiting.append(Request(f"r{self.count}", list(prefix) + tail))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        request = data.draw(st.sampled_from(self.waiting))
        hits, num_hits, _ = self.manager.get_computed_blocks(request)
        assert isinstance(hits, KVCacheBlocks) and num_hits <= request.num_tokens - 1
        for g, group in enumerate(hits.blocks):
            assert len(group) == num_hits // self.block_size
            for i, block in enumerate(group):
                if not block.is_null:
                    assert self.shadow[block.block_id] == self._identity(g, request, i)
        chunk = data.draw(st.integers(1, request.num_tokens - num_hits))
        before = self._tables()
        new = self.manager.allocate_slots(request, chunk, num_hits, hits)
        if new is None:
            self._refused_changed_only_the_window(before)
            return
        self._check_step_can_read_its_windows(request, num_hits)
        request.num_computed_tokens = num_hits + chunk
        request.status = RequestStatus.RUNNING
        self.waiting.remove(request)
        self.running.append(request)
        self._record(request, new)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def step(self, data, token):
        request = data.draw(st.sampled_from(self.running))
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(token)
        num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
        before = self._tables()
        new = self.manager.allocate_slots(request, num_new)
        if new is None:
            self._refused_changed_only_the_window(before)
            return
        assert all(not b.is_null for group in new.blocks for b in group)  # the null block is never handed out
        self._check_step_can_read_its_windows(request, request.num_computed_tokens)
        request.num_computed_tokens += num_new
        self._record(request, new)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data, preempt):
        request = data.draw(st.sampled_from(self.running))
        self.manager.free(request)
        self.running.remove(request)
        if preempt:
            request.status, request.num_computed_tokens = RequestStatus.PREEMPTED, 0
            request.num_preemptions += 1
            self.waiting.append(request)
        else:
            request.status = RequestStatus.FINISHED_STOPPED

    @rule()
    def reset_prefix_cache(self):
        assert self.manager.reset_prefix_cache() == (not self.running)

    @precondition(lambda self: self.waiting or self.running)
    @rule(data=st.data(), kind=st.sampled_from(["too_many", "one_group", "foreign", "null_in_full", "swapped"]))
    def a_failing_call_changes_nothing(self, data, kind):
        request = data.draw(st.sampled_from(self.waiting + self.running))
        running = request in self.running
        hits, n, _ = (KVCacheBlocks(tuple([] for _ in self.specs)), 0, 0) if running else \
            self.manager.get_computed_blocks(request)
        groups = list(hits.blocks)
        null = self.manager.block_pool.null_block
        foreign = KVCacheManager(4, self.block_size).block_pool.blocks[1]
        bad = {
            "too_many": (request.num_tokens + 1, n, hits),
            "one_group": (1, n, groups[:1]),
            "foreign": (1, self.block_size, KVCacheBlocks(tuple([foreign] for _ in groups))),
            "null_in_full": (1, self.block_size, KVCacheBlocks(tuple([null] for _ in groups))),
            "swapped": (1, n, KVCacheBlocks(tuple(reversed(groups)))),
        }[kind]
        if kind == "swapped" and (not n or len(groups) < 2):
            return
        before = self._snapshot()
        try:
            self.manager.allocate_slots(request, *bad)
        except KvlabError:
            pass
        else:
            raise AssertionError(f"allocate_slots accepted {kind}")
        assert self._snapshot() == before

    # ----------------------------------------------------------------- invariants

    @invariant()
    def no_table_misses_a_block_it_can_still_see(self):
        for request in self.running:
            c = request.num_computed_tokens
            for spec, table in zip(self.specs, self.manager.get_blocks(request.request_id), strict=True):
                assert len(table) == cdiv(c, self.block_size)
                first_seen = 0
                if isinstance(spec, SlidingWindowSpec):
                    first_seen = max(0, c - spec.sliding_window + 1) // self.block_size
                assert all(not b.is_null for b in table[first_seen:])
                nulls = sum(b.is_null for b in table)
                assert all(b.is_null for b in table[:nulls])  # nulls only at the head

    @invariant()
    def freed_blocks_are_unreachable(self):
        pool = self.manager.block_pool
        holders = Counter(b.block_id for r in self.manager.req_to_blocks for g in self.manager.coordinator.get_blocks(r)
                          for b in g if not b.is_null)
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free) == len(set(free)) == pool.get_num_free_blocks()
        for block in pool.blocks:
            if block.is_null:
                assert block.ref_cnt == 0 and block.block_id not in free and block.block_hash is None
                continue
            assert (block.block_id in free) == (block.ref_cnt == 0) == (holders[block.block_id] == 0)
            assert block.ref_cnt == holders[block.block_id]
        assert set(self.manager.req_to_blocks) == {r.request_id for r in self.running}

    @invariant()
    def hash_index_is_exact(self):
        pool = self.manager.block_pool
        indexed = set()
        for block_hash, blocks in pool.cached_block_hash_to_block.items():
            for block_id, block in blocks.items():
                assert block.block_hash == block_hash
                indexed.add(block_id)
        assert indexed == {b.block_id for b in pool.blocks if b.block_hash is not None}


HybridMachine.TestCase.settings = settings(settings.default, stateful_step_count=50)
TestHybridManagerStateMachine = HybridMachine.TestCase
