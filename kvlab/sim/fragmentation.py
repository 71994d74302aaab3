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
not modelled. The simulation is event-driven: between admissions, finishes and preemptions
every request just grows by one token per step, so those steps are accounted in closed form.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np

from kvlab._validate import one_of, positive_int
from kvlab.errors import KvlabValueError
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


class _Trace:
    """Residencies (who held what, from which step to which) and the measured windows."""

    def __init__(self) -> None:
        self.start: list[int] = []
        self.end: list[int] = []
        self.tokens0: list[int] = []  # tokens held at the first step of the residency
        self.final: list[int] = []
        self.alloc: list[int] = []  # contiguous reservation (paged: 0, derived from tokens)
        self.windows: list[list[int]] = []  # measured steps [first, last], merged
        self.free_slots = 0  # contiguous: slot-steps free, queue head too big for the free total
        self.external_slots = 0

    def begin(self, step: int, tokens: int, final: int, alloc: int = 0) -> int:
        """Open a residency at ``step`` holding ``tokens``; its end is set when it finishes or is preempted."""
        self.start.append(step)
        self.end.append(-1)
        self.tokens0.append(tokens)
        self.final.append(final)
        self.alloc.append(alloc)
        return len(self.start) - 1

    def measure(self, first: int, last: int) -> None:
        """Count steps ``first..last`` toward the averages (adjacent ranges merge)."""
        if last < first:
            return
        if self.windows and self.windows[-1][1] + 1 >= first:
            self.windows[-1][1] = max(self.windows[-1][1], last)
        else:
            self.windows.append([first, last])


def _sum_ceil(n: np.ndarray, bs: int) -> np.ndarray:
    """sum_{x=1..n} ceil(x / bs), for n >= 0 (element-wise)."""
    q, r = np.divmod(n, bs)
    return bs * q * (q + 1) // 2 + r * (q + 1)


