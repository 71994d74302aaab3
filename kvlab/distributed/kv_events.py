"""KV cache events on the wire, as vLLM 0.33.0 publishes them (``vllm/distributed/kv_events.py``).

The structs below have vLLM's names, field order, tags and msgspec options (``array_like`` batches,
tagged ``omit_defaults`` events), so ``vllm.distributed.kv_events.KVEventBatch``'s decoder reads
kvlab's bytes unchanged. ``ZmqEventPublisher`` sends each batch as a PUB multipart
``(topic, 8-byte big-endian seq, payload)`` from a background thread and answers replay requests on
a ROUTER socket from a bounded buffer, as vLLM's does. ``KVEventsConfig`` has the fields of
``vllm/config/kv_events.py``. kvlab's core queues plain records (``kvlab.core.kv_cache_events``);
``to_wire`` turns them into these structs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import replace
from itertools import count
from typing import Any

import msgspec
import zmq

from kvlab.core import kv_cache_events as records
from kvlab.engine.kv_events_config import KVEventsConfig
from kvlab.errors import KvlabValueError

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventPublisherFactory", "KVEventBatch",
           "KVEventSubscriber", "KVEventsConfig", "NullEventPublisher", "ZmqEventPublisher", "decode_batch",
           "make_batch", "to_wire"]

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class for all KV cache-related events."""


MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM (use lora_name), kept on the wire
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(record: records.KVCacheEventRecord) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """The msgspec struct for one of core's plain event records (same names, same fields)."""
    if isinstance(record, records.BlockStored):
        return BlockStored(list(record.block_hashes), record.parent_block_hash, list(record.token_ids),
                           record.block_size, record.lora_id, record.medium, record.lora_name,
                           group_idx=record.group_idx)
    if isinstance(record, records.BlockRemoved):
        return BlockRemoved(list(record.block_hashes), record.medium, group_idx=record.group_idx)
    assert isinstance(record, records.AllBlocksCleared), record
    return AllBlocksCleared()


def make_batch(events: list[records.KVCacheEventRecord], ts: float | None = None) -> KVEventBatch:
    """One step's events as a batch, stamped with the wall clock as vLLM's scheduler stamps it."""
    return KVEventBatch(ts=time.time() if ts is None else ts, events=[to_wire(e) for e in events])


_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Read one frame's payload back into a ``KVEventBatch``."""
    return _decoder.decode(payload)


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """PUB socket plus a ROUTER replay socket with the last ``buffer_steps`` batches, fed from a thread.

    As vLLM's: ``publish`` queues a batch; the thread numbers it, sends ``(topic, seq, payload)`` and
    keeps ``(seq, payload)`` for replay; a replay request ``(identity, b"", start_seq)`` gets every
    kept frame from ``start_seq`` on, then ``(b"", END_SEQ, b"")``. kvlab binds an endpoint whose port
    is 0 to a free port (vLLM binds only wildcard ones) and reports the bound address in
    ``endpoint`` and ``replay_endpoint``, so tests and notebooks run on the loopback.
    """

    SHUTDOWN_TIMEOUT: float = 1.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank
        self._event_queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = self._bind_or_connect(self._pub, config.endpoint)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self.replay_endpoint = self._bind(self._replay, config.replay_endpoint)
        self._topic_bytes = config.topic.encode("utf-8")
        self._publisher_config = replace(config, enable_kv_cache_events=True, publisher="zmq",
                                         endpoint=self.endpoint, replay_endpoint=self.replay_endpoint)
        self._seq_gen = count()
        self.num_published = 0  # kvlab: batches queued so far, so the last one's seq is num_published - 1
        self._pack = msgspec.msgpack.Encoder()
        self._running = True
        self._thread = threading.Thread(target=self._publisher_thread, daemon=True, name="zmq-publisher")
        self._thread.start()

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = sock.bind_to_random_port(endpoint[: -len(":0")])
            return f"{endpoint[: -len(':0')]}:{port}"
        sock.bind(endpoint)
        return endpoint

    def _bind_or_connect(self, sock: zmq.Socket, endpoint: str) -> str:
        wildcard = "*" in endpoint or "::" in endpoint
        if wildcard or endpoint.startswith(("ipc://", "inproc://")) or endpoint.endswith(":0"):
            return self._bind(sock, endpoint)
        sock.connect(endpoint)
        return endpoint

    def get_publisher_config(self) -> KVEventsConfig:
        """The configuration with the endpoints actually bound (vLLM's ``get_publisher_config``)."""
        return self._publisher_config

    def publish(self, events: EventBatch) -> None:
        """Queue one batch for the thread, stamped with this publisher's data-parallel rank."""
        if not self._running:
            raise RuntimeError("Publisher is closed")
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self._event_queue.put(events)
        self.num_published += 1

    def shutdown(self) -> None:
        """Send what is queued (for at most ``SHUTDOWN_TIMEOUT`` s), stop the thread, close the sockets."""
        self._running = False
        self._event_queue.put(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _publisher_thread(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._service_replay()
            try:
                event = self._event_queue.get(timeout=0.01)
            except queue.Empty:
                if not self._running:
                    break
                continue
            if event is None:
                break
            seq = next(self._seq_gen)
            payload = self._pack.encode(event)
            self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _service_replay(self) -> None:
        assert self._replay is not None
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            return
        client_id, _, start_seq_bytes = frame
        start_seq = int.from_bytes(start_seq_bytes, "big")
        for seq, buf in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client_id, b"", self._topic_bytes, seq.to_bytes(8, "big"), buf))
        self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))


