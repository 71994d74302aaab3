"""A step that fails strands no request: each one finishes, with an error status if need be, and frees its blocks.

``num_computed_tokens`` advances when a step is scheduled, as in vLLM, so a request whose step
produced no token would wait forever for a token no later step computes. These tests break the
executor in every way the scheduler can see (it raises, it returns a bad token, it leaves a
request out) and check that the loop ends, the pool is whole again, and the requests the
failure did not touch produce exactly what they produce in a clean run.
"""

import sys

import pytest
from _interrupts import InterruptAtLine
from hypothesis import given
from hypothesis import strategies as st

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_offload import CPUOffloadingManager, OffloadingConnector
from kvlab.core.request import RequestStatus
from kvlab.core.sched.loop import NoComputeExecutor, run_until_done, step
from kvlab.core.sched.output import GenerationRequest, ModelRunnerOutput, SamplingParams
from kvlab.core.sched.scheduler import Scheduler
from kvlab.errors import KvlabValueError, RequestFailedError


def make_scheduler(num_blocks=64, block_size=4, **kwargs):
    return Scheduler(KVCacheManager(num_blocks, block_size, hash_seed="0"), **kwargs)


def req(request_id, prompt, max_tokens=4, **params):
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    return GenerationRequest(request_id, tokens, SamplingParams(max_tokens=max_tokens, **params))


class Broken:
    """NoComputeExecutor's tokens, broken on purpose: ``raise_at`` steps raise, ``tamper`` edits the output."""

    def __init__(self, raise_at=(), tamper=None, error=None):
        self.inner, self.calls = NoComputeExecutor(vocab_size=1000), 0
        self.raise_at, self.tamper, self.error = set(raise_at), tamper, error or RuntimeError("the GPU fell over")

    def execute_model(self, scheduler_output):
        self.calls += 1
        if self.calls in self.raise_at:
            raise self.error
        out = self.inner.execute_model(scheduler_output)
        return ModelRunnerOutput(self.tamper(dict(out.sampled_token_ids))) if self.tamper else out


def assert_pool_is_whole(s):
    pool = s.kv_cache_manager.block_pool
    assert s.kv_cache_manager.usage == 0 and not s.kv_cache_manager.req_to_blocks
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and not s.requests


def clean_outputs(prompts, **kwargs):
    s = make_scheduler(**kwargs)
    requests = [req(f"r{i}", p, max_tokens=5) for i, p in enumerate(prompts)]
    for r in requests:
        s.add_request(r)
    run_until_done(s, NoComputeExecutor(vocab_size=1000))
    return {r.request_id: r.output_token_ids for r in requests}


def test_finished_ids_a_failed_step_never_delivered_are_sent_again():
    s = make_scheduler()
    s.add_request(req("done", 3, max_tokens=1))
    s.add_request(req("next", 3, max_tokens=3))
    step(s, NoComputeExecutor())                      # "done" finishes: the next step carries its id
    out, _, _ = step(s, Broken(raise_at={1}))         # ... but that step fails before the executor reads it
    assert "done" in out.finished_req_ids and "done" in s.schedule().finished_req_ids


def test_a_negative_token_for_one_request_finishes_it_with_an_error_and_the_others_go_on():
    s = make_scheduler()
    requests = [req(f"r{i}", 6 + i, max_tokens=5) for i in range(3)]
    for r in requests:
        s.add_request(r)
    executor = Broken(tamper=lambda tokens: {**tokens, "r1": -1} if "r1" in tokens else tokens)
    _, outputs, _ = step(s, executor)
    (failed,) = [o for o in outputs if o.request_id == "r1"]
    assert (failed.finished, failed.finish_reason, failed.new_token_ids) == (True, "error", ())
    assert isinstance(failed.error, RequestFailedError) and "returned -1" in str(failed.error)
    assert requests[1].status == RequestStatus.FINISHED_ERROR and "r1" not in s.kv_cache_manager.req_to_blocks
    run_until_done(s, executor)
    assert_pool_is_whole(s)
    clean = clean_outputs([6, 7, 8])
    assert [r.output_token_ids for r in requests] == [clean["r0"], (), clean["r2"]]


