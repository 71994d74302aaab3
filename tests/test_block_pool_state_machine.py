"""Random get / free / touch / cache / start / write / fork / release sequences keep every invariant of the pool.

After every step: a block is in the free queue exactly when its ref_cnt is 0; ref_cnt equals
the live block tables plus the direct holders that point at it; free plus in-use blocks
(plus the null block) make the pool; the null block never leaves it; the hash index and
the blocks' hashes agree; every sequence reads back exactly its tokens. Every refused
operation raises a kvlab error and leaves the pool and every sequence exactly as they were.
The ``ci`` profile runs 200 examples, ``make test-long`` (HYPOTHESIS_PROFILE=long) 5000.
"""

from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab.core.block_pool import BlockPool
from kvlab.core.hashing import hash_token_blocks
from kvlab.core.sequence import Sequence
from kvlab.errors import BlockStateError, KvlabError, OutOfBlocksError, RequestStateError
from kvlab.sim.block_scenarios import snapshot
from kvlab.units import cdiv

HASHES = ("x", "y", "z")  # few values, so several blocks end up cached under one hash


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 10), reserve_null_block=st.booleans(), block_size=st.integers(1, 4))
    def make_pool(self, num_blocks, reserve_null_block, block_size):
        self.pool = BlockPool(num_blocks, reserve_null_block=reserve_null_block)
        self.block_size = block_size
        self.held = []  # direct holders: one entry per reference taken by get_new_blocks or touch
        self.live: dict[str, Sequence] = {}
        self.tokens: dict[str, list[int]] = {}  # what each live sequence must read back
        self.released: list[Sequence] = []
        self.counter = 0  # token ids, all different
        self.names = iter(f"s{i}" for i in range(10**6))

    # ----------------------------------------------------------------- helpers

    def state(self):
        return (snapshot(self.pool, self.live, self.block_size), sorted(b.block_id for b in self.held),
                [(s.block_table, s.num_tokens, s.released) for s in self.released])

    def refused(self, error, operation):
        """The operation raises ``error`` with a message, and nothing changes."""
        before = self.state()
        with pytest.raises(error) as info:
            operation()
        assert isinstance(info.value, KvlabError) and len(str(info.value)) > 20
        assert self.state() == before

    def fresh_tokens(self, count):
        self.counter += count
        return list(range(self.counter - count, self.counter))

    def in_tables(self):
        return Counter(i for s in self.live.values() for i in s.block_table)

    # ----------------------------------------------------------------- direct use of the pool

    @rule(n=st.integers(0, 4))
    def get(self, n):
        if n > self.pool.get_num_free_blocks():
            self.refused(OutOfBlocksError, lambda: self.pool.get_new_blocks(n))
            return
        blocks = self.pool.get_new_blocks(n)
        assert all(b.ref_cnt == 1 and b.block_hash is None and not b.is_null for b in blocks)
        self.held += blocks

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        picks = data.draw(st.lists(st.integers(0, len(self.held) - 1), min_size=1, unique=True))
        blocks = [self.held[i] for i in picks]
        self.pool.free_blocks(blocks)
        self.held = [b for i, b in enumerate(self.held) if i not in picks]

    @rule(data=st.data())
    def free_too_often(self, data):
        block = data.draw(st.sampled_from([b for b in self.pool.blocks if not b.is_null]))
        self.refused(BlockStateError, lambda: self.pool.free_blocks([block] * (block.ref_cnt + 1)))

    @rule(data=st.data())
    def touch(self, data):
        block = data.draw(st.sampled_from([b for b in self.pool.blocks if not b.is_null]))
        self.pool.touch([block])
        self.held.append(block)

    @rule()
    def null_and_foreign_blocks_are_refused(self):
        foreign = BlockPool(3, reserve_null_block=False).blocks[1]
        self.refused(BlockStateError, lambda: self.pool.free_blocks([foreign]))
        self.refused(BlockStateError, lambda: self.pool.touch([foreign]))
        if self.pool.null_block is not None:
            self.refused(BlockStateError, lambda: self.pool.free_blocks([self.pool.null_block]))
            self.refused(BlockStateError, lambda: self.pool.touch([self.pool.null_block]))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), block_hash=st.sampled_from(HASHES))
    def cache_held(self, data, block_hash):
        block = data.draw(st.sampled_from(self.held))
        if block.block_id in self.in_tables():
            return  # a sequence's own block is cached from its content (cache_sequence)
        if block.block_hash not in (None, block_hash):
            self.refused(BlockStateError, lambda: self.pool.cache_full_blocks([block], [block_hash], 0, 1))
            return
        self.pool.cache_full_blocks([block], [block_hash], 0, 1)
        assert self.pool.get_cached_block(block_hash) is not None

    # ----------------------------------------------------------------- sequences

    def need(self, seq, count):
        copy = seq.num_tokens % self.block_size != 0 and seq.blocks[-1].ref_cnt > 1
        return cdiv(seq.num_tokens + count, self.block_size) - cdiv(seq.num_tokens, self.block_size) + copy, copy

    @rule(count=st.integers(0, 10))
    def start(self, count):
        seq = Sequence(self.pool, self.block_size)
        tokens = self.fresh_tokens(count)
        if cdiv(count, self.block_size) > self.pool.get_num_free_blocks():
            self.refused(OutOfBlocksError, lambda: seq.extend(tokens))
            return
        assert seq.extend(tokens) == []
        name = next(self.names)
        self.live[name], self.tokens[name] = seq, tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data(), count=st.integers(1, 6))
    def write(self, data, count):
        name = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live[name]
        tokens = self.fresh_tokens(count)
        write = (lambda: seq.append(tokens[0])) if count == 1 else (lambda: seq.extend(tokens))
        need, copy = self.need(seq, count)
        if need > self.pool.get_num_free_blocks():
            self.refused(OutOfBlocksError, write)
            return
        shared, table = seq.blocks[-1:], seq.block_table
        copies = write()
        if copy:  # copy-on-write: exactly the shared partial last block, to the new last block
            assert copies == [(shared[0].block_id, seq.block_table[len(table) - 1])]
            assert seq.block_table[:len(table) - 1] == table[:-1]
        else:
            assert copies == [] and seq.block_table[:len(table)] == table
        self.tokens[name] += tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.live)))
        name = next(self.names)
        self.live[name] = self.live[parent].fork()
        self.tokens[name] = list(self.tokens[parent])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache_sequence(self, data):
        seq = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        hashes = hash_token_blocks(seq.token_ids(), self.block_size)
        cache = lambda: self.pool.cache_full_blocks(seq.blocks, hashes, 0, seq.num_full_blocks)  # noqa: E731
        if any(b.block_hash not in (None, h) for b, h in zip(seq.blocks, hashes, strict=False)):
            self.refused(BlockStateError, cache)
        else:
            cache()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        name = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live.pop(name)
        del self.tokens[name]
        # What free_blocks must do with the table, tail first: blocks reaching 0 without a hash to
        # the head (in that order), with a hash to the tail; blocks still referenced stay out.
        uses = Counter(seq.block_table)
        reaching_zero = [b for b in dict.fromkeys(reversed(seq.blocks)) if b.ref_cnt == uses[b.block_id]]
        queue = [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]
        expected = ([b.block_id for b in reaching_zero if b.block_hash is None] + queue
                    + [b.block_id for b in reaching_zero if b.block_hash is not None])
        seq.release()
        assert [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()] == expected
        self.released.append(seq)

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def use_after_release(self, data):
        seq = data.draw(st.sampled_from(self.released))
        for use in (lambda: seq.append(1), lambda: seq.extend([1, 2]), seq.fork, seq.release, seq.token_ids,
                    seq.slot_mapping):
            self.refused(RequestStateError, use)

    # ----------------------------------------------------------------- invariants

    @invariant()
    def free_queue_holds_exactly_the_unreferenced_blocks(self):
        queue = self.pool.free_block_queue.get_all_free_blocks()
        assert len(queue) == self.pool.get_num_free_blocks() == len({b.block_id for b in queue})
        for left, right in zip(queue, queue[1:], strict=False):
            assert left.next_free_block is right and right.prev_free_block is left
        in_queue = {b.block_id for b in queue}
        for block in self.pool.blocks:
            if block.is_null:
                assert block.block_id not in in_queue and block.ref_cnt == 0 and block.block_hash is None
            else:
                assert (block.block_id in in_queue) == (block.ref_cnt == 0)
            if block.block_id not in in_queue:
                assert block.prev_free_block is None and block.next_free_block is None

    @invariant()
    def ref_cnt_counts_tables_and_direct_holders(self):
        expected = self.in_tables() + Counter(b.block_id for b in self.held)
        assert {b.block_id: b.ref_cnt for b in self.pool.blocks if b.ref_cnt} == dict(expected)

    @invariant()
    def free_plus_used_is_the_pool_and_the_null_block_stays_home(self):
        used = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        null = self.pool.null_block is not None
        assert self.pool.get_num_free_blocks() + used + null == self.pool.num_gpu_blocks
        assert self.pool.get_usage() == pytest.approx(used / (self.pool.num_gpu_blocks - null))
        if null:
            assert self.pool.null_block is self.pool.blocks[0] and self.pool.null_block.is_null
            assert 0 not in self.in_tables() and all(b.block_id != 0 for b in self.held)

    @invariant()
    def hash_index_and_block_hashes_agree(self):
        index = self.pool.cached_block_hash_to_block
        assert all(index.values()), "no empty entry is left behind"
        from_index = {(h, i) for h, blocks in index.items() for i in blocks}
        from_blocks = {(b.block_hash, b.block_id) for b in self.pool.blocks if b.block_hash is not None}
        assert from_index == from_blocks
        assert all(block is self.pool.blocks[i] for blocks in index.values() for i, block in blocks.items())

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        for name, seq in self.live.items():
            assert seq.token_ids() == self.tokens[name] and len(seq) == len(self.tokens[name])
            assert len(seq.block_table) == cdiv(len(seq), self.block_size)
            assert seq.slot_mapping() == [seq.block_table[p // self.block_size] * self.block_size
                                          + p % self.block_size for p in range(len(seq))]
        assert all(s.block_table == [] and len(s) == 0 for s in self.released)


TestBlockPoolStateMachine = BlockPoolMachine.TestCase
