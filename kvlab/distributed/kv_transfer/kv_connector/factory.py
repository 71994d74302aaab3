"""Connectors by name (vLLM 0.33.0's ``KVConnectorFactory``, ``vllm/distributed/kv_transfer/kv_connector/factory.py``).

A name maps to a module and a class, imported on first use, as vLLM registers its connectors.
``create_connectors`` is what a one-rank ``LLMEngine`` calls at start-up: the worker half first (it registers
the KV caches and may open its side channel), then the scheduler half, bound to the cache manager and told
where the worker listens (vLLM's ``set_xfer_handshake_metadata``). Under tensor parallelism each rank builds
its worker half (``create_worker_connector``, in ``kvlab.engine.worker``) and the engine the scheduler half
from every rank's handshake metadata (``create_scheduler_connector``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from kvlab.distributed.kv_transfer.kv_connector.utils import TransferTopology
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
    def create_connector(kv_transfer_config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                         topology: TransferTopology | None = None) -> KVConnectorBase_V1:
        return KVConnectorFactory.get_connector_class(kv_transfer_config)(kv_transfer_config, role, block_size,
                                                                           topology)


def transfer_topology(model_config: Any, tp_rank: int = 0, tp_size: int = 1) -> TransferTopology:
    """This rank's ``TransferTopology``: its rank and size, the model's KV heads (MLA: one latent)."""
    is_mla = model_config.spec.attention == "mla"
    return TransferTopology(tp_rank, tp_size, 1 if is_mla else model_config.spec.num_kv_heads, is_mla)


def create_worker_connector(kv_transfer_config: KVTransferConfig, block_size: int, kv_caches: Sequence[Any],
                            topology: TransferTopology) -> KVConnectorBase_V1:
    """One rank's worker half, its caches registered (it may open its side channel now); what each rank of a
    tensor-parallel engine builds for itself, as vLLM's workers do (``ensure_kv_transfer_initialized``)."""
    worker = KVConnectorFactory.create_connector(kv_transfer_config, KVConnectorRole.WORKER, block_size, topology)
    worker.register_kv_caches(dict(zip(kv_layer_names(len(kv_caches)), kv_caches, strict=True)))
    return worker


def create_scheduler_connector(kv_transfer_config: KVTransferConfig, block_size: int, kv_cache_manager: Any,
                               handshakes: dict[int, Any]) -> KVConnectorBase_V1:
    """The engine's scheduler half, bound to its cache manager and told where each rank's worker listens."""
    scheduler = KVConnectorFactory.create_connector(kv_transfer_config, KVConnectorRole.SCHEDULER, block_size)
    scheduler.bind_kv_cache_manager(kv_cache_manager)
    if handshakes:
        scheduler.set_xfer_handshake_metadata(handshakes)
    return scheduler


def create_connectors(kv_transfer_config: KVTransferConfig, block_size: int, kv_caches: Sequence[Any],
                      kv_cache_manager: Any, model_config: Any) -> tuple[KVConnectorBase_V1, KVConnectorBase_V1]:
    """A one-rank engine's two halves of one connector: ``(scheduler half, worker half)``, wired to each other."""
    worker = create_worker_connector(kv_transfer_config, block_size, kv_caches, transfer_topology(model_config))
    try:
        handshake = worker.get_handshake_metadata()
        scheduler = create_scheduler_connector(kv_transfer_config, block_size, kv_cache_manager,
                                               {} if handshake is None else {0: handshake})
    except BaseException:
        worker.shutdown()
        raise
    return scheduler, worker