class NullEventPublisher:
    """Publishes nothing: what vLLM's factory returns when events are off or ``publisher="null"``."""

    def publish(self, events: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return

    def get_publisher_config(self) -> KVEventsConfig | None:
        return None


class EventPublisherFactory:
    """vLLM's ``EventPublisherFactory.create``: a ``ZmqEventPublisher`` when events are on and ``publisher="zmq"``."""

    @classmethod
    def create(cls, config: KVEventsConfig | None,
               data_parallel_rank: int = 0) -> ZmqEventPublisher | NullEventPublisher:
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher()
        return ZmqEventPublisher(config, data_parallel_rank)


class KVEventSubscriber:
    """A SUB socket on one publisher, with the replay request a subscriber makes after a gap in ``seq``.

    ``poll`` returns the ``(seq, KVEventBatch)`` pairs that arrived within ``timeout`` s; when a frame's
    seq skips ahead of the last one seen, it first asks the replay endpoint for the missed frames
    (every wait bounded), so the caller sees each batch once and in order.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.last_seq = -1
        self.num_replayed = 0

    def replay(self, start_seq: int, timeout: float = 2.0) -> list[tuple[int, KVEventBatch]]:
        """Ask the replay endpoint for every kept frame from ``start_seq`` on; wait at most ``timeout`` s."""
        if self.replay_endpoint is None:
            raise KvlabValueError("replay_endpoint is None: this subscriber cannot ask for missed frames")
        dealer = self._ctx.socket(zmq.DEALER)  # a DEALER takes the ROUTER's many replies to one request
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        got: list[tuple[int, KVEventBatch]] = []
        try:
            dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(max(1, int(left * 1000))):
                    raise TimeoutError(f"replay from seq {start_seq} got no end marker within {timeout} s")
                _empty, _topic, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_SEQ:
                    return got
                got.append((int.from_bytes(seq_bytes, "big"), decode_batch(payload)))
        finally:
            dealer.close(linger=0)

    def poll(self, timeout: float = 0.0) -> list[tuple[int, KVEventBatch]]:
        """Every batch received within ``timeout`` s (and any missed ones, replayed), in sequence order."""
        out: list[tuple[int, KVEventBatch]] = []
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1 and self.replay_endpoint is not None:
                missed = [(s, b) for s, b in self.replay(self.last_seq + 1) if s < seq]
                self.num_replayed += len(missed)
                out.extend(missed)
            out.append((seq, decode_batch(payload)))
            self.last_seq = seq
        return out

    def close(self) -> None:
        """Close the socket (no linger)."""
        self._sub.close(linger=0)
