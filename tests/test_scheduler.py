"""The scheduler, driven by the no-compute executor: the rules of vLLM V1's unified token budget.

Each test is one rule: the budget caps a step, running requests go first, a long prompt is
chunked, a cached prefix is not recomputed, the most recent request is preempted and nothing
is admitted in that step, a preempted request comes back and finishes the same, n > 1 forks
and copies on write, and a request that could never fit is refused at the door.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import RequestStatus
from kvlab.core.sched.loop import NoComputeExecutor, run_until_done, step
from kvlab.core.sched.output import GenerationRequest, SamplingParams
from kvlab.core.sched.scheduler import Scheduler
from kvlab.errors import KvlabValueError, RequestTooLongError


def make_scheduler(num_blocks=64, block_size=4, caching=True, **kwargs):
    return Scheduler(KVCacheManager(num_blocks, block_size, enable_caching=caching, hash_seed="0"), **kwargs)


def req(request_id, prompt, max_tokens=4, **params):
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    return GenerationRequest(request_id, tokens, SamplingParams(max_tokens=max_tokens, **params))


def run(scheduler, executor=None):
    """Step to the end; return each step's SchedulerOutput and the running ids just before it."""
    executor = executor or NoComputeExecutor(vocab_size=1000)
    steps = []
    while scheduler.has_unfinished_requests():
        running_before = [r.request_id for r in scheduler.running]
        steps.append((step(scheduler, executor)[0], running_before))
        assert len(steps) < 1000
    return steps


def outputs_of(requests):
    return {r.request_id: list(r.output_token_ids) for r in requests}


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_and_sampled_once():
    s = make_scheduler(max_num_batched_tokens=10)
    r = req("a", 25, max_tokens=2)
    s.add_request(r)
    steps = run(s)
    chunks = [(o.scheduled[0].num_computed_tokens, o.scheduled[0].num_tokens, o.scheduled[0].sample)
              for o, _ in steps]
    assert chunks == [(0, 10, False), (10, 10, False), (20, 5, True), (25, 1, True)]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_output_tokens == 2


def test_running_requests_are_served_before_waiting_ones_and_the_budget_holds():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(req("old", 3, max_tokens=6))
    step(s, NoComputeExecutor())
    s.add_request(req("new", 30, max_tokens=2))
    out = s.schedule()
    assert [(x.request_id, x.num_tokens) for x in out.scheduled] == [("old", 1), ("new", 7)]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 7
    assert out.total_num_scheduled_tokens == 8 == s.max_num_scheduled_tokens


def test_max_num_seqs_caps_the_running_queue():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 5))
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["r0", "r1"] and len(s.waiting) == 2


def test_a_cached_prefix_is_counted_as_hits_and_not_recomputed():
    s = make_scheduler(block_size=16)
    shared = list(range(1000, 1032))  # two full blocks
    s.add_request(req("first", shared + [1, 2, 3, 4, 5, 6, 7, 8]))
    run(s)
    s.add_request(req("second", shared + [9, 9, 9]))
    out, _, stats = step(s, NoComputeExecutor())
    (only,) = out.scheduled
    assert (only.num_computed_tokens, only.num_tokens) == (32, 3)
    assert (stats.prefix_cache_stats.queries, stats.prefix_cache_stats.hits) == (35, 32)


def test_a_fully_cached_prompt_still_computes_its_last_block():
    s = make_scheduler(block_size=16)
    prompt = list(range(500, 532))
    s.add_request(req("first", prompt))
    run(s)
    s.add_request(req("again", prompt))
    out = s.schedule()
    # 32 tokens hit at most 31: hits are whole blocks, so the second block is recomputed.
    assert (out.scheduled[0].num_computed_tokens, out.scheduled[0].num_tokens) == (16, 16)


def preemption_run(num_blocks, caching=True):
    s = make_scheduler(num_blocks=num_blocks, block_size=4, caching=caching, max_num_batched_tokens=64)
    requests = [req(f"r{i}", [10 * i + t for t in range(7)], max_tokens=6) for i in range(3)]
    for r in requests:
        s.add_request(r)
    return s, requests, run(s)