@pytest.mark.parametrize("tamper, words", [
    (lambda tokens: {k: v for k, v in tokens.items() if k != "r0"}, "returned no token for it"),
    (lambda tokens: {**tokens, "r0": 3.5}, "returned 3.5, which is not a token id"),
    (lambda tokens: {**tokens, "r0": True}, "returned True, which is not a token id"),
])
def test_a_missing_or_malformed_token_fails_only_its_request(tamper, words):
    s = make_scheduler()
    for i in range(2):
        s.add_request(req(f"r{i}", 5))
    _, outputs, _ = step(s, Broken(tamper=tamper))
    assert {o.request_id: o.finish_reason for o in outputs} == {"r1": None, "r0": "error"}
    assert words in str(next(o.error for o in outputs if o.error))
    run_until_done(s)
    assert_pool_is_whole(s)


def test_a_token_for_a_request_that_does_not_sample_is_refused_not_appended():
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(req("long", 10))                      # a 4-token chunk of a 10-token prompt: no sample yet
    _, outputs, _ = step(s, Broken(tamper=lambda tokens: {**tokens, "long": 7}))
    assert [(o.finish_reason, "does not sample in this step" in str(o.error)) for o in outputs] == [("error", True)]
    assert s.requests == {} and s.kv_cache_manager.usage == 0


def test_when_the_executor_raises_the_step_fails_and_the_waiting_requests_are_served():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 6 + i, max_tokens=5))
    error = RuntimeError("the GPU fell over")
    _, outputs, stats = step(s, Broken(raise_at={1}, error=error))
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [("r0", "error", error),
                                                                           ("r1", "error", error)]
    assert stats.num_running_reqs == 0 and [r.request_id for r in s.waiting] == ["r2"]
    assert s.finished_req_ids == {"r0", "r1"}             # the next step tells the executor to drop them
    run_until_done(s)
    assert_pool_is_whole(s)


def test_blocks_a_failed_step_was_to_fill_leave_the_prefix_cache_and_earlier_ones_stay():
    s = make_scheduler(max_num_batched_tokens=8)   # block size 4: a 16-token prompt takes two steps
    prompt = list(range(200, 216))
    s.add_request(req("a", prompt))
    executor = Broken(raise_at={2})
    step(s, executor)                              # tokens 0-7 computed: blocks 0 and 1 cached
    step(s, executor)                              # tokens 8-15 were to be computed: the step fails
    assert s.kv_cache_manager.usage == 0 and len(s.kv_cache_manager.block_pool.cached_block_hash_to_block) == 2
    s.add_request(req("b", prompt))
    out = s.schedule()
    assert out.scheduled[0].num_computed_tokens == 8  # only what was really computed is a hit


def test_forked_samples_fail_with_their_parent_and_unforked_ones_are_reported_too():
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(req("p", 6, n=3, temperature=1.0, seed=0))
    _, outputs, _ = step(s, Broken(raise_at={1}))  # the first chunk fails: the samples were never forked
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("p", "error"), ("p#1", "error"), ("p#2", "error")]
    s.add_request(req("q", 3, n=2, temperature=1.0, seed=0))
    _, outputs, _ = step(s, Broken(raise_at={1}))  # the prompt completes, forks, and the step fails
    assert sorted(o.request_id for o in outputs) == ["q", "q#1"] and all(o.finish_reason == "error" for o in outputs)
    assert_pool_is_whole(s)


def test_an_interrupt_inside_the_executor_finishes_the_step_and_then_stops_the_loop():
    s = make_scheduler()
    s.add_request(req("a", 5))
    s.add_request(req("b", 5))
    with pytest.raises(KeyboardInterrupt):
        run_until_done(s, Broken(raise_at={1}, error=KeyboardInterrupt()))
    assert_pool_is_whole(s)


