"""A CPU tier under the GPU's KV cache: cached blocks the GPU evicts are kept in CPU memory and loaded back on a hit.

Three parts, split as vLLM splits its native offloading (``vllm/v1/kv_offload/``, driven through
the ``OffloadingConnector``, which ``--kv-offloading-size`` configures):

* ``CPUOffloadingManager`` (scheduler side): which block hashes the CPU tier holds, in which
  of its own block ids, in LRU order, with ``lookup``, ``touch``, ``prepare_load`` /
  ``complete_load`` and ``prepare_store``. It never touches tensors. It also lends blocks to
  **swap**: a preempted request's KV, owned by the request rather than by a hash.
* ``OffloadingConnector`` (scheduler side): watches the GPU ``BlockPool`` for evictions, finds
  hits in the CPU tier beyond the GPU's own (``get_num_new_matched_tokens``), and turns both
  into one step's transfers (``build_connector_meta``). It is a KV connector like the two of notebook
  11 (``kvlab.distributed.kv_transfer``): the scheduler makes the same calls, with vLLM 0.33.0's
  signatures (``SchedulerKVConnector``), and an engine selects it as vLLM does, by
  ``kv_connector="OffloadingConnector"`` or by the size of the tier (``cpu_offload_blocks``, vLLM's
  ``kv_offloading_size``).
* ``kvlab.engine.kv_offload.OffloadingExecutor`` (worker side, in the engine because it moves
  tensors): performs a step's transfers (GPU to CPU first, then CPU to GPU), then lets the model run.

Where kvlab differs from vLLM, on purpose: a block is stored when the GPU pool **evicts** it
(write-back), as issue 10 asks; vLLM's OffloadingConnector stores every block as soon as it is
full (write-through), so an eviction costs no copy but every block crosses the link once.
Loads here are synchronous (done before the step's forward), as they are in vLLM when the
connector loads before the model runs. On this CPU both tiers are host memory; the copies,
their order and the accounting are the real ones.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvlab._validate import MAX_OBJECTS, checked, non_negative_int, positive_int
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import BlockHash, KVCacheBlock, KVCacheBlocks
from kvlab.core.request import Request
from kvlab.errors import BlockStateError, KvlabValueError
from kvlab.units import cdiv

BlockTransfer = tuple[int, int]  # (source block id, destination block id)


# ----------------------------------------------------------------- the CPU tier's bookkeeping


@checked(at_most={"num_blocks": MAX_OBJECTS})
class CPUOffloadingManager:
    """The CPU tier's blocks: a fixed number of ids, hashed blocks in LRU order, and blocks lent to swap.

    Every block id is in exactly one of three places: free, holding a hashed block (the LRU
    index, oldest first), or lent to a swapped-out request. A hashed block being loaded is
    *protected* until ``complete_load``: it is not evicted to make room for a store.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> cpu block id, least recently used first
        self._protected: dict[BlockHash, int] = {}  # hash -> loads in flight
        self._swap: dict[str, list[int]] = {}  # request id -> cpu block ids holding its swapped-out KV
        self.num_stored = 0  # hashed blocks written into the tier
        self.num_evicted = 0  # hashed blocks dropped to make room
        self.num_store_skipped = 0  # stores refused: every block was protected or lent to swap

    # ----------------------------------------------------------------- reading

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hashed (prefix-cache) block."""
        return len(self._lru)

    @property
    def num_swap_blocks(self) -> int:
        """Blocks lent to swapped-out requests."""
        return sum(len(ids) for ids in self._swap.values())

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def lru_order(self) -> list[BlockHash]:
        """The hashes held, least recently used first (the next eviction is the first)."""
        return list(self._lru)

    @checked
    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the tier holds: a prefix, like the GPU's lookup."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self._lru:
                break
            n += 1
        return n

    # ----------------------------------------------------------------- loads

    @checked
    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Mark held blocks as just used (the end of the LRU order)."""
        for block_hash in block_hashes:
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)

    @checked
    def prepare_load(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The cpu block ids of ``block_hashes``, protected from eviction until ``complete_load``."""
        missing = [h for h in block_hashes if h not in self._lru]
        if missing:
            raise BlockStateError(f"block_hashes: cannot load {len(missing)} block(s) the CPU tier does not hold")
        self.touch(block_hashes)
        for block_hash in block_hashes:
            self._protected[block_hash] = self._protected.get(block_hash, 0) + 1
        return [self._lru[h] for h in block_hashes]

    @checked
    def complete_load(self, block_hashes: Sequence[BlockHash]) -> None:
        """The loads of ``block_hashes`` are done: they may be evicted again.

        Every hash must be loading (as often as it is listed) or nothing is released.
        """
        counts: dict[BlockHash, int] = {}
        for block_hash in block_hashes:
            counts[block_hash] = counts.get(block_hash, 0) + 1
        for block_hash, count in counts.items():
            if self._protected.get(block_hash, 0) < count:
                raise BlockStateError("block_hashes: complete_load for a block that was not being loaded; nothing was "
                                      "released")
        for block_hash, count in counts.items():
            left = self._protected[block_hash] - count
            if left:
                self._protected[block_hash] = left
            else:
                del self._protected[block_hash]

    # ----------------------------------------------------------------- stores

    def _take_block(self) -> int | None:
        """A free block id, evicting the least recently used unprotected hashed block if none is free."""
        if self._free:
            return self._free.pop()
        for block_hash, block_id in self._lru.items():
            if block_hash not in self._protected:
                del self._lru[block_hash]
                self.num_evicted += 1
                return block_id
        return None

    @checked
    def prepare_store(self, block_hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, int]]:
        """Find room for the hashes not held yet; return ``(hash, cpu block id)`` for each block to write.

        A hash already held is only touched. When every block is protected or lent to swap, the
        rest are not stored (``num_store_skipped``): the tier is best effort, like vLLM's.
        """
        out: list[tuple[BlockHash, int]] = []
        for block_hash in dict.fromkeys(block_hashes):
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)
                continue
            block_id = self._take_block()
            if block_id is None:
                self.num_store_skipped += 1
                continue
            self._lru[block_hash] = block_id
            self.num_stored += 1
            out.append((block_hash, block_id))
        return out

    # ----------------------------------------------------------------- swap

    @checked
    def swap_out(self, request_id: str, num_blocks: int) -> list[int] | None:
        """Lend ``num_blocks`` blocks to a preempted request (evicting hashed blocks if need be), or None."""
        num_blocks = non_negative_int("num_blocks", num_blocks)
        if request_id in self._swap:
            raise BlockStateError(f"request {request_id!r} is swapped out already")
        evictable = sum(h not in self._protected for h in self._lru)
        if num_blocks > len(self._free) + evictable:
            return None
        ids = [self._take_block() for _ in range(num_blocks)]
        self._swap[request_id] = ids  # type: ignore[assignment]
        return ids  # type: ignore[return-value]

    @checked
    def swapped_blocks(self, request_id: str) -> list[int]:
        """The cpu block ids holding a swapped-out request's KV, in its logical order."""
        if request_id not in self._swap:
            raise BlockStateError(f"request {request_id!r} is not swapped out")
        return list(self._swap[request_id])

    @checked
    def free_swap(self, request_id: str) -> None:
        """Give a swapped-in (or finished) request's blocks back."""
        ids = self._swap.pop(request_id, [])
        self._free.extend(reversed(ids))

    def check_invariants(self) -> None:
        """Every block id in exactly one place; protected blocks held; capacity never exceeded."""
        held = list(self._lru.values())
        lent = [i for ids in self._swap.values() for i in ids]
        everything = self._free + held + lent
        if sorted(everything) != list(range(self.num_blocks)):
            raise BlockStateError("CPU tier block ids are lost or duplicated")
        if any(h not in self._lru for h in self._protected):
            raise BlockStateError("a protected hash is not held by the CPU tier")


# ----------------------------------------------------------------- what one step transfers


@dataclasses.dataclass
class KVConnectorMetadata:
    """One step's copies, in the order the executor makes them: stores (GPU to CPU), then loads (CPU to GPU)."""

    stores: list[BlockTransfer] = dataclasses.field(default_factory=list)  # (gpu block id, cpu block id)
    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)  # (cpu block id, gpu block id)


