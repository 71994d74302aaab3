"""A step is all or nothing: an interrupt (a learner pressing Stop) anywhere in the scheduler's half of a step
undoes the step and is raised again; the engine then serves every request to the same tokens, and frees every block.
"""

import sys

import pytest
from _interrupts import InterruptAtLine

from kvlab.engine import LLMEngine
from kvlab.engine.toy import random_token_ids
from kvlab.errors import BlockStateError

SHARED = random_token_ids(20, seed=11)
PROMPTS = [SHARED + random_token_ids(6, seed=12), SHARED + random_token_ids(9, seed=13), random_token_ids(18, seed=14)]


def crowded_engine(model_dir):
    """Six usable blocks and a 16-token budget for three requests: chunked prefill, prefix hits and preemption."""
    return LLMEngine(model_dir, num_gpu_blocks=7, block_size=8, max_num_batched_tokens=16)


def serve(eng, tracer):
    """Three greedy requests and one seeded pair of samples (n=2, forked), stepped to the end; Ctrl-Cs caught.

    ``tracer`` counts (and interrupts) the lines of steps only.
    """
    ids = [eng.add_request(p, max_tokens=10, request_id=f"greedy{i}") for i, p in enumerate(PROMPTS)]
    ids.append(eng.add_request(PROMPTS[0][:12], max_tokens=6, request_id="sampled", n=2, temperature=1.0, seed=3))
    interrupts = 0
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        tracer.active = True
        try:
            eng.step()
        except KeyboardInterrupt:
            interrupts += 1
        finally:
            tracer.active = False
    return interrupts


def run_interrupted_at(model_dir, k):
    eng = crowded_engine(model_dir)
    tracer, previous = InterruptAtLine(k), sys.gettrace()
    tracer.active = False
    sys.settrace(tracer)
    try:
        interrupts = serve(eng, tracer)
    finally:
        sys.settrace(previous)
    return eng, interrupts, tracer.lines


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The uninterrupted run: its tokens, and how many lines of kvlab.core it runs."""
    eng, interrupts, lines = run_interrupted_at(tiny_llama_dir, 0)
    assert interrupts == 0 and eng.kv_cache_metrics is None
    assert eng.metrics.num_preemptions > 0 and eng.metrics.prefix_cache_hits > 0  # the hard paths are taken
    return eng.outputs, lines


def test_an_interrupt_in_check_stop_undoes_the_step_and_the_request_then_finishes(tiny_llama_dir):
    eng = LLMEngine(tiny_llama_dir, num_gpu_blocks=32)
    eng.add_request([5, 6, 7], max_tokens=4)
    check_stop, calls = eng.scheduler._check_stop, []

    def interrupted_once(request):
        calls.append(request.request_id)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return check_stop(request)

    eng.scheduler._check_stop = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    assert eng.scheduler.requests["0"].num_computed_tokens == 0 and eng.outputs["0"] == []  # as before the step
    for _ in range(100):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    assert not eng.has_unfinished_requests() and eng.finish_reasons == {"0": "length"} and len(eng.outputs["0"]) == 4
    pool = eng.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


@pytest.mark.parametrize("position", [i / 16 for i in range(16)])
def test_an_interrupt_at_any_line_of_the_scheduler_loses_no_request_block_or_token(tiny_llama_dir, reference,
                                                                                   position):
    outputs, lines = reference
    k = 1 + int(position * lines) + 7  # spread over the run, off the step boundaries
    try:
        eng, interrupts, _ = run_interrupted_at(tiny_llama_dir, k)
    except BlockStateError as wedged:  # pragma: no cover - what main did
        pytest.fail(f"the engine wedged after an interrupt at line {k}: {wedged}")
    assert interrupts == 1
    assert not eng.has_unfinished_requests()
    assert set(eng.finish_reasons.values()) <= {"length", "stop"}  # undone, not failed: nothing is lost
    assert eng.outputs == outputs  # greedy and seeded tokens alike: no token dropped, no draw repeated
    pool = eng.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks and not eng.kv_cache_manager.req_to_blocks
