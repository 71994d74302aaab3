"""Notebook 04's exercises (chained block hashes, the longest cached prefix) and self-test."""

from __future__ import annotations

import random
from typing import Any

from kvlab.capacity.models import get_model
from kvlab.capacity.sizing import kv_bytes
from kvlab.core.kv_cache_manager import KVCacheManager, find_longest_cache_hit
from kvlab.core.request import Request
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.exercises.predictions import Prediction, register_prediction
from kvlab.sim.prefix_sim import admit
from kvlab.units import cdiv, format_bytes

# ----------------------------------------------------------------- 04.chained_hashes (a prediction)

_A70 = list(range(70))  # request A of section 1: 70 tokens, four full blocks of 16 and 6 tokens of a fifth
CHAIN_PARTS = {
    "A again": _A70,
    "B: token 20 changed": _A70[:20] + [999] + _A70[21:],
    "D: A without its first 16 tokens": _A70[16:],
}


def _shared_with_a(hash_block: Any) -> dict[str, list[int]]:
    """For each request, the indices of its blocks whose hash is one of A's, with ``hash_block(parent, tokens)``;
    a ``hash_block`` that returns None for a partial block's parent-less tokens skips it."""
    def chain(tokens: list[int], partial: bool) -> list[Any]:
        hashes, parent = [], None
        for start in range(0, len(tokens) if partial else len(tokens) - 15, 16):
            parent = hash_block(parent, tuple(tokens[start:start + 16]))
            hashes.append(parent)
        return hashes

    partial = getattr(hash_block, "partial", False)
    a = set(chain(_A70, partial))
    return {name: [i for i, h in enumerate(chain(tokens, partial)) if h in a] for name, tokens in CHAIN_PARTS.items()}


def _chained_hashes_in_kvlab() -> dict[str, list[int]]:
    manager = KVCacheManager(16, 16, hash_seed="04")
    requests = {name: Request(name, tokens) for name, tokens in {"A": _A70, **CHAIN_PARTS}.items()}
    for request in requests.values():
        manager.get_computed_blocks(request)  # the first look hashes the request's full blocks
    a = set(requests["A"].block_hashes)
    return {name: [i for i, h in enumerate(requests[name].block_hashes) if h in a] for name in CHAIN_PARTS}


def _each_block_alone(parent: Any, tokens: tuple) -> Any:
    return tokens


def _partial_hashed(parent: Any, tokens: tuple) -> Any:
    return (parent, tokens)


_partial_hashed.partial = True  # type: ignore[attr-defined]

CHAIN_MISTAKES = (
    Mistake(lambda: _shared_with_a(_each_block_alone),
            "a block's hash folds in its parent's hash, so it names the whole prefix: the same 16 tokens after "
            "another prefix (or at another position) get another hash"),
    Mistake(lambda: _shared_with_a(_partial_hashed),
            "only full blocks are hashed: A's fifth block, 6 of 16 tokens, has no hash, so nothing can match it"),
    Mistake(lambda: {**_shared_with_a(lambda parent, tokens: (parent, tokens)), "B: token 20 changed": []},
            "a change in block 1 leaves block 0 alone: block 0's hash depends only on the blocks up to it"),
)

register_prediction(Prediction(
    id="04.chained_hashes",
    title="which block hashes two requests share",
    question=(
        "Request A holds tokens 0..69 (block size 16). For each request below, predict the indices of its blocks "
        "whose hash is one of A's hashes: A sent again; B, A's tokens with token 20 replaced; D, A's tokens from 16 "
        "on (D's first block holds exactly A's second block's tokens). Then run the cell: kvlab hashes all of them."
    ),
    form='{"A again": [0, 1], "B: token 20 changed": [...], "D: A without its first 16 tokens": [...]}: block indices',
    run=_chained_hashes_in_kvlab,
    runs="KVCacheManager(16, 16).get_computed_blocks(request) for each request, then request.block_hashes against A's",
    mistakes=CHAIN_MISTAKES,
    hints=[
        "Which of each request's blocks are full? Only those get a hash.",
        "A block's hash takes its parent's hash as an input. If a block's parent differs, what about the block?",
        "Token 20 is in block 1. Which of B's blocks have every token up to their end equal to A's?",
    ],
))


# ----------------------------------------------------------------- 04.longest_cached_prefix


def longest_cached_prefix(block_hashes: list[bytes], cached: set[bytes], num_tokens: int, block_size: int) -> int:
    """Reference: tokens of the longest cached prefix, whole blocks, at most num_tokens - 1 of them."""
    hits = find_longest_cache_hit(block_hashes, num_tokens - 1, block_size, lambda h: True if h in cached else None)
    return len(hits) * block_size


