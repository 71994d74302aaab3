"""What prefix caching costs: hashing every full block, measured on this CPU with ``measure_hash_cost``.

What a hit saves (a block's prefill) is estimated in ``kvlab.capacity.cost_model``.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import time
from collections.abc import Callable, Sequence

import xxhash

from kvlab._validate import checked, one_of, positive_int
from kvlab.core.hashing import HASH_FUNCTIONS, get_hash_fn_by_name, hash_block_tokens
from kvlab.errors import KvlabValueError


@checked(at_most={"number": 10**6, "repeat": 1000})
def measure_hash_cost(
    hash_fn_names: Sequence[str] = tuple(HASH_FUNCTIONS),
    block_sizes: Sequence[int] = (16, 64),
    number: int = 2000,
    repeat: int = 5,
    seed: int = 0,
    include_digest_only: bool = True,
) -> list[dict[str, object]]:
    """Seconds per ``hash_block_tokens`` call for each hash function and block size, on this machine.

    Each figure is the best of ``repeat`` runs of ``number`` calls on random 32-byte parents and
    random token ids below 32,000 (best-of is the usual way to read a timing on a shared
    machine: noise only ever adds time). With ``include_digest_only`` two more rows time the
    bare SHA-256 and xxh3-128 digests of the already pickled input, to show how much of a
    call is serialisation.
    """
    number, repeat = positive_int("number", number), positive_int("repeat", repeat)
    for i, size in enumerate(block_sizes):
        if positive_int(f"block_sizes[{i}]", size) > 4096:
            raise KvlabValueError(f"block_sizes[{i}]={size}: vLLM's block sizes are at most a few hundred tokens")
    for i, name in enumerate(hash_fn_names):
        one_of(f"hash_fn_names[{i}]", name, HASH_FUNCTIONS)
    rng = random.Random(seed)
    hash_once = hash_block_tokens.__wrapped__  # the hashing itself, without kvlab's argument check
    rows = []
    for block_size in block_sizes:
        block_size = positive_int("block_size", block_size)
        inputs = [(rng.randbytes(32), tuple(rng.randrange(32_000) for _ in range(block_size))) for _ in range(number)]
        for name in hash_fn_names:
            fn = get_hash_fn_by_name(name)
            best = float("inf")
            for _ in range(repeat):
                start = time.perf_counter()
                for parent, tokens in inputs:
                    hash_once(fn, parent, tokens)
                best = min(best, time.perf_counter() - start)
            rows.append({"hash_fn": name, "block_size": block_size, "seconds_per_block": best / number})
        if include_digest_only:
            payloads = [pickle.dumps((parent, tokens, None), protocol=pickle.HIGHEST_PROTOCOL)
                        for parent, tokens in inputs]
            for name, digest in (("sha256 digest only", lambda b: hashlib.sha256(b).digest()),
                                 ("xxh3_128 digest only", xxhash.xxh3_128_digest)):
                best = min(_time_calls(digest, payloads) for _ in range(repeat))
                rows.append({"hash_fn": name, "block_size": block_size, "seconds_per_block": best / number})
    return rows


def _time_calls(fn: Callable[[bytes], bytes], payloads: list[bytes]) -> float:
    start = time.perf_counter()
    for payload in payloads:
        fn(payload)
    return time.perf_counter() - start
