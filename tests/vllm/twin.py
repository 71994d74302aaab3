"""kvlab's KVCacheManager and vLLM 0.33.0's, driven with the same operations and compared after every one.

vLLM's side is built as its own ``tests/v1/core/test_prefix_caching.py`` builds it: one
full-attention KV cache group (``FullAttentionSpec``), real ``Request`` objects with vLLM's
block hasher, ``init_none_hash`` for the chain's seed. For hashes finer than blocks
(``hash_block_size`` < ``block_size``, the partial hits with copy-on-write), 0.33.0 uses its
``HybridKVCacheCoordinator`` (it turns partial hits on only beside a Mamba "align" group); the
twin builds that coordinator for the one full-attention group and turns them on, so both
sides run the same ``FullAttentionManager`` code path. ``groups`` gives a hybrid model's KV cache
groups instead (``"full"`` or a sliding window's size W per group): both sides then build their
``HybridKVCacheCoordinator`` over ``SlidingWindowSpec`` and ``FullAttentionSpec`` groups, and every
block table, hit and allocation is compared group by group, keys (hash + group id) byte for byte.

An operation that does not apply to the current state (a request that is not waiting, say)
is skipped on both sides, so a trace stays valid when a shrinker drops some of its steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import vllm.v1.core.kv_cache_manager as vllm_kv_cache_manager
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec as VllmFeature
from vllm.multimodal.inputs import MultiModalKwargsItem
from vllm.multimodal.inputs import PlaceholderRange as VllmRange
from vllm.sampling_params import SamplingParams
from vllm.utils import hashing as vllm_hashing
from vllm.v1.core import kv_cache_utils as vllm_utils
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus as VllmStatus

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import MultiModalFeatureSpec, PlaceholderRange, Request, RequestStatus
from kvlab.kv_cache_interface import FullAttentionSpec as KFullAttentionSpec
from kvlab.kv_cache_interface import SlidingWindowSpec as KSlidingWindowSpec

HASH_FUNCTIONS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
logging.getLogger("vllm").setLevel(logging.ERROR)  # its warnings (a refused reset, a random seed) are expected here


COMPARED = [0]  # operations compared in this process, for the summary make test-vllm prints


class Divergence(AssertionError):
    """kvlab and vLLM disagreed; the message says on what, after which operation."""


class Recorder:
    """A pool observer that writes down every call, to compare what each pool told its metrics collector."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_block_allocated(self, block) -> None:
        self.calls.append(("allocated", block.block_id))

    def on_block_accessed(self, block) -> None:
        self.calls.append(("accessed", block.block_id))

    def on_block_evicted(self, block) -> None:
        self.calls.append(("evicted", block.block_id))

    def reset(self) -> None:
        self.calls.append(("reset",))


@contextlib.contextmanager
def python_hash_seed(seed: str | None) -> Iterator[None]:
    """Run with ``PYTHONHASHSEED`` set to ``seed`` (or unset), as vLLM's ``init_none_hash`` reads it."""
    old = os.environ.pop("PYTHONHASHSEED", None)
    if seed is not None:
        os.environ["PYTHONHASHSEED"] = seed
    try:
        yield
    finally:
        os.environ.pop("PYTHONHASHSEED", None)
        if old is not None:
            os.environ["PYTHONHASHSEED"] = old


def kvlab_specs(groups: tuple, block_size: int) -> list:
    """kvlab's spec per KV cache group: "full", or a sliding window's size."""
    return [KFullAttentionSpec(block_size) if g == "full" else KSlidingWindowSpec(block_size, sliding_window=g)
            for g in groups]


def vllm_kv_cache_config(groups: tuple, block_size: int, num_blocks: int) -> KVCacheConfig:
    """vLLM's ``KVCacheConfig`` of one layer per group ("full" or a window's size) over ``num_blocks`` blocks."""
    shape = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        [f"layer{i}"], FullAttentionSpec(**shape) if g == "full" else SlidingWindowSpec(**shape, sliding_window=g))
        for i, g in enumerate(groups)])


@dataclass
class Pair:
    """One request on both sides, and what the twin knows of it."""

    k: Request
    v: VllmRequest
    state: str = "waiting"  # waiting, running, finished


