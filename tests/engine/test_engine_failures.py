"""The engine keeps serving: bad sampling parameters are refused up front, a request that fails finishes
with an error and frees its blocks, an abort frees everything, and the others get exactly their tokens.
"""

import warnings

import pytest
import torch

from kvlab.core.request import RequestStatus
from kvlab.core.sched.output import MIN_SAMPLING_TEMPERATURE, SamplingParams
from kvlab.engine import LLMEngine
from kvlab.engine.toy import random_token_ids
from kvlab.errors import KvlabValueError, NonFiniteLogitsError

POISON = 250  # a token id whose input embedding the tests set to NaN


def engine(model_dir, **kwargs):
    return LLMEngine(model_dir, **{"num_gpu_blocks": 32, **kwargs})


def poisoned_engine(model_dir, **kwargs):
    """An engine whose input embedding of ``POISON`` is NaN: a prompt holding it gets NaN logits, others do not.

    The tiny model ties its head to the embedding, so the head gets its own (clean) copy first.
    """
    eng = engine(model_dir, **kwargs)
    model = eng.model
    model.lm_head = torch.nn.Embedding.from_pretrained(model.model.embed_tokens.weight.detach().clone())
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")
    return eng


def assert_nothing_held(eng):
    assert not eng.has_unfinished_requests() and eng.kv_cache_manager.usage == 0
    assert not eng.kv_cache_manager.req_to_blocks


# ----------------------------------------------------------------- refused before anything runs


