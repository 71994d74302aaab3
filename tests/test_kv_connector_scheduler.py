"""The scheduler's side of a KV connector, call by call, as vLLM 0.33.0's scheduler makes the calls.

A ``ScriptedConnector`` records every call and answers from a script: how many external tokens a request
has, whether they load asynchronously, whether a finished request's blocks wait for a send. The "worker"
is the test: it reports loads and sends done through ``KVConnectorOutput`` when it chooses. No tensors:
the scheduler never touches one.
"""

import pytest

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import RequestStatus
from kvlab.core.sched.loop import NoComputeExecutor
from kvlab.core.sched.output import GenerationRequest, KVConnectorOutput, ModelRunnerOutput, SamplingParams
from kvlab.core.sched.scheduler import Scheduler
from kvlab.errors import KvlabValueError

BS = 4


class ScriptedConnector:
    """Scheduler half of a connector: ``external[rid] = (tokens it can load beyond the local hit, async?)``."""

    def __init__(self, external=None, delay=(), params=None):
        self.external = dict(external or {})
        self.delay, self.params = set(delay), params
        self.calls = []
        self.loading = {}  # rid -> block ids it loads into

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        tokens, load_async = self.external.get(request.request_id, (0, False))
        return (None, False) if tokens is None else (max(tokens - num_computed_tokens, 0), load_async)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("update_state_after_alloc", request.request_id, num_external_tokens))
        if num_external_tokens and self.external[request.request_id][1]:
            del self.external[request.request_id]  # one transfer per request, as NIXL's (it clears do_remote_prefill)
            self.loading[request.request_id] = [b.block_id for b in blocks.blocks[0] if b.block_hash is None]

    def build_connector_meta(self, scheduler_output):
        self.calls.append(("build_connector_meta", tuple(s.request_id for s in scheduler_output.scheduled)))
        return {"step": scheduler_output.step}

    def update_connector_output(self, connector_output):
        self.calls.append(("update_connector_output", sorted(connector_output.finished_recving or ()),
                           sorted(connector_output.finished_sending or ())))

    def request_finished(self, request, block_ids):
        self.calls.append(("request_finished", request.request_id, list(block_ids)))
        delay = request.request_id in self.delay
        return delay, (dict(self.params, blocks=list(block_ids)) if self.params else None)

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def scheduler(connector, num_blocks=32, policy="fail", budget=64):
    manager = KVCacheManager(num_blocks, BS, hash_seed="0")
    return Scheduler(manager, max_num_batched_tokens=budget, connector=connector, kv_load_failure_policy=policy)


def req(rid, n, max_tokens=2, start=1):
    return GenerationRequest(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def run_step(s, recving=(), sending=(), invalid=(), failed=()):
    """One step whose worker reports ``recving`` and ``sending`` done, ``invalid`` blocks and ``failed`` loads."""
    out = s.schedule()
    sampled = NoComputeExecutor(vocab_size=50).execute_model(out).sampled_token_ids
    kv = KVConnectorOutput(set(sending) or None, set(recving) or None, set(invalid), set(failed))
    return out, s.update_from_output(out, ModelRunnerOutput(sampled, kv_connector_output=kv))


def test_an_asynchronous_load_waits_for_remote_kvs_and_the_calls_come_in_vllms_order():
    c = ScriptedConnector(external={"a": (10, True)})
    s = scheduler(c)
    a = req("a", 10)
    s.add_request(a)
    out, _ = run_step(s)
    # After the local lookup (nothing cached): the connector's count, the allocation, its state, the step's metadata.
    assert c.take() == [("get_num_new_matched_tokens", "a", 0), ("update_state_after_alloc", "a", 10),
                        ("build_connector_meta", ()), ("update_connector_output", [], [])]
    assert out.scheduled == [] and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert a.num_computed_tokens == 10 and list(s.kv_holding_waiting) == [a] and not s.waiting
    assert len(c.loading["a"]) == 3 and out.kv_connector_metadata == {"step": 0}
    blocks = s.kv_cache_manager.req_to_blocks["a"]
    assert all(b.block_hash is None for b in blocks)              # delay_cache_blocks: not cached before it arrives
    run_step(s)                                                   # the load runs: skipped, no second lookup
    assert [call[0] for call in c.take()] == ["build_connector_meta", "update_connector_output"]
    run_step(s, recving={"a"})                                    # reported done, at the end of this step
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and "a" in s.finished_recving_kv_req_ids
    c.take()
    out, _ = run_step(s)
    # The whole prompt arrived: its last token is computed again, for the logits of the first output token.
    assert [(r.request_id, r.num_computed_tokens, r.num_tokens) for r in out.scheduled] == [("a", 9, 1)]
    assert out.scheduled_new_req_ids == ["a"] and [b.block_hash is not None for b in blocks] == [True, True, False]
    # No lookup again (its blocks are held); as vLLM's docstring says, update_state_after_alloc comes a second time.
    assert c.take()[:2] == [("update_state_after_alloc", "a", 0), ("build_connector_meta", ("a",))]


def test_a_delayed_free_keeps_the_blocks_until_the_worker_reports_the_send():
    c = ScriptedConnector(delay={"p"}, params={"do_remote_prefill": True})
    s = scheduler(c)
    s.add_request(req("p", 9, max_tokens=1))
    out, outputs = run_step(s)
    finished = [call for call in c.take() if call[0] == "request_finished"]
    ids = [b.block_id for b in s.kv_cache_manager.req_to_blocks["p"]]
    assert finished == [("request_finished", "p", ids)] and len(ids) == 3       # the blocks of its 9 computed tokens
    assert outputs[0].finished and outputs[0].kv_transfer_params == {"do_remote_prefill": True, "blocks": ids}
    assert s.kv_cache_manager.usage > 0 and s.has_requests() and not s.has_unfinished_requests()
    run_step(s)                                                   # the send is not done yet
    assert s.kv_cache_manager.usage > 0 and "p" in s.requests
    run_step(s, sending={"p"})
    assert s.kv_cache_manager.usage == 0 and "p" not in s.requests and not s.has_requests()


def test_a_synchronous_hit_is_scheduled_at_once_and_counted_as_an_external_hit():
    c = ScriptedConnector(external={"b": (8, False)})
    s = scheduler(c)
    s.add_request(req("b", 10))
    out, _ = run_step(s)
    assert [(r.num_computed_tokens, r.num_tokens) for r in out.scheduled] == [(8, 2)]
    stats = s.make_stats().connector_prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 10, 8)   # vllm:external_prefix_cache_queries / _hits


