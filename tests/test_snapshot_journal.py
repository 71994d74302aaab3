"""A step's undo record costs what the step touches, not what the pool holds: a pool's blocks note their own
state before their first change (the pool's journal), and so do the requests, so ``Snapshot`` copies none of
them up front."""

import pytest

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.core.kv_offload import CPUOffloadingManager, OffloadingConnector
from kvlab.core.request import Request, RequestStatus
from kvlab.core.sched import loop
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


# ----------------------------------------------------------------- requests journal themselves too


def contents(request):
    """A request's attributes, each list, dict or set copied (what the step may change in place)."""
    return {k: v.copy() if type(v) in (list, dict, set) else v for k, v in vars(request).items()}


def crowded(make):
    """More requests than fit (a queue that waits), sharing a prefix, one forked n=2, preempting as they grow."""
    s = make()
    shared = list(range(1, 10))
    for i in range(6):
        s.add_request(GenerationRequest(f"p{i}", [*shared, 20 + i], SamplingParams(max_tokens=6)))
    s.add_request(GenerationRequest("fork", list(range(40, 51)), SamplingParams(max_tokens=5, n=2, temperature=1.0,
                                                                               seed=0)))
    for i in range(5):
        s.add_request(GenerationRequest(f"w{i}", list(range(60 + i, 67 + i)), SamplingParams(max_tokens=7)))
    return s


def swap_scheduler():
    manager = KVCacheManager(9, 4, hash_seed="0")
    return Scheduler(manager, max_num_batched_tokens=8, preemption_mode="swap",
                     connector=OffloadingConnector(manager, CPUOffloadingManager(8)))


@pytest.mark.parametrize("make", [lambda: Scheduler(KVCacheManager(9, 4, hash_seed="0"), max_num_batched_tokens=8),
                                  swap_scheduler], ids=["recompute", "swap"])
def test_every_request_a_step_changes_noted_itself_before_the_change(make, monkeypatch):
    """The journal's premise: a step changes no request it did not note, and the note is the state before it."""
    opened = []

    class Recording(Snapshot):
        def __init__(self, root):
            super().__init__(root)
            opened.append(self)

    monkeypatch.setattr(loop, "Snapshot", Recording)
    s, executor = crowded(make), NoComputeExecutor(1000)
    noted_any = waiting_untouched = 0
    while s.has_unfinished_requests():
        before = {id(r): (r, contents(r)) for r in s.requests.values()}
        step(s, executor)
        noted = opened[-1]._requests.noted
        for key, (request, state) in before.items():
            if contents(request) != state:
                assert key in noted, request
            if key in noted:
                noted_any += 1
                _, attrs, saved = noted[key]
                copies = {id(container): copy for container, copy in saved}
                assert {k: copies.get(id(v), v) for k, v in attrs.items()} == state  # as it was before the step
            elif request.status == RequestStatus.WAITING:
                waiting_untouched += 1
    assert s.num_preemptions > 0 and noted_any > 20 and waiting_untouched > 10
    assert not Request._journals and "__setattr__" not in Request.__dict__


def test_an_undone_step_puts_back_a_request_it_admitted_and_its_tokens():
    s = busy_scheduler(64)
    waiting = GenerationRequest("late", list(range(200, 210)), SamplingParams(max_tokens=4))
    s.add_request(waiting)
    running = s.running[0]
    state = {r.request_id: contents(r) for r in (waiting, running)}
    before = Snapshot(s)
    output = s.schedule()
    s.update_from_output(output, NoComputeExecutor(1000).execute_model(output))
    assert waiting.status == RequestStatus.RUNNING and len(running.output_token_ids) > 1
    before.restore()
    assert {r.request_id: contents(r) for r in (waiting, running)} == state
    assert s.waiting[0] is waiting and not Request._journals