def _explain_prefix(case: Case, expected: Any, actual: Any) -> str | None:
    if not isinstance(actual, int):
        return "return a number of tokens (an int), a multiple of block_size"
    return "hits are whole blocks: the answer is a multiple of block_size" if actual % case.args[3] else None


def _prefix_with(block_hashes: list[bytes], cached: set[bytes], num_tokens: int, block_size: int, *,
                 last_token_rule: bool = True, stop_at_miss: bool = True) -> int:
    """longest_cached_prefix with one rule dropped: at most num_tokens - 1 tokens, or stop at the first miss."""
    limit = (num_tokens - 1) // block_size if last_token_rule else len(block_hashes)
    hits = [h in cached for h in block_hashes[:limit]]
    return (hits + [False]).index(False) * block_size if stop_at_miss else sum(hits) * block_size


PREFIX_MISTAKES = (
    Mistake(lambda *args: _prefix_with(*args, last_token_rule=False),
            "at most num_tokens - 1 tokens may hit: the last token must be computed to get the next token's logits, "
            "so a fully cached prompt recomputes its last block"),
    Mistake(lambda *args: _prefix_with(*args, stop_at_miss=False),
            "stop at the first miss: after it, no later block can be cached with this request's prefix"),
)


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
    shown=plain.longest_cached_prefix,
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
    mistakes=PREFIX_MISTAKES,
    hints=[
        "Count blocks from the start while their hash is in `cached`, and stop at the first one that is not: a "
        "later block cannot be reused without the ones before it.",
        "The last token must be computed to get the next token's logits, so at most num_tokens - 1 tokens may "
        "hit. How many whole blocks fit in num_tokens - 1 tokens?",
        "The answer is in tokens, and hits come in whole blocks.",
    ],
))


# ----------------------------------------------------------------- 04.chat_turn_hits (transfer)


def chat_turn_hits(cached_tokens: list[int], prompt: list[int], block_size: int) -> int:
    """Reference, run on kvlab's KVCacheManager: one request finishes, the next is looked up."""
    manager = KVCacheManager(cdiv(len(cached_tokens), block_size) + cdiv(len(prompt), block_size) + 1, block_size,
                             hash_seed="04")
    earlier = Request("earlier turn", cached_tokens)
    admit(manager, earlier)
    manager.free(earlier)  # it finished: its full blocks keep their hashes in the free queue
    return admit(manager, Request("next turn", prompt))


def _explain_chat(case: Case, expected: Any, actual: Any) -> str | None:
    if type(actual) is not int:
        return "return a number of tokens (an int)"
    return "hits come in whole blocks: the answer is a multiple of block_size" if actual % case.args[2] else None