def test_preemption_takes_the_most_recent_request_frees_it_and_admits_nobody_that_step():
    s, requests, steps = preemption_run(num_blocks=8)  # 7 usable blocks; the three need 3 each at the end
    preempting = [(o, before) for o, before in steps if o.preempted_req_ids]
    assert preempting, "the pool is too small: some step must preempt"
    out, running_before = preempting[0]
    assert out.preempted_req_ids == [running_before[-1]]  # the most recently admitted
    assert not out.scheduled_new_req_ids and not out.scheduled_resumed_req_ids
    assert out.preempted_req_ids[0] not in out.num_scheduled_tokens
    assert s.num_preemptions == sum(len(o.preempted_req_ids) for o, _ in steps)
    victim = next(r for r in requests if r.request_id == out.preempted_req_ids[0])
    assert victim.num_preemptions >= 1
    # Preempted or not, every request produces exactly what it produces in a roomy pool.
    _, roomy, _ = preemption_run(num_blocks=64)
    assert outputs_of(requests) == outputs_of(roomy)
    assert s.kv_cache_manager.usage == 0


def test_a_preempted_request_waits_at_the_front_with_nothing_computed():
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64, max_num_seqs=3)
    requests = [req(f"r{i}", [10 * i + t for t in range(7)], max_tokens=6) for i in range(3)]
    for r in requests:
        s.add_request(r)
    s.add_request(req("late", 3))  # waits: three sequences run at most
    executor = NoComputeExecutor()
    while True:
        out, _, stats = step(s, executor)
        if out.preempted_req_ids:
            break
    victim = s.requests[out.preempted_req_ids[0]]
    assert s.waiting[0] is victim and s.waiting[1].request_id == "late"
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.request_id not in s.kv_cache_manager.req_to_blocks
    assert stats.num_preempted_reqs == 1


def test_with_prefix_caching_a_resumed_request_skips_its_blocks_that_survived():
    s, requests, steps = preemption_run(num_blocks=8, caching=True)
    resumed = [o for o, _ in steps if o.scheduled_resumed_req_ids]
    assert resumed
    out = resumed[0]
    (entry,) = [x for x in out.scheduled if x.request_id == out.scheduled_resumed_req_ids[0]]
    total = entry.num_computed_tokens + entry.num_tokens
    # Its full blocks kept their hashes; those not evicted while it waited are hits.
    assert 0 < entry.num_computed_tokens < total and entry.num_computed_tokens % 4 == 0
    s_off, _, steps_off = preemption_run(num_blocks=8, caching=False)
    resumed_off = [o for o, _ in steps_off if o.scheduled_resumed_req_ids]
    assert all(x.num_computed_tokens == 0 for o in resumed_off for x in o.scheduled
               if x.request_id in o.scheduled_resumed_req_ids)


def test_parallel_sampling_forks_after_the_prompt_and_copies_the_partial_block_on_write():
    # The source's walk-through: a 40-token prompt, block size 16, n = 4.
    s = make_scheduler(num_blocks=32, block_size=16)
    parent = req("p", 40, max_tokens=20, n=4, temperature=1.0, seed=3)
    s.add_request(parent)
    executor = NoComputeExecutor()
    out, _, _ = step(s, executor)
    manager = s.kv_cache_manager
    ids = ["p", "p#1", "p#2", "p#3"]
    assert [c for c, _ in out.scheduled[0].forked] == ids[1:]
    tables = [manager.get_block_ids(i) for i in ids]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 3  # 3 blocks shared, not 12
    assert [manager.block_pool.blocks[b].ref_cnt for b in tables[0]] == [4, 4, 4]
    out, _, _ = step(s, executor)  # every sample writes token 41 into the shared, half-full third block
    shared = tables[0][2]
    assert [src for src, _ in out.blocks_to_copy] == [shared] * 3  # three copies; the last writer keeps it
    after = [manager.get_block_ids(i) for i in ids]
    assert all(t[:2] == tables[0][:2] for t in after)  # full blocks stay shared
    assert sorted(t[2] for t in after) == sorted([shared] + [dst for _, dst in out.blocks_to_copy])
    assert [s.kv_cache_manager.block_pool.blocks[b].ref_cnt for b in tables[0][:2]] == [4, 4]
    run(s, executor)
    assert s.kv_cache_manager.usage == 0


def replay_block_ids(scheduler, executor, tables):
    """One step, its block ids applied as an executor applies them; returns the step's output."""
    out, _, _ = step(scheduler, executor)
    for request_id in (*out.finished_req_ids, *out.preempted_req_ids):
        tables.pop(request_id, None)
    for s in out.scheduled:
        tables[s.request_id] = list(s.block_ids) if s.whole_table else tables[s.request_id] + list(s.block_ids)
    return out


