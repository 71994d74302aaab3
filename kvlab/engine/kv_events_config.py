"""``KVEventsConfig``: vLLM 0.33.0's ``vllm/config/kv_events.py``, field for field, checked when built.

It is ``EngineConfig.kv_events_config`` (vLLM's ``VllmConfig.kv_events_config``, the ``--kv-events-config``
flag): with ``enable_kv_cache_events=True`` an ``LLMEngine``'s block pool queues its KV cache events and
the engine publishes them once per step on ``endpoint`` (``kvlab.distributed.kv_events``). This module
imports neither torch nor ZMQ, so a router can build one. kvlab adds one thing: an endpoint whose port is
0 (``tcp://127.0.0.1:0``) binds a free port, reported by the publisher (vLLM binds only ``tcp://*:0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvlab.errors import KvlabValueError

PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    """Configuration for KV event publishing: vLLM 0.33.0's ``KVEventsConfig`` fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise KvlabValueError(f"enable_kv_cache_events must be True or False, got {self.enable_kv_cache_events!r}")
        if self.publisher is None:  # vLLM's rule: on means zmq, off means null
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in PUBLISHERS:
            raise KvlabValueError(f"publisher must be 'null' or 'zmq', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KvlabValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise KvlabValueError(f"endpoint must be a ZMQ address such as 'tcp://127.0.0.1:0', got {self.endpoint!r}")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str)
                                                 or "://" not in self.replay_endpoint):
            raise KvlabValueError(f"replay_endpoint must be None or a ZMQ address, got {self.replay_endpoint!r}")
        if not isinstance(self.topic, str):
            raise KvlabValueError(f"topic must be a string, got {self.topic!r}")
