"""``P2pGlooConnector``: a prefill engine's blocks pulled into a decode engine's, over torch.distributed (gloo).

kvlab's own connector, built on the handshake of vLLM 0.33.0's ``NixlConnector``
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``, its pull scheduler ``NixlPullConnectorScheduler``):

1. A proxy sends a request to the **producer** (``kv_role="kv_producer"``) with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": True}``. When it finishes, ``request_finished`` keeps its
   blocks (``delay_free``) and returns the parameters a consumer needs: ``do_remote_prefill``,
   ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``,
   ``remote_num_tokens``, ``tp_size``.
2. The proxy sends the same prompt to the **consumer** with those parameters. Its scheduler asks
   ``get_num_new_matched_tokens``: the whole prompt beyond the local prefix hit, loaded asynchronously.
   The request waits in ``WAITING_FOR_REMOTE_KVS`` while the consumer's worker pulls the producer's blocks
   into the blocks its own scheduler allocated (the last ``len(local)`` remote blocks: a local prefix hit
   shortens the pull, as NIXL's end-trim does), then computes the prompt's last token itself and samples.
3. Once the blocks are sent, or their lease (``kv_lease_duration`` seconds, NIXL's default 30) ran out
   with no pull, the producer's worker reports the request in ``finished_sending`` and its scheduler frees them.

The wire. ``remote_host:remote_port`` is the producer's handshake listener, a ZMQ ROUTER beside its
scheduler (NIXL's ``_nixl_handshake_listener``): asked ``(GET_META_MSG, tp_rank)``, it answers where that
rank's worker listens. Each producer rank's worker has its own side channel (a ROUTER), which carries the
join (the layout of its caches, the port of its ``TCPStore``) and each read request and its answer; the
blocks themselves go over a gloo process group of two (that producer rank 0, the consumer 1) with
``send`` / ``recv``, one message per layer tensor, as raw bytes (any dtype, bit for bit). A side channel
answers reads for requests its worker holds; a read for a request it never held (its worker has not yet
seen the request finish: the next step tells it) is asked again, one it released (lease out, or aborted)
fails: the consumer reports the blocks in ``get_block_ids_with_load_errors`` and its scheduler recomputes
them (``kv_load_failure_policy="recompute"``) or fails the request. A consumer request aborted before its
pull tells the producer to let go (an empty read).

**A producer at TP > 1** (``tp_size`` in the parameters). Each of its ranks holds its own KV heads of the
same block ids (one block table), and reports a request in ``finished_sending`` on its own; the engine frees
the blocks once every rank has (vLLM's ``KVOutputAggregator``). A one-rank consumer holds every head: it
reads each head from the producer rank that holds it and writes it at that head's place in its blocks
(``TransferTopology.head_sources``, NIXL's ``compute_tp_mapping``); a rank it reads nothing from (a copy of
a head already read, or MLA's latent, whole on every rank) gets an empty read, which lets its blocks go,
as NIXL notifies the ranks it does not read.

What kvlab leaves out: one consumer per producer rank (a gloo group of two; NIXL reads from any peer by
RDMA), a consumer of one rank (the pull runs in its one process), no heartbeats (NIXL renews the lease
while a decode waits), pull only.
"""

from __future__ import annotations

import dataclasses
import datetime
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from kvlab.core.request import RequestStatus
from kvlab.distributed.kv_transfer.kv_connector.utils import TransferTopology
from kvlab.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvlab.engine.kv_cache_interface import layer_tensors
from kvlab.engine.kv_transfer_config import KVTransferConfig
from kvlab.errors import KvlabValueError

GET_META_MSG = b"get_meta_msg"  # NIXL's handshake request (to the listener, with a TP rank; to a worker, its join)
POLL_MS = 20  # how long a side-channel thread waits for a message before it checks whether to stop


def _serve_router(router: Any, stop: threading.Event, handle: Callable[[Any, bytes, bytes], None]) -> None:
    """A side-channel thread: hand each message ``handle(router, identity, payload)`` until ``stop`` is set,
    waking every ``POLL_MS`` to look; the socket closes when the thread ends."""
    try:
        while not stop.is_set():
            if router.poll(POLL_MS):
                identity, _, payload = router.recv_multipart()
                handle(router, identity, payload)
    finally:
        router.close(linger=0)
