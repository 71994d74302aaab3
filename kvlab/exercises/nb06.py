"""Notebook 06's exercises (who is preempted, and what a preemption costs) and self-test."""

from __future__ import annotations

import random
from typing import Any

from kvlab.core.cache_stats import interpret_hit_rate
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request
from kvlab.core.sched.loop import NoComputeExecutor, run_until_done, step
from kvlab.core.sched.output import GenerationRequest, SamplingParams
from kvlab.core.sched.scheduler import Scheduler
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.units import cdiv

# ----------------------------------------------------------------- 06.preemption_victim


def preemption_victims(running: list[str], blocks_held: dict[str, int], request_id: str, blocks_needed: int,
                       free_blocks: int) -> list[str]:
    """Reference: vLLM's loop: pop the most recently admitted running request until the need is met."""
    running = list(running)
    victims: list[str] = []
    while free_blocks < blocks_needed:
        victim = running.pop()  # the end of the running queue: the most recently admitted
        victims.append(victim)
        free_blocks += blocks_held[victim]
        if victim == request_id:
            break  # nothing left to give: the request itself waits for recompute
    return victims


def _explain_victims(case: Case, expected: Any, actual: Any) -> str | None:
    if type(actual) not in (list, tuple):
        return "return the list of preempted request ids, in the order they are preempted"
    return None


def _victims_with(running: list[str], blocks_held: dict[str, int], request_id: str, blocks_needed: int,
                  free_blocks: int, *, oldest_first: bool = False, spare_itself: bool = False,
                  stop_at_itself: bool = True) -> list[str]:
    """preemption_victims with one rule taken the wrong way: the oldest request first, the request itself spared,
    or the loop going on past the request itself."""
    queue = [r for r in running if r != request_id] if spare_itself else list(running)
    victims: list[str] = []
    while free_blocks < blocks_needed and queue:
        victim = queue.pop(0 if oldest_first else -1)
        victims.append(victim)
        free_blocks += blocks_held[victim]
        if victim == request_id and stop_at_itself:
            break
    return victims


VICTIM_MISTAKES = (
    Mistake(lambda *args: _victims_with(*args, oldest_first=True),
            "preempt from the end of running (the most recently admitted), not the oldest request"),
    Mistake(lambda *args: _victims_with(*args, spare_itself=True),
            "when the request that needs blocks is itself the most recently admitted, it is the victim: vLLM "
            "preempts it and stops"),
    Mistake(lambda *args: _victims_with(*args, stop_at_itself=False),
            "once the request itself is preempted, stop: it gives back its blocks and waits, nothing is left to do"),
)


def _random_victims_case(rng: random.Random) -> Case:
    running = [f"r{i}" for i in range(rng.randint(1, 6))]
    held = {r: rng.randint(1, 4) for r in running}
    return Case((running, held, rng.choice(running), rng.randint(1, 4), rng.randint(0, 2)),
                probes="a random running queue")


register(Exercise(
    id="06.preemption_victim",
    title="choose the preemption victims",
    task=(
        "Running request `request_id` needs `blocks_needed` new blocks and only `free_blocks` are free. As vLLM "
        "V1's scheduler does, preempt the most recently admitted running request (the end of `running`, which is "
        "in admission order), count its `blocks_held[...]` as freed, and repeat until the need is met. If the "
        "request itself is preempted, stop: it will be recomputed later. Return the preempted ids in order "
        "(an empty list when nothing needs preempting)."
    ),
    signature=("def preemption_victims(running: list, blocks_held: dict, request_id: str, "
               "blocks_needed: int, free_blocks: int) -> list:"),
    reference=preemption_victims,
    edge_cases=[
        Case((["a", "b", "c"], {"a": 2, "b": 2, "c": 2}, "a", 1, 1),
             probes="enough blocks are free: nobody is preempted"),
        Case((["a", "b", "c"], {"a": 2, "b": 2, "c": 2}, "a", 1, 0),
             probes="one victim, the newest request, not the oldest"),
        Case((["a", "b", "c"], {"a": 3, "b": 1, "c": 1}, "a", 2, 0),
             probes="one small victim is not enough: keep preempting from the end"),
        Case((["a", "b"], {"a": 2, "b": 2}, "b", 1, 0),
             probes="the request needing blocks is the newest: it preempts itself and stops"),
        Case((["a", "b", "c"], {"a": 1, "b": 1, "c": 1}, "b", 3, 0),
             probes="the victims reach the request itself before enough is free"),
    ],
    random_case=_random_victims_case,
    explain=_explain_victims,
    mistakes=VICTIM_MISTAKES,
    hints=[
        "Work on a copy of `running`: the next victim is always the most recently admitted request still running, "
        "the last one.",
        "Keep going while the free blocks do not cover the need; each victim's blocks become free.",
        "One victim is special: the request that needs the blocks. Once it is preempted, nothing is left to do.",
    ],
))


