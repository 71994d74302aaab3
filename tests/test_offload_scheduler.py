"""The CPU tier and swap inside the scheduler, with the no-compute executor: what is counted, and what never happens.

Invariants checked at every step: the tier never holds more blocks than its capacity and every
block id is in one place; a CPU hit never counts a block the GPU still holds; a load's source
is never overwritten by a store of the same step.
"""

import pytest

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_offload import CPUOffloadingManager, OffloadingConnector
from kvlab.core.sched.loop import NoComputeExecutor, step
from kvlab.core.sched.output import GenerationRequest, SamplingParams
from kvlab.core.sched.scheduler import Scheduler
from kvlab.engine.toy import random_token_ids
from kvlab.errors import KvlabValueError
from kvlab.sim.serving_sim import ChatWorkload, simulate_chat


class CheckedConnector(OffloadingConnector):
    """The real connector, asserting at each call what the CPU tier must never do."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        found, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        assert load_async is False                                # the CPU tier loads before the forward
        if not self.is_swapped(request):
            first = num_computed_tokens // self.block_size
            for block_hash in request.block_hashes[first:first + found // self.block_size]:
                # a CPU hit is a block the GPU no longer holds
                assert self.kv_cache_manager.block_pool.get_cached_block(block_hash) is None
        return found, load_async

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        loaded_from = {cpu for cpu, _ in meta.loads}
        assert not loaded_from & {cpu for _, cpu in meta.stores}, "a store overwrote a block being loaded"
        self.cpu.check_invariants()
        assert self.cpu.num_cached_blocks + self.cpu.num_swap_blocks <= self.cpu.num_blocks
        return meta


def _scheduler(num_gpu_blocks, cpu_blocks, mode="recompute", budget=64):
    manager = KVCacheManager(num_gpu_blocks, 16, hash_seed="nb07")
    connector = CheckedConnector(manager, CPUOffloadingManager(cpu_blocks))
    return Scheduler(manager, max_num_batched_tokens=budget, connector=connector, preemption_mode=mode), connector


def _run(scheduler, prompts, max_tokens):
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(GenerationRequest(f"r{i}", prompt, params))
    executor, outputs, computed = NoComputeExecutor(), {}, 0
    while scheduler.has_unfinished_requests():
        scheduler_output, produced, _ = step(scheduler, executor)
        computed += scheduler_output.total_num_scheduled_tokens
        for out in produced:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs, computed


def test_a_prefix_evicted_from_the_gpu_comes_back_from_the_cpu_tier():
    system_a, system_b = random_token_ids(32, seed=1), random_token_ids(32, seed=2)
    prompts = [system_a + [7, 8], system_b + [9, 10], system_a + [11, 12]]
    plain = Scheduler(KVCacheManager(4, 16, hash_seed="nb07"))
    tiered, connector = _scheduler(4, 8)
    outputs = {}
    for scheduler in (plain, tiered):                         # one at a time: each request evicts the other prompt
        outputs[scheduler is tiered] = [_run(scheduler, [p], 3)[0] for p in prompts]
    assert outputs[True] == outputs[False]
    assert connector.stats.external_prefix_cache_hits == 32 and connector.stats.blocks_loaded == 2
    assert connector.stats.blocks_stored >= 2 and connector.stats.external_prefix_cache_queries == 34 * 3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_cramped_pool_gives_the_same_tokens_either_way(mode):
    prompts = [random_token_ids(30, seed=50 + i) for i in range(3)]
    roomy, _ = _run(Scheduler(KVCacheManager(64, 16, hash_seed="nb07"), max_num_batched_tokens=64), prompts, 20)
    scheduler, connector = _scheduler(7, 16, mode)
    outputs, _ = _run(scheduler, prompts, 20)
    assert outputs == roomy and scheduler.num_preemptions > 0
    if mode == "swap":
        assert scheduler.num_recomputed_tokens == 0 and connector.stats.swap_outs == scheduler.num_preemptions
        assert connector.stats.blocks_swapped_in <= connector.stats.blocks_swapped_out
        assert connector.cpu.num_swap_blocks == 0                 # every swap block was given back
    else:
        assert scheduler.num_recomputed_tokens > 0 and connector.stats.swap_outs == 0


def test_swap_falls_back_to_recompute_when_the_tier_is_full():
    prompts = [random_token_ids(30, seed=50 + i) for i in range(3)]
    scheduler, connector = _scheduler(7, 1, "swap")             # one CPU block: no victim fits
    outputs, _ = _run(scheduler, prompts, 20)
    assert connector.stats.swap_refused == scheduler.num_preemptions > 0 and scheduler.num_recomputed_tokens > 0


def test_swap_needs_a_tier_and_modes_are_named():
    manager = KVCacheManager(8, 16)
    with pytest.raises(KvlabValueError, match="needs a CPU tier"):
        Scheduler(manager, preemption_mode="swap")
    with pytest.raises(KvlabValueError, match="preemption_mode"):
        Scheduler(manager, preemption_mode="page-out", connector=OffloadingConnector(manager, CPUOffloadingManager(2)))


# ----------------------------------------------------------------- the chat simulation


@pytest.fixture(scope="module")
def chat_runs():
    return {name: simulate_chat(blocks, ChatWorkload(), cpu_offload_blocks=cpu)
            for name, blocks, cpu in (("small", 76, 0), ("large", 421, 0), ("tiered", 76, 400))}


def test_a_larger_pool_raises_the_hit_rate_and_clears_the_diagnostic(chat_runs):
    small, large = chat_runs["small"], chat_runs["large"]
    assert small.diagnose().too_small and not large.diagnose().too_small
    assert small.hit_rate < large.hit_rate and large.computed_tokens < small.computed_tokens
    assert small.prompt_tokens == large.prompt_tokens             # the same conversations


def test_a_cpu_tier_keeps_what_the_larger_pool_kept_without_changing_the_gpu(chat_runs):
    small, large, tiered = chat_runs["small"], chat_runs["large"], chat_runs["tiered"]
    assert tiered.num_gpu_blocks == small.num_gpu_blocks and abs(tiered.hit_rate - small.hit_rate) < 0.01
    assert abs(tiered.tiered_hit_rate - large.hit_rate) < 0.01
    assert tiered.gpu_hit_tokens + tiered.cpu_hit_tokens <= tiered.prompt_tokens


def test_the_chat_simulation_repeats_exactly_and_refuses_bad_input():
    a, b = (simulate_chat(100, ChatWorkload(num_conversations=4, max_active=2, turns=2)) for _ in range(2))
    assert (a.computed_tokens, a.gpu_hit_tokens, a.num_steps) == (b.computed_tokens, b.gpu_hit_tokens, b.num_steps)
    with pytest.raises(KvlabValueError, match="workload"):
        simulate_chat(100, {"turns": 2})
    with pytest.raises(KvlabValueError, match="turns"):
        ChatWorkload(turns=0)
