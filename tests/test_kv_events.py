"""KV cache events: core queues them where vLLM's BlockPool does; the ZMQ publisher sends and replays them."""

from __future__ import annotations

import time

import pytest

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request
from kvlab.distributed import kv_events
from kvlab.errors import KvlabValueError


def admit(manager: KVCacheManager, request: Request) -> None:
    hits, num_hits, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits) is not None


def test_caching_full_blocks_stores_them_with_their_tokens_and_parent():
    manager = KVCacheManager(8, 4, enable_kv_cache_events=True)
    request = Request("a", list(range(10)))
    admit(manager, request)
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 2  # 10 tokens: 2 full blocks
    assert stored.block_hashes == tuple(request.block_hashes[:2]) and stored.parent_block_hash is None
    assert stored.token_ids == tuple(range(8)) and stored.block_size == 4
    longer = Request("b", list(range(13)))  # hits blocks 0-1, caches block 2 with block 1 as parent
    admit(manager, longer)
    (more,) = manager.take_events()
    assert more.parent_block_hash == request.block_hashes[1] and more.token_ids == (8, 9, 10, 11)
    assert manager.take_events() == []  # taken: the queue starts again


def test_evicting_a_cached_block_removes_its_hash_and_reset_clears_all():
    manager = KVCacheManager(3, 4, enable_kv_cache_events=True)  # two usable blocks
    first = Request("a", list(range(5)))
    admit(manager, first)
    manager.free(first)
    admit(manager, Request("b", list(range(50, 58))))
    stored_a, removed, stored_b = manager.take_events()
    assert removed == BlockRemoved(stored_a.block_hashes)
    manager.free(manager._requests["b"])
    assert manager.reset_prefix_cache()
    assert manager.take_events()[-1] == AllBlocksCleared()


def test_events_off_by_default_queue_nothing():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"h"], 0, 1, 4)
    assert pool.kv_event_queue == [] and pool.take_events() == []


def test_config_refuses_an_unknown_publisher_by_name():
    with pytest.raises(KvlabValueError, match="publisher"):
        kv_events.KVEventsConfig(publisher="kafka")
    with pytest.raises(KvlabValueError, match="buffer_steps"):
        kv_events.KVEventsConfig(buffer_steps=0)


def wait_for(subscriber: kv_events.KVEventSubscriber, last_seq: int, timeout: float = 5.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while subscriber.last_seq < last_seq and time.monotonic() < deadline:
        got += subscriber.poll(0.05)
    return got


def test_a_subscriber_that_missed_frames_gets_them_replayed_from_the_bounded_buffer():
    config = kv_events.KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                                      replay_endpoint="tcp://127.0.0.1:0", buffer_steps=4)
    publisher = kv_events.ZmqEventPublisher(config)
    subscriber = kv_events.KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        deadline = time.monotonic() + 5
        while not subscriber.poll(0.05) and time.monotonic() < deadline:  # SUB joins late: until one arrives
            publisher.publish(kv_events.make_batch([AllBlocksCleared()], ts=0.0))
        time.sleep(0.1)
        subscriber.poll(0.05)  # a frame still in flight is read before the drop
        subscriber.close()  # the subscriber drops: these frames go nowhere
        first = subscriber.last_seq
        for i in range(6):
            publisher.publish(kv_events.make_batch([BlockRemoved((i,))], ts=float(i)))
        time.sleep(0.2)
        subscriber = kv_events.KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint)
        subscriber.last_seq = first
        replayed = subscriber.replay(first + 1)
        # only the last buffer_steps=4 frames are kept: the first two missed ones are gone
        assert [seq for seq, _ in replayed] == [first + 3, first + 4, first + 5, first + 6]
        assert [b.events[0].block_hashes for _, b in replayed] == [[2], [3], [4], [5]]
        time.sleep(0.2)  # the new SUB is connected: a fresh frame with a gap triggers the replay itself
        publisher.publish(kv_events.make_batch([BlockRemoved((6,))], ts=6.0))
        got = wait_for(subscriber, first + 7)
        # the buffer now holds seqs first+4 .. first+7: the three missed ones it still has, then the new one
        assert [seq for seq, _ in got] == list(range(first + 4, first + 8))  # in order, each once
        assert subscriber.num_replayed == 3
    finally:
        subscriber.close()
        publisher.shutdown()


def test_an_index_fed_only_by_the_events_always_equals_the_pools_cached_hashes():
    """The invariant a precise router relies on: BlockStored and BlockRemoved account for every change."""
    import random

    from kvlab.fleet.routers import KVBlockIndex

    rng = random.Random(0)
    manager = KVCacheManager(12, 4, enable_kv_cache_events=True)
    index = KVBlockIndex(1)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[Request] = []
    for i in range(200):
        if live and (len(live) > 2 or rng.random() < 0.5):
            manager.free(live.pop(rng.randrange(len(live))))
        else:
            request = Request(f"r{i}", rng.choice(prefixes)[: rng.randint(1, 12)] + [rng.randrange(50)
                                                                                for _ in range(rng.randint(0, 9))])
            hits, num_hits, _ = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits) is not None:
                live.append(request)
        if i % 50 == 49 and not live:
            assert manager.reset_prefix_cache()
        for event in manager.take_events():
            index.apply(0, event)
        cached = {h for h, _ in manager.block_pool.cached_block_hash_to_block.items()}
        assert index.held[0] == cached, i