RETRY_S = 0.002  # a read for a request the producer has not seen finish yet is asked again after this
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclasses.dataclass(frozen=True)
class P2pHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Where one producer rank's worker listens: its side channel (and, through it, its TCPStore)."""

    engine_id: str
    host: str
    port: int
    tp_rank: int = 0
    tp_size: int = 1


@dataclasses.dataclass
class RecvMeta:
    local_block_ids: list[int]
    kv_transfer_params: dict[str, Any]


@dataclasses.dataclass
class P2pConnectorMetadata(KVConnectorMetadata):
    """One step's orders: pulls to start, held requests (block ids, lease seconds), requests not to send."""

    reqs_to_recv: dict[str, RecvMeta] = dataclasses.field(default_factory=dict)
    reqs_to_send: dict[str, tuple[list[int], float]] = dataclasses.field(default_factory=dict)
    reqs_not_processed: set[str] = dataclasses.field(default_factory=set)


class P2pGlooConnector(KVConnectorBase_V1):
    """Disaggregated prefill and decode: the decode engine pulls the prefill engine's blocks (see the module)."""

    def __init__(self, kv_transfer_config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                 topology: TransferTopology | None = None) -> None:
        super().__init__(kv_transfer_config, role, block_size, topology)
        self.engine_id: str = kv_transfer_config.engine_id  # type: ignore[assignment]
        self.connector_scheduler = (P2pConnectorScheduler(kv_transfer_config, block_size)
                                    if role == KVConnectorRole.SCHEDULER else None)
        self.connector_worker = (P2pConnectorWorker(kv_transfer_config, self._topology)
                                 if role == KVConnectorRole.WORKER else None)

    # ----------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> P2pHandshakeMetadata | None:
        return self.connector_worker.handshake_metadata()

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, P2pConnectorMetadata)
        self.connector_worker.start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: their requests wait in WAITING_FOR_REMOTE_KVS, not the forward

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # pull: nothing is saved, the producer's blocks stay where they are until read

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.connector_worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()

    # ----------------------------------------------------------------- scheduler side

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.connector_scheduler.set_xfer_handshake_metadata(metadata)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> P2pConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)


