"""``KVTransferConfig``: which KV connector an engine runs and in which role (vLLM's ``vllm/config/kv_transfer.py``).

The fields are vLLM 0.33.0's: ``kv_connector`` (a connector's name), ``kv_role`` (``"kv_producer"``: this
engine computes KV for another; ``"kv_consumer"``: it loads KV another computed; ``"kv_both"``),
``engine_id`` (a fresh uuid by default), ``kv_port``, ``kv_connector_extra_config`` (what one connector
alone reads), ``kv_buffer_device`` and ``kv_load_failure_policy`` (``"fail"``, vLLM's default: a request
whose KV failed to load finishes with an error; ``"recompute"``: it computes the missing tokens itself).

kvlab knows three connectors (``KV_CONNECTORS``): ``"ExampleConnector"`` and ``"P2pGlooConnector"``
(``kvlab.distributed.kv_transfer.kv_connector.v1``) and ``"OffloadingConnector"``, notebook 07's CPU tier
(``kvlab.core.kv_offload``), which vLLM also configures from ``--kv-offloading-size`` (kvlab:
``cpu_offload_blocks``). vLLM's ``kv_connector_module_path`` (a connector from another package) and
``MultiConnector`` are not kept.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from kvlab._validate import checked, non_negative_int, one_of
from kvlab.errors import KvlabValueError

#: vLLM's KVRole values.
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_PRODUCER_ROLES = ("kv_producer", "kv_both")
KV_CONSUMER_ROLES = ("kv_consumer", "kv_both")
#: The connectors an engine can be given by name.
KV_CONNECTORS = ("ExampleConnector", "P2pGlooConnector", "OffloadingConnector")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_KV_PORT = 14579  # vLLM's default; kvlab's P2pGlooConnector takes 0 (a free port) as well


@checked
@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """Configuration for moving KV caches between engines (vLLM 0.33.0's ``KVTransferConfig`` fields)."""

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cpu"
    kv_role: str | None = None
    kv_port: int = DEFAULT_KV_PORT
    kv_connector_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        if self.kv_connector is not None:
            one_of("kv_connector", self.kv_connector, KV_CONNECTORS)
        if self.kv_role is not None:
            one_of("kv_role", self.kv_role, KV_ROLES)
        if self.kv_connector is not None and self.kv_role is None:
            raise KvlabValueError(f"kv_role: give one of {list(KV_ROLES)} with kv_connector={self.kv_connector!r}, "
                                  "as vLLM requires")
        if self.engine_id is None:
            object.__setattr__(self, "engine_id", str(uuid.uuid4()))
        elif not isinstance(self.engine_id, str) or not self.engine_id:
            raise KvlabValueError(f"engine_id must be a non-empty string or None, got {self.engine_id!r}")
        one_of("kv_buffer_device", self.kv_buffer_device, ("cpu", "cuda"))
        if non_negative_int("kv_port", self.kv_port) > 65535:
            raise KvlabValueError(f"kv_port must be a TCP port in [0, 65535] (0: any free one), got {self.kv_port}")
        if not isinstance(self.kv_connector_extra_config, dict) or not all(
                isinstance(k, str) for k in self.kv_connector_extra_config):
            raise KvlabValueError(f"kv_connector_extra_config must be a dict with string keys, got "
                                  f"{self.kv_connector_extra_config!r}")
        one_of("kv_load_failure_policy", self.kv_load_failure_policy, KV_LOAD_FAILURE_POLICIES)

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_ROLES

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_PRODUCER_ROLES

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_CONSUMER_ROLES

    @checked
    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)
