"""The first-come-first-served loop over the manager: seeded workloads, exact hit accounting, pool-size effects."""

import pytest

from kvlab.errors import KvlabValueError
from kvlab.sim.prefix_sim import (
    SimRequest,
    chat_workload,
    min_num_blocks,
    shared_prompt_workload,
    simulate,
    sweep_pool_sizes,
)


def test_workloads_are_seeded_and_chat_turns_resend_the_history():
    assert chat_workload(seed=3) == chat_workload(seed=3) != chat_workload(seed=4)
    assert shared_prompt_workload(seed=3) == shared_prompt_workload(seed=3)
    by_id = {r.request_id: r for r in chat_workload(num_conversations=2, num_turns=3)}
    second = by_id["chat1-turn2"]
    previous = by_id[second.after]
    assert second.prompt_token_ids[: len(previous.prompt_token_ids) + len(previous.output_token_ids)] == (
        previous.prompt_token_ids + previous.output_token_ids)
    assert [r.request_id for r in chat_workload(num_conversations=2, num_turns=2)] == [
        "chat0-turn0", "chat1-turn0", "chat0-turn1", "chat1-turn1"]


def test_with_room_for_everything_each_turn_hits_what_the_last_turn_computed():
    requests = chat_workload()
    result = simulate(requests, num_blocks=240)
    by_id = {r.request_id: r for r in requests}
    # Admission order is the workload order here (the pool never blocks).
    assert result.hit_tokens[0] == 0
    for request, hit in zip(requests[1:], result.hit_tokens[1:], strict=True):
        if request.after is None:
            assert hit == 256  # the shared system prompt: 16 full blocks, cached as soon as the first is allocated
        else:
            previous = by_id[request.after]
            # The last output token is sampled but never computed, so its KV never exists.
            assert hit == previous.num_slots // 16 * 16
    assert result.num_blocks_evicted_before_reuse == 0
    total = sum(len(r.prompt_token_ids) for r in requests)
    assert result.prefill_tokens_saved + result.prefill_tokens_computed == total


def test_a_small_pool_evicts_prefixes_before_they_return():
    requests = shared_prompt_workload()
    small, large = simulate(requests, 40), simulate(requests, 200)
    assert small.hit_rate < large.hit_rate and small.num_blocks_evicted_before_reuse > 0
    assert large.num_blocks_evicted_before_reuse == 0
    assert large.prefill_tokens_saved > small.prefill_tokens_saved


def test_caching_off_saves_nothing_and_runs_are_deterministic():
    requests = chat_workload(num_conversations=2, num_turns=2)
    off = simulate(requests, 100, enable_caching=False)
    assert off.hit_rate == 0 and off.prefill_tokens_saved == 0
    assert simulate(requests, 60) == simulate(requests, 60)
    assert [r.num_blocks for r in sweep_pool_sizes(requests, [60, 100])] == [60, 100]


def test_bad_workloads_and_pools_are_refused():
    requests = shared_prompt_workload(num_requests=3)
    with pytest.raises(KvlabValueError, match="largest request needs"):
        simulate(requests, min_num_blocks(requests, 16) - 1)
    with pytest.raises(KvlabValueError, match="does not come before"):
        simulate([SimRequest("b", (1,), (2,), after="a")], 10)
    with pytest.raises(KvlabValueError, match="repeats"):
        simulate([SimRequest("a", (1,), (2,))] * 2, 10)
    with pytest.raises(KvlabValueError, match="at least one output token"):
        simulate([SimRequest("a", (1,), ())], 10)
    with pytest.raises(KvlabValueError, match="num_turns"):
        chat_workload(num_turns=0)
