"""Chained block hashes: the identity of a KV block is its whole prefix, not its own tokens.

Mirrors ``vllm/v1/core/kv_cache_utils.py`` (``NONE_HASH``, ``init_none_hash``,
``hash_block_tokens``, ``generate_block_hash_extra_keys``, ``get_request_block_hasher``) and
``vllm/utils/hashing.py`` (the four hash functions and ``get_hash_fn_by_name``):

    h_0 = H((NONE_HASH, tokens_0, extra_0)),   h_i = H((h_{i-1}, tokens_i, extra_i))

Only full blocks are hashed. ``NONE_HASH``, the seed of every chain, is process state in
vLLM; here it is set once at import, and every ``KVCacheManager`` derives its own (as a
separate vLLM process would), so nothing a notebook cell does to this module changes
another cell's results. vLLM 0.33.0's rule for that seed: ``PYTHONHASHSEED`` if set, else a
fixed string for SHA-256 (shareable across processes) and 32 random bytes for xxhash (whose
seed must stay secret); older releases drew random bytes for every function.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash as _xxhash

from kvlab._validate import checked, non_negative_int, one_of, positive_int
from kvlab.core.kv_cache_utils import BlockHash  # the one home of the type
from kvlab.core.request import Request
from kvlab.errors import KvlabValueError

HashFn = Callable[[Any], bytes]


# ----------------------------------------------------------------- the hash functions


def sha256(input: Any) -> bytes:
    """Pickle, then SHA-256: vLLM's default. Stable for one Python version; collision-resistant."""
    return hashlib.sha256(pickle.dumps(input, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(input: Any) -> bytes:
    """Canonical CBOR, then SHA-256: the same bytes from any language, process or Python version."""
    return hashlib.sha256(cbor2.dumps(input, canonical=True)).digest()


def xxhash(input: Any) -> bytes:
    """Pickle, then xxh3-128: several times faster, but anyone can construct collisions."""
    return _xxhash.xxh3_128_digest(pickle.dumps(input, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(input: Any) -> bytes:
    """Canonical CBOR, then xxh3-128: portable and fast, not collision-resistant."""
    return _xxhash.xxh3_128_digest(cbor2.dumps(input, canonical=True))


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
}


@checked
def get_hash_fn_by_name(hash_fn_name: str) -> HashFn:
    """The hash function vLLM's ``--prefix-caching-hash-algo`` names; unknown names list the known."""
    return HASH_FUNCTIONS[one_of("hash_fn_name", hash_fn_name, HASH_FUNCTIONS)]


@checked
def hash_fn_name(hash_fn: HashFn) -> str:
    """The name of ``hash_fn`` (its registry name, else its ``__name__``)."""
    for name, fn in HASH_FUNCTIONS.items():
        if fn is hash_fn:
            return name
    return getattr(hash_fn, "__name__", repr(hash_fn))


# ----------------------------------------------------------------- the seed of every chain

#: The seed vLLM 0.33.0 hashes for ``NONE_HASH`` when ``PYTHONHASHSEED`` is unset and the hash is cryptographic.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
#: Hash functions that are not collision resistant: their seed must stay secret, so it is random per process.
NON_CRYPTO_HASH_FUNCTIONS = frozenset({xxhash, xxhash_cbor})


@checked
def resolve_none_hash_seed(hash_fn: HashFn, hash_seed: str | None) -> str:
    """The string ``NONE_HASH`` is derived from, by vLLM 0.33.0's rule (``resolve_none_hash_seed``).

    ``hash_seed`` (vLLM reads ``PYTHONHASHSEED``) wins when set. Otherwise SHA-256 (either
    serialisation) gets the fixed ``DEFAULT_NONE_HASH_SEED``: every process computes the same
    hashes, so caches can be shared across processes and nodes, and a known seed costs SHA-256
    nothing (its collision resistance does not depend on a secret). xxhash gets 32 random
    bytes (as hex): anyone who knew its seed could build colliding blocks offline.
    """
    if hash_seed is not None:
        if not isinstance(hash_seed, str):
            raise KvlabValueError(f"hash_seed must be a string (as PYTHONHASHSEED is) or None, got {hash_seed!r}")
        return hash_seed
    if hash_fn in NON_CRYPTO_HASH_FUNCTIONS:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


@checked
def none_hash_from_seed(hash_fn: HashFn, hash_seed: str | None) -> bytes:
    """``NONE_HASH`` as vLLM 0.33.0 derives it: ``hash_fn`` of the seed ``resolve_none_hash_seed`` picks."""
    return hash_fn(resolve_none_hash_seed(hash_fn, hash_seed))


@checked
def init_none_hash(hash_fn: HashFn) -> bytes:
    """Set this process's ``NONE_HASH`` from ``PYTHONHASHSEED`` (or the default rule) and return it."""
    global NONE_HASH
    NONE_HASH = none_hash_from_seed(hash_fn, os.getenv("PYTHONHASHSEED"))
    return NONE_HASH


NONE_HASH: bytes = b""
init_none_hash(sha256)  # once, at import, as vLLM's engine does at start-up


# ----------------------------------------------------------------- one block


@checked
def hash_block_tokens(
    hash_function: HashFn,
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """The hash of a full block: ``hash_function((parent or NONE_HASH, tuple(tokens), extra_keys))``.

    The parent's hash folds the whole prefix in, so equal hashes mean equal prefixes (up to
    collisions): the same 16 tokens after a different prefix have different K and V.
    """
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    return hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


@checked
def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, hash_function: HashFn | None = None, none_hash: BlockHash | None = None
) -> list[BlockHash]:
    """Chained hashes of the full blocks of a bare token list (no extra keys): one per full block."""
    block_size = positive_int("block_size", block_size)
    hash_function = hash_function or sha256
    hashes: list[BlockHash] = []
    parent = none_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(hash_function, parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


# ----------------------------------------------------------------- what else a block's identity holds


@checked
def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int = 0
) -> tuple[tuple[Any, ...] | None, int]:
    """Keys besides the tokens that decide a block's KV, and the next multimodal index to look at.

    Each key is tagged with its kind, as vLLM 0.33.0 writes them, so that no value of one kind
    can stand for another (a LoRA named ``"x"`` and a salt ``"x"`` stay apart). In vLLM's
    order: ``("lora", name, path)`` on every block (the adapter changes every K and V; the
    path keeps two adapters given one name apart), ``("mm", identifier, offset -
    start_token_idx)`` for each multimodal item overlapping the block (the same placeholder
    tokens stand for different images), and ``("cache_salt", salt)`` on the first block only
    (the chain carries it into every later hash). ``None`` when there are none.
    """
    start_token_idx = non_negative_int("start_token_idx", start_token_idx)
    end_token_idx = positive_int("end_token_idx", end_token_idx)
    if end_token_idx <= start_token_idx:
        raise KvlabValueError(f"end_token_idx={end_token_idx} must be greater than start_token_idx={start_token_idx}")
    return _extra_keys(request, start_token_idx, end_token_idx, start_mm_idx)


def _extra_keys(request: Request, start: int, end: int, mm_idx: int) -> tuple[tuple[Any, ...] | None, int]:
    """``generate_block_hash_extra_keys`` without its argument checks (the hasher's indices are its own)."""
    mm_keys, next_mm_idx = _mm_extra_keys(request, start, end, mm_idx) if request.mm_features else ([], mm_idx)
    extra_keys = [("lora", request.lora_name, request.lora_path)] if request.lora_name else []
    extra_keys += mm_keys
    if start == 0 and request.cache_salt:
        extra_keys.append(("cache_salt", request.cache_salt))
    return (tuple(extra_keys) if extra_keys else None), next_mm_idx


def _mm_extra_keys(request: Request, start: int, end: int, mm_idx: int) -> tuple[list[Any], int]:
    features = request.mm_features
    if not features:
        return [], mm_idx
    if mm_idx < 0:  # -1: start from the last item, as vLLM does for blocks completed by output tokens
        mm_idx = len(features) + mm_idx
    keys: list[Any] = []
    while mm_idx < len(features):
        feature = features[mm_idx]
        offset, length = feature.mm_position.offset, feature.mm_position.length
        if end <= offset:  # the block ends before this item begins
            break
        if start >= offset + length:  # the block starts after this item ends
            mm_idx += 1
            continue
        keys.append(("mm", feature.identifier, offset - start))
        if end >= offset + length:  # the item ends inside the block: the next may start here too
            mm_idx += 1
        else:
            break
    return keys, mm_idx


# ----------------------------------------------------------------- a request's blocks


@checked
def get_request_block_hasher(
    hash_block_size: int, caching_hash_fn: HashFn, none_hash: BlockHash | None = None
) -> Callable[[Request], list[BlockHash]]:
    """A function returning the hashes of a request's full hash blocks not yet in ``request.block_hashes``.

    Hashes are taken every ``hash_block_size`` tokens and chained over the whole prefix, so a
    coarser KV block is named by the hash at its last boundary (vLLM's
    ``BlockHashListWithBlockSize``). ``none_hash`` is the chain's seed (default: this process's
    ``NONE_HASH``); passing it as the first block's parent gives exactly the hash vLLM
    computes when its ``NONE_HASH`` is that seed.
    """
    hash_block_size = positive_int("hash_block_size", hash_block_size)
    hash_tokens = hash_block_tokens.__wrapped__  # type: ignore[attr-defined]  # checked here, not once per block

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start_token_idx = len(request.block_hashes) * hash_block_size
        num_tokens = len(request._all_token_ids)
        if start_token_idx + hash_block_size > num_tokens:
            return []
        parent = request.block_hashes[-1] if request.block_hashes else none_hash
        tokens = request._all_token_ids
        mm_idx = 0
        keyed = request.mm_features or request.lora_name is not None or request.cache_salt is not None
        extra_keys = None
        new_hashes: list[BlockHash] = []
        while start_token_idx + hash_block_size <= num_tokens:
            end_token_idx = start_token_idx + hash_block_size
            if keyed:
                extra_keys, mm_idx = _extra_keys(request, start_token_idx, end_token_idx, mm_idx)
            block_hash = hash_tokens(caching_hash_fn, parent, tokens[start_token_idx:end_token_idx], extra_keys)
            new_hashes.append(block_hash)
            parent = block_hash
            start_token_idx = end_token_idx
        return new_hashes

    return request_block_hasher


# ----------------------------------------------------------------- one hash per KV cache group


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> Any:
    """The prefix cache's key for ``block_hash`` in KV cache group ``group_id`` (vLLM's ``BlockHashWithGroupId``).

    Every group of a hybrid model caches the same prefix in its own block, so the index keys a
    block by its hash *and* its group: vLLM appends the group id as 4 big-endian bytes. A hash
    that is not bytes (a teaching hash function's value) is paired with the id instead. A
    manager with a single group keys by the bare hash (kvlab's simplification, see block_pool).
    """
    group_id = non_negative_int("group_id", group_id)
    if group_id >= 1 << 32:
        raise KvlabValueError(f"group_id must fit vLLM's 4 bytes (< 2**32), got {group_id}")
    if block_hash is None:
        raise KvlabValueError("block_hash must be a block's hash, got None")
    if isinstance(block_hash, bytes):
        return block_hash + group_id.to_bytes(4, "big", signed=False)
    return (block_hash, group_id)
