"""kvlab's Scheduler against vLLM 0.33.0's, step for step: scenarios, then seeded random traces.

Each test drives both schedulers with the same requests, aborts and sampled tokens, and the twin
(``sched_twin.SchedTwin``) compares every step: what is scheduled and how many tokens, new against
cached against resumed requests, the new block ids, preemptions, what finished and why,
``num_computed_tokens``, the queues in order and the prefix-cache stats.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33.0 is not installed here: run make test-vllm")
from sched_twin import (
    DELIBERATE_DIFFERENCES,
    SchedConfig,
    SchedTwin,
    apply,
    generate_ops,
    sampled_token,
    tiny_checkpoint,
)
from traces import shrink_ops
from twin import Divergence
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.request import Request as VllmRequest

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.scheduler import Scheduler


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-config"))


def prompt(start: int, length: int) -> list[int]:
    """A prompt of ``length`` tokens that never holds the stop token (0)."""
    return [1 + (start + i) % 39 for i in range(length)]


# ----------------------------------------------------------------- scenarios


def test_a_long_prompt_is_chunked_across_steps_by_the_token_budget(checkpoint):
    t = SchedTwin(checkpoint, 100, 16, max_num_batched_tokens=64)
    t.add("long", prompt(0, 200), max_tokens=3)
    steps = [t.step() for _ in range(4)]
    assert [s.num_scheduled_tokens["long"] for s in steps] == [64, 64, 64, 8]
    assert steps[0].new_req_ids == ["long"] and steps[1].running_req_ids == ["long"]
    assert steps[0].new_block_ids == {"long": ((1, 2, 3, 4),)}
    assert t.run() == 2


def test_three_prompts_share_one_budget_first_come_first_served(checkpoint):
    t = SchedTwin(checkpoint, 100, 16, max_num_batched_tokens=64)
    for i in range(3):
        t.add(f"r{i}", prompt(10 * i, 40), max_tokens=4)
    first, second = t.step(), t.step()
    assert first.num_scheduled_tokens == {"r0": 40, "r1": 24}
    assert second.num_scheduled_tokens == {"r0": 1, "r1": 16, "r2": 40}
    t.run()


def test_max_num_seqs_caps_the_running_requests(checkpoint):
    t = SchedTwin(checkpoint, 100, 16, max_num_seqs=2, max_num_batched_tokens=256)
    for i in range(5):
        t.add(f"r{i}", prompt(7 * i, 20), max_tokens=3)
    assert list(t.step().num_scheduled_tokens) == ["r0", "r1"]
    assert [r.request_id for r in t.k.waiting] == ["r2", "r3", "r4"]
    t.run()


def test_the_newest_request_is_preempted_under_pressure_and_recomputed(checkpoint):
    t = SchedTwin(checkpoint, 9, 4, max_num_batched_tokens=64, enable_caching=False)  # 8 usable blocks
    for i in range(3):
        t.add(f"r{i}", prompt(5 * i, 8), max_tokens=12)
    preempted, resumed = [], []
    while t.k.has_unfinished_requests():
        view = t.step()
        preempted += view.preempted_req_ids
        resumed += view.resumed_req_ids
    assert preempted and preempted[0] == "r2" and "r2" in resumed


def test_a_prefix_hit_shortens_the_prefill(checkpoint):
    t = SchedTwin(checkpoint, 100, 16, max_num_batched_tokens=256)
    t.add("first", prompt(0, 50), max_tokens=2)
    t.run()
    t.add("second", prompt(0, 48) + [7, 7, 7, 7], max_tokens=2)
    view = t.step()
    assert view.num_scheduled_tokens == {"second": 52 - 48}  # three full blocks hit
    t.run()


def test_aborts_mid_prefill_and_mid_decode_free_the_requests_on_both_sides(checkpoint):
    t = SchedTwin(checkpoint, 100, 16, max_num_batched_tokens=32)
    t.add("decoding", prompt(0, 10), max_tokens=50)
    t.add("prefilling", prompt(3, 100), max_tokens=5)
    t.step()
    t.step()
    t.abort("prefilling")
    t.step()
    t.abort("decoding")
    view = t.step()
    assert view.finished_req_ids == {"decoding"} and not t.k.has_unfinished_requests()


def test_a_sliding_window_group_beside_a_full_one(checkpoint):
    t = SchedTwin(checkpoint, 60, 4, max_num_batched_tokens=16, groups=(8, "full"))
    t.add("a", prompt(0, 30), max_tokens=20)
    t.add("b", prompt(0, 26), max_tokens=20)
    slid = False
    while t.k.has_unfinished_requests():
        t.step()
        manager = t.k.kv_cache_manager
        tables = [manager.get_block_ids(r) for r in t.k.requests if r in manager.req_to_blocks]
        slid |= any(0 in sliding for sliding, _full in tables)  # the window's blocks went back: null block
        assert all(0 not in full for _sliding, full in tables)
    assert slid and t.steps > 10


def test_vllm_caps_a_long_prefill_where_kvlab_has_no_threshold(checkpoint):
    """A deliberate difference: vLLM's ``long_prefill_token_threshold`` (off by default); kvlab chunks by budget."""
    assert "no long_prefill_token_threshold" in DELIBERATE_DIFFERENCES
    t = SchedTwin(checkpoint, 100, 16, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    for rid in ("a", "b"):  # vLLM alone: kvlab has no such knob
        t.v.add_request(VllmRequest(rid, prompt(0, 40), VllmSamplingParams(max_tokens=2), None))
    assert dict(t.v.schedule().num_scheduled_tokens) == {"a": 16, "b": 16}


# ----------------------------------------------------------------- seeded random traces

CONFIGS = [
    SchedConfig(100, 16), SchedConfig(20, 16), SchedConfig(12, 4, max_num_batched_tokens=32),
    SchedConfig(40, 4, max_num_seqs=3), SchedConfig(30, 8, enable_caching=False),
    SchedConfig(60, 4, max_num_batched_tokens=16, groups=(8, "full")),
    SchedConfig(25, 16, max_num_batched_tokens=128, max_num_seqs=4),
]
SEEDS = range(5)
STEPS = 300  # 7 configurations x 5 seeds x 300 = 10,500 compared steps


def run_trace(checkpoint: str, config: SchedConfig, seed: int, num_steps: int) -> int:
    """One seeded trace; on a divergence, fail with a shrunk reproducer. Returns the steps compared."""
    ops = generate_ops(config, random.Random(seed), num_steps)

    def diverges(candidate: list[tuple]) -> Divergence | None:
        twin = config.twin(checkpoint)
        try:
            for op in candidate:
                apply(twin, op)
        except Divergence as exc:
            return exc
        return None

    twin = config.twin(checkpoint)
    done = 0
    try:
        for op in ops:
            apply(twin, op)
            done += 1
    except Divergence as exc:
        small = shrink_ops(lambda c: diverges(c) is not None, ops[:done + 1], budget=200)
        lines = "\n".join(f"    {o!r}," for o in small)
        raise Divergence(f"{config} seed={seed}: {exc}\nreproducer ({len(small)} operations; "
                         f"then: {diverges(small)}):\n[\n{lines}\n]") from None
    return twin.steps


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_random_traces_agree_step_for_step(checkpoint, config):
    assert sum(run_trace(checkpoint, config, seed, STEPS) for seed in SEEDS) == STEPS * len(SEEDS)


def test_the_fake_model_repeats_after_a_recompute():
    assert sampled_token("r", 12) == sampled_token("r", 12) != sampled_token("r", 13)


#: Where notebook 06 states each deliberate difference (its scheduler section, after "One step under the microscope").
STATED_IN_NOTEBOOK_06 = {
    "synchronous step": "its step is synchronous",
    "no long_prefill_token_threshold": "it has no `long_prefill_token_threshold`",
    "parallel sampling by fork": "it serves `n > 1` by forking",
    "door checks": "it refuses at `add_request`",
    "a failing step fails its requests": "a failing step fails only its own requests",
    "stop tokens": "`stop_token_ids`",
}


def test_every_deliberate_difference_is_stated_in_notebook_06():
    import json
    from pathlib import Path
    cells = json.loads((Path(__file__).parents[2] / "notebooks" / "06_end_to_end.ipynb").read_text())["cells"]
    text = "".join("".join(c["source"]) for c in cells)
    assert set(STATED_IN_NOTEBOOK_06) == set(DELIBERATE_DIFFERENCES)
    assert [k for k, phrase in STATED_IN_NOTEBOOK_06.items() if phrase not in text] == []


# ----------------------------------------------------------------- the comparison catches bugs


def _preempted_to_the_back(monkeypatch):  # a preempted request waits behind the queue, not at its front
    original = Scheduler._preempt_request

    def preempt(self, request):
        original(self, request)
        self.waiting.remove(request)
        self.waiting.append(request)
    monkeypatch.setattr(Scheduler, "_preempt_request", preempt)


def _admits_by_first_chunk(monkeypatch):  # a waiting request admitted when only its first chunk fits
    original = KVCacheManager.allocate_slots
    monkeypatch.setattr(KVCacheManager, "allocate_slots",
                        lambda self, *args, full_sequence_must_fit=False, **kw: original(self, *args, **kw))


def _one_token_too_many(monkeypatch):  # max_tokens lets one more token through
    original = Scheduler._check_stop

    def check_stop(self, request):
        if request.num_output_tokens == request.max_tokens and request.output_token_ids[-1] != 0:
            return False
        return original(self, request)
    monkeypatch.setattr(Scheduler, "_check_stop", check_stop)


@pytest.mark.parametrize("inject", [_preempted_to_the_back, _admits_by_first_chunk, _one_token_too_many])
def test_each_injected_scheduler_bug_is_caught(checkpoint, inject, monkeypatch):
    inject(monkeypatch)
    config = SchedConfig(20, 16)
    with pytest.raises(Divergence):
        for seed in range(3):
            twin = config.twin(checkpoint)
            for op in generate_ops(config, random.Random(seed), STEPS):
                apply(twin, op)