def test_the_connector_sees_a_block_aligned_local_hit_and_a_longer_remote_hit_replaces_a_partial_tail():
    manager = KVCacheManager(32, BS, hash_seed="0", hash_block_size=2)   # hits may end inside a block
    c = ScriptedConnector(external={"b": (11, False)})
    s = Scheduler(manager, connector=c)
    s.add_request(req("a", 7, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 12))
    out, _ = run_step(s)
    # The local hit is 6 tokens (one block and a half); the connector is shown 4 and its 11 supersede the tail.
    assert ("get_num_new_matched_tokens", "b", 4) in c.calls
    assert ("update_state_after_alloc", "b", 7) in c.calls
    assert [(r.num_computed_tokens, r.num_tokens) for r in out.scheduled] == [(11, 1)]


def test_a_connector_that_cannot_tell_yet_is_asked_again_and_its_request_keeps_its_place():
    c = ScriptedConnector(external={"a": (None, False)})
    s = scheduler(c)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6, start=20))
    out, _ = run_step(s)
    assert [r.request_id for r in out.scheduled] == ["b"] and [r.request_id for r in s.waiting] == ["a"]
    c.external["a"] = (0, False)
    out, _ = run_step(s)
    assert "a" in [r.request_id for r in out.scheduled]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_synchronous_load_that_failed_is_recomputed_from_its_first_bad_block_or_fails(policy):
    c = ScriptedConnector(external={"a": (8, False)})
    s = scheduler(c, policy=policy)
    a = req("a", 10)
    s.add_request(a)
    out = s.schedule()
    bad = s.kv_cache_manager.req_to_blocks["a"][1].block_id                  # the second of the two loaded blocks
    sampled = NoComputeExecutor(vocab_size=50).execute_model(out).sampled_token_ids
    outputs = s.update_from_output(out, ModelRunnerOutput(sampled, kv_connector_output=KVConnectorOutput(
        invalid_block_ids={bad})))
    assert s.num_kv_load_failures == 1
    if policy == "fail":
        assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "error")]
        assert s.kv_cache_manager.usage == 0
        return
    assert outputs == [] and a.num_computed_tokens == BS and not a.output_token_ids   # this step's token dropped
    out, _ = run_step(s)
    assert [(r.num_computed_tokens, r.num_tokens) for r in out.scheduled] == [(4, 6)]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_an_asynchronous_load_that_failed_is_recomputed_whole_or_fails(policy):
    c = ScriptedConnector(external={"a": (10, True)})
    s = scheduler(c, policy=policy)
    a = req("a", 10)
    s.add_request(a)
    run_step(s)
    _, outputs = run_step(s, recving={"a"}, invalid=set(c.loading["a"]))
    if policy == "fail":
        assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "error")]
        assert s.kv_cache_manager.usage == 0 and "a" not in s.requests and not s.has_unfinished_requests()
        return
    out, _ = run_step(s)
    assert [(r.num_computed_tokens, r.num_tokens) for r in out.scheduled] == [(0, 10)]   # every block failed
    assert a.num_preemptions == 0 and s.kv_cache_manager.usage > 0


def test_a_load_that_failed_whole_by_request_id_is_recomputed():
    c = ScriptedConnector(external={"a": (10, True)})
    s = scheduler(c, policy="recompute")
    s.add_request(req("a", 10))
    run_step(s)
    run_step(s, recving={"a"}, failed={"a"})
    out, _ = run_step(s)
    assert [(r.num_computed_tokens, r.num_tokens) for r in out.scheduled] == [(0, 10)]


def test_an_abort_during_a_load_frees_the_blocks_only_once_the_load_ended():
    c = ScriptedConnector(external={"a": (10, True)})
    s = scheduler(c)
    s.add_request(req("a", 10))
    run_step(s)
    outputs = s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert [o.finish_reason for o in outputs] == ["abort"] and ("request_finished", "a", []) not in c.calls
    assert s.kv_cache_manager.usage > 0 and not s.has_unfinished_requests() and s.has_requests()
    run_step(s, recving={"a"})                                    # the load writes no more: the blocks go
    assert s.kv_cache_manager.usage == 0 and not s.has_requests()


def test_the_waiting_requests_holding_blocks_go_first_and_the_failure_policy_is_checked():
    c = ScriptedConnector(external={"a": (10, True)})
    s = scheduler(c, budget=8)
    s.add_request(req("a", 10))
    run_step(s)
    s.add_request(req("b", 6, start=20))
    run_step(s, recving={"a"})                                    # "b" runs now: "a" is not promoted yet
    out, _ = run_step(s)
    assert [r.request_id for r in out.scheduled][-1] == "a"       # "a" is admitted before the waiting queue
    with pytest.raises(KvlabValueError, match="kv_load_failure_policy"):
        scheduler(c, policy="retry")
