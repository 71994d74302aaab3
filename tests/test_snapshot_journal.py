"""A step's undo record costs what the step touches, not what the pool holds: a pool's blocks note their own
state before their first change (the pool's journal), so ``Snapshot`` copies none of them up front."""

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.core.sched.loop import NoComputeExecutor, step
from kvlab.core.sched.output import GenerationRequest, SamplingParams
from kvlab.core.sched.scheduler import Scheduler
from kvlab.core.sched.snapshot import Snapshot


def state(pool):
    return [(b.ref_cnt, b.block_hash, b.prev_free_block, b.next_free_block) for b in pool.blocks]


def busy_scheduler(num_blocks):
    s = Scheduler(KVCacheManager(num_blocks, 4, hash_seed="0"))
    for i in range(3):
        s.add_request(GenerationRequest(f"r{i}", list(range(100 + i, 130 + i)), SamplingParams(max_tokens=8)))
    step(s, NoComputeExecutor(1000))
    return s


def test_a_snapshot_of_a_large_pool_copies_none_of_its_blocks_and_the_journal_keeps_only_those_touched():
    s = busy_scheduler(4096)
    pool = s.kv_cache_manager.block_pool
    before = Snapshot(s)
    saved = sum(len(st) if isinstance(st, list) else 1 for obj, st in before._saved if obj is not pool.blocks)
    assert saved < 400  # the scheduler's queues and requests, not 4,096 blocks
    blocks_before = state(pool)
    s.schedule()
    assert pool._journal is not None and len(pool._journal) < 20
    before.restore()
    assert state(pool) == blocks_before and pool._journal is None


def test_a_step_that_succeeds_closes_the_journal_so_later_changes_are_not_recorded():
    s = busy_scheduler(256)
    pool = s.kv_cache_manager.block_pool
    step(s, NoComputeExecutor(1000))
    assert pool._journal is None


def test_blocks_note_their_writes_only_while_a_journal_is_open():
    s = busy_scheduler(64)
    assert "__setattr__" not in KVCacheBlock.__dict__  # outside a step a write to a block is a plain slot write
    other = Snapshot(busy_scheduler(64))
    before = Snapshot(s)
    assert "__setattr__" in KVCacheBlock.__dict__
    before.close()
    assert "__setattr__" in KVCacheBlock.__dict__  # another pool still journals
    other.restore()
    assert "__setattr__" not in KVCacheBlock.__dict__