@dataclass
class Twin:
    num_blocks: int
    block_size: int
    enable_caching: bool = True
    hash_fn: str = "sha256"
    hash_block_size: int | None = None
    seed: str | None = None  # PYTHONHASHSEED for both (None: vLLM 0.33.0's default rule)
    max_model_len: int = 8192
    watermark: float = 0.0
    groups: tuple = ("full",)  # per KV cache group: "full", or a sliding window's size
    ops: int = 0
    pairs: dict[str, Pair] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hbs = self.hash_block_size or self.block_size
        self.num_copies = 0  # partial-hit copies seen (both sides agreed on each)
        self.keyed = len(self.groups) > 1  # several groups: keys carry the group id on both sides
        self.k_rec, self.v_rec = Recorder(), Recorder()
        k_specs = kvlab_specs(self.groups, self.block_size)
        self.k = KVCacheManager(self.num_blocks, self.block_size, self.enable_caching, self.hash_fn,
                                hash_seed=self.seed, hash_block_size=self.hbs, max_model_len=self.max_model_len,
                                watermark=self.watermark, metrics_collector=self.k_rec, kv_cache_groups=k_specs)
        self.v_fn = vllm_hashing.get_hash_fn_by_name(self.hash_fn)
        with python_hash_seed(self.seed):
            vllm_utils.init_none_hash(self.v_fn)
        # Random seeds (xxhash without PYTHONHASHSEED) differ between the sides: then hashes are compared
        # through a one-to-one renaming instead of byte for byte.
        self.exact_hashes = self.k.none_hash == vllm_utils.NONE_HASH
        self.k_to_v: dict[bytes, bytes] = {}
        self.v_to_k: dict[bytes, bytes] = {}
        config = vllm_kv_cache_config(self.groups, self.block_size, self.num_blocks)
        with self._fine_grained_coordinator():
            self.v = vllm_kv_cache_manager.KVCacheManager(
                config, max_model_len=self.max_model_len, scheduler_block_size=self.block_size,
                hash_block_size=self.hbs, enable_caching=self.enable_caching, log_stats=True,
                metrics_collector=self.v_rec, watermark=self.watermark)
        self.v_hasher = vllm_utils.get_request_block_hasher(self.hbs, self.v_fn) if self.enable_caching else None
        self.compare("start")

    @contextlib.contextmanager
    def _fine_grained_coordinator(self) -> Iterator[None]:
        if self.hbs == self.block_size or not self.enable_caching:
            yield
            return
        original = vllm_kv_cache_manager.get_kv_cache_coordinator

        def coordinator(**kwargs):
            kwargs.pop("allow_partial_hash_hits", None)
            built = HybridKVCacheCoordinator(**kwargs)
            built.enable_partial_hash_hits = True  # what a Mamba "align" group would switch on
            for manager in built.single_type_managers:
                manager.cache_hit_alignment_tokens = built.hash_block_size
            return built

        vllm_kv_cache_manager.get_kv_cache_coordinator = coordinator
        try:
            yield
        finally:
            vllm_kv_cache_manager.get_kv_cache_coordinator = original

    # ----------------------------------------------------------------- operations

    def add(self, rid: str, tokens: list[int], salt: str | None = None, lora: str | None = None,
            lora_path: str | None = None, mm: tuple[tuple[str, int, int], ...] = ()) -> None:
        if rid in self.pairs:
            return
        path = lora_path or (f"/adapters/{lora}" if lora else None)
        features = [MultiModalFeatureSpec(name, PlaceholderRange(off, n)) for name, off, n in mm]
        k = Request(rid, tokens, cache_salt=salt, lora_name=lora, lora_path=path, mm_features=features)
        params = SamplingParams(max_tokens=10_000)
        params.update_from_generation_config({}, eos_token_id=100_000)
        v_features = [VllmFeature(data=MultiModalKwargsItem.dummy(), mm_position=VllmRange(off, n), identifier=name,
                                  modality="image") for name, off, n in mm]
        v = VllmRequest(rid, list(tokens), params, None, mm_features=v_features or None, cache_salt=salt,
                        lora_request=LoRARequest(lora, abs(hash(path)) % 1000 + 1, path) if lora else None,
                        block_hasher=self.v_hasher)
        self.pairs[rid] = Pair(k, v)
        self._done(f"add {rid}")

    def lookup(self, rid: str, max_cache_hit_length: int | None = None):
        pair = self.pairs[rid]
        k_hits, k_n, k_b = self.k.get_computed_blocks(pair.k, max_cache_hit_length)
        v_hits, v_n, v_b = self.v.get_computed_blocks(pair.v, max_cache_hit_length)
        self._same("hit blocks", k_hits.get_block_ids(), v_hits.get_block_ids())
        self._same("hit tokens", (k_n, k_b), (v_n, v_b))
        return k_hits, v_hits, k_n

    def admit(self, rid: str, chunk: int, lookahead: int = 0, external: int = 0, full_must_fit: bool = False,
              reserved: int = 0, delay: bool = False, max_hit: int | None = None) -> bool | None:
        pair = self.pairs.get(rid)
        if pair is None or pair.state != "waiting":
            return None
        if max_hit is not None:
            max_hit = min(max_hit, pair.k.num_tokens - 1)  # a cap below the default, as a connector sets one
        k_hits, v_hits, hit = self.lookup(rid, max_hit)
        if external and hit % self.block_size:
            external = 0  # the scheduler hands a connector block-aligned hits only
        external = max(0, min(external, pair.k.num_tokens - hit - 1))
        chunk = max(1, min(chunk, pair.k.num_tokens - hit - external))
        kwargs = dict(num_lookahead_tokens=lookahead, num_external_computed_tokens=external,
                      full_sequence_must_fit=full_must_fit, reserved_blocks=reserved, delay_cache_blocks=delay,
                      has_scheduled_reqs=any(p.state == "running" for p in self.pairs.values()))
        k_new = self.k.allocate_slots(pair.k, chunk, hit, k_hits, **kwargs)
        v_new = self.v.allocate_slots(pair.v, chunk, hit, v_hits, **kwargs)
        self._same_allocation(k_new, v_new)
        if k_new is not None:
            self.v.record_prefix_cache_stats(pair.v, hit)  # vLLM's scheduler counts at admission, as kvlab does
            for r in (pair.k, pair.v):
                r.num_computed_tokens = hit + external + chunk
            pair.k.status, pair.v.status, pair.state = RequestStatus.RUNNING, VllmStatus.RUNNING, "running"
            self._take_copies()
        self._done(f"admit {rid} chunk={chunk} lookahead={lookahead} external={external}")
        return k_new is not None

    def run(self, rid: str, chunk: int, lookahead: int = 0, token: int = 7) -> bool | None:
        """One more step of a running request: the next prompt chunk, or (prompt done) one sampled token."""
        pair = self.pairs.get(rid)
        if pair is None or pair.state != "running":
            return None
        if pair.k.num_computed_tokens == pair.k.num_tokens:
            if pair.k.num_tokens + 1 + lookahead > self.max_model_len:
                return None
            pair.k.append_output_token_ids(token)
            pair.v.append_output_token_ids(token)
            chunk = 1
        chunk = max(1, min(chunk, pair.k.num_tokens - pair.k.num_computed_tokens))
        k_new = self.k.allocate_slots(pair.k, chunk, num_lookahead_tokens=lookahead)
        v_new = self.v.allocate_slots(pair.v, chunk, num_lookahead_tokens=lookahead)
        self._same_allocation(k_new, v_new)
        if k_new is not None:
            pair.k.num_computed_tokens += chunk
            pair.v.num_computed_tokens += chunk
        self._done(f"run {rid} chunk={chunk} lookahead={lookahead}")
        return k_new is not None

    def finish(self, rid: str) -> None:
        pair = self.pairs.get(rid)
        if pair is None or pair.state == "finished":
            return
        self.k.free(pair.k)
        self.v.free(pair.v)
        pair.k.status, pair.v.status, pair.state = RequestStatus.FINISHED_STOPPED, VllmStatus.FINISHED_STOPPED, \
            "finished"
        self._done(f"finish {rid}")

    def preempt(self, rid: str) -> None:
        pair = self.pairs.get(rid)
        if pair is None or pair.state != "running":
            return
        self.k.free(pair.k)
        self.v.free(pair.v)
        for r in (pair.k, pair.v):
            r.num_computed_tokens = 0
            r.num_preemptions += 1
        pair.k.status, pair.v.status, pair.state = RequestStatus.PREEMPTED, VllmStatus.PREEMPTED, "waiting"
        self._done(f"preempt {rid}")

    def reset(self) -> None:
        self._same("reset_prefix_cache", self.k.reset_prefix_cache(), self.v.reset_prefix_cache())
        self._done("reset")

    def drain(self) -> None:
        """Every request finishes (or is dropped while waiting), then the prefix cache is reset."""
        for rid in list(self.pairs):
            self.finish(rid)
            del self.pairs[rid]
        self.reset()

    def apply(self, op: tuple) -> None:
        """Run one operation written as a tuple: ``("admit", rid, chunk, ...)``."""
        getattr(self, op[0])(*op[1:])

    # ----------------------------------------------------------------- comparing

    def _take_copies(self) -> None:
        k_copies, k_retained = self.k.take_kv_cache_block_copies()
        self.num_copies += len(k_copies)
        v_copies, v_retained = self.v.take_kv_cache_block_copies()
        self._same("partial-hit copies", [tuple(c) for c in k_copies], [tuple(c) for c in v_copies])
        self._same("retained blocks", [b.block_id for b in k_retained], [b.block_id for b in v_retained])
        self.k.block_pool.free_blocks(k_retained)  # the copies ran (the synchronous scheduler's order)
        self.v.block_pool.free_blocks(v_retained)

    def _same_allocation(self, k_new, v_new) -> None:
        self._same("allocation", None if k_new is None else k_new.get_block_ids(),
                   None if v_new is None else v_new.get_block_ids())

    def _done(self, what: str) -> None:
        self.ops += 1
        COMPARED[0] += 1
        self.compare(what)

    def _same(self, what: str, k, v) -> None:
        if k != v:
            raise Divergence(f"after {self.ops} operations, {what}: kvlab {k!r} != vLLM {v!r}")

    def _hash(self, k_hash, v_key) -> None:
        """The kvlab hash and vLLM's key (hash + group id) name the same content."""
        if (k_hash is None) != (v_key is None):
            raise Divergence(f"after {self.ops} operations: hash {k_hash!r} against vLLM key {v_key!r}")
        if k_hash is None:
            return
        v_hash = vllm_utils.get_block_hash(v_key) if len(v_key) == len(k_hash) + 4 else v_key  # kvlab: bare
        if self.exact_hashes:
            self._same("hash bytes", k_hash, v_hash)
        elif self.k_to_v.setdefault(k_hash, v_hash) != v_hash or self.v_to_k.setdefault(v_hash, k_hash) != k_hash:
            raise Divergence(f"after {self.ops} operations: hash {k_hash.hex()} maps to two vLLM hashes")

    def compare(self, what: str) -> None:
        """Everything the issue lists, on both sides, after operation ``what``."""
        kp, vp = self.k.block_pool, self.v.block_pool
        try:
            for rid, pair in self.pairs.items():  # first: every hash a block or the index can hold comes from here
                k_ids = self.k.get_block_ids_per_group(rid) if rid in self.k.req_to_blocks else \
                    tuple([] for _ in self.groups)
                self._same(f"block tables of {rid}", k_ids, self.v.get_block_ids(rid))
                if pair.k._hasher_owner is None:  # kvlab hashes at the first lookup, vLLM at construction
                    continue
                self._same(f"hash count of {rid}", len(pair.k.block_hashes), len(pair.v.block_hashes))
                for kh, vh in zip(pair.k.block_hashes, pair.v.block_hashes, strict=True):
                    self._hash(kh, vh)
            self._same("free queue", [b.block_id for b in kp.free_block_queue.get_all_free_blocks()],
                       [b.block_id for b in vp.free_block_queue.get_all_free_blocks()])
            self._same("free count", kp.get_num_free_blocks(), vp.get_num_free_blocks())
            self._same("usage", kp.get_usage(), vp.get_usage())
            self._same("ref counts", [b.ref_cnt for b in kp.blocks[1:]], [b.ref_cnt for b in vp.blocks[1:]])
            self._same("hash tokens", [b.block_hash_num_tokens for b in kp.blocks],
                       [b.block_hash_num_tokens for b in vp.blocks])
            for kb, vb in zip(kp.blocks, vp.blocks, strict=True):
                self._hash(kb.block_hash, vb.block_hash)
            self._compare_index(kp, vp)
            ks, vs = self.k.prefix_cache_stats, self.v.prefix_cache_stats
            fields = ("reset", "requests", "queries", "hits", "preempted_requests", "preempted_queries",
                      "preempted_hits")
            self._same("prefix cache stats", [getattr(ks, f) for f in fields], [getattr(vs, f) for f in fields])
            self._same("metrics observer calls", self.k_rec.calls, self.v_rec.calls)
            self.k_rec.calls.clear()
            self.v_rec.calls.clear()
        except Divergence as exc:
            raise Divergence(f"{exc} (last operation: {what})") from None

    def _compare_index(self, kp, vp) -> None:
        v_index = {}
        for key, blocks in vp.cached_block_hash_to_block._cache.items():
            v_index[key] = [blocks.block_id] if not isinstance(blocks, dict) else list(blocks)
        k_index = dict((h, list(blocks)) for h, blocks in kp.cached_block_hash_to_block.items())
        self._same("index size", len(k_index), len(v_index))
        by_v = {}
        for key, ids in v_index.items():
            by_v[key if self.keyed else vllm_utils.get_block_hash(key)] = ids
        for k_hash, ids in k_index.items():
            v_hash = k_hash if self.exact_hashes else self.k_to_v.get(k_hash)
            self._same(f"index entry {k_hash[:4].hex()}", ids, by_v.get(v_hash))
        v_secondary = {i: {key if self.keyed else vllm_utils.get_block_hash(key) for key in keys}
                       for i, keys in vp.cached_block_hashes_by_block.items() if keys}
        k_secondary = {i: {h if self.exact_hashes else self.k_to_v.get(h) for h in keys}
                       for i, keys in kp.cached_block_hashes_by_block.items() if keys}
        self._same("secondary hashes", k_secondary, v_secondary)