def test_finish_requests_aborts_running_and_waiting_requests_and_ignores_unknown_ids():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=4)
    s.add_request(req("run", 9, n=2, temperature=1.0, seed=1))     # its prompt needs three chunks
    s.add_request(req("wait", 5))
    step(s, NoComputeExecutor())
    outputs = s.finish_requests(["run", "wait", "nobody", "run"], RequestStatus.FINISHED_ABORTED)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("run", "abort"), ("run#1", "abort"),
                                                                  ("wait", "abort")]
    assert s.finish_requests("run", RequestStatus.FINISHED_ABORTED) == []   # finished already: ignored
    assert_pool_is_whole(s) and not s.has_unfinished_requests()
    assert "run" in s.schedule().finished_req_ids                           # the executor may drop its state
    with pytest.raises(KvlabValueError, match="finished RequestStatus"):
        s.finish_requests("x", RequestStatus.RUNNING)


@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=6),
    failing_steps=st.sets(st.integers(1, 12), max_size=3),
    bad_token_step=st.integers(0, 12),
    num_blocks=st.integers(8, 30),
    budget=st.integers(2, 16),
)
def test_any_mix_of_failures_ends_with_every_request_finished_and_the_pool_whole(lengths, failing_steps,
                                                                                 bad_token_step, num_blocks, budget):
    s = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=3)
    requests = [req(f"r{i}", [7] * 4 + list(range(n)), max_tokens=5) for i, n in enumerate(lengths)]
    for r in requests:
        s.add_request(r)
    calls = iter(range(1, 10_000))

    def tamper(tokens):  # at one step, every sampled token comes back negative
        return {k: -5 for k in tokens} if next(calls) == bad_token_step else tokens

    run_until_done(s, Broken(raise_at=failing_steps, tamper=tamper), max_steps=2000)
    assert all(r.is_finished() for r in requests)
    assert_pool_is_whole(s)
    clean = clean_outputs([[7] * 4 + list(range(n)) for n in lengths], num_blocks=num_blocks,
                          max_num_batched_tokens=budget, max_num_seqs=3)
    for r in requests:
        if r.status != RequestStatus.FINISHED_ERROR:  # untouched by the failures: exactly the clean tokens
            assert r.output_token_ids == clean[r.request_id]


# ----------------------------------------------------------------- an interrupt outside the executor (issue 28.1)


def swap_scheduler():
    """Nine GPU blocks of 4 tokens over a CPU tier of eight, preempting by swap: offload, swap-out and swap-in."""
    manager = KVCacheManager(9, 4, hash_seed="0")
    return Scheduler(manager, max_num_batched_tokens=8, preemption_mode="swap",
                     connector=OffloadingConnector(manager, CPUOffloadingManager(8)))


def interrupted_run(make, k):
    """Four requests (one forked n=2, two sharing a prefix) stepped to the end, a Ctrl-C at line ``k`` of a step."""
    s, tracer, interrupts = make(), InterruptAtLine(k), 0
    for r in (req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=6), req("b", [1, 2, 3, 4, 5, 6, 7, 8, 10]),
              req("c", 11, n=2, temperature=1.0, seed=0), req("d", 6, max_tokens=7)):
        s.add_request(r)
    requests = dict(s.requests)
    executor = NoComputeExecutor(vocab_size=1000)
    for _ in range(300):
        if not s.has_unfinished_requests():
            break
        sys.settrace(tracer)
        try:
            step(s, executor)
        except KeyboardInterrupt:
            interrupts += 1
        finally:
            sys.settrace(None)
    return s, interrupts, {i: r.output_token_ids for i, r in requests.items()}, tracer.lines


@pytest.mark.parametrize("make", [lambda: make_scheduler(num_blocks=9, max_num_batched_tokens=8), swap_scheduler],
                         ids=["recompute", "swap"])
def test_a_ctrl_c_at_any_line_of_a_step_undoes_it_and_the_run_ends_as_if_none_came(make):
    s, _, clean, lines = interrupted_run(make, 0)
    assert s.num_preemptions > 0 and s.kv_cache_manager.prefix_cache_stats.hits > 0
    for k in range(1, lines + 1, max(1, lines // 150)):
        s, interrupts, outputs, _ = interrupted_run(make, k)
        assert interrupts == 1, k
        assert outputs == clean, k  # every request finished with exactly its tokens: none lost, none failed
        assert_pool_is_whole(s)
