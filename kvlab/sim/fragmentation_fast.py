"""The fragmentation simulation's fast engine: the rules of ``kvlab.sim.fragmentation``, skipping quiet steps.

``kvlab.sim.fragmentation.simulate(..., step_by_step=True)`` walks every step as the rules read; here
the same rules run event by event. Between two events (an admission, a finish, a
preemption) every running request only grows by one token per step, so those steps are
accounted in closed form: a residency's tokens grow linearly, and a paged request needs a
new block at the steps where its token count crosses a block boundary, which depends only on
its *phase* (tokens minus admission step, modulo the block size). ``tests/test_fragmentation.py``
holds the two engines to the same numbers, slot-step for slot-step.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque

import numpy as np

from kvlab._validate import checked, positive_int


@dataclasses.dataclass(frozen=True)
class SlotSteps:
    """What a run counted, before it is turned into shares: slot-steps per category over the measured steps."""

    used: int
    reserved: int
    internal: int
    external: int
    free: int
    measured_steps: int
    running_steps: int  # requests running, summed over the measured steps
    max_running: int
    num_steps: int
    num_preemptions: int = 0
    recomputed_tokens: int = 0


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


@checked
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

    @checked
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

    @checked
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


class _PagedRun:
    """Event-driven paging with LIFO preemption, as vLLM V1 schedules.

    A running request admitted at step ``a`` with ``c`` tokens holds ``d + t`` tokens at step
    ``t`` (``d = c - a``), so it needs a new block at the steps where ``(d + t) % bs == 1 % bs``.
    Requests that share ``d % bs`` (their *phase*) need blocks at the same steps: counting
    requests per phase finds the step the pool runs dry without visiting every request.
    """

    def __init__(self, req: np.ndarray, order: np.ndarray, num_blocks: int, bs: int, trace: _Trace) -> None:
        self.req, self.num_blocks, self.bs, self.trace = req, num_blocks, bs, trace
        self.final = req[:, 0] + req[:, 1]
        self.to_prefill = req[:, 0].copy()  # tokens to prefill at (re-)admission
        self.offset = np.zeros(len(req), dtype=np.int64)  # d of the current residency
        self.residency = np.full(len(req), -1, dtype=np.int64)
        self.phase_count = [0] * bs
        self.finishes: list[tuple[int, int, int]] = []  # heap of (finish step, residency, request); stale skipped
        self.stack: list[tuple[int, int]] = []  # (request, residency) in admission order, newest last
        self.waiting = deque(int(i) for i in order)
        self.used_blocks = self.n_running = self.max_running = self.preemptions = self.recomputed = 0

    def _phase(self, step: int) -> int:
        """The phase whose requests need a block at ``step``."""
        return (1 - step) % self.bs

    def _gains(self, first: int, last: int) -> int:
        """Blocks all running requests take over steps ``first..last``."""
        span = last - first + 1
        if span <= 0:
            return 0
        return (span // self.bs) * self.n_running + sum(
            self.phase_count[self._phase(s)] for s in range(first, first + span % self.bs))

    def _dry_step(self, after: int) -> int:
        """The first step after ``after`` at which the running requests' growth exceeds the free blocks."""
        if self.n_running == 0:
            return 1 << 62
        free = self.num_blocks - self.used_blocks
        rounds = free // self.n_running
        step, left = after + rounds * self.bs, free - rounds * self.n_running
        while True:
            step += 1
            left -= self.phase_count[self._phase(step)]
            if left < 0:
                return step

    def _stop(self, i: int, last_step: int) -> None:
        """End request ``i``'s residency at ``last_step`` (finished or preempted) and free its blocks."""
        self.trace.end[self.residency[i]] = last_step
        self.residency[i] = -1
        self.phase_count[int(self.offset[i]) % self.bs] -= 1
        self.n_running -= 1
        self.used_blocks -= -(-(int(self.offset[i]) + last_step) // self.bs)

    def grow(self, t: int) -> bool:
        """Step 1: requests that cross a block boundary take a block, preempting the newest while none is free."""
        if not self.n_running:
            return False
        need, preempted = self.phase_count[self._phase(t)], False
        while need > self.num_blocks - self.used_blocks:  # vLLM's self.running.pop()
            victim, rid = self.stack.pop()
            if self.residency[victim] != rid:
                continue  # finished, or preempted and admitted again since
            tokens = int(self.offset[victim]) + t - 1
            if (tokens + 1) % self.bs == 1 % self.bs:
                need -= 1  # the victim was one of those that needed a block
            self._stop(victim, t - 1)
            self.to_prefill[victim] = tokens
            self.recomputed += tokens  # all of them are prefilled again when it is re-admitted
            self.waiting.appendleft(victim)
            preempted = True
            self.preemptions += 1
        self.used_blocks += need
        return preempted

    def admit(self, t: int) -> None:
        """Step 2: admit from the queue's head, first come first served, while its prompt's blocks are free."""
        while self.waiting:
            i = self.waiting[0]
            tokens = int(self.to_prefill[i])
            blocks = -(-tokens // self.bs)
            if blocks > self.num_blocks - self.used_blocks:
                break
            self.waiting.popleft()
            self.offset[i] = tokens - t
            self.residency[i] = self.trace.begin(t, tokens, int(self.final[i]))
            self.phase_count[(tokens - t) % self.bs] += 1
            self.n_running += 1
            self.used_blocks += blocks
            self.stack.append((i, int(self.residency[i])))
            heapq.heappush(self.finishes, (t + int(self.final[i]) - tokens, int(self.residency[i]), i))

    def finish(self, t: int) -> bool:
        """Step 4: requests holding their final length leave; True if any did."""
        freed = False
        while self.finishes and self.finishes[0][0] <= t:
            _, rid, i = heapq.heappop(self.finishes)
            if self.residency[i] == rid:  # else preempted since this entry was pushed
                self._stop(i, t)
                freed = True
        while self.finishes and self.residency[self.finishes[0][2]] != self.finishes[0][1]:
            heapq.heappop(self.finishes)
        return freed

    def run(self) -> tuple[int, int, int, int]:
        """Every step until the last request leaves: (max running, steps, preemptions, recomputed tokens)."""
        t = 0
        while self.waiting or self.n_running:
            preempted = self.grow(t)
            if not preempted:  # 2. admit only if nobody was preempted in this step
                self.admit(t)
            self.max_running = max(self.max_running, self.n_running)
            if self.waiting:  # 3. measure
                self.trace.measure(t, t)
            freed = self.finish(t) or preempted  # blocks came back: the queue head may fit in the next step
            if not self.n_running:
                t += 1
                continue
            # Fast-forward the quiet steps (only growth): after a finish or a preemption the queue head
            # may fit at once; else nothing changes until the next finish or the step the pool runs dry.
            next_event = t + 1 if self.waiting and freed else min(self.finishes[0][0], self._dry_step(t))
            if next_event > t + 1:
                if self.waiting:
                    self.trace.measure(t + 1, next_event - 1)
                self.used_blocks += self._gains(t + 1, next_event - 1)
            t = next_event
        return self.max_running, t, self.preemptions, self.recomputed


@checked
def run_fast(req: np.ndarray, order: np.ndarray, pool_tokens: int, reserve: np.ndarray | None,
             block_size: int) -> SlotSteps:
    """Serve ``req`` in ``order`` (paged when ``reserve`` is None, else contiguous reservations of ``reserve``)."""
    trace = _Trace()
    paged = reserve is None
    preemptions = recomputed = 0
    if paged:
        engine = _PagedRun(req, order, pool_tokens // positive_int("block_size", block_size), block_size, trace)
        max_running, end_step, preemptions, recomputed = engine.run()
    else:
        max_running, end_step = _simulate_contiguous(req, order, pool_tokens, reserve, trace)
    whole_run = not trace.windows
    if whole_run:  # the pool never turned a request away: measure the whole run
        trace.windows = [[0, end_step - 1]]
    sums, running_steps, measured = _account(trace, block_size if paged else None)
    if paged or whole_run:
        external, free = 0, pool_tokens * measured - sums["used"] - sums["reserved"] - sums["internal"]
    else:
        external, free = trace.external_slots, trace.free_slots
    return SlotSteps(sums["used"], sums["reserved"], sums["internal"], external, free, measured, running_steps,
                     max_running, end_step, preemptions, recomputed)