def test_a_step_sends_only_the_new_block_ids_and_they_rebuild_every_block_table():
    # As vLLM's SchedulerOutput: a new or resumed request's whole table, then only the blocks a step adds.
    # kvlab also sends the whole table where it changed a table otherwise: a forked sample, a copy-on-write.
    s = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    for r in (req("a", [7] * 9, max_tokens=9), req("b", [7] * 8 + [3], max_tokens=6),
              req("c", 6, max_tokens=5, n=2, temperature=1.0, seed=0), req("d", 5, max_tokens=12)):
        s.add_request(r)
    executor, tables, outputs = NoComputeExecutor(vocab_size=1000), {}, []
    while s.has_unfinished_requests():
        outputs.append(replay_block_ids(s, executor, tables))
        for request_id, table in tables.items():
            if request_id in s.kv_cache_manager.req_to_blocks:
                assert table == s.kv_cache_manager.get_block_ids(request_id), (len(outputs), request_id)
    sent = [x for o in outputs for x in o.scheduled]
    assert s.num_preemptions and s.kv_cache_manager.prefix_cache_stats.hits  # resumed requests and hits are sent
    assert sum(not x.whole_table and not x.block_ids for x in sent) > len(sent) / 2  # most steps send no block id
    assert all(x.whole_table for o in outputs for x in o.scheduled
               if x.request_id in (*o.scheduled_new_req_ids, *o.scheduled_resumed_req_ids))
    first_of_sample = next(x for x in sent if x.request_id == "c#1")
    assert first_of_sample.whole_table and first_of_sample.block_ids  # the fork's table, from its first step


def test_after_an_undone_step_every_table_is_sent_whole():
    s = make_scheduler()
    s.add_request(req("a", 6, max_tokens=5))
    executor = NoComputeExecutor()
    step(s, executor)
    update = s.update_from_output
    s.update_from_output = lambda *args: (_ for _ in ()).throw(KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        step(s, executor)  # the executor may have applied its new block ids: the step is undone after it
    s.update_from_output = update
    out, _, _ = step(s, executor)
    assert out.scheduled[0].whole_table and out.scheduled[0].block_ids == tuple(s.kv_cache_manager.get_block_ids("a"))
    assert not step(s, executor)[0].scheduled[0].whole_table


def test_forked_samples_count_against_max_num_seqs():
    s = make_scheduler(max_num_seqs=4)
    s.add_request(req("a", 5, n=3))
    s.add_request(req("b", 5, n=2))
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["a"]  # b's two samples would make 5 sequences


def test_a_request_that_could_never_fit_is_refused_and_changes_nothing():
    s = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)  # 4 usable blocks: 16 slots
    s.add_request(req("fits", 10, max_tokens=7))  # 16 tokens of KV
    with pytest.raises(RequestTooLongError, match="needs 5 blocks"):
        s.add_request(req("long", 10, max_tokens=8))
    assert [r.request_id for r in s.waiting] == ["fits"] and "long" not in s.requests
    with pytest.raises(RequestTooLongError, match="max_model_len"):
        s.add_request(req("huge", 64))
    run(s)
    assert s.kv_cache_manager.usage == 0


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(KvlabValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=0)
    with pytest.raises(KvlabValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(KvlabValueError, match="n must"):
        SamplingParams(n=0)


@given(
    prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 8)), min_size=1, max_size=8),
    num_blocks=st.integers(10, 40),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 5),
    caching=st.booleans(),
)
def test_any_workload_finishes_within_the_budget_and_returns_every_block(prompts, num_blocks, budget, max_num_seqs,
                                                                         caching):
    s = make_scheduler(num_blocks=num_blocks, block_size=4, caching=caching, max_num_batched_tokens=budget,
                       max_num_seqs=max_num_seqs)
    requests = []
    for i, (prefix, length, max_tokens) in enumerate(prompts):
        r = GenerationRequest(f"r{i}", [7 * prefix] * 12 + list(range(length)), SamplingParams(max_tokens=max_tokens))
        try:
            s.add_request(r)
        except RequestTooLongError:
            continue
        requests.append(r)
    history = run_until_done(s, NoComputeExecutor(), max_steps=5000)
    assert all(h.num_scheduled_tokens <= budget and h.num_running_reqs <= max_num_seqs for h in history)
    # max_model_len defaults to the pool's capacity: a request that reaches it is length-capped there.
    assert all(r.num_output_tokens == min(r.max_tokens, s.max_model_len - r.num_prompt_tokens) for r in requests)
    assert s.kv_cache_manager.usage == 0 and not s.requests
