"""An ``LLMEngine`` with ``kv_events_config`` publishes its own pool's KV cache events over ZMQ, once per step.

What a subscriber receives, applied to an index, is exactly the set of hashes the engine's pool has cached:
the contract a precise router relies on. The config takes vLLM 0.33.0's fields and refuses others by name.
"""

from __future__ import annotations

import pytest

from kvlab.data import TINY_MODEL_DIR
from kvlab.distributed.kv_events import KVEventSubscriber
from kvlab.engine import LLMEngine
from kvlab.engine.engine_config import EngineConfig
from kvlab.engine.kv_events_config import KVEventsConfig
from kvlab.errors import KvlabValueError
from kvlab.fleet.routers import KVBlockIndex

LOOPBACK_ANY_PORT = "tcp://127.0.0.1:0"
MODEL = TINY_MODEL_DIR  # the trained tiny-pydoc-llama the fleet's replicas serve


def test_the_config_takes_vllms_fields_as_a_dict_and_refuses_others_by_name():
    config = EngineConfig(MODEL, num_gpu_blocks=8,
                          kv_events_config={"enable_kv_cache_events": True, "endpoint": LOOPBACK_ANY_PORT})
    assert isinstance(config.kv_events_config, KVEventsConfig) and config.kv_events_config.publisher == "zmq"
    assert config.enable_kv_cache_events and not EngineConfig(MODEL, num_gpu_blocks=8).enable_kv_cache_events
    with pytest.raises(KvlabValueError, match="kv_events_config key"):
        EngineConfig(MODEL, num_gpu_blocks=8, kv_events_config={"enable_events": True})
    with pytest.raises(KvlabValueError, match="kv_events_config: publisher"):
        EngineConfig(MODEL, num_gpu_blocks=8, kv_events_config={"publisher": "kafka"})
    with pytest.raises(KvlabValueError, match="kv_events_config"):
        EngineConfig(MODEL, num_gpu_blocks=8, kv_events_config="on")


def test_an_engine_publishes_its_pools_events_and_an_index_of_them_equals_its_cache():
    engine = LLMEngine(MODEL, num_gpu_blocks=9, block_size=4, dtype="float32", kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, endpoint=LOOPBACK_ANY_PORT, replay_endpoint=LOOPBACK_ANY_PORT, topic="kv"))
    bound = engine.kv_event_publisher.get_publisher_config()
    assert bound.endpoint.startswith("tcp://127.0.0.1:") and not bound.endpoint.endswith(":0")
    subscriber = KVEventSubscriber(bound.endpoint, bound.replay_endpoint, topic="kv")
    index = KVBlockIndex(1)
    try:
        for k in range(4):  # 8 usable blocks of 4: the third and fourth prompts evict the first ones
            engine.generate([list(range(10 * k + 1, 10 * k + 11))], max_tokens=3, ignore_eos=True)
        engine.generate([list(range(1, 11))], max_tokens=1)  # evicted: recomputed, stored again
        # the SUB socket may have joined after the first frames: the replay endpoint has every batch (seq 0 on)
        received = subscriber.replay(0, timeout=5.0)
        subscriber.last_seq = received[-1][0]
        received += subscriber.poll(0.1)  # the same frames live: skipped, each batch is applied once
        for _seq, batch in received:
            for event in batch.events:
                index.apply(0, event)
        kinds = {type(e).__name__ for _, b in received for e in b.events}
        cached = {h for h, _ in engine.kv_cache_manager.block_pool.cached_block_hash_to_block.items()}
        assert kinds == {"BlockStored", "BlockRemoved"} and index.held[0] == cached
        # each batch once, in order, and at most one per step, as vLLM's scheduler publishes
        assert [seq for seq, _ in received] == list(range(len(received))) and len(received) <= len(engine.history)
        assert engine.kv_cache_manager.block_pool.kv_event_queue == []  # every step's events were taken
    finally:
        subscriber.close()
        engine.shutdown()
