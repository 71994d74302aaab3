"""kvlab's KV cache events read by vLLM 0.33.0's own structs: the same bytes, the same fields, the same config.

The frames come from kvlab's ``ZmqEventPublisher`` over a real loopback socket and from the events
a kvlab ``KVCacheManager`` queued, so what is checked is what a router subscribed to a kvlab
replica would receive.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

pytest.importorskip("vllm.distributed.kv_events", reason="vLLM 0.33.0 is not installed here: run make test-vllm")

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm.config.kv_events import KVEventsConfig as VllmKVEventsConfig  # noqa: E402
from vllm.distributed import kv_events as vllm_events  # noqa: E402

from kvlab.core.kv_cache_manager import KVCacheManager  # noqa: E402
from kvlab.core.request import Request  # noqa: E402
from kvlab.distributed import kv_events  # noqa: E402


def manager_events() -> list:
    """Store two blocks, evict them by storing two others, then reset: every kind of event core emits."""
    manager = KVCacheManager(4, 4, enable_kv_cache_events=True)
    for request_id, start in (("a", 0), ("b", 100)):
        request = Request(request_id, list(range(start, start + 9)))
        hits, num_hits, _ = manager.get_computed_blocks(request)
        manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits)
        manager.free(request)
    assert manager.reset_prefix_cache()
    return manager.take_events()


@pytest.mark.parametrize("name", ["EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
                                  "KVEventBatch"])
def test_structs_have_vllms_fields_order_and_options(name):
    ours, theirs = getattr(kv_events, name), getattr(vllm_events, name)
    assert ours.__struct_fields__ == theirs.__struct_fields__
    assert ours.__struct_defaults__ == theirs.__struct_defaults__
    for option in ("array_like", "omit_defaults", "tag", "tag_field"):
        assert getattr(ours.__struct_config__, option) == getattr(theirs.__struct_config__, option), option


def test_config_has_vllms_fields_and_defaults():
    ours = {f.name: f.default for f in dataclasses.fields(kv_events.KVEventsConfig)}
    theirs = {f.name: f.default for f in dataclasses.fields(VllmKVEventsConfig)}
    assert ours == theirs
    assert kv_events.KVEventsConfig(enable_kv_cache_events=True).publisher == VllmKVEventsConfig(
        enable_kv_cache_events=True).publisher == "zmq"


def test_vllms_decoder_reads_the_frames_kvlabs_publisher_sends():
    events = manager_events()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved", "BlockRemoved", "BlockStored",
                                                  "AllBlocksCleared"]
    publisher = kv_events.ZmqEventPublisher(kv_events.KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0", topic="kv"), data_parallel_rank=3)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(publisher.endpoint)
        decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # a SUB joins late: publish until one frame arrives
            publisher.publish(kv_events.make_batch(events, ts=1.5))
            if sub.poll(100):
                break
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        batch = decoder.decode(payload)
    finally:
        sub.close(linger=0)
        publisher.shutdown()
    assert batch.ts == 1.5 and batch.data_parallel_rank == 3
    stored, removed, _, stored_again, cleared = batch.events
    assert isinstance(stored, vllm_events.BlockStored) and isinstance(cleared, vllm_events.AllBlocksCleared)
    assert stored.token_ids == list(range(8)) and stored.block_size == 4 and stored.parent_block_hash is None
    assert stored.medium == vllm_events.MEDIUM_GPU and stored.lora_id is None
    assert isinstance(removed, vllm_events.BlockRemoved) and removed.block_hashes[0] in stored.block_hashes
    assert stored_again.token_ids == list(range(100, 108))
    # and the bytes are the ones vLLM itself would send for those structs
    assert msgspec.msgpack.encode(batch) == payload
