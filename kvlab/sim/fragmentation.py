"""Contiguous reservation against paging, measured: a continuous-batching simulation of a KV pool.

Before PagedAttention, serving systems reserved one contiguous stretch of KV memory per
request, sized before the request's output length was known. ``simulate`` serves a list of
``(prompt_len, output_len)`` requests from a pool of ``pool_tokens`` token slots under one
of four policies and reports where the pool's slots went, as the PagedAttention paper's
Fig. 2 does (Kwon et al., SOSP 2023):

* ``"max"``: reserve ``max_model_len`` slots per request;
* ``"pow2"``: reserve the final length rounded up to a power of two (at most ``max_model_len``);
* ``"oracle"``: reserve exactly the final length (the output length known in advance);
* ``"paged"``: blocks of ``block_size`` slots, taken one at a time as tokens arrive.

The three contiguous policies place each reservation first-fit in one address space of
``pool_tokens`` slots and free it when the request leaves, so holes appear and external
fragmentation is real, not estimated.

One step of the simulation, as vLLM V1's scheduler orders it (``sched/scheduler.py``):

1. **Grow.** Every running request admitted in an earlier step stores one more token. Under
   ``"paged"`` a request that crosses a block boundary needs a new block; when none is
   free, the newest running request is preempted (``self.running.pop()``): it frees all
   its blocks and goes back to the front of the queue, keeping the tokens it generated,
   which it recomputes when it is admitted again.
2. **Admit.** Unless something was preempted in this step, queued requests are admitted in
   order (FCFS) while the first one fits: its contiguous reservation in one hole, or, paged,
   ``ceil(tokens / block_size)`` free blocks for the tokens it must prefill. The first one
   that does not fit blocks those behind it, as in vLLM.
3. **Measure.** If a request is still waiting, the step counts toward the averages.
4. **Finish.** Requests holding ``prompt_len + output_len`` tokens leave and free their memory.

Simplifications: a prefill takes one step whatever its length; a request ends holding
``prompt_len + output_len`` tokens (vLLM never stores the KV of the last generated token,
one slot less); all requests are queued at step 0 (a saturated server); the null block is
not modelled.

**Why a loop of its own, beside the scheduler.** ``kvlab.core.sched.scheduler.Scheduler`` runs
the real ``KVCacheManager`` and only knows paging; notebook 02 needs the contiguous policies
the paper measured against, reservations placed first-fit in one address space, and 10,000
requests in well under a second. So this is a small model of the same loop (vLLM's
admission order and ``running.pop()`` preemption), not a second scheduler.
``simulate(..., step_by_step=True)`` walks every step exactly as the rules above read, and is
the reference; by default it gets the same numbers event by event (``kvlab.sim.fragmentation_fast``),
and ``tests/test_fragmentation.py`` holds the two together.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np

from kvlab._validate import checked, one_of, positive_int
from kvlab.errors import KvlabValueError
from kvlab.sim.fragmentation_fast import SlotSteps, run_fast
from kvlab.sim.workloads import validate_requests
from kvlab.units import cdiv

POLICIES = ("max", "pow2", "oracle", "paged")
CATEGORIES = ("used", "reserved", "internal", "external", "free")


@dataclasses.dataclass(frozen=True)
class FragmentationResult:
    """Where the pool's slots went, averaged over the steps in which a request was waiting.

    Those are the steps in which the pool is the bottleneck; a run in which no request ever
    waited is averaged over all its steps instead.

    ``breakdown`` holds shares of ``pool_tokens`` that sum to 1:

    * ``used``: slots holding a token's KV (``utilization`` is this share);
    * ``reserved``: slots allocated to a request that its own future tokens will fill;
    * ``internal``: slots allocated to a request that it will never fill (a reservation
      beyond its final length, or the unused tail of its last block);
    * ``external``: free slots while the first waiting request's reservation would fit in
      the free total, but no hole is large enough (contiguous policies only);
    * ``free``: all other free slots (the queue head needs more than is free in total, or,
      paged, the slots of free blocks and the sub-block remainder of the pool).
    """

    policy: str
    pool_tokens: int
    max_model_len: int
    block_size: int | None
    num_requests: int
    utilization: float
    breakdown: Mapping[str, float]
    max_running: int
    mean_running: float  # time-averaged batch size over the measured steps
    num_steps: int  # steps until the last request left: fewer means more throughput
    measured_steps: int
    num_preemptions: int
    recomputed_tokens: int  # tokens prefilled again after a preemption (paged only): the work preemption throws away


@checked
def reservation(final_len: np.ndarray | int, policy: str, max_model_len: int) -> np.ndarray:
    """Slots a contiguous policy reserves for requests that end with ``final_len`` tokens."""
    final = np.asarray(final_len, dtype=np.int64)
    if policy == "max":
        return np.full_like(final, max_model_len)
    if policy == "pow2":
        pow2 = np.left_shift(1, np.ceil(np.log2(final)).astype(np.int64))
        pow2 = np.where(pow2 < final, pow2 * 2, pow2)  # guard against log2 rounding down
        return np.minimum(pow2, max_model_len)
    if policy == "oracle":
        return final.copy()
    raise KvlabValueError(f"policy={policy!r} reserves no contiguous memory; choose max, pow2 or oracle")


# --------------------------------------------------------------------------- the reference: every step


@dataclasses.dataclass(eq=False)
class _Running:
    """A request in the pool: which one, the tokens it holds, and its blocks (paged) or its reservation."""

    i: int
    tokens: int
    final: int
    admitted: int
    blocks: int = 0
    start: int = 0
    alloc: int = 0


class _StepByStep:
    """The module's four steps, applied to every running request at every step: slow, and the specification."""

    def __init__(self, req: np.ndarray, order: np.ndarray, pool_tokens: int, reserve: np.ndarray | None,
                 block_size: int) -> None:
        self.req, self.pool, self.reserve, self.bs = req, pool_tokens, reserve, block_size
        self.paged = reserve is None
        self.num_blocks = pool_tokens // block_size
        self.waiting = deque(int(i) for i in order)
        self.to_prefill = {i: int(req[i, 0]) for i in range(len(req))}  # tokens held at (re-)admission
        self.running: list[_Running] = []  # admission order, newest last
        self.preemptions = self.recomputed = self.max_running = 0
        self.counts = {"waiting": dict.fromkeys((*CATEGORIES, "steps", "running"), 0),
                       "all": dict.fromkeys((*CATEGORIES, "steps", "running"), 0)}

    def held(self, r: _Running) -> int:
        return r.blocks * self.bs if self.paged else r.alloc

    def grow(self, t: int) -> bool:
        """1. Each request admitted before ``t`` stores a token, oldest first; paged, a full block needs a new one."""
        preempted = False
        for r in list(self.running):
            if r not in self.running or r.admitted == t:
                continue
            if self.paged and r.tokens % self.bs == 0:
                while self.num_blocks == sum(x.blocks for x in self.running):
                    victim = self.running.pop()  # the newest, as vLLM's self.running.pop()
                    self.to_prefill[victim.i] = victim.tokens
                    self.recomputed += victim.tokens
                    self.waiting.appendleft(victim.i)
                    self.preemptions += 1
                    preempted = True
                    if victim is r:
                        break
                if r not in self.running:
                    continue
                r.blocks += 1
            r.tokens += 1
        return preempted

    def admit(self, t: int) -> None:
        """2. Admit from the head of the queue while it fits: its prompt's blocks, or one hole for its reservation."""
        while self.waiting:
            i = self.waiting[0]
            tokens, final = self.to_prefill[i], int(self.req[i].sum())
            if self.paged:
                blocks = cdiv(tokens, self.bs)
                if blocks > self.num_blocks - sum(x.blocks for x in self.running):
                    return
                r = _Running(i, tokens, final, t, blocks=blocks)
            else:
                need = int(self.reserve[i])
                taken = sorted((x.start, x.alloc) for x in self.running)
                starts = [0] + [s + a for s, a in taken]  # the lowest start where it fits: first fit
                start = next((s for s in starts if s + need <= self.pool
                              and all(s + need <= s2 or s >= s2 + a2 for s2, a2 in taken)), None)
                if start is None:
                    return
                r = _Running(i, tokens, final, t, start=start, alloc=need)
            self.running.append(r)
            self.waiting.popleft()

    def measure(self) -> None:
        """3. Count every slot's state, for the waiting steps and for the whole run."""
        free = self.pool - sum(self.held(r) for r in self.running)
        head_fits_total = not self.paged and bool(self.waiting) and free >= self.reserve[self.waiting[0]]
        for key in ("waiting", "all") if self.waiting else ("all",):
            c = self.counts[key]
            c["steps"] += 1
            c["running"] += len(self.running)
            for r in self.running:
                filled = min(self.held(r), r.final)
                c["used"] += r.tokens
                c["reserved"] += filled - r.tokens
                c["internal"] += self.held(r) - filled
            c["external" if head_fits_total and key == "waiting" else "free"] += free

    def run(self) -> SlotSteps:
        t = 0
        while self.waiting or self.running:
            if not self.grow(t):
                self.admit(t)
            self.max_running = max(self.max_running, len(self.running))
            self.measure()
            self.running = [r for r in self.running if r.tokens < r.final]  # 4. finish
            t += 1
        c = self.counts["waiting"] if self.counts["waiting"]["steps"] else self.counts["all"]
        return SlotSteps(c["used"], c["reserved"], c["internal"], c["external"], c["free"], c["steps"], c["running"],
                         self.max_running, t, self.preemptions, self.recomputed)


