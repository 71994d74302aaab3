"""One engine step over a scheduler and an executor, and a loop to the end: vLLM's ``EngineCore.step``.

Mirrors the loop of ``vllm/v1/engine/core.py``: ``schedule``, ``execute_model``, ``update_from_output``.
kvlab differs where a step fails: vLLM treats an exception from ``execute_model`` as fatal (the
engine core logs it, tells its clients the engine is dead and shuts down, failing every request);
kvlab fails only the requests of that step (``Scheduler.fail_step``) and serves the rest, so a
learner's loop ``while scheduler.has_unfinished_requests(): step(...)`` always ends. An exception
anywhere else in the step, a Ctrl-C in ``schedule`` or ``update_from_output`` included, undoes the
step instead: the scheduler goes back to its state before it (``kvlab.core.sched.snapshot``). vLLM
dies of such an exception as well (``run_engine_core``: "EngineCore encountered a fatal error"), and
its engine core process turns SIGINT into a shutdown request its busy loop handles between steps,
so there a Ctrl-C never lands inside one; in a notebook kernel it lands wherever Python is.

``NoComputeExecutor`` stands in for a model, for simulations at scales a CPU model could not run.
"""

from __future__ import annotations

import zlib

from kvlab._validate import checked, positive_int
from kvlab.core.sched.output import Executor, ModelRunnerOutput, RequestOutput, SchedulerOutput, SchedulerStats
from kvlab.core.sched.scheduler import Scheduler
from kvlab.core.sched.snapshot import Snapshot, commit
from kvlab.errors import RequestStateError


@checked
class NoComputeExecutor:
    """An executor without a model: it samples a made-up token for every request that asks for one.

    The token depends only on the request id and the position (a CRC, not Python's salted
    ``hash``), so a run repeats exactly and a preempted request regenerates the same tokens.
    Use it to simulate scheduling and the KV pool at scales a CPU model could not run.
    """

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = positive_int("vocab_size", vocab_size)

    @checked
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        for s in scheduler_output.scheduled:
            if not s.sample:
                continue
            position = s.num_computed_tokens + s.num_tokens
            for request_id, _params in ((s.request_id, s.sampling_params), *s.forked):
                sampled[request_id] = zlib.crc32(f"{request_id}:{position}".encode()) % self.vocab_size
        return ModelRunnerOutput(sampled)


@checked
def step(scheduler: Scheduler, executor: Executor, *, atomic: bool = True
         ) -> tuple[SchedulerOutput, list[RequestOutput], SchedulerStats]:
    """One engine step, as vLLM's ``EngineCore.step``: schedule, execute, update; all or nothing.

    An exception from the executor (an interrupt included) does not escape: it fails the step's
    requests (``Scheduler.fail_step``), whose outputs carry it, and the scheduler serves the rest.
    ``LLMEngine.step`` raises it again once its bookkeeping is done. Any other exception, a
    ``KeyboardInterrupt`` in ``schedule`` or ``update_from_output`` included, undoes the step: the
    scheduler, its KV cache manager and pool go back to their state before it (a ``Snapshot``, the
    design kvlab chose over failing the step's requests, so a Ctrl-C costs no request), blocks the
    step took out of the prefix cache stay out of it (it may have written them), and the exception
    is raised again. The next call schedules the same step afresh. ``atomic=False`` skips the snapshot
    (a walk of the scheduler's state; the pool's blocks journal their own changes) for a caller that
    throws the scheduler away when a step raises: a simulation builds its own and keeps nothing of an
    interrupted run.
    """
    before = None
    try:  # nothing above this line changes anything, and every line below is undone if it raises
        before = Snapshot(scheduler) if atomic else None
        scheduler_output = scheduler.schedule()
        model_runner_output = _execute(scheduler, executor, scheduler_output)
        outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
        return commit(before, (scheduler_output, outputs, scheduler.make_stats()))  # the journal closes last
    except BaseException:
        if before is not None:
            _undo(scheduler, before)
        raise


def _execute(scheduler: Scheduler, executor: Executor, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    """The executor's output; if the executor raised, the output that fails the step's requests (``fail_step``).

    A function of its own because CPython 3.11 leaves the ``try:`` line of a ``try`` nested in another
    one outside both handlers: an interrupt landing there would have skipped ``step``'s undo.
    """
    try:
        return executor.execute_model(scheduler_output)
    except BaseException as error:  # noqa: BLE001 - nothing may strand the step's requests; re-raised by callers
        return scheduler.fail_step(scheduler_output, error)


def _undo(scheduler: Scheduler, before: Snapshot) -> None:
    """Put the scheduler back as ``before`` saw it; a block whose cached hash the step changed loses it.

    Such a block was evicted for reuse during the step, and the step's forward may have written
    new KV into it, so its old hash must not serve a prefix hit. The executor may have applied the
    undone step's new block ids to its copy of the tables, so the next step sends every table whole.
    (A second interrupt during the undo itself, a few milliseconds, is not guarded against.)
    """
    blocks = scheduler.kv_cache_manager.block_pool.blocks
    hashes = [block.block_hash for block in blocks]
    before.restore()
    rewritten = [b.block_id for b, h in zip(blocks, hashes, strict=True) if b.block_hash not in (None, h)]
    scheduler.kv_cache_manager.block_pool.evict_blocks(rewritten, notify=False)
    scheduler._send_every_table = True  # the executor may have applied the undone step's new block ids


@checked
def run_until_done(scheduler: Scheduler, executor: Executor | None = None, max_steps: int = 100_000
                   ) -> list[SchedulerStats]:
    """Step until every request finished; return one ``SchedulerStats`` per step (a simulation's history).

    An interrupt (Ctrl-C) inside the executor fails that step's requests and then stops the loop.
    """
    executor = executor or NoComputeExecutor()
    history = []
    while scheduler.has_unfinished_requests():
        if len(history) >= positive_int("max_steps", max_steps):
            raise RequestStateError(f"requests were still unfinished after max_steps={max_steps} steps")
        _, outputs, stats = step(scheduler, executor)
        history.append(stats)
        for out in outputs:
            if out.error is not None and not isinstance(out.error, Exception):
                raise out.error
    return history