@dataclasses.dataclass
class OffloadStats:
    """What the CPU tier did since start: queries and hits in tokens (vLLM's external prefix-cache
    counters), blocks and bytes each way, and swaps."""

    external_prefix_cache_queries: int = 0  # tokens looked up in the CPU tier (beyond the GPU's hits)
    external_prefix_cache_hits: int = 0  # of those, tokens found there
    blocks_stored: int = 0
    blocks_loaded: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    swap_refused: int = 0  # preemptions that fell back to recompute: no room in the CPU tier
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0

    @checked
    def bytes_to_cpu(self, bytes_per_block: int) -> int:
        return (self.blocks_stored + self.blocks_swapped_out) * bytes_per_block

    @checked
    def bytes_to_gpu(self, bytes_per_block: int) -> int:
        return (self.blocks_loaded + self.blocks_swapped_in) * bytes_per_block


@checked
class OffloadingConnector:
    """The scheduler's link to the CPU tier, called where vLLM's scheduler calls its ``KVConnector``.

    It is also one of the GPU pool's observers (beside any ``metrics_collector``, whichever
    was attached first): an evicted block that carries a hash becomes a store in this step's
    metadata. vLLM's connector learns of blocks another way (it stores each block once full).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, cpu_manager: CPUOffloadingManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.cpu = cpu_manager
        self.block_size = kv_cache_manager.block_size
        kv_cache_manager.block_pool.add_observer(self)
        self.stats = OffloadStats()
        self._evicted: list[tuple[int, BlockHash]] = []  # (gpu block id, hash) evicted this step
        self._meta = KVConnectorMetadata()
        self._loading: list[BlockHash] = []  # hashes whose loads this step's metadata carries
        self._swapped_tokens: dict[str, int] = {}  # request id -> computed tokens swapped out
        self._swapped_in: list[str] = []  # requests whose swap blocks this step's loads read
        self._pending_release: tuple[list[BlockHash], list[str]] = ([], [])  # the last metadata's loads
        self._num_local_hits: dict[str, int] = {}  # request id -> the GPU hit its last lookup was given

    # ----------------------------------------------------------------- the GPU pool's observer

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        pass

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        pass

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        """The pool is about to reuse ``block``: if it holds a cached block, keep a copy on the CPU."""
        if block.block_hash is not None:
            self._evicted.append((block.block_id, block.block_hash))

    def reset(self) -> None:
        pass

    # ----------------------------------------------------------------- what the scheduler calls

    @checked
    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self._swapped_tokens

    @checked
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the GPU's ``num_computed_tokens`` whose KV the CPU tier can load (whole blocks), and
        False: the load is synchronous (made before the step's forward).

        A swapped-out request gets back everything it had computed; otherwise the hit is the
        longest run of the request's next block hashes held by the CPU tier, never reaching
        its last token (which must be computed to give the next token's logits).
        """
        if num_computed_tokens % self.block_size:
            raise KvlabValueError(f"num_computed_tokens={num_computed_tokens} must be a whole number of blocks")
        self._num_local_hits[request.request_id] = num_computed_tokens  # update_state_after_alloc starts there
        if request.request_id in self._swapped_tokens:
            return max(self._swapped_tokens[request.request_id] - num_computed_tokens, 0), False
        first = num_computed_tokens // self.block_size
        limit = (request.num_tokens - 1) // self.block_size
        return self.cpu.lookup(request.block_hashes[first:limit]) * self.block_size, False

    @checked
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The scheduler gave ``request`` its ``blocks``, ``num_external_tokens`` of whose tokens this tier loads.

        The load starts after the GPU hit its lookup was given (``get_num_new_matched_tokens``). Counts the
        lookup (once per admission, like vLLM's prefix-cache counters) and queues the loads: from the
        request's own swap blocks, or from the hashed blocks of the CPU tier.
        """
        num_computed_tokens = self._num_local_hits.pop(request.request_id, 0)
        if num_computed_tokens + num_external_tokens > request.num_tokens:
            raise KvlabValueError(f"num_computed_tokens={num_computed_tokens} + num_external_tokens="
                                  f"{num_external_tokens} exceed request {request.request_id!r}'s "
                                  f"{request.num_tokens} tokens")
        swapped = request.request_id in self._swapped_tokens
        if swapped:
            del self._swapped_tokens[request.request_id]
            if num_external_tokens == 0:  # the GPU prefix cache still held all of it
                self.cpu.free_swap(request.request_id)
                return
        elif request.num_preemptions == 0:  # like the GPU's counters: a resumed request's lookups are not hits
            self.stats.external_prefix_cache_queries += request.num_tokens - num_computed_tokens
            self.stats.external_prefix_cache_hits += num_external_tokens
        if num_external_tokens == 0:
            return
        first = num_computed_tokens // self.block_size
        count = cdiv(num_external_tokens, self.block_size)
        gpu_ids = [block.block_id for block in blocks.blocks[0][first:first + count]]
        if swapped:
            cpu_ids = self.cpu.swapped_blocks(request.request_id)[first:first + count]
            self._swapped_in.append(request.request_id)
            self.stats.swap_ins += 1
            self.stats.blocks_swapped_in += count
        else:
            hashes = request.block_hashes[first:first + count]
            cpu_ids = self.cpu.prepare_load(hashes)
            self._loading += hashes
            self.stats.blocks_loaded += count
        self._meta.loads += list(zip(cpu_ids, gpu_ids, strict=True))

    @checked
    def swap_out(self, request: Request) -> bool:
        """Copy a preempted request's computed KV to the CPU tier before its GPU blocks are freed; False if no room."""
        if request.num_computed_tokens == 0:
            return False
        count = cdiv(request.num_computed_tokens, self.block_size)
        cpu_ids = self.cpu.swap_out(request.request_id, count)
        if cpu_ids is None:
            self.stats.swap_refused += 1
            return False
        gpu_ids = self.kv_cache_manager.get_block_ids(request.request_id)[:count]
        self._meta.stores += list(zip(gpu_ids, cpu_ids, strict=True))
        self._swapped_tokens[request.request_id] = request.num_computed_tokens
        self.stats.swap_outs += 1
        self.stats.blocks_swapped_out += count
        return True

    @checked
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        """Forget a finished request's swap state (it has none once swapped back in); its blocks may go at once."""
        self._swapped_tokens.pop(request.request_id, None)
        self._num_local_hits.pop(request.request_id, None)
        self.cpu.free_swap(request.request_id)
        return False, None

    def build_connector_meta(self, scheduler_output: Any = None) -> KVConnectorMetadata:
        """This step's transfers; the previous step's are complete (kvlab's executor is synchronous).

        The previous metadata's loads are released first (``complete_step``). Evicted blocks are stored
        last, after every load was prepared: a store never takes a CPU block a load of this step still
        has to read.
        """
        self.complete_step()
        stores = self.cpu.prepare_store([h for _, h in self._evicted])
        gpu_of = {h: gpu_id for gpu_id, h in self._evicted}
        self._meta.stores += [(gpu_of[h], cpu_id) for h, cpu_id in stores]
        self.stats.blocks_stored += len(stores)
        meta, self._meta = self._meta, KVConnectorMetadata()
        self._evicted = []
        # The executor runs this step's transfers before the next schedule: release them then.
        self._pending_release = (self._loading, self._swapped_in)
        self._loading, self._swapped_in = [], []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Nothing to learn from the worker: its copies are synchronous (``complete_step`` releases them)."""

    def complete_step(self) -> None:
        """The executor made the last metadata's copies: loaded blocks may be evicted, swap blocks freed."""
        loading, swapped_in = self._pending_release
        self.cpu.complete_load(loading)
        for request_id in swapped_in:
            self.cpu.free_swap(request_id)
        self._pending_release = ([], [])