def test_a_seed_that_does_not_fit_64_bits_is_refused_before_anything_is_queued(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    with pytest.raises(KvlabValueError, match=r"seed must be an integer in \[0, 2\*\*64 - n\]"):
        eng.generate([[5, 6, 7]], temperature=1.0, seed=2**70)
    with pytest.raises(KvlabValueError, match="seed"):
        eng.add_request([5, 6, 7], n=2, temperature=1.0, seed=2**64 - 1)  # sample 1 would need 2**64
    assert not eng.has_unfinished_requests() and eng.outputs == {}
    assert len(eng.generate([[5, 6, 7]], max_tokens=2, temperature=1.0, seed=2**64 - 1)[0]) == 2  # the largest


def test_temperatures_follow_vllm_greedy_at_zero_raised_below_a_hundredth_refused_above_two():
    assert SamplingParams(temperature=0.0).is_greedy
    with pytest.warns(UserWarning, match="raised to 0.01"):
        tiny = SamplingParams(temperature=1e-300)
    assert tiny.temperature == MIN_SAMPLING_TEMPERATURE and not tiny.is_greedy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SamplingParams(temperature=0.5).temperature == 0.5
    for bad in (2.5, float("nan"), float("inf"), -1.0):
        with pytest.raises(KvlabValueError, match="temperature"):
            SamplingParams(temperature=bad)


def test_a_tiny_temperature_samples_the_greedy_token_instead_of_token_zero(tiny_llama_dir, hf_greedy):
    prompt = random_token_ids(12, seed=5)
    with pytest.warns(UserWarning, match="raised to 0.01"):
        out = engine(tiny_llama_dir).generate([prompt], max_tokens=4, temperature=1e-300, seed=0)
    assert out == [hf_greedy(prompt, 4)]  # the model's logits are peaked: at T = 0.01 sampling is greedy


# ----------------------------------------------------------------- a request that fails, the others go on


def test_non_finite_logits_fail_their_request_by_name_and_the_batch_is_served(tiny_llama_dir, hf_greedy):
    eng = poisoned_engine(tiny_llama_dir)
    clean, bad = random_token_ids(10, seed=1), random_token_ids(9, seed=2) + [POISON]
    with pytest.raises(NonFiniteLogitsError, match=r"request '1': its logits hold 256 NaN") as raised:
        eng.generate([clean, bad], max_tokens=5)
    assert "finished with finish_reason 'error'" in "".join(raised.value.__notes__)
    assert eng.outputs["0"] == hf_greedy(clean, 5) and eng.outputs["1"] == []
    assert eng.finish_reasons == {"0": "length", "1": "error"} and eng.errors["1"] is raised.value
    assert eng.metrics.value("vllm:request_success", "error") == 1
    assert_nothing_held(eng)
    assert eng.generate([clean], max_tokens=5) == [hf_greedy(clean, 5)]  # the engine goes on


def test_step_raises_the_failure_after_recording_it_and_the_loop_ends(tiny_llama_dir):
    eng = poisoned_engine(tiny_llama_dir)
    eng.add_request([5, 6, POISON], max_tokens=3, request_id="bad", n=2, temperature=1.0, seed=0)
    eng.add_request([5, 6, 7], max_tokens=3, request_id="good")
    failures = []
    while eng.has_unfinished_requests():  # the loop of issue 14 used to spin forever
        try:
            eng.step()
        except NonFiniteLogitsError as error:
            failures.append(error.request_id)
    assert sorted(failures) == ["bad"]  # raised once, for the first; its forked sample failed with it
    assert eng.finish_reasons == {"bad": "error", "bad#1": "error", "good": "length"}
    assert len(eng.outputs["good"]) == 3
    assert_nothing_held(eng)


class FailOnce:
    """An executor that raises on its first call, before any KV is written, then runs the real one."""

    def __init__(self, inner):
        self.inner, self.failed = inner, False

    def execute_model(self, scheduler_output):
        if not self.failed:
            self.failed = True
            raise RuntimeError("the device fell over")
        return self.inner.execute_model(scheduler_output)


def test_when_the_executor_raises_its_step_fails_and_nothing_it_never_wrote_is_a_hit(tiny_llama_dir, hf_greedy):
    eng = engine(tiny_llama_dir)
    prompt = random_token_ids(40, seed=3)                      # two full blocks the failed step was to fill
    eng.executor = FailOnce(eng.executor)
    eng.add_request(prompt, max_tokens=4)
    with pytest.raises(RuntimeError, match="fell over") as raised:
        eng.step()
    assert "request(s) ['0']" in "".join(raised.value.__notes__)
    assert eng.finish_reasons["0"] == "error"
    assert_nothing_held(eng)
    assert eng.generate([prompt], max_tokens=4) == [hf_greedy(prompt, 4)]
    assert eng.metrics.prefix_cache_hits == 0                  # the zeroed blocks were not served as a prefix


def test_without_evicting_those_blocks_the_next_request_would_read_kv_never_written(tiny_llama_dir, hf_greedy,
                                                                                     monkeypatch):
    eng = engine(tiny_llama_dir)
    monkeypatch.setattr(eng.kv_cache_manager.block_pool, "evict_blocks", lambda block_ids, notify=True: None)
    prompt = random_token_ids(40, seed=3)
    eng.executor = FailOnce(eng.executor)
    eng.add_request(prompt, max_tokens=4)
    with pytest.raises(RuntimeError):
        eng.step()
    assert eng.generate([prompt], max_tokens=4) != [hf_greedy(prompt, 4)]  # it hit two blocks of zeros
    assert eng.metrics.prefix_cache_hits == 32


# ----------------------------------------------------------------- abort


def test_abort_frees_a_request_and_its_samples_and_the_others_finish(tiny_llama_dir, hf_greedy):
    eng = engine(tiny_llama_dir, max_num_batched_tokens=16)
    parent = eng.add_request(random_token_ids(30, seed=4), max_tokens=8, n=3, temperature=1.0, seed=1)
    other = random_token_ids(8, seed=5)
    other_id = eng.add_request(other, max_tokens=6)
    eng.step()                                                 # the parent's prompt is half done: no fork yet
    assert eng.abort_request(parent) == [parent, f"{parent}#1", f"{parent}#2"]
    assert eng.abort_request([parent, "nobody"]) == []         # finished or unknown ids are ignored, as in vLLM
    assert eng.metrics.value("vllm:request_success", "abort") == 0   # vLLM 0.33.0 drops it before counting
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.outputs[other_id] == hf_greedy(other, 6) and eng.finish_reasons[parent] == "abort"
    assert eng.latency.histograms["vllm:e2e_request_latency_seconds"].count == 1  # an abort observes no latency
    assert_nothing_held(eng)


def test_aborting_a_running_parent_takes_its_forked_samples_along(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    parent = eng.add_request(random_token_ids(20, seed=6), max_tokens=8, n=2, temperature=1.0, seed=2)
    eng.step()
    eng.step()                                                 # forked and decoding: both hold blocks
    assert sorted(eng.abort_request(parent)) == [parent, f"{parent}#1"]
    assert eng.scheduler.requests == {} and all(len(eng.outputs[i]) == 2 for i in (parent, f"{parent}#1"))
    assert_nothing_held(eng)
    with pytest.raises(KvlabValueError, match="request id strings"):
        eng.abort_request([7])


def test_an_aborted_request_is_finished_aborted_in_the_scheduler(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    request_id = eng.add_request([5, 6, 7], max_tokens=4)
    request = eng.scheduler.requests[request_id]
    eng.abort_request(request_id)
    assert request.status == RequestStatus.FINISHED_ABORTED and request.get_finished_reason() == "abort"


# ----------------------------------------------------------------- refused at the door, or failing alone (issue 28)


def test_more_samples_than_max_num_seqs_could_never_be_admitted_and_are_refused(tiny_llama_dir):
    eng = engine(tiny_llama_dir, max_num_seqs=2)
    with pytest.raises(KvlabValueError, match=r"n=3 samples, but max_num_seqs=2: .* could never be admitted"):
        eng.generate([[5, 6, 7]], n=3, temperature=1.0, seed=0)
    with pytest.raises(KvlabValueError, match="max_num_seqs=2"):
        eng.add_request([5, 6, 7], n=3, temperature=1.0, seed=0)
    assert not eng.has_unfinished_requests() and eng.outputs == {}
    assert len(eng.generate([[5, 6, 7]], max_tokens=2, n=2, temperature=1.0, seed=0)[0]) == 2  # n = max_num_seqs runs


def test_numpy_integers_are_taken_as_ints_at_the_door(tiny_llama_dir):
    np = pytest.importorskip("numpy")
    params = SamplingParams(max_tokens=np.int64(3), n=np.int32(2), temperature=1.0, seed=np.int64(7))
    assert [type(v) for v in (params.max_tokens, params.n, params.seed)] == [int, int, int]
    eng = engine(tiny_llama_dir)
    eng.add_request([5, 6, 7], max_tokens=np.int64(3), request_id="numpy", temperature=1.0, seed=np.int64(7))
    eng.add_request([5, 6, 7], max_tokens=3, request_id="python", temperature=1.0, seed=7)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.outputs["numpy"] == eng.outputs["python"] and len(eng.outputs["numpy"]) == 3


def test_a_request_whose_sampling_raises_fails_alone_and_the_batch_is_served(tiny_llama_dir, hf_greedy, monkeypatch):
    eng = engine(tiny_llama_dir)
    sample = eng.model_runner.sampler.sample

    def broken_for_bad(logits, request_id, params):
        if request_id == "bad":
            raise TypeError("manual_seed expected a long")
        return sample(logits, request_id, params)

    monkeypatch.setattr(eng.model_runner.sampler, "sample", broken_for_bad)
    good = random_token_ids(10, seed=7)
    eng.add_request([5, 6, 7], max_tokens=3, request_id="bad", temperature=1.0, seed=1)
    eng.add_request(good, max_tokens=4, request_id="good")
    failures = []
    while eng.has_unfinished_requests():
        try:
            eng.step()
        except TypeError as error:
            failures.append(error)
    assert len(failures) == 1 and "request(s) ['bad']" in "".join(failures[0].__notes__)
    assert eng.finish_reasons == {"bad": "error", "good": "length"} and eng.outputs["good"] == hf_greedy(good, 4)
    assert_nothing_held(eng)


@pytest.mark.parametrize("request_ids", [123, None, 1.5])
def test_abort_request_refuses_what_is_not_a_request_id_by_name(tiny_llama_dir, request_ids):
    eng = engine(tiny_llama_dir)
    eng.add_request([5, 6, 7], max_tokens=2, request_id="kept")
    with pytest.raises(KvlabValueError, match="request_ids must be a request id string or a list of them"):
        eng.abort_request(request_ids)
    assert eng.has_unfinished_requests()