class P2pConnectorScheduler:
    """The scheduler half: NIXL's pull scheduler, one KV cache group. Never touches a tensor; on a producer it
    runs the handshake listener, which tells a consumer where each rank's worker listens."""

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.engine_id = config.engine_id
        self.block_size = block_size
        self.kv_lease_duration = float(config.get_from_extra_config("kv_lease_duration", 30))
        self.host = str(config.get_from_extra_config("kv_ip", "127.0.0.1"))
        self.side_channel: tuple[str, int] | None = None  # the handshake listener's, once it listens
        self.tp_size = 1
        self._ranks: dict[int, bytes] = {}  # tp rank -> its worker's handshake metadata, encoded
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        self._context: zmq.Context | None = None
        self._reqs_need_recv: dict[str, RecvMeta] = {}
        self._reqs_need_send: dict[str, tuple[list[int], float]] = {}
        self._reqs_not_processed: set[str] = set()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Keep every rank's metadata and start the listener that serves it (``_nixl_handshake_listener``)."""
        for rank, meta in metadata.items():
            assert isinstance(meta, P2pHandshakeMetadata) and meta.tp_rank == rank
            self._ranks[rank] = msgspec.msgpack.encode(dataclasses.asdict(meta))
        self.tp_size = len(self._ranks)
        if self._listener is None:
            self._context = zmq.Context()
            router = self._context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            port = router.bind_to_random_port(f"tcp://{self.host}")
            self.side_channel = (self.host, port)
            self._listener = threading.Thread(target=self._listen, args=(router,), name="p2p-gloo-handshake",
                                              daemon=True)
            self._listener.start()

    def _listen(self, router: Any) -> None:
        _serve_router(router, self._stop, self._answer)

    def _answer(self, router: Any, identity: bytes, payload: bytes) -> None:
        try:
            message, tp_rank = msgspec.msgpack.decode(payload)
            reply = self._ranks[tp_rank] if message == GET_META_MSG else None
        except (msgspec.DecodeError, ValueError, TypeError, KeyError):
            reply = None
        router.send_multipart([identity, b"", reply or msgspec.msgpack.encode(
            {"error": f"no rank {payload!r} here: this engine has {self.tp_size} rank(s)"})])

    def shutdown(self) -> None:
        """Stop the handshake listener (it wakes within ``POLL_MS``)."""
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=1 + POLL_MS / 1000)
            self._listener = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """A request prefilled elsewhere loads its whole prompt beyond the local hit, asynchronously."""
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Queue the pull into the blocks just allocated (those not from the local prefix cache), once."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        if params.get("remote_block_ids") and all(k in params for k in REMOTE_KEYS):
            # A full local hit pulls nothing but still tells the producer to let its blocks go.
            local = [b.block_id for b in blocks.blocks[0] if b.block_hash is None] if num_external_tokens > 0 else []
            self._reqs_need_recv[request.request_id] = RecvMeta(local, dict(params))
        params["do_remote_prefill"] = False  # one transfer per request

    def build_connector_meta(self, scheduler_output: Any) -> P2pConnectorMetadata:
        meta = P2pConnectorMetadata(self._reqs_need_recv, self._reqs_need_send, self._reqs_not_processed)
        self._reqs_need_recv, self._reqs_need_send, self._reqs_not_processed = {}, {}, set()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A prefill (``do_remote_decode``) that ended well keeps its blocks for the pull and says where they are."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # a decode request that ends before its pull: release the producer
            self._reqs_need_recv[request.request_id] = RecvMeta([], dict(params))
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            self._reqs_not_processed.add(request.request_id)  # aborted or failed: freed now, nothing to send
            return False, None
        delay_free_blocks = bool(block_ids)
        if delay_free_blocks:  # each rank's worker counts the lease from when it hears of the request
            self._reqs_need_send[request.request_id] = (list(block_ids), self.kv_lease_duration)
        host, port = self.side_channel or ("", 0)
        return delay_free_blocks, dict(
            do_remote_prefill=True, do_remote_decode=False, remote_block_ids=list(block_ids),
            remote_engine_id=self.engine_id, remote_request_id=request.request_id, remote_host=host,
            remote_port=port, tp_size=self.tp_size, remote_num_tokens=request.num_computed_tokens)


