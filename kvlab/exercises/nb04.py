"""Notebook 04's exercises (chained block hashes, the longest cached prefix) and self-test."""

from __future__ import annotations

import random
from typing import Any

from kvlab.capacity.models import get_model
from kvlab.capacity.sizing import kv_bytes
from kvlab.core.hashing import get_request_block_hasher, hash_block_tokens, sha256
from kvlab.core.kv_cache_manager import KVCacheManager, find_longest_cache_hit
from kvlab.core.request import Request
from kvlab.exercises.core import Case, Exercise, ask, register
from kvlab.sim.prefix_sim import admit
from kvlab.units import format_bytes

# ----------------------------------------------------------------- 04.chained_hashes


def chained_hashes(token_ids: list[int], block_size: int, none_hash: bytes) -> list[bytes]:
    """Reference: the sha256 chain of the full blocks of ``token_ids``, seeded with ``none_hash``."""
    return get_request_block_hasher(block_size, sha256, none_hash)(Request("exercise", token_ids))


def _blocks(token_ids: list[int], block_size: int) -> list[list[int]]:
    return [token_ids[i:i + block_size] for i in range(0, len(token_ids) - block_size + 1, block_size)]


def _explain_chain(case: Case, expected: Any, actual: Any) -> str | None:
    token_ids, block_size, none_hash = case.args
    if not isinstance(actual, list) or not all(isinstance(h, bytes) for h in actual):
        return "return a list of bytes, one hash per full block (hash_block_tokens returns bytes)"
    if len(actual) > len(expected):
        return "only full blocks are hashed: a trailing partial block has no hash yet (its tokens may still change)"
    blocks = _blocks(token_ids, block_size)
    if actual and expected and actual[0] == hash_block_tokens(sha256, None, blocks[0]) != expected[0]:
        return "the first block's parent is the none_hash argument, not kvlab's process-wide NONE_HASH"
    if len(actual) == len(expected) > 1 and actual[1:] == [hash_block_tokens(sha256, none_hash, b) for b in blocks[1:]]:
        return "each block's hash must chain from the previous block's hash, not start again from none_hash"
    return None


def _random_chain_case(rng: random.Random) -> Case:
    block_size = rng.choice([2, 4, 16])
    token_ids = [rng.randrange(50) for _ in range(rng.randint(1, 5 * block_size))]
    return Case((token_ids, block_size, rng.randbytes(32)), probes="random tokens, block size and seed")


