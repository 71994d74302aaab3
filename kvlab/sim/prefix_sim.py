"""Workloads run through the KV cache manager by a first-come-first-served loop: hit rates and evictions.

Pure and seeded: the same arguments give the same numbers. Two workloads, with token ids
drawn at random (the content does not matter to the cache, only which prefixes repeat):

* ``chat_workload``: conversations whose every turn re-sends the whole history, so turn *k*
  can hit the blocks of turn *k - 1*, replies included;
* ``shared_prompt_workload``: one-shot questions behind a few long system prompts.

The loop (``simulate``) is deliberately simple. Up to ``max_num_seqs`` requests run at once;
the head of the queue is admitted when ``allocate_slots`` succeeds (first come, first served,
so a request that does not fit blocks those behind it); a prompt is prefilled in one step,
then each step decodes one token per request. Each request reserves its output's slots at
admission through ``num_lookahead_tokens``, so nothing is ever preempted. Notebook 06's
scheduler does without that reservation: chunked prefill, a token budget and preemption.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque

from kvlab._validate import MAX_OBJECTS, checked, positive_int
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request, RequestStatus
from kvlab.errors import KvlabValueError
from kvlab.units import cdiv

VOCAB_SIZE = 32_000


@checked
@dataclasses.dataclass(frozen=True)
class SimRequest:
    """A request of a workload: its prompt, the tokens the model will produce, and what it waits for."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    after: str | None = None  # admitted only once this request has finished (the previous turn)

    @property
    def num_slots(self) -> int:
        """Tokens whose KV the request writes: the prompt and every output token but the last."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - 1


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB_SIZE) for _ in range(n))


@checked(at_most=dict.fromkeys(("num_conversations", "num_turns", "system_len", "user_len", "reply_len"), MAX_OBJECTS))
def chat_workload(
    num_conversations: int = 6,
    num_turns: int = 4,
    system_len: int = 256,
    user_len: int = 32,
    reply_len: int = 48,
    seed: int = 0,
) -> list[SimRequest]:
    """Conversations sharing one system prompt; each turn re-sends the history plus a new user message.

    Requests arrive turn by turn across conversations (every first turn, then every second
    turn...), so a conversation's earlier blocks must survive the other conversations'
    traffic to be hit.
    """
    for name, value in (("num_conversations", num_conversations), ("num_turns", num_turns),
                        ("system_len", system_len), ("user_len", user_len), ("reply_len", reply_len)):
        positive_int(name, value)
    rng = random.Random(seed)
    system = _tokens(rng, system_len)
    turns: list[list[SimRequest]] = [[] for _ in range(num_turns)]
    for c in range(num_conversations):
        history, previous = system, None
        for t in range(num_turns):
            prompt = history + _tokens(rng, user_len)
            reply = _tokens(rng, reply_len)
            request = SimRequest(f"chat{c}-turn{t}", prompt, reply, after=previous)
            turns[t].append(request)
            history, previous = prompt + reply, request.request_id
    return [r for turn in turns for r in turn]


@checked(at_most=dict.fromkeys(
    ("num_requests", "num_system_prompts", "system_len", "question_len", "reply_len"), MAX_OBJECTS))
def shared_prompt_workload(
    num_requests: int = 36,
    num_system_prompts: int = 3,
    system_len: int = 512,
    question_len: int = 32,
    reply_len: int = 16,
    seed: int = 0,
) -> list[SimRequest]:
    """One-shot questions, each behind one of a few long system prompts chosen at random."""
    for name, value in (("num_requests", num_requests), ("num_system_prompts", num_system_prompts),
                        ("system_len", system_len), ("question_len", question_len), ("reply_len", reply_len)):
        positive_int(name, value)
    rng = random.Random(seed)
    systems = [_tokens(rng, system_len) for _ in range(num_system_prompts)]
    return [
        SimRequest(f"q{i}", rng.choice(systems) + _tokens(rng, question_len), _tokens(rng, reply_len))
        for i in range(num_requests)
    ]


WORKLOADS = {"multi-turn chat": chat_workload, "shared system prompt": shared_prompt_workload}


@checked
def admit(manager: KVCacheManager, request: Request, num_lookahead_tokens: int = 0) -> int | None:
    """Admit a waiting request whole, as a scheduler with no token budget would; return its hit tokens.

    Looks up the cached prefix, allocates slots for the rest of the prompt (plus
    ``num_lookahead_tokens`` reserved), and marks every token computed and the request
    running. Returns None, with nothing changed, when the pool cannot take it.
    """
    hits, num_hits, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits, num_lookahead_tokens)
    if new is None:
        return None
    request.num_computed_tokens, request.status = request.num_tokens, RequestStatus.RUNNING
    return num_hits


@checked
def min_num_blocks(requests: list[SimRequest], block_size: int, reserve_null_block: bool = True) -> int:
    """The smallest pool in which the largest request fits on its own (null block included)."""
    block_size = positive_int("block_size", block_size)
    _check_workload(requests)
    return max(cdiv(r.num_slots, block_size) for r in requests) + (1 if reserve_null_block else 0)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What a run measured. Tokens are prompt tokens; a hit is a prompt token not prefilled."""

    num_blocks: int
    block_size: int
    enable_caching: bool
    prompt_tokens: tuple[int, ...]  # per request, in admission order
    hit_tokens: tuple[int, ...]
    hit_rate: float  # hits / queries, as vLLM counts them
    num_evicted_blocks: int
    num_blocks_evicted_before_reuse: int
    num_steps: int

    @property
    def prefill_tokens_saved(self) -> int:
        return sum(self.hit_tokens)

    @property
    def prefill_tokens_computed(self) -> int:
        return sum(self.prompt_tokens) - sum(self.hit_tokens)


