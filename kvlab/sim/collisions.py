"""Hash collisions on purpose: a deliberately weak block hash and a seeded search for blocks it confuses.

A prefix-cache hit trusts the hash: equal hashes are taken to mean equal prefixes, and the
request reads the cached block's K and V. With a 16-bit hash, two different blocks share a
hash after a few hundred random tries (the birthday bound, ``birthday_bound(16)`` = sqrt(pi/2 x 2^16) = 321);
with SHA-256 no collision has ever been found. xxh3-128 is wide enough that random collisions
are negligible, but it is not cryptographic: someone who chooses the tokens can build one.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterable

from kvlab._validate import MAX_OBJECTS, checked, positive_int
from kvlab.core.hashing import BlockHash, HashFn, get_hash_fn_by_name, hash_block_tokens
from kvlab.errors import KvlabError, KvlabValueError


@checked(at_most={"bits": 4096})
def birthday_bound(bits: int) -> float:
    """Expected random draws until two of them share a ``bits``-bit hash: ``sqrt(pi / 2 x 2**bits)``."""
    return math.sqrt(math.pi / 2 * 2 ** positive_int("bits", bits))


@checked(at_most={"bits": 4096})
def truncated_hash(hash_fn_name: str = "sha256", bits: int = 16) -> HashFn:
    """``hash_fn_name``'s digest cut to its first ``bits`` bits (a multiple of 8): weak on purpose."""
    base = get_hash_fn_by_name(hash_fn_name)
    bits = positive_int("bits", bits)
    if bits % 8 or bits > 8 * len(base(b"")):
        raise KvlabValueError(f"bits must be a multiple of 8 no larger than {hash_fn_name}'s digest, got {bits}")
    num_bytes = bits // 8

    def weak_hash(input: object) -> bytes:
        return base(input)[:num_bytes]

    weak_hash.__name__ = f"{hash_fn_name}_first_{bits}_bits"
    return weak_hash


@dataclasses.dataclass(frozen=True)
class BlockCollision:
    """Two different blocks with the same hash after the same parent, and every block tried on the way."""

    tokens_a: tuple[int, ...]
    tokens_b: tuple[int, ...]
    block_hash: BlockHash
    tried: tuple[tuple[int, ...], ...]


@checked(at_most={"block_size": MAX_OBJECTS, "max_tries": MAX_OBJECTS})
def find_block_collision(
    hash_fn: HashFn,
    block_size: int,
    parent_block_hash: BlockHash,
    seed: int = 0,
    max_tries: int = 1_000_000,
    vocab_size: int = 32_000,
) -> BlockCollision:
    """Draw random full blocks (seeded) until two different ones hash alike after ``parent_block_hash``."""
    block_size, max_tries = positive_int("block_size", block_size), positive_int("max_tries", max_tries)
    vocab_size = positive_int("vocab_size", vocab_size)
    rng = random.Random(seed)
    seen: dict[BlockHash, tuple[int, ...]] = {}
    tried: list[tuple[int, ...]] = []
    for _ in range(max_tries):
        tokens = tuple(rng.randrange(vocab_size) for _ in range(block_size))
        tried.append(tokens)
        block_hash = hash_block_tokens(hash_fn, parent_block_hash, tokens)
        other = seen.setdefault(block_hash, tokens)
        if other != tokens:
            return BlockCollision(other, tokens, block_hash, tuple(tried))
    raise KvlabError(f"no collision among {max_tries} random blocks: the hash is stronger than this search")


@checked
def count_distinct_hashes(hash_fn: HashFn, parent_block_hash: BlockHash, blocks: Iterable[tuple[int, ...]]) -> int:
    """How many different hashes ``hash_fn`` gives the distinct ``blocks`` after one parent."""
    return len({hash_block_tokens(hash_fn, parent_block_hash, tokens) for tokens in set(blocks)})