register(Exercise(
    id="04.chained_hashes",
    title="a request's chained block hashes",
    task=(
        "Return one hash per *full* block of `token_ids`, in order. Block i's hash is "
        "`hash_block_tokens(sha256, parent, block_i_tokens)` (both from `kvlab.core.hashing`), where the parent is "
        "the previous block's hash, and for the first block the `none_hash` you are given (the seed of the "
        "chain). A trailing partial block gets no hash."
    ),
    signature="def chained_hashes(token_ids: list[int], block_size: int, none_hash: bytes) -> list[bytes]:",
    reference=chained_hashes,
    edge_cases=[
        Case(([1, 2, 3, 4, 5, 6, 7, 8], 4, b"seed"), probes="two full blocks: the second chains from the first"),
        Case(([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, b"seed"), probes="a trailing partial block is not hashed"),
        Case(([1, 2, 3], 4, b"seed"), probes="fewer tokens than one block: no hash at all"),
        Case(([7, 7, 7, 7, 7, 7, 7, 7], 4, b"seed"), probes="the same tokens twice: two different hashes"),
        Case(([1, 2, 3], 1, b"other seed"), probes="block size 1, and a seed that is not kvlab's NONE_HASH"),
    ],
    random_case=_random_chain_case,
    explain=_explain_chain,
    hints=[
        "Walk the token list in steps of block_size and stop before a block that would be short.",
        "Keep a variable `parent`, starting at none_hash; after hashing a block, the block's hash becomes the parent.",
        "hashes, parent = [], none_hash; for start in range(0, len(token_ids) - block_size + 1, block_size): "
        "parent = hash_block_tokens(sha256, parent, token_ids[start:start + block_size]); hashes.append(parent)",
    ],
))


# ----------------------------------------------------------------- 04.longest_cached_prefix


def longest_cached_prefix(block_hashes: list[bytes], cached: set[bytes], num_tokens: int, block_size: int) -> int:
    """Reference: tokens of the longest cached prefix, whole blocks, at most num_tokens - 1 of them."""
    hits = find_longest_cache_hit(block_hashes, num_tokens - 1, block_size, lambda h: True if h in cached else None)
    return len(hits) * block_size


def _explain_prefix(case: Case, expected: Any, actual: Any) -> str | None:
    block_hashes, cached, num_tokens, block_size = case.args
    if not isinstance(actual, int):
        return "return a number of tokens (an int), a multiple of block_size"
    leading = 0
    while leading < len(block_hashes) and block_hashes[leading] in cached:
        leading += 1
    if actual == leading * block_size != expected:
        return ("at most num_tokens - 1 tokens may hit: the last token must be computed to get the next token's "
                "logits, so a fully cached prompt recomputes its last block")
    max_blocks = (num_tokens - 1) // block_size
    if actual == sum(h in cached for h in block_hashes[:max_blocks]) * block_size != expected:
        return "stop at the first miss: after it, no later block can be cached with this request's prefix"
    if actual % block_size:
        return "hits are whole blocks: the answer is a multiple of block_size"
    return None


def _random_prefix_case(rng: random.Random) -> Case:
    block_size = rng.choice([4, 16])
    num_tokens = rng.randint(1, 8 * block_size)
    hashes = [rng.randbytes(8) for _ in range(num_tokens // block_size)]
    cached = {h for h in hashes if rng.random() < 0.8} | {rng.randbytes(8)}
    return Case((hashes, cached, num_tokens, block_size), probes="random hashes, four in five of them cached")


register(Exercise(
    id="04.longest_cached_prefix",
    title="how many tokens a request finds in the prefix cache",
    task=(
        "A request of `num_tokens` tokens has the chained hashes `block_hashes` (one per full block); "
        "`cached` is the set of hashes the prefix cache holds. Return how many tokens hit: walk the blocks in "
        "order, stop at the first block not in `cached`, and never let more than `num_tokens - 1` tokens hit "
        "(in whole blocks), as vLLM's `get_computed_blocks` does."
    ),
    signature=("def longest_cached_prefix(block_hashes: list[bytes], cached: set[bytes], num_tokens: int, "
               "block_size: int) -> int:"),
    reference=longest_cached_prefix,
    edge_cases=[
        Case(([b"a", b"b", b"c"], {b"a", b"b", b"c"}, 50, 16), probes="every full block cached, 2 tokens beyond"),
        Case(([b"a", b"b", b"c"], {b"a", b"b", b"c"}, 48, 16),
             probes="a fully cached prompt: at most num_tokens - 1 tokens may hit, so the last block is recomputed"),
        Case(([b"a", b"b", b"c", b"d"], {b"a", b"c", b"d"}, 70, 16),
             probes="a miss in the middle: later cached blocks do not count"),
        Case(([b"a", b"b"], {b"b"}, 40, 16), probes="the first block misses: nothing hits"),
        Case(([], {b"a"}, 1, 16), probes="a one-token prompt has no full block"),
    ],
    random_case=_random_prefix_case,
    explain=_explain_prefix,
    hints=[
        "Count blocks from the start while their hash is in `cached`; break at the first one that is not.",
        "Only the first (num_tokens - 1) // block_size blocks may be counted at all.",
        "n = 0; for h in block_hashes[: (num_tokens - 1) // block_size]: if h not in cached: break; n += 1. "
        "Return n * block_size.",
    ],
))


# ----------------------------------------------------------------- self-test


def _chain_question() -> dict[str, Any]:
    manager = KVCacheManager(16, 16, hash_seed="quiz")
    block = list(range(100, 116))
    at_start, later = Request("a", block), Request("b", list(range(16)) + block)
    original = Request("c", list(range(64)))
    changed = Request("d", [999] + list(range(1, 64)))
    for r in (at_start, later, original, changed):
        manager.get_computed_blocks(r)
    return {"same_tokens_same_hash": at_start.block_hashes[0] == later.block_hashes[1],
            "hashes_changed_by_first_token": sum(a != b for a, b in zip(original.block_hashes, changed.block_hashes,
                                                                        strict=True)),
            "blocks": len(original.block_hashes)}


ask(
    "04.q1",
    "Why is the prefix cache keyed by a chained hash rather than by a hash of the block's own 16 tokens?",
    _chain_question,
    lambda v: (
        "A token's K and V depend on every token before it, so the same 16 tokens after a different prefix are a "
        f"different block. The chain hash(parent hash, tokens, extra keys) folds the whole prefix in: the same block "
        f"at another position gets another hash (equal? {v['same_tokens_same_hash']}), and changing the first token "
        f"changes all {v['hashes_changed_by_first_token']} of {v['blocks']} hashes. Extra keys add what the tokens "
        "do not say: LoRA adapter, images, cache salt."),
)


def _system_prompt_question() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system_len in (2000, 2005):
        manager = KVCacheManager(300, 16, hash_seed="quiz")
        system = list(range(system_len))
        admit(manager, Request("first", system + [50_000 + i for i in range(50)]))
        second = Request("second", system + [60_000 + i for i in range(50)])
        hits = admit(manager, second)
        out[system_len] = {"hit_blocks": hits // 16, "prefill_tokens": second.num_tokens - hits}
    return {"hit_blocks": out[2000]["hit_blocks"], "prefill_tokens": out[2000]["prefill_tokens"],
            "hit_blocks_2005": out[2005]["hit_blocks"], "prefill_tokens_2005": out[2005]["prefill_tokens"],
            "shared_bytes": kv_bytes(get_model("llama-3-70b"), out[2000]["hit_blocks"] * 16)}


ask(
    "04.q2",
    ("Block size 16: a 2,000-token system prompt plus a 50-token question. How many blocks does a second "
     "request with the same system prompt hit, how many tokens does it prefill, and what changes at 2,005?"),
    _system_prompt_question,
    lambda v: (
        f"2,000 / 16 = {v['hit_blocks']} full blocks hit, so only the {v['prefill_tokens']} question tokens are "
        f"prefilled; for Llama-3-70B those blocks are {format_bytes(v['shared_bytes'])} of KV held once. With 2,005 "
        f"tokens the last 5 share the 126th block with the first question's tokens: still "
        f"{v['hit_blocks_2005']} blocks hit and {v['prefill_tokens_2005']} tokens are prefilled. Reuse comes in "
        "whole blocks."),
)


def _freed_question() -> dict[str, Any]:
    manager = KVCacheManager(6, 16, hash_seed="quiz")
    prompt = list(range(40))
    a, b = Request("a", prompt), Request("b", prompt)
    admit(manager, a)
    admit(manager, b)
    shared = manager.block_pool.blocks[manager.get_block_ids("a")[0]]
    content = shared.block_hash
    out: dict[str, Any] = {"ref_cnt_both": shared.ref_cnt}
    manager.free(a)
    out["ref_cnt_after_one"] = shared.ref_cnt
    manager.free(b)
    out["ref_cnt_after_both"] = shared.ref_cnt
    out["in_free_queue"] = shared in manager.block_pool.free_block_queue.get_all_free_blocks()
    out["still_cached"] = shared.block_hash == content
    admit(manager, Request("c", list(range(1000, 1080))))  # needs every block of the pool
    out["cached_after_pool_filled"] = shared.block_hash == content
    return out


ask(
    "04.q3",
    "Two requests share a cached block. When is that block really freed, and when does its content go?",
    _freed_question,
    lambda v: (
        f"Its ref_cnt is {v['ref_cnt_both']} while both run, {v['ref_cnt_after_one']} after one finishes (it stays "
        f"out of the free queue), {v['ref_cnt_after_both']} after both. Only then does it enter the free queue, at "
        f"the tail and still cached (cached: {v['still_cached']}), where a later request can hit it again. Its "
        "content goes only when allocation reaches it at the head and evicts its hash (still cached after another "
        f"request filled the pool: {v['cached_after_pool_filled']})."),
)


def _timestamp_question() -> dict[str, Any]:
    rules = list(range(100, 580))  # 30 blocks of fixed instructions
    out = {}
    for where in ("first", "after"):
        manager = KVCacheManager(200, 16, hash_seed="quiz")
        hits = []
        for second in (1, 2):
            stamp = [90_000 + second] * 8
            prompt = (stamp + rules if where == "first" else rules + stamp) + [70_000 + second] * 24
            hits.append(admit(manager, Request(f"{where}{second}", prompt)))
        out[where] = hits[1]
    return {"hit_tokens_timestamp_first": out["first"], "hit_tokens_timestamp_after": out["after"],
            "instruction_tokens": len(rules)}


ask(
    "04.q4",
    ("A system prompt starts with the current time, then 480 tokens of fixed rules. How much does the next "
     "second's request hit, and what would you change?"),
    _timestamp_question,
    lambda v: (
        f"{v['hit_tokens_timestamp_first']} tokens: the first block differs, and the chain carries that into every "
        f"later hash. Move the time after the rules and all {v['hit_tokens_timestamp_after']} rule tokens hit. Put "
        "what is fixed first and what varies last."),
)