# ----------------------------------------------------------------- 06.recompute_tokens


def recompute_tokens(num_tokens: int, block_size: int, enable_prefix_caching: bool, num_evicted_blocks: int = 0) -> int:
    """Reference, measured on kvlab's KVCacheManager: preempt a request, evict some of its blocks, look it up again."""
    num_blocks = cdiv(num_tokens, block_size)
    manager = KVCacheManager(num_blocks + 1, block_size, enable_caching=enable_prefix_caching, hash_seed="06")
    tokens = list(range(1000, 1000 + num_tokens))
    victim = Request("victim", tokens)
    manager.allocate_slots(victim, num_tokens)
    manager.free(victim)  # the preemption: blocks back to the pool, tail first, full ones keep their hashes
    victim.num_computed_tokens = 0
    num_partial = num_blocks - num_tokens // block_size  # an uncached partial block is reused first
    evict = min(num_evicted_blocks, num_tokens // block_size)
    if evict:  # another request takes the partial block and then `evict` cached blocks from the queue's head
        manager.allocate_slots(Request("other", [7] * ((num_partial + evict) * block_size)),
                               (num_partial + evict) * block_size)
    _, num_hit_tokens, _ = manager.get_computed_blocks(victim)
    return num_tokens - num_hit_tokens


def _recompute_with(num_tokens: int, block_size: int, enable_prefix_caching: bool, num_evicted_blocks: int = 0, *,
                    caching: bool | None = None, last_token_rule: bool = True, evict_from_start: bool = False) -> int:
    """recompute_tokens with one rule taken the wrong way: the caching flag ignored (``caching``), every token
    allowed to hit, or the evictions taken from the request's first blocks."""
    if not (enable_prefix_caching if caching is None else caching):
        return num_tokens
    full = num_tokens // block_size
    surviving = 0 if evict_from_start and num_evicted_blocks else max(full - num_evicted_blocks, 0)
    hits = min(surviving, (num_tokens - 1) // block_size) if last_token_rule else surviving
    return num_tokens - hits * block_size


RECOMPUTE_MISTAKES = (
    Mistake(lambda *args: _recompute_with(*args, caching=True),
            "without prefix caching nothing survives a preemption: every token is recomputed"),
    Mistake(lambda *args: _recompute_with(*args, last_token_rule=False),
            "at most num_tokens - 1 tokens can hit: the last token must be computed to get its logits, and hits are "
            "whole blocks, so a block-aligned request recomputes its whole last block"),
    Mistake(lambda *args: _recompute_with(*args, evict_from_start=True),
            "a request's blocks are freed tail first, so its *last* full blocks are evicted first; the blocks at its "
            "start survive and still hit"),
)


def _random_recompute_case(rng: random.Random) -> Case:
    block_size = rng.choice([4, 8, 16])
    num_tokens = rng.randint(1, 12 * block_size)
    return Case((num_tokens, block_size, rng.random() < 0.8, rng.randint(0, 3)), probes="a random preempted request")


register(Exercise(
    id="06.recompute_tokens",
    title="tokens recomputed after a preemption",
    task=(
        "A request holding `num_tokens` tokens (prompt plus output so far) was preempted: its blocks went back "
        "to the pool and `num_computed_tokens` to 0. While it waited, `num_evicted_blocks` of its cached blocks "
        "were taken by other requests (a request's blocks are freed last block first, so its last full blocks "
        "are the first to go). When it is admitted again, how many tokens must the model compute before it can "
        "sample the next token? With prefix caching its surviving full blocks are hits; without it, nothing is."
    ),
    signature=("def recompute_tokens(num_tokens: int, block_size: int, enable_prefix_caching: bool, "
               "num_evicted_blocks: int = 0) -> int:"),
    reference=recompute_tokens,
    shown=plain.recompute_tokens,
    edge_cases=[
        Case((2050, 16, False), probes="no prefix caching: the whole request is recomputed"),
        Case((2050, 16, True), probes="2048 tokens sit in full blocks that kept their hashes: only 2 are recomputed"),
        Case((2048, 16, True), probes="block-aligned: the last token must be computed, so its whole block is"),
        Case((10, 16, True), probes="shorter than a block: nothing was ever cached"),
        Case((100, 16, True, 2), probes="two evicted blocks: the last two full blocks are gone, the first four hit"),
        Case((100, 16, True, 9), probes="more evictions than full blocks: every full block is gone"),
    ],
    random_case=_random_recompute_case,
    mistakes=RECOMPUTE_MISTAKES,
    hints=[
        "Without prefix caching nothing survives a preemption: every token is computed again.",
        "With it, only full blocks kept their hashes. The evictions take the request's *last* full blocks first "
        "(its blocks were freed tail first).",
        "Hits are whole blocks from the start and may cover at most num_tokens - 1 tokens: the last token is "
        "always computed, to sample the next one.",
    ],
))


# ----------------------------------------------------------------- 06.first_token_steps (transfer)


def first_token_steps(prompt_lens: list[int], max_tokens: int, max_num_batched_tokens: int) -> list[int]:
    """Reference, run on kvlab's Scheduler: the step (from 1) in which each request samples its first token."""
    num_blocks = sum(cdiv(p + max_tokens, 16) for p in prompt_lens) + 1       # room for everyone: no preemption
    scheduler = Scheduler(KVCacheManager(num_blocks, 16, enable_caching=False),
                          max_num_batched_tokens=max_num_batched_tokens)
    for i, length in enumerate(prompt_lens):
        scheduler.add_request(GenerationRequest(f"r{i}", [1000 * (i + 1) + t for t in range(length)],
                                                SamplingParams(max_tokens=max_tokens)))
    executor, first, number = NoComputeExecutor(), {}, 0
    while scheduler.has_unfinished_requests():
        number += 1
        for out in step(scheduler, executor)[1]:
            if out.new_token_ids:
                first.setdefault(out.request_id, number)
    return [first[f"r{i}"] for i in range(len(prompt_lens))]


def _steps_if(prompt_lens: list[int], max_tokens: int, budget: int, *, running_first: bool = True,
              decodes_cost: bool = True, first_at_start: bool = False) -> list[int]:
    """The same schedule worked by hand with one rule changed (the known mistakes): waiting requests served first,
    decodes taking none of the budget, or the first token counted in the step a prompt starts."""
    n = len(prompt_lens)
    computed, generated, first = [0] * n, [0] * n, [0] * n
    waiting, running, number = list(range(n)), [], 0
    while waiting or running:
        number, left, chosen = number + 1, budget, {}
        groups = (running, waiting) if running_first else (waiting, running)
        for group in groups:
            for r in list(group):
                need = prompt_lens[r] + generated[r] - computed[r]
                take = min(need, left) if (decodes_cost or need > 1 or r in waiting) else 1
                if take <= 0:
                    break
                chosen[r] = take
                left -= take if (decodes_cost or need > 1) else 0
                if r in waiting:
                    waiting.remove(r)
                    running.append(r)
                    first[r] = number if first_at_start else 0
        for r, take in chosen.items():
            computed[r] += take
            if computed[r] == prompt_lens[r] + generated[r]:
                generated[r] += 1
                first[r] = first[r] or number
                if generated[r] == max_tokens:
                    running.remove(r)
    return first


def _explain_first_token(case: Case, expected: Any, actual: Any) -> str | None:
    if not (type(actual) in (list, tuple) and all(type(x) is int for x in actual)):
        return "return a list of step numbers (ints, counting from 1), one per request, in the order given"
    return None


FIRST_TOKEN_MISTAKES = (
    Mistake(lambda *args: _steps_if(*args, decodes_cost=False),
            "a running request's decode token takes one token of the step's budget too: a new prompt gets only what "
            "the running requests leave"),
    Mistake(lambda *args: _steps_if(*args, running_first=False),
            "every step serves the RUNNING requests first (their decode token, or their prompt's next chunk), then "
            "admits WAITING ones in arrival order with what is left"),
    Mistake(lambda *args: _steps_if(*args, first_at_start=True),
            "a request samples its first token only in the step that computes its prompt's last token; a chunk that "
            "stops short samples nothing"),
)


def _random_first_token_case(rng: random.Random) -> Case:
    return Case(([rng.randint(1, 300) for _ in range(rng.randint(1, 5))], rng.randint(1, 10),
                 rng.choice([16, 32, 64, 128, 256])), probes="random prompts, output lengths and token budget")


register(Exercise(
    id="06.first_token_steps",
    title="when each request gets its first token, under a token budget",
    task=(
        "Requests with prompts of `prompt_lens` tokens arrive together, in that order, at an idle engine; each "
        "generates `max_tokens` tokens. The scheduler has a budget of `max_num_batched_tokens` tokens per step and "
        "works as section 4 showed (chunked prefill, vLLM V1's order, FCFS); the pool is large enough that nothing "
        "is preempted and no prefix is shared. Return, for each request, the step (counting from 1) in which it "
        "samples its first token."
    ),
    signature=("def first_token_steps(prompt_lens: list[int], max_tokens: int, max_num_batched_tokens: int) "
               "-> list[int]:"),
    reference=first_token_steps,
    shown=plain.first_token_steps,
    edge_cases=[
        Case(([100, 300, 50], 5, 128),
             probes="the 300-token prompt is cut into chunks; the short one behind it waits for its turn"),
        Case(([1000], 3, 256), probes="one prompt four times the budget: four chunks, the token after the last"),
        Case(([10] * 5, 20, 12), probes="five short prompts: each new one gets only what the running requests leave"),
        Case(([2048, 16], 1, 2048), probes="a prompt that fills the whole budget leaves nothing for the next one"),
        Case(([64, 64, 64], 8, 64), probes="decode tokens of the requests already running delay a prompt's last chunk"),
        Case(([500, 500], 100, 512), probes="the second prompt starts in the first step with 12 tokens"),
    ],
    random_case=_random_first_token_case,
    num_random=15,
    explain=_explain_first_token,
    mistakes=FIRST_TOKEN_MISTAKES,
    transfer=True,
    hints=[
        "Simulate step by step. In a step, which requests are served first, and how many tokens does each take?",
        "Running requests first: a decode takes 1 token, a prompt still being prefilled takes the rest of its prompt "
        "or whatever budget is left. Then waiting requests, in order, while budget is left, each taking what it can.",
        "A request samples a token in the step that computes the last token it has so far; from then on it decodes "
        "one token per step until it has max_tokens.",
    ],
))


# ----------------------------------------------------------------- self-test


def _fork_question() -> dict[str, Any]:
    """The source's n = 4 walk-through, run on the scheduler: 40-token prompt, block size 16."""
    scheduler = Scheduler(KVCacheManager(64, 16, hash_seed="06"))
    scheduler.add_request(GenerationRequest("E", list(range(40)), SamplingParams(max_tokens=32, n=4, temperature=1.0)))
    executor = NoComputeExecutor()
    step(scheduler, executor)
    manager = scheduler.kv_cache_manager
    tables = [manager.get_block_ids(r.request_id) for r in scheduler.running]
    shared_blocks = len({b for t in tables for b in t})
    out, _, _ = step(scheduler, executor)
    copies = out.blocks_to_copy
    run_until_done(scheduler, executor)
    return {"shared_blocks": shared_blocks, "unshared_blocks": 4 * cdiv(40, 16), "copies": len(copies),
            "copied_block_position": tables[0].index(copies[0][0]), "samples": len(tables)}


ask(
    "06.q1",
    ("Parallel sampling, n = 4, from a 40-token prompt with block size 16: how many KV blocks hold the prompt "
     "right after the fork, and how many block copies are made when each sample writes its first token?"),
    _fork_question,
    lambda v: (
        f"{v['shared_blocks']} blocks, shared by all {v['samples']} samples (instead of {v['unshared_blocks']} "
        f"for four private copies). The first two are full and stay shared to the end; the third holds 8 of 16 "
        f"slots, so the first write into it copies it: {v['copies']} copies, because the last sample to write "
        "finds the block no longer shared and writes in place."),
)


def _recompute_question() -> dict[str, Any]:
    return {"with_caching": recompute_tokens(2050, 16, True), "without": recompute_tokens(2050, 16, False)}


ask(
    "06.q2",
    ("A request with a 2,000-token prompt has generated 50 tokens when it is preempted (block size 16). "
     "How many tokens does it recompute when it returns, with and without prefix caching?"),
    _recompute_question,
    lambda v: (
        f"With prefix caching {v['with_caching']} (its 128 full blocks kept their hashes and hit, only the 2 "
        f"tokens of its partial block are recomputed); without it {v['without']:,}. That is why vLLM V1 preempts "
        "by recompute rather than swapping KV out: with the prefix cache, recompute is usually cheap."),
)


def _hit_rate_question() -> dict[str, Any]:
    scheduler = Scheduler(KVCacheManager(128, 16, hash_seed="06"))
    system = list(range(64))
    for i in range(10):
        scheduler.add_request(GenerationRequest(f"q{i}", system + [500 + i] * 8, SamplingParams(max_tokens=4)))
        run_until_done(scheduler)
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    return {"queries": stats.queries, "hits": stats.hits, "hit_rate": stats.hit_rate,
            "reading": interpret_hit_rate(stats.hit_rate, workload_shares_prefixes=True)}


ask(
    "06.q3",
    ("Ten requests, one after another, each a 64-token system prompt plus an 8-token question (block size 16). "
     "What do vllm:prefix_cache_queries and vllm:prefix_cache_hits count, and what hit rate do they give?"),
    _hit_rate_question,
    lambda v: (
        f"Both count tokens: {v['queries']} queried (72 per request), {v['hits']} hit (64 for each request after "
        f"the first), a hit rate of {v['hit_rate']:.0%}: {v['reading']}. A dashboard computes it as "
        "rate(vllm:prefix_cache_hits_total[5m]) / rate(vllm:prefix_cache_queries_total[5m])."),
)


def _aligned_question() -> dict[str, Any]:
    return {"no_eviction": recompute_tokens(2048, 16, True), "two_evicted": recompute_tokens(2048, 16, True, 2),
            "unaligned": recompute_tokens(2050, 16, True)}


ask(
    "06.q4",
    ("Question 2's request had 2,050 tokens. A request of exactly 2,048 tokens (block size 16) is preempted instead, "
     "and while it waits two of its cached blocks are evicted. How many tokens does it recompute, and how many "
     "would it have without the evictions?"),
    _aligned_question,
    lambda v: (
        f"{v['two_evicted']} tokens, and {v['no_eviction']} without the evictions (against {v['unaligned']} for "
        "2,050 tokens). All 128 blocks are full and hashed, but the last token must be computed again to sample the "
        "next one, and hits come in whole blocks: the whole last block is recomputed. Its blocks were freed tail "
        "first, so the evictions took its last two full blocks, one of which it recomputes anyway."
    ),
    transfer=True,
)