# --------------------------------------------------------------------------- the public functions


def _prepared(requests: Sequence[Sequence[int]] | np.ndarray, pool_tokens: int, max_model_len: int, policy: str,
              block_size: int, seed: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The checked requests, their queue order and the contiguous reservations (None when paged), or a named error."""
    req = validate_requests(requests)
    policy = one_of("policy", policy, POLICIES)
    pool_tokens = positive_int("pool_tokens", pool_tokens)
    max_model_len = positive_int("max_model_len", max_model_len)
    block_size = positive_int("block_size", block_size)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise KvlabValueError(f"seed must be a non-negative integer or None, got {seed!r}")
    final = req.sum(axis=1)
    too_long = np.flatnonzero(final > max_model_len)
    if too_long.size:
        i = int(too_long[0])
        raise KvlabValueError(
            f"requests[{i}] = {tuple(int(x) for x in req[i])} ends with {int(final[i])} tokens, more than "
            f"max_model_len={max_model_len}"
        )
    paged = policy == "paged"
    smallest_pool = cdiv(max_model_len, block_size) * block_size if paged else max_model_len
    if pool_tokens < smallest_pool:
        raise KvlabValueError(
            f"pool_tokens={pool_tokens} cannot hold one request of max_model_len={max_model_len} tokens"
            + (f" in blocks of {block_size} (block_size)" if paged else "") + f"; it must be at least {smallest_pool}"
        )
    order = np.arange(len(req)) if seed is None else np.random.default_rng(int(seed)).permutation(len(req))
    return req, order, None if paged else reservation(final, policy, max_model_len)


def _result(policy: str, pool_tokens: int, max_model_len: int, block_size: int, num_requests: int,
            counts: SlotSteps) -> FragmentationResult:
    total = pool_tokens * counts.measured_steps
    breakdown = {k: getattr(counts, k) / total for k in CATEGORIES}
    return FragmentationResult(
        policy=policy, pool_tokens=pool_tokens, max_model_len=max_model_len,
        block_size=block_size if policy == "paged" else None, num_requests=num_requests,
        utilization=breakdown["used"], breakdown=breakdown, max_running=counts.max_running,
        mean_running=counts.running_steps / counts.measured_steps, num_steps=counts.num_steps,
        measured_steps=counts.measured_steps, num_preemptions=counts.num_preemptions,
        recomputed_tokens=counts.recomputed_tokens,
    )


@checked
def simulate(
    requests: Sequence[Sequence[int]] | np.ndarray,
    *,
    pool_tokens: int,
    max_model_len: int,
    policy: str,
    block_size: int = 16,
    seed: int | None = 0,
    step_by_step: bool = False,
) -> FragmentationResult:
    """Serve ``requests`` (``(prompt_len, output_len)`` pairs) from a pool of ``pool_tokens`` slots.

    ``policy`` is "max", "pow2", "oracle" or "paged" (see the module docstring for the step
    rules). Requests queue in the order ``seed`` shuffles them to (``seed=None`` keeps the
    given order). Raises ``KvlabValueError`` for a request longer than ``max_model_len`` or a
    pool too small to serve a request of ``max_model_len`` tokens on its own. Runs event by
    event (``kvlab.sim.fragmentation_fast``); ``step_by_step=True`` walks every step and every
    request as the rules read instead: the reference, slow (steps times running requests), for
    small workloads and for reading, with the same result.
    """
    req, order, reserve = _prepared(requests, pool_tokens, max_model_len, policy, block_size, seed)
    engine = _StepByStep(req, order, pool_tokens, reserve, block_size).run if step_by_step else \
        lambda: run_fast(req, order, pool_tokens, reserve, block_size)
    return _result(policy, pool_tokens, max_model_len, block_size, len(req), engine())