def _account(trace: _Trace, block_size: int | None) -> tuple[dict[str, int], int, int]:
    """Slot-steps used, reserved and internal over the measured windows; running-steps; measured steps."""
    start, end = np.asarray(trace.start, np.int64), np.asarray(trace.end, np.int64)
    tokens0, final = np.asarray(trace.tokens0, np.int64), np.asarray(trace.final, np.int64)
    alloc = np.asarray(trace.alloc, np.int64)
    sums = {"used": 0, "reserved": 0, "internal": 0}
    running_steps = 0
    for first, last in trace.windows:
        lo_step, hi_step = np.maximum(start, first), np.minimum(end, last)
        live = hi_step >= lo_step
        lo = tokens0[live] + lo_step[live] - start[live]  # tokens at the first measured step
        hi = tokens0[live] + hi_step[live] - start[live]  # tokens at the last one
        f = final[live]
        steps = hi - lo + 1
        used = (lo + hi) * steps // 2
        if block_size is None:  # contiguous: alloc >= final, constant
            a = alloc[live]
            filled = f * steps  # min(alloc, final) summed over the steps
            allocated = a * steps
        else:  # paged: alloc = bs * ceil(tokens / bs); min(alloc, final) = final in the last block
            bs = block_size
            allocated = bs * (_sum_ceil(hi, bs) - _sum_ceil(lo - 1, bs))
            last_block_start = bs * (-(-f // bs) - 1)  # tokens <= this are not in the last block
            top = np.minimum(hi, last_block_start)
            before = np.where(top >= lo, bs * (_sum_ceil(np.maximum(top, lo - 1), bs) - _sum_ceil(lo - 1, bs)), 0)
            in_last = np.maximum(0, hi - np.maximum(lo, last_block_start + 1) + 1)
            filled = before + f * in_last
        sums["used"] += int(used.sum())
        sums["reserved"] += int((filled - used).sum())
        sums["internal"] += int((allocated - filled).sum())
        running_steps += int(steps.sum())
    measured = sum(last - first + 1 for first, last in trace.windows)
    return sums, running_steps, measured


class FirstFit:
    """One address space of ``size`` slots handing out contiguous ranges, lowest address first.

    ``holes`` is the sorted list of free ``[start, length]`` ranges; a freed range merges
    with free neighbours, so two holes never touch.
    """

    def __init__(self, size: int) -> None:
        self.size = positive_int("size", size)
        self.holes: list[list[int]] = [[0, self.size]]

    @property
    def free(self) -> int:
        """Free slots in all holes together."""
        return sum(length for _, length in self.holes)

    def allocate(self, length: int) -> int | None:
        """The start of a new range of ``length`` slots in the first hole that fits, or None."""
        for k, hole in enumerate(self.holes):
            if hole[1] >= length:
                start = hole[0]
                hole[0] += length
                hole[1] -= length
                if hole[1] == 0:
                    del self.holes[k]
                return start
        return None

    def release(self, start: int, length: int) -> None:
        """Give ``[start, start + length)`` back, merging it with the holes beside it."""
        k = 0
        while k < len(self.holes) and self.holes[k][0] < start:
            k += 1
        merge_left = k > 0 and self.holes[k - 1][0] + self.holes[k - 1][1] == start
        merge_right = k < len(self.holes) and start + length == self.holes[k][0]
        if merge_left and merge_right:
            self.holes[k - 1][1] += length + self.holes[k][1]
            del self.holes[k]
        elif merge_left:
            self.holes[k - 1][1] += length
        elif merge_right:
            self.holes[k][0] = start
            self.holes[k][1] += length
        else:
            self.holes.insert(k, [start, length])


def _simulate_contiguous(req: np.ndarray, order: np.ndarray, pool: int, reserve: np.ndarray,
                         trace: _Trace) -> tuple[int, int]:
    """Event-driven first-fit: after the admissions of a step, nothing changes until the next finish."""
    space = FirstFit(pool)
    running: list[tuple[int, int, int, int]] = []  # heap of (finish_step, residency, start, length)
    waiting = deque(int(i) for i in order)
    allocated, max_running, t = 0, 0, 0
    while waiting or running:
        while waiting:  # 2. admit, first-fit, FCFS
            i = waiting[0]
            need = int(reserve[i])
            start = space.allocate(need)
            if start is None:
                break
            waiting.popleft()
            prompt, output = int(req[i, 0]), int(req[i, 1])
            rid = trace.begin(t, prompt, prompt + output, need)
            heapq.heappush(running, (t + output, rid, start, need))
            allocated += need
        max_running = max(max_running, len(running))
        finish = running[0][0]  # never empty: the checks guarantee an empty pool fits any request
        if waiting:  # 3. steps t..finish are measured, all with this allocation
            trace.measure(t, finish)
            free = pool - allocated
            if free >= reserve[waiting[0]]:
                trace.external_slots += free * (finish - t + 1)
            else:
                trace.free_slots += free * (finish - t + 1)
        while running and running[0][0] == finish:  # 4. finish
            _, rid, start, length = heapq.heappop(running)
            trace.end[rid] = finish
            allocated -= length
            space.release(start, length)
        t = finish + 1
    return max_running, t


def _simulate_paged(req: np.ndarray, order: np.ndarray, num_blocks: int, bs: int,
                    trace: _Trace) -> tuple[int, int, int, int]:
    """Event-driven paging with LIFO preemption, as vLLM V1 schedules.

    A running request admitted at step ``a`` with ``c`` tokens holds ``d + t`` tokens at
    step ``t`` (``d = c - a``), so it needs a new block at the steps where ``(d + t) % bs == 1 % bs``.
    Requests that share ``d % bs`` (their *phase*) need blocks at the same steps: counting
    requests per phase finds the step the pool runs dry without visiting every request.
    """
    n_req = len(req)
    final = req[:, 0] + req[:, 1]
    held_before = req[:, 0].copy()  # tokens to prefill at (re-)admission
    offset_of = np.zeros(n_req, dtype=np.int64)  # d of the current residency
    residency = np.full(n_req, -1, dtype=np.int64)
    phase_count = [0] * bs
    finishes: list[tuple[int, int, int]] = []  # heap of (finish_step, residency, request); stale entries skipped
    stack: list[tuple[int, int]] = []  # (request, residency) in admission order, newest last; stale ones skipped
    waiting = deque(int(i) for i in order)
    used_blocks, n_running, max_running, preemptions, recomputed = 0, 0, 0, 0, 0

    def gain_phase(step: int) -> int:  # requests with d % bs == this phase need a block at ``step``
        return (1 - step) % bs

    def gains(first: int, last: int) -> int:  # blocks all running requests take over steps first..last
        span = last - first + 1
        if span <= 0:
            return 0
        total = (span // bs) * n_running
        for s in range(first, first + span % bs):
            total += phase_count[gain_phase(s)]
        return total

    def dry_step(after: int, free: int) -> int:  # first step > after at which the growth exceeds ``free``
        if n_running == 0:
            return 1 << 62
        rounds = free // n_running
        step, left = after + rounds * bs, free - rounds * n_running
        while True:
            step += 1
            left -= phase_count[gain_phase(step)]
            if left < 0:
                return step

    def blocks_at(i: int, step: int) -> int:
        return -(-(int(offset_of[i]) + step) // bs)

    def stop(i: int, last_step: int) -> None:
        nonlocal n_running, used_blocks
        trace.end[residency[i]] = last_step
        residency[i] = -1
        phase_count[int(offset_of[i]) % bs] -= 1
        n_running -= 1
        used_blocks -= blocks_at(i, last_step)

    t = 0
    while waiting or n_running:
        # 1. grow: requests admitted before t gain a block if they cross a boundary
        preempted = False
        if n_running:
            need = phase_count[gain_phase(t)]
            free = num_blocks - used_blocks
            while need > free:  # preempt the newest running request, as vLLM's self.running.pop()
                victim, rid = stack.pop()
                if residency[victim] != rid:
                    continue  # finished, or preempted and admitted again since
                tokens = int(offset_of[victim]) + t - 1
                if (tokens + 1) % bs == 1 % bs:
                    need -= 1
                stop(victim, t - 1)
                held_before[victim] = tokens
                recomputed += tokens  # all of them are prefilled again when it is re-admitted
                waiting.appendleft(victim)
                free = num_blocks - used_blocks
                preempted = True
                preemptions += 1
            used_blocks += need
        # 2. admit, FCFS, only if nobody was preempted in this step
        while waiting and not preempted:
            i = waiting[0]
            tokens = int(held_before[i])
            blocks = -(-tokens // bs)
            if blocks > num_blocks - used_blocks:
                break
            waiting.popleft()
            offset_of[i] = tokens - t
            residency[i] = trace.begin(t, tokens, int(final[i]))
            phase_count[(tokens - t) % bs] += 1
            n_running += 1
            used_blocks += blocks
            stack.append((i, int(residency[i])))
            heapq.heappush(finishes, (t + int(final[i]) - tokens, int(residency[i]), i))
        max_running = max(max_running, n_running)
        # 3. measure; 4. finish
        if waiting:
            trace.measure(t, t)
        freed = preempted  # blocks came back: the queue head may fit in the next step
        while finishes and finishes[0][0] <= t:
            step, rid, i = heapq.heappop(finishes)
            if residency[i] != rid:
                continue  # preempted since this entry was pushed
            stop(i, t)
            freed = True
        while finishes and residency[finishes[0][2]] != finishes[0][1]:
            heapq.heappop(finishes)
        # fast-forward the quiet steps: only growth, no finish, no preemption, no admission
        if not n_running:
            t += 1
            continue
        # after a finish or a preemption the queue head may fit at once; else wait for a finish or the dry step
        next_event = t + 1 if waiting and freed else min(finishes[0][0], dry_step(t, num_blocks - used_blocks))
        if next_event > t + 1:
            if waiting:
                trace.measure(t + 1, next_event - 1)
            used_blocks += gains(t + 1, next_event - 1)
        t = next_event
    return max_running, t, preemptions, recomputed


def simulate(
    requests: Sequence[Sequence[int]] | np.ndarray,
    *,
    pool_tokens: int,
    max_model_len: int,
    policy: str,
    block_size: int = 16,
    seed: int | None = 0,
) -> FragmentationResult:
    """Serve ``requests`` (``(prompt_len, output_len)`` pairs) from a pool of ``pool_tokens`` slots.

    ``policy`` is "max", "pow2", "oracle" or "paged" (see the module docstring for the step
    rules). Requests queue in the order ``seed`` shuffles them to (``seed=None`` keeps the
    given order). Raises ``KvlabValueError`` for a request longer than ``max_model_len`` or a
    pool too small to serve a request of ``max_model_len`` tokens on its own.
    """
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
            + (f" in blocks of {block_size}" if paged else "") + f"; it must be at least {smallest_pool}"
        )
    order = np.arange(len(req)) if seed is None else np.random.default_rng(int(seed)).permutation(len(req))

    trace = _Trace()
    if paged:
        num_blocks = pool_tokens // block_size
        max_running, end_step, preemptions, recomputed = _simulate_paged(req, order, num_blocks, block_size, trace)
    else:
        max_running, end_step = _simulate_contiguous(req, order, pool_tokens, reservation(final, policy, max_model_len),
                                                     trace)
        preemptions = recomputed = 0
    if not trace.windows:  # the pool never turned a request away: measure the whole run
        trace.windows = [[0, end_step - 1]]
        trace.free_slots = trace.external_slots = 0
        whole_run = True
    else:
        whole_run = False
    sums, running_steps, measured = _account(trace, block_size if paged else None)
    total = pool_tokens * measured
    if paged or whole_run:
        sums["external"] = 0
        sums["free"] = total - sums["used"] - sums["reserved"] - sums["internal"]
    else:
        sums["external"] = trace.external_slots
        sums["free"] = trace.free_slots
    breakdown = {k: sums[k] / total for k in CATEGORIES}
    return FragmentationResult(
        policy=policy, pool_tokens=pool_tokens, max_model_len=max_model_len,
        block_size=block_size if paged else None, num_requests=len(req), utilization=breakdown["used"],
        breakdown=breakdown, max_running=max_running, mean_running=running_steps / measured,
        num_steps=end_step, measured_steps=measured, num_preemptions=preemptions,
        recomputed_tokens=recomputed,
    )