def _chat_with(cached: list[int], prompt: list[int], block_size: int, *, by_token: bool = False,
               last_token_rule: bool = True, partial_cached: bool = False, stop_at_difference: bool = True) -> int:
    """chat_turn_hits with one rule taken the wrong way: tokens compared one by one, the prompt's last token allowed
    to hit, the earlier request's partial block taken as cached, or blocks past a difference counted."""
    limit = len(prompt) - 1 if last_token_rule else len(prompt)
    if by_token:
        common = next((i for i, (a, b) in enumerate(zip(cached, prompt, strict=False)) if a != b),
                      min(len(cached), len(prompt)))
        return min(common, limit)
    blocks = min(-(-len(cached) // block_size) if partial_cached else len(cached) // block_size, limit // block_size)
    same = [cached[i * block_size:(i + 1) * block_size] == prompt[i * block_size:i * block_size + len(
        cached[i * block_size:(i + 1) * block_size])] for i in range(blocks)]  # a partial block: its tokens only
    return (same + [False]).index(False) * block_size if stop_at_difference else sum(same) * block_size


_PARTIAL_MATCH = ("a block that matches only in part is not a hit: compare whole blocks, and stop at the first that "
                  "differs")
CHAT_MISTAKES = (
    Mistake(lambda *args: _chat_with(*args, by_token=True), _PARTIAL_MATCH),
    Mistake(lambda *args: _chat_with(*args, by_token=True, last_token_rule=False), _PARTIAL_MATCH),
    Mistake(lambda *args: _chat_with(*args, last_token_rule=False),
            "at most len(prompt) - 1 tokens may hit: the last token must be computed to sample the next one, so a "
            "prompt that is all cached recomputes its last block"),
    Mistake(lambda *args: _chat_with(*args, partial_cached=True),
            "only the earlier request's *full* blocks were cached: its last, partly filled block never got a hash"),
    Mistake(lambda *args: _chat_with(*args, stop_at_difference=False),
            "stop at the first block whose tokens differ: every later hash chains through it"),
)


def _random_chat_case(rng: random.Random) -> Case:
    block_size = rng.choice([4, 8, 16])
    cached = [rng.randrange(100) for _ in range(rng.randint(1, 8 * block_size))]
    prompt = cached[:rng.randint(0, len(cached))] + [rng.randrange(100) for _ in range(rng.randint(0, 3 * block_size))]
    if rng.random() < 0.3 and prompt:
        prompt[rng.randrange(len(prompt))] = 999                  # an edit somewhere in the history
    return Case((cached, prompt or [1], block_size), probes="a random earlier turn and next prompt")


_TURN_1 = list(range(100, 140)) + list(range(500, 521))             # a 40-token prompt and its 21-token reply
_QUESTION = list(range(900, 930))

register(Exercise(
    id="04.chat_turn_hits",
    title="prefix hits of a chat's next turn",
    task=(
        "A chat service sends every turn as one prompt: the conversation so far, then the new message. The previous "
        "request finished holding `cached_tokens` (its prompt and its reply), and its full blocks are still in the "
        "prefix cache. Return how many tokens of `prompt`, the next request, hit the cache, with `block_size` "
        "tokens per block and the rules of this notebook. Nothing else is cached. The cases include what goes wrong "
        "in practice: a template that puts the date first, an edited history, a re-tokenized reply."
    ),
    signature="def chat_turn_hits(cached_tokens: list[int], prompt: list[int], block_size: int) -> int:",
    reference=chat_turn_hits,
    shown=plain.chat_turn_hits,
    edge_cases=[
        Case((_TURN_1, _TURN_1 + _QUESTION, 16),
             probes="turn 2 repeats turn 1 and its reply: turn 1's three full blocks hit, its partial block does not"),
        Case((_TURN_1, [7] + _TURN_1[1:] + _QUESTION, 16), probes="a template that changes the first token: nothing"),
        Case((_TURN_1, _TURN_1[:20] + [999] + _TURN_1[21:] + _QUESTION, 16),
             probes="an edit at token 20: only the block before it hits"),
        Case((_TURN_1[:48], _TURN_1[:48], 16),
             probes="the same 48 tokens again: the last token is computed, so the last block is recomputed"),
        Case((_TURN_1, _TURN_1[:40] + [520, 519] + _QUESTION, 16),
             probes="the reply tokenized differently the second time: the hits stop inside the reply"),
        Case((_TURN_1, _TURN_1 + _QUESTION, 4), probes="block size 4: more, smaller blocks hit"),
        Case(([1, 2, 3], [1, 2, 3, 4, 5], 4), probes="an earlier request shorter than one block cached nothing"),
    ],
    random_case=_random_chat_case,
    explain=_explain_chat,
    mistakes=CHAT_MISTAKES,
    transfer=True,
    hints=[
        "A block of the new prompt can hit only if the earlier request had the same tokens in the same block, and "
        "in every block before it (the hashes are chained).",
        "The earlier request cached only its full blocks; the new request may hit at most len(prompt) - 1 tokens.",
        "Compare block by block from the start and stop at the first block that differs, is not full in the earlier "
        "request, or would reach the new prompt's last token.",
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


def _rotation_question() -> dict[str, Any]:
    prompts = {name: [base + i for i in range(640)] for name, base in (("A", 0), ("B", 10_000), ("C", 20_000))}
    out: dict[str, Any] = {}
    for usable in (81, 100, 130):
        manager = KVCacheManager(usable + 1, 16, hash_seed="quiz")
        hits = []
        for k in range(12):
            request = Request(f"r{k}", prompts["ABC"[k % 3]] + [50_000 + 16 * k + i for i in range(16)])
            hits.append(admit(manager, request))
            manager.free(request)
        out[usable] = hits[3:]  # after each prompt was seen once
    return {"hits_81": out[81], "hits_100": out[100], "hits_130": out[130], "request_blocks": (640 + 16) // 16}


ask(
    "04.q5",
    ("Three system prompts of 640 tokens take turns, A, B, C, A, B, C, ..., each request adding 16 tokens of its "
     "own (41 blocks of 16 per request); each request finishes before the next arrives. The pool has 100 usable "
     "blocks, too few to keep all three. Does LRU eviction thrash to zero hits? And with 81 or 130 blocks?"),
    _rotation_question,
    lambda v: (
        f"No: with 100 blocks every request after the first round still hits {v['hits_100'][0]} tokens "
        f"({v['hits_100'][0] // 16} blocks). KVCacheManager frees a request's blocks tail first, so the pool evicts "
        "each prompt's *end* first and keeps its start, which is the part a later prefix hit needs. With 130 blocks "
        f"every prompt stays whole ({v['hits_130'][0]} tokens hit); with 81, fewer than two requests' "
        f"{2 * v['request_blocks']} blocks, each request evicts what the next one needs and nothing hits "
        f"({v['hits_81'][0]})."
    ),
    transfer=True,
)
