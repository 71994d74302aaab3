"""kvlab's Scheduler against vLLM 0.33.0's with a KV connector on both sides (``connector_twin``), step for step.

The same script drives both connectors; the twin compares, every step, the connector calls in order, what is
scheduled, the queues (``kv_holding_waiting`` included), statuses (``WAITING_FOR_REMOTE_KVS``), frees delayed
for a send, ``kv_transfer_params``, both prefix-cache counters and what failed loads recompute.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33.0 is not installed here: run make test-vllm")
from connector_twin import ConnectorTwin
from sched_twin import VOCAB, tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-config"))


def prompt(start: int, length: int) -> list[int]:
    return [1 + (start + i) % (VOCAB - 1) for i in range(length)]


def test_a_remote_prefill_waits_for_its_kvs_then_decodes_and_a_producer_keeps_its_blocks_for_the_send(checkpoint):
    script = {"external": {"d": [40, True]}, "delay": ["p"]}
    t = ConnectorTwin(checkpoint, 40, 16, max_num_batched_tokens=64, script=script, load_steps=2)
    t.add("p", prompt(0, 30), max_tokens=1)                       # a prefill whose blocks wait for a pull
    t.add("d", prompt(50, 40), max_tokens=5)                      # a decode whose whole prompt is pulled
    t.add("x", prompt(100, 20), max_tokens=3)
    assert t.run() > 4


def test_synchronous_hits_partial_local_hits_and_a_prefix_shared_with_a_loaded_request(checkpoint):
    script = {"external": {"b": [32, False], "c": [48, True], "e": [None, False]}}
    t = ConnectorTwin(checkpoint, 60, 16, max_num_batched_tokens=48, script=script)
    t.add("a", prompt(0, 40), max_tokens=2)
    t.run()
    t.add("b", prompt(0, 50), max_tokens=3)                       # local hit 32, nothing more from outside
    t.add("c", prompt(0, 70), max_tokens=3)                       # local 32, then an asynchronous load
    t.add("e", prompt(9, 20), max_tokens=2)                       # the connector cannot tell yet: skipped
    for _ in range(6):
        t.step()
    t.script["external"]["e"] = [0, False]
    t.k_connector.logic.external["e"] = t.v.connector.logic.external["e"] = (0, False)
    t.run()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_loads_are_recomputed_or_failed_as_vllm_does(checkpoint, policy):
    script = {"external": {"s": [32, False], "a": [48, True], "ok": [16, True]}, "fail": ["s", "a"]}
    t = ConnectorTwin(checkpoint, 60, 16, max_num_batched_tokens=64, script=script, kv_load_failure_policy=policy)
    for rid, start in (("s", 0), ("a", 200), ("ok", 400)):
        t.add(rid, prompt(start, 50), max_tokens=3)
    t.run()


def test_aborts_while_loading_before_and_after_the_load_ends(checkpoint):
    script = {"external": {"a": [40, True], "b": [40, True], "c": [40, True]}, "delay": ["c"]}
    t = ConnectorTwin(checkpoint, 60, 16, max_num_batched_tokens=64, script=script, load_steps=3)
    for rid, start in (("a", 0), ("b", 100), ("c", 200)):
        t.add(rid, prompt(start, 45), max_tokens=4)
    t.step()
    t.abort("a")                                                  # mid-load: its blocks wait for the load to end
    t.step()
    t.step()
    t.step()
    t.abort("b")                                                  # the load ended: freed at once
    t.run()


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_with_loads_sends_failures_and_aborts_agrees_step_for_step(checkpoint, seed):
    rng = random.Random(seed)
    external = {f"r{i}": [rng.choice([16, 32, 48, 80]), rng.random() < 0.6] for i in range(40) if rng.random() < 0.5}
    script = {"external": external, "delay": [f"r{i}" for i in range(40) if rng.random() < 0.3],
              "fail": [f"r{i}" for i in range(40) if rng.random() < 0.15]}
    t = ConnectorTwin(checkpoint, 24, 16, max_num_batched_tokens=64, max_num_seqs=6, script=script,
                      load_steps=rng.choice([0, 1, 3]), kv_load_failure_policy=rng.choice(["recompute", "fail"]))
    prefixes = [prompt(rng.randrange(500), 48) for _ in range(3)]
    for i in range(40):
        length = rng.choice([10, 33, 60, 90])
        t.add(f"r{i}", (rng.choice(prefixes) + prompt(rng.randrange(900), length))[:length],
              max_tokens=rng.choice([1, 3, 8]))
        for _ in range(rng.choice([0, 1, 2])):
            t.step()
        if rng.random() < 0.08:
            t.abort(f"r{rng.randrange(i + 1)}")
    t.run()


# ----------------------------------------------------------------- the comparison catches bugs


def _whole_prompt_kept(monkeypatch):  # a loaded prompt's last token is not computed again
    from kvlab.core.sched.scheduler import Scheduler

    original = Scheduler._remote_kvs_ready

    def ready(self, request):
        done = original(self, request)
        if done and request.num_computed_tokens == request.num_tokens - 1 and request.num_tokens > 1:
            request.num_computed_tokens += 0 if request.num_preemptions else 1
        return done
    monkeypatch.setattr(Scheduler, "_remote_kvs_ready", ready)


def _delay_ignored(monkeypatch):  # blocks freed at once although the connector keeps them for a send
    from kvlab.core.sched.scheduler import Scheduler

    original = Scheduler._free_request
    monkeypatch.setattr(Scheduler, "_free_request", lambda self, request, delay=False: original(self, request, False)
                        and None)


@pytest.mark.parametrize("inject", [_whole_prompt_kept, _delay_ignored])
def test_each_injected_connector_bug_is_caught(checkpoint, inject, monkeypatch):
    from twin import Divergence

    inject(monkeypatch)
    with pytest.raises((Divergence, AssertionError, KeyError, ValueError)):  # a divergence, or kvlab's own door
        test_a_remote_prefill_waits_for_its_kvs_then_decodes_and_a_producer_keeps_its_blocks_for_the_send(checkpoint)
