"""Random request traffic through the KVCacheManager keeps the pool's books exact at every step.

Requests share random prefixes (and sometimes a LoRA adapter or a cache salt), are admitted
with their prefix hits in chunks, decode, finish, are preempted or dropped. After every step:
a block is in the free queue exactly when nobody holds it; its ref_cnt is the number of live
requests holding it; free plus in use is the pool; the null block never moves; the hash index
is exact; no hit ever hands a request a block computed for a different prefix (checked
against a shadow record of what each block holds); queries are never fewer than hits.
"""

import math
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request, RequestStatus
from kvlab.units import cdiv

PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (5,) * 12]


class ManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 14), block_size=st.sampled_from([2, 4]), verify=st.booleans())
    def setup(self, num_blocks, block_size, verify):
        self.manager = KVCacheManager(num_blocks, block_size, hash_seed="state-machine", verify_hits=verify)
        self.block_size = block_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.shadow: dict[int, tuple] = {}  # block id -> (lora, salt, every token up to the block's end)
        self.count = 0

    # ----------------------------------------------------------------- helpers

    def _identity(self, request, block_index):
        end = (block_index + 1) * self.block_size
        return request.lora_name, request.cache_salt, request.token_ids(0, end)

    def _record(self, request, new_blocks):
        for block in new_blocks.blocks[0]:  # fresh blocks: whatever they held before is gone
            self.shadow.pop(block.block_id, None)
        blocks = self.manager.get_blocks(request.request_id)
        for j in range(request.num_computed_tokens // self.block_size):
            identity = self._identity(request, j)
            assert self.shadow.setdefault(blocks[j].block_id, identity) == identity

    def _snapshot(self):
        pool = self.manager.block_pool
        return ([(b.ref_cnt, b.block_hash) for b in pool.blocks],
                [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
                {r: [b.block_id for b in bl] for r, bl in self.manager.req_to_blocks.items()})

    # ----------------------------------------------------------------- traffic

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), min_size=1, max_size=10),
          lora=st.sampled_from([None, None, "adapter"]), salt=st.sampled_from([None, None, "tenant"]))
    def arrive(self, prefix, tail, lora, salt):
        self.count += 1
        self.waiting.append(Request(f"r{self.count}", list(prefix) + tail, lora_name=lora, cache_salt=salt))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        request = data.draw(st.sampled_from(self.waiting))
        hits, num_hits, _ = self.manager.get_computed_blocks(request)
        assert num_hits == len(hits.blocks[0]) * self.block_size <= request.num_tokens - 1
        for i, block in enumerate(hits.blocks[0]):  # a hit is exactly the request's own prefix
            assert self.shadow[block.block_id] == self._identity(request, i)
        chunk = data.draw(st.integers(1, request.num_tokens - num_hits))
        before = self._snapshot()
        new = self.manager.allocate_slots(request, chunk, num_hits, hits)
        if new is None:
            assert self._snapshot() == before
            return
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
        before = self._snapshot()
        new = self.manager.allocate_slots(request, num_new)
        if new is None:
            assert self._snapshot() == before
            return
        request.num_computed_tokens += num_new
        self._record(request, new)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        request = data.draw(st.sampled_from(self.running))
        self.manager.free(request)
        request.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        request = data.draw(st.sampled_from(self.running))
        self.manager.free(request)
        request.status, request.num_computed_tokens = RequestStatus.PREEMPTED, 0
        request.num_preemptions += 1
        self.running.remove(request)
        self.waiting.append(request)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def drop(self, data):
        request = data.draw(st.sampled_from(self.waiting))
        self.manager.free(request)  # holds nothing: a no-op, as aborting a waiting request is in vLLM
        request.status = RequestStatus.FINISHED_ABORTED
        self.waiting.remove(request)

    @rule()
    def reset_prefix_cache(self):
        assert self.manager.reset_prefix_cache() == (not self.running)

    # ----------------------------------------------------------------- invariants

    @invariant()
    def books_balance(self):
        pool = self.manager.block_pool
        holders = Counter(b.block_id for blocks in self.manager.req_to_blocks.values() for b in blocks)
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free) == len(set(free)) == pool.get_num_free_blocks()
        for block in pool.blocks:
            if block.is_null:
                assert block.ref_cnt == 0 and block.block_id not in free and not holders[block.block_id]
                assert block.block_hash is None
                continue
            assert (block.block_id in free) == (block.ref_cnt == 0)
            assert block.ref_cnt == holders[block.block_id]
        in_use = sum(b.ref_cnt > 0 for b in pool.blocks)
        assert len(free) + in_use == pool.num_gpu_blocks - 1
        assert math.isclose(self.manager.usage, in_use / (pool.num_gpu_blocks - 1))

    @invariant()
    def hash_index_is_exact(self):
        pool = self.manager.block_pool
        indexed = set()
        for block_hash, blocks in pool.cached_block_hash_to_block.items():
            assert blocks
            for block_id, block in blocks.items():
                assert block.block_id == block_id and block.block_hash == block_hash
                indexed.add(block_id)
        assert indexed == {b.block_id for b in pool.blocks if b.block_hash is not None}

    @invariant()
    def requests_and_stats_agree(self):
        assert set(self.manager.req_to_blocks) == {r.request_id for r in self.running}
        for request in self.running:
            assert len(self.manager.req_to_blocks[request.request_id]) == cdiv(request.num_computed_tokens,
                                                                             self.block_size)
            assert len(request.block_hashes) == request.num_tokens // self.block_size
        stats = self.manager.prefix_cache_stats
        assert stats.queries >= stats.hits and stats.preempted_queries >= stats.preempted_hits


ManagerMachine.TestCase.settings = settings(settings.default, stateful_step_count=50)
TestManagerStateMachine = ManagerMachine.TestCase
