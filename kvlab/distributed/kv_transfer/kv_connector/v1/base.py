"""``KVConnectorBase_V1``: a KV connector's two halves, as vLLM 0.33.0 defines them (``.../kv_connector/v1/base.py``).

A connector moves KV between this engine's paged cache and somewhere else: another engine (disaggregated
prefill and decode), a file, a CPU tier. vLLM builds two instances of one class per engine:

* role ``SCHEDULER``, in the scheduler's process: bookkeeping only, never a tensor.
  ``get_num_new_matched_tokens(request, num_computed_tokens) -> (tokens, load_async)`` after the local
  prefix lookup; ``update_state_after_alloc(request, blocks, num_external_tokens)`` once blocks are
  allocated; ``build_connector_meta(scheduler_output)`` at the end of ``schedule()``: this step's orders
  for the worker (a ``KVConnectorMetadata``); ``update_connector_output(output)`` with the worker's
  report; ``request_finished(request, block_ids) -> (delay_free, kv_transfer_params)``.
* role ``WORKER``, beside the model: ``register_kv_caches`` once, then every step
  ``bind_connector_metadata``, ``start_load_kv``, per layer ``wait_for_layer_load`` and ``save_kv_layer``,
  ``wait_for_save``, ``get_finished(finished_req_ids) -> (finished_sending, finished_recving)``,
  ``get_block_ids_with_load_errors()`` and ``clear_connector_metadata``.

kvlab's scheduler takes the scheduler half through a protocol (``kvlab.core.sched.output.SchedulerKVConnector``)
and the model runner the worker half (``kvlab.engine.kv_connector_runner``), so neither imports this package.
Where kvlab is simpler: one KV cache group (no ``SupportsHMA``), ``start_load_kv`` and ``save_kv_layer`` get
no forward context (a connector reads the caches it registered), and the runner calls the per-layer hooks
around the whole forward rather than inside each attention layer (vLLM's ``maybe_transfer_kv_layer``
decorator calls them on each layer's entry and exit, so that copies overlap the next layer's compute).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from kvlab.distributed.kv_transfer.kv_connector.utils import TransferTopology
from kvlab.engine.kv_transfer_config import KVTransferConfig
from kvlab.errors import KvlabValueError

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.kv_cache_utils import KVCacheBlocks
    from kvlab.core.sched.output import GenerationRequest, KVConnectorOutput, SchedulerOutput


class KVConnectorRole(enum.Enum):
    """Where an instance runs: beside the scheduler, or beside the model (vLLM's names and values)."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:  # noqa: B024 - vLLM's abstract marker class, with no abstract method either
    """What the scheduler half tells the worker half about one step (each connector subclasses it)."""


class KVConnectorHandshakeMetadata:  # noqa: B024
    """What a connector's worker half publishes for peers to reach it (each connector subclasses it)."""


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's name
    """Base class for KV connectors: one class, two instances (one per role) in each engine."""

    def __init__(self, kv_transfer_config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                 topology: TransferTopology | None = None) -> None:
        if not isinstance(kv_transfer_config, KVTransferConfig):
            raise KvlabValueError(f"kv_transfer_config must be a KVTransferConfig, got {kv_transfer_config!r}")
        if not isinstance(role, KVConnectorRole):
            raise KvlabValueError(f"role must be a KVConnectorRole, got {role!r}")
        self._kv_transfer_config = kv_transfer_config
        self._role = role
        self._block_size = block_size
        self._topology = topology or TransferTopology()  # this rank's place (vLLM reads it from its parallel config)
        self._connector_metadata: KVConnectorMetadata | None = None
        self._kv_cache_manager: KVCacheManager | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ----------------------------------------------------------------- worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Set this step's metadata from the scheduler (before the forward)."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Drop this step's metadata (after the forward)."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:  # noqa: B027 - optional, as in vLLM
        """The engine's KV caches by layer name (``"model.layers.0.self_attn.attn"``), once at start-up."""

    @abstractmethod
    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Start loading this step's KV into the paged cache (synchronously, or in the background)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV is loaded."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Start saving ``layer_name``'s KV from the paged cache."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are done (or handed to a thread that keeps its blocks)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous send and whose asynchronous load ended since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids a load failed to fill since the last call (an asynchronous load's, at the latest in the
        call that reports it finished)."""
        return set()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """What this worker publishes for peers (None: nothing)."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional, as in vLLM
        """Stop threads and close sockets: the engine is going away."""

    # ----------------------------------------------------------------- scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """The scheduler's cache manager, once it exists (read-only use: block ids of a request)."""
        self._kv_cache_manager = kv_cache_manager

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:  # noqa: B027 - optional, as in vLLM
        """The workers' handshake metadata, by TP rank (what ``kv_transfer_params`` tell peers)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: GenerationRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` this connector can load (None: ask again later), and whether
        the load is asynchronous (between steps; must be False when the count is 0)."""

    @abstractmethod
    def update_state_after_alloc(self, request: GenerationRequest, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Blocks are allocated for ``request``; ``num_external_tokens`` of its tokens are to be loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata for the worker; resets the scheduler half's per-step state."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027 - optional, as in vLLM
        """The worker's report on a step."""

    def request_finished(self, request: GenerationRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finished, before its blocks are freed: True keeps them until the
        worker reports the request in ``finished_sending``; and the ``kv_transfer_params`` of its output."""
        return False, None