@checked(at_most={"num_blocks": MAX_OBJECTS})
def simulate(
    requests: list[SimRequest],
    num_blocks: int,
    block_size: int = 16,
    max_num_seqs: int = 4,
    hash_fn: str = "sha256",
    enable_caching: bool = True,
) -> SimResult:
    """Run ``requests`` first come, first served through a ``KVCacheManager`` of ``num_blocks`` blocks.

    Why a loop beside ``kvlab.core.sched.scheduler.Scheduler``: notebook 04 teaches the prefix
    cache before the scheduler (notebook 06), so its hit rates come from the manager alone,
    with whole-prompt admission and reserved outputs, so that no preemption or token budget
    moves a hit rate and every number is the manager's. Notebook 07 runs chat on the real
    scheduler (``kvlab.sim.serving_sim``).
    """
    num_blocks, block_size = positive_int("num_blocks", num_blocks), positive_int("block_size", block_size)
    max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
    _check_workload(requests)
    needed = min_num_blocks(requests, block_size)
    if num_blocks < needed:
        raise KvlabValueError(
            f"num_blocks={num_blocks} is too small: the largest request needs {needed} blocks (null block included)"
        )
    manager = KVCacheManager(num_blocks, block_size, enable_caching, hash_fn, hash_seed="kvlab")
    waiting = deque(requests)
    running: list[tuple[SimRequest, Request]] = []
    finished: set[str] = set()
    prompt_tokens: list[int] = []
    hit_tokens: list[int] = []
    steps = 0
    while waiting or running:
        steps += 1
        while waiting and len(running) < max_num_seqs and (waiting[0].after is None or waiting[0].after in finished):
            spec = waiting[0]
            request = Request(spec.request_id, spec.prompt_token_ids)
            num_hits = admit(manager, request, num_lookahead_tokens=len(spec.output_token_ids) - 1)
            if num_hits is None:
                break
            waiting.popleft()
            prompt_tokens.append(request.num_tokens)
            hit_tokens.append(num_hits)
            running.append((spec, request))
        if not running:
            raise KvlabValueError(f"request {waiting[0].request_id!r} waits for one that never runs")
        running = _decode_step(manager, running, finished)
    return SimResult(
        num_blocks=num_blocks, block_size=block_size, enable_caching=enable_caching,
        prompt_tokens=tuple(prompt_tokens), hit_tokens=tuple(hit_tokens),
        hit_rate=manager.prefix_cache_stats.hit_rate,
        num_evicted_blocks=manager.num_evicted_blocks,
        num_blocks_evicted_before_reuse=manager.num_blocks_evicted_before_reuse,
        num_steps=steps,
    )


def _decode_step(manager: KVCacheManager, running: list[tuple[SimRequest, Request]],
                 finished: set[str]) -> list[tuple[SimRequest, Request]]:
    """One token for every running request; those that produced their last one leave. Returns the rest."""
    still_running = []
    for spec, request in running:
        if request.num_computed_tokens < request.num_tokens:  # compute the token sampled last step
            manager.allocate_slots(request, 1)
            request.num_computed_tokens += 1
        request.append_output_token_ids(spec.output_token_ids[request.num_output_tokens])
        if request.num_output_tokens == len(spec.output_token_ids):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            manager.free(request)
            finished.add(spec.request_id)
        else:
            still_running.append((spec, request))
    return still_running


@checked
def sweep_pool_sizes(requests: list[SimRequest], pool_sizes: list[int], **kwargs: object) -> list[SimResult]:
    """``simulate`` once per pool size (same workload, same settings)."""
    smallest = min_num_blocks(requests, int(kwargs.get("block_size", 16)))  # type: ignore[call-overload]
    for i, n in enumerate(pool_sizes):
        if n < smallest:
            raise KvlabValueError(f"pool_sizes[{i}]={n} is too small: the largest request needs {smallest} blocks "
                                  "(null block included)")
    return [simulate(requests, n, **kwargs) for n in pool_sizes]  # type: ignore[arg-type]


def _check_workload(requests: list[SimRequest]) -> None:
    if not requests:
        raise KvlabValueError("requests must hold at least one SimRequest")
    seen: set[str] = set()
    for r in requests:
        if not isinstance(r, SimRequest):
            raise KvlabValueError(f"requests must hold SimRequest items, got {type(r).__name__}")
        if r.request_id in seen:
            raise KvlabValueError(f"request ids must be unique; {r.request_id!r} repeats")
        if r.after is not None and r.after not in seen:
            raise KvlabValueError(f"request {r.request_id!r} waits for {r.after!r}, which does not come before it")
        if not r.output_token_ids:
            raise KvlabValueError(f"request {r.request_id!r} must produce at least one output token")
        seen.add(r.request_id)
