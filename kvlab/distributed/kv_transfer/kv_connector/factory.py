"""Connectors by name (vLLM 0.33.0's ``KVConnectorFactory``, ``vllm/distributed/kv_transfer/kv_connector/factory.py``).

A name maps to a module and a class, imported on first use, as vLLM registers its connectors.
``create_connectors`` is what ``LLMEngine`` calls at start-up: the worker half first (it registers the
KV caches and may open its side channel), then the scheduler half, bound to the cache manager and told
where the worker listens (vLLM's ``set_xfer_handshake_metadata``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from kvlab.engine.kv_connector_model_runner import kv_layer_names
from kvlab.engine.kv_transfer_config import KVTransferConfig
from kvlab.errors import UnknownNameError

_V1 = "kvlab.distributed.kv_transfer.kv_connector.v1"
#: connector name -> (module, class): the connectors that live in this package.
CONNECTORS: dict[str, tuple[str, str]] = {
    "ExampleConnector": (f"{_V1}.example_connector", "ExampleConnector"),
    "P2pGlooConnector": (f"{_V1}.p2p_gloo_connector", "P2pGlooConnector"),
}


class KVConnectorFactory:
    """Build a connector from a ``KVTransferConfig``, in one role."""

    @staticmethod
    def get_connector_class(kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        name = kv_transfer_config.kv_connector
        if name not in CONNECTORS:
            raise UnknownNameError("kv_connector", name, CONNECTORS)
        module, cls = CONNECTORS[name]
        return getattr(importlib.import_module(module), cls)

    @staticmethod
    def create_connector(kv_transfer_config: KVTransferConfig, role: KVConnectorRole, block_size: int
                         ) -> KVConnectorBase_V1:
        return KVConnectorFactory.get_connector_class(kv_transfer_config)(kv_transfer_config, role, block_size)


def create_connectors(kv_transfer_config: KVTransferConfig, block_size: int, kv_caches: Sequence[Any],
                      kv_cache_manager: Any) -> tuple[KVConnectorBase_V1, KVConnectorBase_V1]:
    """An engine's two halves of one connector: ``(scheduler half, worker half)``, wired to each other."""
    worker = KVConnectorFactory.create_connector(kv_transfer_config, KVConnectorRole.WORKER, block_size)
    worker.register_kv_caches(dict(zip(kv_layer_names(len(kv_caches)), kv_caches, strict=True)))
    try:
        scheduler = KVConnectorFactory.create_connector(kv_transfer_config, KVConnectorRole.SCHEDULER, block_size)
        scheduler.bind_kv_cache_manager(kv_cache_manager)
        handshake = worker.get_handshake_metadata()
        if handshake is not None:
            scheduler.set_xfer_handshake_metadata({0: handshake})
    except BaseException:
        worker.shutdown()
        raise
    return scheduler, worker
