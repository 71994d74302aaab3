"""Every failing call changes nothing: invalid calls interleaved with valid traffic, checked on a deep snapshot.

The valid traffic is ``ManagerMachine``'s (arrivals, admissions with prefix hits, chunks,
decodes, forks, preemptions, resets). Between its steps this machine makes calls that must
fail (wrong types and values, foreign or null blocks, hashes that name nothing, writes into
a shared block, a pool observer that raises) and requires a kvlab error each time, with the
pool, its free queue, its hash index, the manager's request tables and stats, and every
request exactly as they were. The issue's reproducers are tests of their own below.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_manager_state_machine import ManagerMachine

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_offload import CPUOffloadingManager
from kvlab.core.request import Request, RequestStatus
from kvlab.errors import KvlabError


def deep_snapshot(manager: KVCacheManager, requests: list[Request] = ()) -> tuple:
    """Everything a failing call could disturb, as plain values."""
    pool = manager.block_pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash, b.block_hash_num_tokens, b.is_null) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()], pool.get_num_free_blocks(),
        [(h, list(blocks)) for h, blocks in pool.cached_block_hash_to_block.items()],
        {i: sorted(h) for i, h in pool.cached_block_hashes_by_block.items()},
        {r: [b.block_id for b in blocks] for r, blocks in manager.req_to_blocks.items()},
        dict(manager.num_cached_block), sorted(manager._requests), list(manager._pending_cow_copies),
        vars(manager.prefix_cache_stats).copy(), vars(manager._interval_stats).copy(),
        manager.num_evicted_blocks, manager.num_blocks_evicted_before_reuse,
        sorted(pool.evicted_hashes), pool.num_evicted_blocks,
        list(manager.caching_metrics.query_queue), len(pool.observers), pool.metrics_collector,
        [(r.request_id, r.num_tokens, r.num_computed_tokens, list(r.block_hashes), r._hasher_owner is None,
          r.status, r.num_preemptions) for r in requests],
    )


class Raising:
    """A pool observer that fails on its first call of the kind it is told to fail on."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def _maybe(self, kind: str) -> None:
        if kind == self.kind:
            raise RuntimeError(f"observer fails on {kind}")

    def on_block_allocated(self, block) -> None:
        self._maybe("allocated")

    def on_block_accessed(self, block) -> None:
        self._maybe("accessed")

    def on_block_evicted(self, block) -> None:
        self._maybe("evicted")

    def reset(self) -> None:
        self._maybe("reset")


class FailingCallsMachine(ManagerMachine):
    """ManagerMachine's traffic, plus calls that must fail and change nothing."""

    def _all(self) -> list[Request]:
        return self.waiting + self.running

    def _refused(self, call) -> None:
        before = deep_snapshot(self.manager, self._all())
        with pytest.raises(KvlabError):
            call()
        assert deep_snapshot(self.manager, self._all()) == before

    @rule(data=st.data(), which=st.integers(0, 9))
    def bad_allocation(self, data, which):
        m, requests = self.manager, self._all()
        request = data.draw(st.sampled_from(requests)) if requests else Request("lonely", [1, 2, 3])
        other_pool_block = BlockPool(4).blocks[1]
        calls = [
            lambda: m.allocate_slots(request, -1),
            lambda: m.allocate_slots(request, request.num_tokens + 1),
            lambda: m.allocate_slots(request, 1, self.block_size, [other_pool_block]),
            lambda: m.allocate_slots(request, 1, 1, []),
            lambda: m.allocate_slots(request, 1, num_encoder_tokens=3),
            lambda: m.allocate_slots(request, 1, num_lookahead_tokens=-2),
            lambda: m.allocate_slots(Request(request.request_id, [9, 9]), 1) if request in self.running else
            m.allocate_slots(request, 0),
            lambda: m.get_computed_blocks(request, max_cache_hit_length=-1),
            lambda: m.allocate_slots(request, 1, skip_zeroing_group_ids=(0,)),
            lambda: m.free("not a request"),
        ]
        self._refused(calls[which])

    @rule(which=st.integers(0, 6), data=st.data())
    def bad_pool_call(self, which, data):
        pool = self.manager.block_pool
        held = [b for blocks in self.manager.req_to_blocks.values() for b in blocks]
        block = data.draw(st.sampled_from(held)) if held else pool.blocks[1]
        two = [block, pool.blocks[min(2, pool.num_gpu_blocks - 1)]]
        calls = [
            lambda: pool.cache_full_blocks(two, [b"a" * 32, [1]], 0, 2),
            lambda: pool.cache_full_blocks(two, [None, None], 0, 2),
            lambda: pool.free_blocks([block] * (block.ref_cnt + 1)),
            lambda: pool.free_blocks([pool.null_block]),
            lambda: pool.touch([BlockPool(3).blocks[1]]),
            lambda: pool.get_new_blocks(pool.get_num_free_blocks() + 1),
            lambda: pool.evict_blocks([pool.num_gpu_blocks]),
        ]
        self._refused(calls[which])
        assert pool.get_cached_block(None) is None

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), kind=st.sampled_from(["allocated", "accessed", "evicted"]))
    def observer_raises_during_admission(self, data, kind):
        request = data.draw(st.sampled_from(self.waiting))
        pool = self.manager.block_pool
        hits, num_hits, _ = self.manager.get_computed_blocks(request)
        before = deep_snapshot(self.manager, self._all())
        pool.observers.append(Raising(kind))
        try:
            new = self.manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits)
        except RuntimeError:
            new = "raised"
        finally:
            pool.observers.pop()
        if new == "raised":
            assert deep_snapshot(self.manager, self._all()) == before
        elif new is not None:  # the observer had nothing to say this time: an ordinary admission
            request.num_computed_tokens, request.status = request.num_tokens, RequestStatus.RUNNING
            self.waiting.remove(request)
            self.running.append(request)
            self._record(request, new)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def write_into_a_shared_block_without_copying(self, data):
        parent = data.draw(st.sampled_from(self.running))
        if parent.num_computed_tokens % self.block_size == 0:
            return
        self.count += 1
        child = Request(f"kid{self.count}", list(parent.all_token_ids) + [1, 1, 1], lora_name=parent.lora_name,
                        cache_salt=parent.cache_salt)
        self.manager.fork(parent, child)
        child.num_computed_tokens, child.status = parent.num_computed_tokens, RequestStatus.RUNNING
        self.running.append(child)
        self._refused(lambda: self.manager.allocate_slots(child, 2, num_lookahead_tokens=8))
        copies = self.manager.copy_on_write(child)
        for copy in copies or []:
            self.shadow.pop(copy.dst_block_id, None)  # the copy's earlier contents are gone
        if copies is None:  # no block for the copy: the child leaves again
            self.manager.free(child)
            self.running.remove(child)
            child.status = RequestStatus.FINISHED_ABORTED