class P2pConnectorWorker:
    """The worker half: the producer's side-channel thread serves reads, the consumer's pull thread makes them."""

    def __init__(self, config: KVTransferConfig, topology: TransferTopology) -> None:
        self.engine_id = config.engine_id
        self.topology = topology
        self.is_producer, self.is_consumer = config.is_kv_producer, config.is_kv_consumer
        self.host = str(config.get_from_extra_config("kv_ip", "127.0.0.1"))
        self.timeout = float(config.get_from_extra_config("kv_timeout", 10.0))
        # a fixed port is the first rank's; rank r listens r above it (0: any free port)
        self.kv_port = config.kv_port + topology.tp_rank if config.kv_port else 0
        side_channel_port = int(config.get_from_extra_config("side_channel_port", 0))
        self.side_channel_port = side_channel_port + topology.tp_rank if side_channel_port else 0
        self._tensors: list[torch.Tensor] = []  # every layer's K and V (or latent), [num_blocks, block_size, ...]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._context: zmq.Context | None = None
        # producer
        self._store: Any = None
        self._held: dict[str, tuple[list[int], float]] = {}  # request id -> (block ids, lease deadline here)
        self._serving: set[str] = set()
        self._released: set[str] = set()
        self._done_sending: set[str] = set()
        self._consumer: tuple[bytes, Any] | None = None  # the one peer's identity and gloo group
        # consumer
        self._pulls: queue.Queue[tuple[str, RecvMeta]] = queue.Queue()
        self._peers: dict[tuple[str, int], tuple[Any, Any]] = {}  # (engine id, rank) -> (DEALER socket, gloo group)
        self._done_recving: set[str] = set()
        self._failed_blocks: dict[str, list[int]] = {}
        self._load_errors: set[int] = set()
        self.num_blocks_sent = self.num_blocks_received = self.num_bytes_received = 0
        self._tag = 0  # each read's gloo tag
        self.pull_seconds: dict[str, float] = {}  # request id -> seconds its pull took (kvlab's, to measure)
        self.pulled: dict[str, list[int]] = {}  # request id -> the local blocks a pull filled (kvlab's, to inspect)
        self.errors: list[BaseException] = []  # what went wrong in the threads, newest last (kvlab's, to inspect)

    # ----------------------------------------------------------------- start and stop

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Keep the caches and start the threads this role needs."""
        self._tensors = [t for kv in kv_caches.values() for t in layer_tensors(kv)]
        self._context = zmq.Context()
        if self.is_producer:
            self._store = dist.TCPStore(self.host, self.kv_port, 2, True, timeout=self._delta(),
                                        wait_for_workers=False)
            self.kv_port = self._store.port
            router = self._context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            if self.side_channel_port:
                router.bind(f"tcp://{self.host}:{self.side_channel_port}")
            else:
                self.side_channel_port = router.bind_to_random_port(f"tcp://{self.host}")
            self._start(self._serve, router, "p2p-gloo-side-channel")
        if self.is_consumer:
            self._start(self._pull_loop, None, "p2p-gloo-pull")

    def _start(self, target: Any, arg: Any, name: str) -> None:
        thread = threading.Thread(target=target, args=(arg,) if arg is not None else (), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def handshake_metadata(self) -> P2pHandshakeMetadata | None:
        if not self.is_producer:
            return None
        return P2pHandshakeMetadata(self.engine_id, self.host, self.side_channel_port, self.topology.tp_rank,
                                    self.topology.tp_size)

    def shutdown(self) -> None:
        """Stop the threads (each wakes within ``POLL_MS``), close the sockets and the gloo groups."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout + 1)
        self._threads.clear()
        for socket, _ in self._peers.values():
            socket.close(linger=0)
        self._peers.clear()
        self._consumer = None
        self._store = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def _delta(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout)

    def _layout(self) -> list[list[Any]]:
        """Each cache tensor's block shape and dtype, as the side channel carries them (lists, not tuples)."""
        return [[list(t.shape[1:]), str(t.dtype)] for t in self._tensors]

    def _group(self, store: Any, rank: int, producer: str) -> Any:
        """The gloo group of two (a producer rank 0, the consumer 1), on the loopback (or ``kv_ip``) device."""
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self._delta()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        return dist.ProcessGroupGloo(dist.PrefixStore(f"p2p/{producer}", store), rank, 2, options)

    # ----------------------------------------------------------------- each step (the model runner's thread)

    def start_load_kv(self, metadata: P2pConnectorMetadata) -> None:
        now = time.perf_counter()
        with self._lock:
            for request_id, (block_ids, lease) in metadata.reqs_to_send.items():
                self._held[request_id] = (block_ids, now + lease)
            for request_id in metadata.reqs_not_processed:
                self._released.add(request_id)
        for request_id, recv in metadata.reqs_to_recv.items():
            self._pulls.put((request_id, recv))

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Sends done (read, released by the consumer, or out of lease) and pulls done (well or not)."""
        now = time.perf_counter()
        with self._lock:
            for request_id, (_, deadline) in list(self._held.items()):
                if deadline <= now and request_id not in self._serving:
                    del self._held[request_id]
                    self._released.add(request_id)
                    self._done_sending.add(request_id)
            sending, self._done_sending = self._done_sending, set()
            recving, self._done_recving = self._done_recving, set()
            for request_id in recving:
                self._load_errors.update(self._failed_blocks.pop(request_id, ()))
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ----------------------------------------------------------------- producer: the side channel

    def _serve(self, router: Any) -> None:
        _serve_router(router, self._stop, self._exchange)

    def _exchange(self, router: Any, identity: bytes, payload: bytes) -> None:
        try:
            if payload == GET_META_MSG:
                self._handshake(router, identity)
                return
            message = msgspec.msgpack.decode(payload)
            reply = self._read(message)
            router.send_multipart([identity, b"", msgspec.msgpack.encode(reply)])
            if reply["state"] == "ok":
                self._send_blocks(message, reply)
        except Exception as error:  # noqa: BLE001 - one bad exchange must not stop the side channel
            self.errors.append(error)  # the consumer sees its pull fail; the next one may work

    def _handshake(self, router: Any, identity: bytes) -> None:
        if self._consumer is not None and self._consumer[0] != identity:
            router.send_multipart([identity, b"", msgspec.msgpack.encode({"error": "this producer already serves "
                                                                                   "one consumer"})])
            return
        router.send_multipart([identity, b"", msgspec.msgpack.encode(
            {"engine_id": self.engine_id, "store_port": self.kv_port, "layout": self._layout(),
             "tp_rank": self.topology.tp_rank, "tp_size": self.topology.tp_size})])
        if self._consumer is None:  # joining waits (bounded by kv_timeout) for the consumer to join too
            self._consumer = (identity, self._group(self._store, 0, self._producer_name(self.topology.tp_rank)))

    def _read(self, message: dict[str, Any]) -> dict[str, Any]:
        """Whether this worker holds the blocks asked for: "ok", "unknown" (not seen yet) or "released"."""
        request_id, block_ids = message["request_id"], message["block_ids"]
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                return {"state": "released" if request_id in self._released else "unknown"}
            if not set(block_ids) <= set(held[0]):
                return {"state": "released", "error": f"blocks {block_ids} are not request {request_id!r}'s"}
            if not block_ids:  # the consumer needs nothing (a full local hit, or an abort): let go
                del self._held[request_id]
                self._done_sending.add(request_id)
                return {"state": "done"}
            self._serving.add(request_id)
        return {"state": "ok", "tag": int(message["tag"])}

    def _send_blocks(self, message: dict[str, Any], reply: dict[str, Any]) -> None:
        request_id = message["request_id"]
        index = torch.tensor(message["block_ids"], dtype=torch.int64)
        try:
            group = self._consumer[1]
            for tensor in self._tensors:
                block_bytes = tensor.index_select(0, index.to(tensor.device)).cpu().view(torch.uint8)
                group.send([block_bytes], 1, reply["tag"]).wait()  # [num_blocks, block_size, ..., bytes]
            self.num_blocks_sent += len(message["block_ids"])
        finally:
            with self._lock:
                self._serving.discard(request_id)
                self._held.pop(request_id, None)
                self._released.add(request_id)
                self._done_sending.add(request_id)

    # ----------------------------------------------------------------- consumer: the pulls

    def _pull_loop(self) -> None:
        while not self._stop.is_set():
            try:
                request_id, recv = self._pulls.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                continue
            started = time.perf_counter()
            try:
                ok = self._pull(request_id, recv)
            except Exception as error:  # noqa: BLE001 - a pull that cannot complete is a failed load, reported so
                self.errors.append(error)
                ok = False
            if not recv.local_block_ids:
                continue  # a release (an abort, a full local hit): no request waits for it, nothing to report
            with self._lock:
                if not ok:
                    self._failed_blocks[request_id] = list(recv.local_block_ids)
                self.pull_seconds[request_id] = time.perf_counter() - started
                self._done_recving.add(request_id)

    def _producer_name(self, rank: int, engine_id: str | None = None) -> str:
        return f"{engine_id or self.engine_id}/{rank}"

    def _peer(self, params: dict[str, Any], rank: int) -> tuple[Any, Any]:
        """The DEALER socket and gloo group to rank ``rank`` of the producer ``params`` name; the first time, ask
        the producer's listener where that rank listens, then join it (its layout checked against this one's)."""
        engine_id = params["remote_engine_id"]
        if (engine_id, rank) in self._peers:
            return self._peers[(engine_id, rank)]
        where = self._ask(params["remote_host"], params["remote_port"], [GET_META_MSG, rank])
        if "error" in where:
            raise KvlabValueError(f"producer {engine_id!r}: {where['error']}")
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://{where['host']}:{where['port']}")
        try:
            socket.send_multipart([b"", GET_META_MSG])
            meta = self._answer(socket)
            if "error" in meta:
                raise KvlabValueError(f"producer {engine_id!r}, rank {rank}: {meta['error']}")
            expected = self._remote_layout(meta["tp_size"])
            if meta["layout"] != expected:
                raise KvlabValueError(f"producer {engine_id!r}, rank {rank}, has caches {meta['layout']}; this "
                                      f"engine expects {expected} of a rank of {meta['tp_size']}: the blocks cannot "
                                      "be copied")
            store = dist.TCPStore(where["host"], meta["store_port"], 2, False, timeout=self._delta())
            group = self._group(store, 1, self._producer_name(rank, engine_id))
        except BaseException:
            socket.close(linger=0)
            raise
        self._peers[(engine_id, rank)] = (socket, group)
        return socket, group

    def _remote_layout(self, remote_tp_size: int) -> list[list[Any]]:
        """What a producer rank's caches must look like: this engine's, with that rank's count of KV heads."""
        layout = self._layout()
        if not self.topology.is_mla:
            heads = max(1, self.topology.total_num_kv_heads // remote_tp_size)
            for shape, _ in layout:
                shape[-2] = heads  # [block_size, num_kv_heads, head_size]
        return layout

    def _ask(self, host: str, port: int, message: list[Any]) -> dict[str, Any]:
        """One question to a producer's handshake listener, on a socket of its own."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://{host}:{port}")
        try:
            socket.send_multipart([b"", msgspec.msgpack.encode(message)])
            return self._answer(socket)
        finally:
            socket.close(linger=0)

    def _answer(self, socket: Any) -> dict[str, Any]:
        deadline = time.perf_counter() + self.timeout
        while not socket.poll(POLL_MS):
            if self._stop.is_set() or time.perf_counter() > deadline:
                raise TimeoutError("the producer did not answer in time")
        _, payload = socket.recv_multipart()
        return msgspec.msgpack.decode(payload)

    def _pull(self, request_id: str, recv: RecvMeta) -> bool:
        """Read the producer's blocks into ``recv.local_block_ids``, each head from the rank that holds it; an
        empty read to every other rank, which lets its blocks go. False if a rank no longer holds them."""
        params = recv.kv_transfer_params
        local = recv.local_block_ids
        remote = list(params["remote_block_ids"])[len(params["remote_block_ids"]) - len(local):] if local else []
        sources = {s.remote_rank: s for s in self.topology.head_sources(int(params.get("tp_size", 1)))}
        index = torch.tensor(local, dtype=torch.int64)
        ok = True
        for rank in range(int(params.get("tp_size", 1))):
            wanted = remote if rank in sources and local and ok else []  # after a failure, only let go
            state = self._read_from(params, rank, wanted)
            if not wanted:
                continue
            if state != "ok":
                ok = False
                continue
            self._receive(params, rank, sources[rank], index)
        if ok and local:
            self.num_blocks_received += len(local)
            self.pulled[request_id] = list(local)
        return ok

    def _read_from(self, params: dict[str, Any], rank: int, block_ids: list[int]) -> str:
        """Ask rank ``rank`` for ``block_ids`` (none: let them go); its answer, "unknown" asked again a while."""
        socket, _ = self._peer(params, rank)
        self._tag += 1
        deadline = time.perf_counter() + self.timeout
        while True:
            socket.send_multipart([b"", msgspec.msgpack.encode(
                {"request_id": params["remote_request_id"], "block_ids": block_ids, "tag": self._tag})])
            reply = self._answer(socket)
            if reply["state"] != "unknown":
                return reply["state"]
            if time.perf_counter() > deadline or self._stop.is_set():  # the producer never learnt of the request
                return "unknown"
            time.sleep(RETRY_S)

    def _receive(self, params: dict[str, Any], rank: int, source: Any, index: torch.Tensor) -> None:
        """Receive rank ``rank``'s blocks, one message per layer tensor, and write its heads at theirs here."""
        _, group = self._peer(params, rank)
        heads = max(1, self.topology.total_num_kv_heads // int(params.get("tp_size", 1)))
        for tensor in self._tensors:
            shape = (len(index), *tensor.shape[1:-2], heads, tensor.shape[-1]) if source.count else \
                (len(index), *tensor.shape[1:])
            buffer = torch.empty(shape, dtype=tensor.dtype).view(torch.uint8)  # the bytes of the remote blocks
            group.recv([buffer], 0, self._tag).wait()
            blocks = buffer.view(tensor.dtype).to(tensor.device)  # [num_blocks, block_size, remote heads, head_size]
            if source.count:  # this rank's heads, at their place among the local heads
                target = tensor[:, :, source.local_start:source.local_start + source.count]
                blocks = blocks[:, :, source.remote_start:source.remote_start + source.count]
            else:  # MLA's latent: whole on every rank
                target = tensor
            target.index_copy_(0, index.to(tensor.device), blocks)
            self.num_bytes_received += buffer.numel()