FailingCallsMachine.TestCase.settings = settings(settings.default, stateful_step_count=40)
TestFailingCallsStateMachine = FailingCallsMachine.TestCase


# ----------------------------------------------------------------- the reproducers, one by one


def _cached_manager():
    manager = KVCacheManager(8, 4, hash_seed="repro")
    request = Request("a", list(range(10)))
    manager.allocate_slots(request, 10)
    return manager, request


def test_cache_full_blocks_checks_every_hash_before_hashing_any_block():
    pool = BlockPool(6)
    held = pool.get_new_blocks(2)
    with pytest.raises(KvlabError, match=r"block_hashes\[1\]"):
        pool.cache_full_blocks(held, [b"a" * 32, [1]], 0, 2)
    assert held[0].block_hash is None and len(pool.cached_block_hash_to_block) == 0
    with pytest.raises(KvlabError, match=r"block_hashes\[0\]"):
        pool.cache_full_blocks(held, [None, None], 0, 2)
    assert pool.get_cached_block(None) is None


def test_a_fork_that_writes_without_copy_on_write_is_refused_before_any_block_moves():
    manager, parent = _cached_manager()
    parent.num_computed_tokens = 10
    kid = Request("kid", list(range(10)) + [5, 5])
    manager.fork(parent, kid)
    kid.num_computed_tokens = 10
    before = deep_snapshot(manager, [parent, kid])
    with pytest.raises(KvlabError, match="copy_on_write"):
        manager.allocate_slots(kid, 2, num_lookahead_tokens=8)
    assert deep_snapshot(manager, [parent, kid]) == before
    assert manager.copy_on_write(kid) and manager.allocate_slots(kid, 2, num_lookahead_tokens=8) is not None


def test_complete_load_releases_nothing_unless_every_hash_was_loading():
    cpu = CPUOffloadingManager(4)
    cpu.prepare_store([b"a", b"b"])
    cpu.prepare_load([b"a"])
    with pytest.raises(KvlabError, match="nothing was released"):
        cpu.complete_load([b"a", b"b"])
    assert cpu._protected == {b"a": 1}
    cpu.complete_load([b"a"])
    assert cpu._protected == {}


def test_a_failed_allocation_does_not_bind_the_request_to_the_manager():
    manager = KVCacheManager(3, 4)  # two usable blocks
    big = Request("big", list(range(20)))
    assert manager.allocate_slots(big, 20) is None
    assert big._hasher_owner is None and big.block_hashes == []
    with pytest.raises(KvlabError):
        manager.allocate_slots(big, 21)
    assert big._hasher_owner is None
    other = KVCacheManager(8, 4)
    assert other.allocate_slots(big, 20) is not None  # another manager can still take it


@pytest.mark.parametrize("kind", ["allocated", "evicted", "accessed"])
def test_an_observer_that_raises_leaves_every_block_where_it_was(kind):
    manager, first = _cached_manager()
    manager.free(first)
    again = Request("again", list(range(10)) + [7] * 8)
    hits, num_hits, _ = manager.get_computed_blocks(again)
    assert num_hits == 8
    manager.block_pool.observers.append(Raising(kind))
    before = deep_snapshot(manager, [again])
    with pytest.raises(RuntimeError, match=kind):
        manager.allocate_slots(again, again.num_tokens - num_hits, num_hits, hits)
    assert deep_snapshot(manager, [again]) == before
    assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_usable_blocks
