"""The scheduler: which requests run this step, and how many of their tokens, under one token budget.

Mirrors ``vllm/v1/core/sched/scheduler.py`` (first-come-first-served policy). There is no
"prefill phase" and "decode phase": each request has ``num_tokens`` it knows and
``num_computed_tokens`` whose KV is in the cache, and every step hands out at most
``max_num_batched_tokens`` tokens so that requests catch up. That one rule gives:

* **continuous batching**: a request joins the batch the step after it arrives and leaves the
  step it finishes;
* **chunked prefill**: a long prompt is computed a budget-sized chunk per step;
* **decode first**: RUNNING requests are served before WAITING ones, so a stream of new
  prompts cannot stall the requests already generating;
* **admission by whole prompt**: a waiting request is admitted only if its whole prompt fits the
  free blocks (vLLM's ``scheduler_reserve_full_isl``), not just the chunk of this step;
* **prefix caching**: a waiting request first asks ``KVCacheManager.get_computed_blocks``
  for its cached prefix and computes only the rest;
* **preemption by recompute**: when ``allocate_slots`` finds no free block for a running
  request, the most recently admitted running request is preempted: its blocks are freed,
  ``num_computed_tokens`` goes back to 0 and it waits at the *front* of the queue. Its full
  blocks keep their hashes, so on return a prefix hit usually saves most of the recompute.
  No waiting request is admitted in a step that preempted.

What kvlab adds to V1: parallel sampling (``n > 1``) by **fork and copy-on-write**, from
vLLM's earlier block manager. When a request's prompt is complete, ``n - 1`` children are
forked that share all its blocks; the first write into a shared, partly filled block copies
it (``KVCacheManager.copy_on_write``) and the step's ``blocks_to_copy`` tells the executor to
copy the KV tensors before the forward. V1 itself instead runs ``n`` independent requests
that share the prompt's full blocks through the prefix cache.

Optional: a KV ``connector`` (the scheduler side of one, ``SchedulerKVConnector``), called where
vLLM 0.33.0's scheduler calls it (notebook 11). After the local prefix lookup,
``get_num_new_matched_tokens`` says how many more tokens it can load; ``allocate_slots`` takes them as
``num_external_computed_tokens`` (``delay_cache_blocks`` while the load is asynchronous), then
``update_state_after_alloc``; a request loading asynchronously waits in ``WAITING_FOR_REMOTE_KVS``, in
``kv_holding_waiting`` (drained before ``waiting``), until the worker reports it in ``finished_recving``;
``build_connector_meta`` closes ``schedule()``; a finished request goes through ``request_finished``
first, and when the connector asks to delay, its blocks are freed only once the worker reports it in
``finished_sending``. A load that fails (``invalid_block_ids``) is recomputed from the first bad block
or fails the request, by ``kv_load_failure_policy`` ("recompute" or vLLM's default "fail"). The
connector's lookups are counted apart (``connector_prefix_cache_stats``, exported as
``vllm:external_prefix_cache_queries`` and ``vllm:external_prefix_cache_hits``). Notebook 07's CPU
tier is one such connector (``kvlab.core.kv_offload.OffloadingConnector``), with
``preemption_mode="swap"``, which V1 dropped: a preempted request's KV is copied to the CPU tier and
copied back when it resumes, instead of recomputed. ``num_recomputed_tokens`` counts what preemption cost.
Where kvlab's connector path is simpler than vLLM's: no deferred loads or frees (kvlab has one batch in
flight), no reservation of blocks for in-flight asynchronous loads (``_inflight_prefill_reserved_blocks``),
one KV cache group, and ``build_connector_meta`` sees ``num_computed_tokens`` already advanced.

The scheduler never touches tensors: an executor turns each ``SchedulerOutput`` into sampled
tokens, and ``kvlab.core.sched.loop.step`` drives the two (``NoComputeExecutor`` there invents
tokens without a model, for simulations; the real executor is ``kvlab.engine.ModelRunner``).
A step that fails strands no request: see ``update_from_output`` and ``fail_step``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from kvlab._validate import checked, one_of
from kvlab.core.cache_stats import PrefixCacheStats
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import KVCacheBlocks
from kvlab.core.request import RequestStatus
from kvlab.core.sched.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    SchedulerConfig,
    check_request_fits,
)
from kvlab.core.sched.output import (
    GenerationRequest,
    KVConnectorOutput,
    ModelRunnerOutput,
    RequestOutput,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    child_request_id,
)
from kvlab.core.sequence import BlockCopy
from kvlab.errors import KvlabValueError, RequestFailedError, RequestStateError
from kvlab.units import cdiv

#: What a scheduler does with a request whose KV a connector failed to load (vLLM's ``kv_load_failure_policy``).
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@checked
class Scheduler:
    """Waiting and running queues over one ``KVCacheManager``, scheduled as vLLM V1 does (FCFS)."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_model_len: int | None = None,
        connector: Any = None,
        preemption_mode: str = "recompute",
        kv_load_failure_policy: str = "fail",
    ) -> None:
        if not isinstance(kv_cache_manager, KVCacheManager):
            raise KvlabValueError(f"kv_cache_manager must be a KVCacheManager, got {type(kv_cache_manager).__name__}")
        config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, preemption_mode)
        self.scheduler_config = config
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_num_running_reqs = config.max_num_seqs
        self.max_num_scheduled_tokens = config.max_num_batched_tokens
        self.num_usable_blocks = kv_cache_manager.block_pool.num_usable_blocks
        self.max_model_len = config.max_model_len or self.num_usable_blocks * self.block_size
        self.requests: dict[str, GenerationRequest] = {}  # live requests, and finished ones whose frees wait
        self.waiting: deque[GenerationRequest] = deque()
        # Waiting requests that hold blocks (a connector's load in flight or just done): always drained first.
        self.kv_holding_waiting: deque[GenerationRequest] = deque()
        self.running: list[GenerationRequest] = []
        self.finished_req_ids: set[str] = set()
        self.num_steps = 0
        self.num_preemptions = 0  # since start: vllm:num_preemptions
        self._pending_copies: dict[str, list[BlockCopy]] = {}  # copy-on-write copies not yet executed
        # Whose next step sends its whole block table, not just new block ids (ScheduledRequest.whole_table):
        # forked samples and requests whose table a copy-on-write changed; after an undone step, everyone's.
        self._tables_to_send: set[str] = set()
        self._send_every_table = False
        self._last_step: SchedulerOutput | None = None
        # kvlab.core.kv_offload: the CPU tier (vLLM's KV connector) and how a preempted request is resumed.
        self.preemption_mode = config.preemption_mode
        if config.needs_cpu_tier and connector is None:
            raise KvlabValueError("preemption_mode='swap' needs a CPU tier to swap to: pass a connector")
        self.connector = connector
        self.num_recomputed_tokens = 0  # tokens computed again after a preemption
        self._computed_before_preemption: dict[str, int] = {}
        # A KV connector's asynchronous loads (vLLM's names), and what to do when one fails.
        one_of("kv_load_failure_policy", kv_load_failure_policy, KV_LOAD_FAILURE_POLICIES)
        self.recompute_kv_load_failures = kv_load_failure_policy == "recompute"
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self.connector_prefix_cache_stats = PrefixCacheStats() if connector is not None else None
        self.num_kv_load_failures = 0  # requests whose load failed (kvlab's counter)

    # ----------------------------------------------------------------- requests in and out

    @checked
    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; one that could never fit the pool or ``max_model_len`` is refused here."""
        if not isinstance(request, GenerationRequest):
            raise KvlabValueError(f"request must be a GenerationRequest, got {type(request).__name__}")
        if request.request_id in self.requests:
            raise RequestStateError(f"request id {request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise RequestStateError(f"request {request.request_id!r} is {request.status.value}; add a new request")
        self.check_admissible(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @checked
    def check_admissible(self, request: GenerationRequest) -> None:
        """Refuse a request this scheduler could never run: too long for the pool or ``max_model_len``, or
        parallel samples (``n > 1``, served by fork) over several KV cache groups, which fork cannot share, or
        more samples than ``max_num_seqs`` lets run at once (they are admitted together)."""
        n = request.sampling_params.n
        if n > self.max_num_running_reqs:
            raise KvlabValueError(
                f"request {request.request_id!r} asks for n={n} samples, but max_num_seqs="
                f"{self.max_num_running_reqs}: its samples run together, so it could never be admitted. Lower n or "
                "raise max_num_seqs")
        if request.sampling_params.n > 1 and self.kv_cache_manager.num_kv_cache_groups > 1:
            raise KvlabValueError(
                f"request {request.request_id!r} asks for n={request.sampling_params.n} samples: kvlab forks them, "
                "and a fork shares one block table, but this model has several KV cache groups; send n requests")
        check_request_fits(request, self.max_model_len, self.num_usable_blocks, self.block_size, self.blocks_for)

    @checked
    def blocks_for(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once, all KV cache groups together.

        Full attention holds every block; a sliding window W at most ``cdiv(W - 1 + budget, block_size) + 1``,
        where the budget bounds the tokens one step adds (kvlab's scheduler is synchronous: one batch in flight).
        """
        return sum(g.kv_cache_spec.max_num_blocks_per_request(num_tokens, self.max_num_scheduled_tokens)
                   for g in self.kv_cache_manager.kv_cache_groups)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.kv_holding_waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.kv_holding_waiting) + len(self.running)

    def has_finished_requests(self) -> bool:
        """Finished requests the executor has not heard of yet, or whose blocks a connector still holds."""
        return bool(self.finished_req_ids) or len(self.requests) > self.get_num_unfinished_requests()

    def has_requests(self) -> bool:
        """Anything left to step for (vLLM's ``has_requests``): unfinished requests, or frees still to come."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    # ----------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating (or preempting) as needed."""
        token_budget = self.max_num_scheduled_tokens
        num_new_tokens_of: dict[str, int] = {}
        scheduled_running: list[GenerationRequest] = []
        scheduled_new: list[GenerationRequest] = []
        scheduled_resumed: list[GenerationRequest] = []
        admitted: list[GenerationRequest] = []  # new and resumed, in admission order
        preempted: list[GenerationRequest] = []
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}  # what allocate_slots gave each running request

        # 1. RUNNING requests first: their decode token, or the next chunk of their prompt.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if num_new_tokens == 0:
                req_index += 1
                continue
            while True:
                new_blocks = self._allocate(request, num_new_tokens)
                if new_blocks is not None:
                    req_to_new_blocks[request.request_id] = new_blocks
                    break
                # No room: preempt the most recently admitted running request (maybe this one).
                victim = self.running.pop()
                self._preempt_request(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request in preempted:
                break
            scheduled_running.append(request)
            num_new_tokens_of[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # 2. WAITING requests, oldest first, but only in a step that preempted nothing; those holding blocks
        #    (a connector's load) first. A request that cannot go yet is skipped and keeps its place.
        skipped_holding: list[GenerationRequest] = []
        skipped_waiting: list[GenerationRequest] = []
        while not preempted and token_budget > 0:
            queue = self.kv_holding_waiting or self.waiting
            if not queue:
                break
            request = queue[0]
            if self._num_seq_slots_used() + request.num_pending_forks + 1 > self.max_num_running_reqs:
                break
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self._remote_kvs_ready(request):
                (skipped_holding if self._holds_kv_blocks(request) else skipped_waiting).append(queue.popleft())
                continue
            load_kv_async = False
            num_external_tokens = queries = 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit_tokens, _ = self.kv_cache_manager.get_computed_blocks(request)
                if self.connector is not None:  # as vLLM: the connector sees a block-aligned hit, and may supersede
                    partial_tail = num_hit_tokens % self.block_size  # a partial tail only by loading strictly more
                    external, load_kv_async = self.connector.get_num_new_matched_tokens(
                        request, num_hit_tokens - partial_tail)
                    if external is None:  # the connector cannot tell yet: ask again next step
                        skipped_waiting.append(queue.popleft())
                        continue
                    if partial_tail and external > partial_tail:
                        hit_blocks = KVCacheBlocks(tuple(group[:-1] for group in hit_blocks.blocks))
                        num_hit_tokens -= partial_tail
                        num_external_tokens = external
                    elif partial_tail:
                        load_kv_async = False
                    else:
                        num_external_tokens = external
                    queries = request.num_tokens - num_hit_tokens
                num_computed_tokens = num_hit_tokens + num_external_tokens
            else:  # back from a connector's load: its blocks are held, nothing to look up
                hit_blocks, num_hit_tokens = self.kv_cache_manager.empty_kv_cache_blocks, 0
                num_computed_tokens = request.num_computed_tokens
            # A load in flight computes nothing yet: its blocks only are allocated.
            num_new_tokens = 0 if load_kv_async else min(request.num_tokens - num_computed_tokens, token_budget)
            # As vLLM 0.33.0 (scheduler_reserve_full_isl): admitted only if the whole prompt fits, not just this chunk.
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_hit_tokens, hit_blocks, num_external_computed_tokens=num_external_tokens,
                delay_cache_blocks=load_kv_async, full_sequence_must_fit=True, has_scheduled_reqs=bool(self.running))
            if new_blocks is None:
                break  # the pool is full: the queue waits, in order
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, self._blocks_of(request.request_id),
                                                        num_external_tokens)
                if queries:
                    self.connector_prefix_cache_stats.record(queries, num_external_tokens, request.num_preemptions > 0)
            if load_kv_async:  # vLLM: the request waits, holding its blocks, until the worker reports the load done
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_computed_tokens = num_computed_tokens
                queue.popleft()
                skipped_holding.append(request)
                continue
            previously = self._computed_before_preemption.pop(request.request_id, 0)
            self.num_recomputed_tokens += max(previously - num_computed_tokens, 0)
            queue.popleft()
            self.running.append(request)
            admitted.append(request)
            (scheduled_resumed if request.status == RequestStatus.PREEMPTED else scheduled_new).append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            num_new_tokens_of[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        self.kv_holding_waiting.extendleft(reversed(skipped_holding))  # back at the front, in their order
        self.waiting.extendleft(reversed(skipped_waiting))

        assert token_budget >= 0 and len(self.running) <= self.max_num_running_reqs
        # Partial prefix hits' copies (vLLM 0.33.0's copy-on-write): the executor makes them before the forward,
        # and nothing allocates before then, so their retained blocks can go back at once (vLLM's sync path).
        hit_copies, retained = self.kv_cache_manager.take_kv_cache_block_copies()
        self.kv_cache_manager.block_pool.free_blocks(retained)
        output = self._make_output(scheduled_running + admitted, num_new_tokens_of, req_to_new_blocks,
                                   scheduled_new, scheduled_resumed, scheduled_running, preempted, hit_copies)
        self.num_steps += 1
        self.num_preemptions += len(preempted)
        self._last_step = output
        return output

    def _allocate(self, request: GenerationRequest, num_new_tokens: int) -> KVCacheBlocks | None:
        """Slots for a running request's next tokens, copying a shared partial block first; the new blocks, or None
        if the pool is full. A copy changes a block of the table in place, so its next step sends the whole table."""
        copies = self.kv_cache_manager.copy_on_write(request)
        if copies is None:
            return None
        if copies:
            self._pending_copies.setdefault(request.request_id, []).extend(copies)
            self._tables_to_send.add(request.request_id)
        return self.kv_cache_manager.allocate_slots(request, num_new_tokens)

    def _num_seq_slots_used(self) -> int:
        """Sequences running, counting the children a running parent will fork."""
        return len(self.running) + sum(r.num_pending_forks for r in self.running)

    def _blocks_of(self, request_id: str) -> KVCacheBlocks:
        """A request's blocks in every group (none if it holds none), as the connector's calls take them."""
        if request_id not in self.kv_cache_manager.req_to_blocks:
            return self.kv_cache_manager.empty_kv_cache_blocks
        return KVCacheBlocks(tuple(self.kv_cache_manager.get_blocks_per_group(request_id)))

    @staticmethod
    def _holds_kv_blocks(request: GenerationRequest) -> bool:
        """vLLM's test: computed tokens, or a load in flight (whose count a failure may have reset to 0)."""
        return request.num_computed_tokens > 0 or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    def _remote_kvs_ready(self, request: GenerationRequest) -> bool:
        """vLLM's ``_update_waiting_for_remote_kv``: once the load is reported done, cache what arrived and wait
        as an ordinary request; False while it runs.

        A load that failed keeps the tokens before its first bad block (``_handle_invalid_blocks`` cut
        ``num_computed_tokens`` there), or frees everything when none is left. A whole prompt loaded still
        computes its last token, for the logits of the next one.
        """
        request_id = request.request_id
        if request_id not in self.finished_recving_kv_req_ids:
            return False
        if request_id in self.failed_recving_kv_req_ids:
            self.failed_recving_kv_req_ids.remove(request_id)
            if request.num_computed_tokens:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            else:
                self.kv_cache_manager.free(request)
        else:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens = request.num_tokens - 1
        self.finished_recving_kv_req_ids.remove(request_id)
        request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        return True

    def _preempt_request(self, request: GenerationRequest) -> None:
        """Free the request's blocks and put it back at the front of the waiting queue, to recompute.

        With ``preemption_mode="swap"`` its computed KV is first copied to the CPU tier (when there
        is room), to be copied back on resume instead of recomputed.
        """
        if self.preemption_mode == "swap":
            self.connector.swap_out(request)
        self._computed_before_preemption[request.request_id] = request.num_computed_tokens
        self.kv_cache_manager.free(request)
        self._pending_copies.pop(request.request_id, None)
        self._tables_to_send.discard(request.request_id)  # it comes back as a resumed request, whole table
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _make_output(
        self,
        batch: list[GenerationRequest],
        num_new_tokens_of: dict[str, int],
        req_to_new_blocks: dict[str, KVCacheBlocks],
        scheduled_new: list[GenerationRequest],
        scheduled_resumed: list[GenerationRequest],
        scheduled_running: list[GenerationRequest],
        preempted: list[GenerationRequest],
        hit_copies: list[BlockCopy],
    ) -> SchedulerOutput:
        """Advance ``num_computed_tokens`` (as vLLM does at schedule time), fork, and describe the step.

        Block ids go as vLLM sends them: a new or resumed request's whole table (``get_block_ids_per_group``),
        a running request's new blocks only (what ``allocate_slots`` returned), or its whole table where kvlab
        changed it otherwise (``_tables_to_send``).
        """
        scheduled, copies = [], []
        whole_tables = {r.request_id for r in (*scheduled_new, *scheduled_resumed)} | self._tables_to_send
        no_blocks = ((),) * self.kv_cache_manager.num_kv_cache_groups
        for request in batch:
            start = request.num_computed_tokens
            num_new = num_new_tokens_of[request.request_id]
            request.num_computed_tokens += num_new
            sample = request.num_computed_tokens == request.num_tokens
            forked = self._fork_children(request) if sample and request.num_pending_forks else ()
            copies += self._pending_copies.pop(request.request_id, [])
            whole = self._send_every_table or request.request_id in whole_tables
            if whole:
                tables = tuple(map(tuple, self.kv_cache_manager.get_block_ids_per_group(request.request_id)))
            else:
                new_blocks = req_to_new_blocks.get(request.request_id)
                tables = tuple(map(tuple, new_blocks.get_block_ids())) if new_blocks else no_blocks
            scheduled.append(ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.token_ids(start, start + num_new),
                num_computed_tokens=start,
                block_ids=tables[0],
                sample=sample,
                sampling_params=request.sampling_params.for_sample(0) if forked else request.sampling_params,
                forked=forked,
                group_block_ids=tables if len(tables) > 1 else (),
                whole_table=whole,
            ))
        self._tables_to_send -= whole_tables
        self._send_every_table = False
        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = SchedulerOutput(
            step=self.num_steps,
            scheduled=scheduled,
            scheduled_new_req_ids=[r.request_id for r in scheduled_new],
            scheduled_resumed_req_ids=[r.request_id for r in scheduled_resumed],
            scheduled_running_req_ids=[r.request_id for r in scheduled_running],
            preempted_req_ids=[r.request_id for r in preempted],
            finished_req_ids=finished,
            blocks_to_copy=copies + hit_copies,
        )
        if self.connector is not None:  # the last call of schedule(), as in vLLM: the worker's orders for this step
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def _fork_children(self, parent: GenerationRequest) -> tuple[tuple[str, SamplingParams], ...]:
        """Fork the parent's ``n - 1`` children now that its prompt is cached: they share every block."""
        children = []
        first = parent.sampling_params.n - parent.num_pending_forks
        for index in range(first, parent.sampling_params.n):
            params = parent.sampling_params.for_sample(index)
            child = GenerationRequest(
                child_request_id(parent.request_id, index), parent.prompt_token_ids, params,
                eos_token_id=parent.eos_token_id, cache_salt=parent.cache_salt, lora_name=parent.lora_name,
            )
            child.parent_id = parent.request_id
            child.lora_path = parent.lora_path  # the adapter's path enters the block hash, as its name does
            self.kv_cache_manager.fork(parent, child)
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            self.requests[child.request_id] = child
            self.running.append(child)
            self._tables_to_send.add(child.request_id)  # the executor learns its (shared) table on its first step
            children.append((child.request_id, params))
        parent.num_pending_forks = 0
        return tuple(children)

    @checked
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append each sampled token, stop requests that are done, and free their blocks.

        Every request this step samples must get one token id. One the executor could not sample
        (``model_runner_output.errors``), gave a bad token, or left out finishes with ``FINISHED_ERROR``
        and frees its blocks: since ``num_computed_tokens`` advanced at schedule time (as in vLLM),
        a request left without its token would never be scheduled again. A token for a request
        that finished meanwhile (aborted during the step) is dropped, as vLLM drops it.
        """
        kv_output = model_runner_output.kv_connector_output
        failed_kv_loads: set[str] = set()  # requests this step's output must skip: their loads failed
        if kv_output is not None and kv_output.failed_recving:
            failed_kv_loads |= self._handle_failed_recving(kv_output.failed_recving)
        if kv_output is not None and kv_output.invalid_block_ids:
            failed_kv_loads |= self._handle_invalid_blocks(kv_output.invalid_block_ids, scheduler_output)
        expected = dict.fromkeys(i for s in scheduler_output.scheduled if s.sample
                                 for i in (s.request_id, *(child for child, _ in s.forked)) if i not in failed_kv_loads)
        sampled = model_runner_output.sampled_token_ids
        errors = dict(model_runner_output.errors)
        outputs = []
        for request_id, token_id in sampled.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished() or request_id in errors or request_id in failed_kv_loads:
                continue
            problem = _token_problem(token_id, request_id in expected)
            if problem:
                errors[request_id] = RequestFailedError(request_id, f"the executor {problem}")
                continue
            request.append_output_token_ids(token_id)
            stopped = self._check_stop(request)
            kv_transfer_params = self._free_request(request) if stopped else None
            outputs.append(RequestOutput(request_id, (token_id,), stopped, request.get_finished_reason(),
                                         kv_transfer_params=kv_transfer_params))
        for request_id in [i for i in expected if i not in sampled and i not in errors]:
            errors[request_id] = RequestFailedError(request_id, "the executor returned no token for it in a step "
                                                                "that samples it")
        if failed_kv_loads and not self.recompute_kv_load_failures:  # policy "fail": the request ends with an error
            for request_id in failed_kv_loads:
                errors.setdefault(request_id, RequestFailedError(request_id, "its KV failed to load "
                                                                             "(kv_load_failure_policy='fail')"))
        for request_id, error in errors.items():
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished():
                outputs += self._finish(request, RequestStatus.FINISHED_ERROR, error)
        if kv_output is not None:
            self._update_from_kv_xfer_finished(kv_output)
        return outputs

    # ----------------------------------------------------------------- a KV connector's reports

    def _update_from_kv_xfer_finished(self, kv_output: KVConnectorOutput) -> None:
        """vLLM's: a load reported done lets its request be scheduled; a send reported done frees the blocks."""
        self.connector.update_connector_output(kv_output)
        for request_id in kv_output.finished_recving or ():
            request = self.requests[request_id]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(request_id)
            else:  # aborted while loading: its blocks waited for the load to end
                assert request.is_finished()
                self._free_blocks(request)
        for request_id in kv_output.finished_sending or ():
            self._free_blocks(self.requests[request_id])

    def _handle_failed_recving(self, failed_req_ids: set[str]) -> set[str]:
        """Loads that failed whole: recompute from nothing (policy "recompute"), else fail the requests."""
        affected = set()
        for request_id in failed_req_ids:
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                affected.add(request_id)
                self.num_kv_load_failures += 1
                if self.recompute_kv_load_failures:
                    request.num_computed_tokens = 0
                    self.failed_recving_kv_req_ids.add(request_id)
        return set() if self.recompute_kv_load_failures else affected

    def _handle_invalid_blocks(self, invalid_block_ids: set[int], scheduler_output: SchedulerOutput) -> set[str]:
        """vLLM's ``_handle_invalid_blocks``: each request holding a block a load failed to fill computes again
        from its first such block (policy "recompute") or fails ("fail").

        Asynchronous loads (not cached yet) learn it before they leave ``WAITING_FOR_REMOTE_KVS``; a synchronous
        load ran in this step, so its request skips this step's token. Returns the requests this step's output
        must skip.
        """
        num_scheduled = scheduler_output.num_scheduled_tokens
        loading = [r for r in self.kv_holding_waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        async_failed, _ = self._truncate_at_invalid_blocks(loading, invalid_block_ids, num_scheduled, evict=False)
        sync_failed, to_evict = self._truncate_at_invalid_blocks(self.running, invalid_block_ids, num_scheduled,
                                                                 evict=True)
        self.num_kv_load_failures += len(async_failed) + len(sync_failed)
        if not self.recompute_kv_load_failures:
            self.kv_cache_manager.block_pool.evict_blocks(to_evict, notify=False)
            return async_failed | sync_failed
        self.failed_recving_kv_req_ids |= async_failed
        return sync_failed

    def _truncate_at_invalid_blocks(self, requests: Iterable[GenerationRequest], invalid_block_ids: set[int],
                                    num_scheduled: dict[str, int], evict: bool) -> tuple[set[str], set[int]]:
        """vLLM's ``_update_requests_with_invalid_blocks`` (one group): cut each affected request's
        ``num_computed_tokens`` back to its first invalid block; a block shared with an earlier request of
        the batch is recomputed by that one only. Returns the affected ids and the blocks to evict."""
        affected, to_evict, marked = set(), set(), set()
        for request in requests:
            block_ids = self.kv_cache_manager.get_block_ids_per_group(request.request_id)[0]
            computed = request.num_computed_tokens - num_scheduled.get(request.request_id, 0)
            is_affected = truncated = False
            for index, block_id in enumerate(block_ids[:cdiv(computed, self.block_size)]):
                if block_id not in invalid_block_ids:
                    continue
                is_affected = True
                if block_id in marked:
                    continue
                marked.add(block_id)
                if truncated:
                    continue
                truncated = True
                request.num_computed_tokens = index * self.block_size
                if evict:
                    to_evict.update(block_ids[index:])
            if is_affected:
                if not truncated:
                    request.num_computed_tokens = computed
                affected.add(request.request_id)
        return affected, to_evict

    @checked
    def fail_step(self, scheduler_output: SchedulerOutput, error: BaseException) -> ModelRunnerOutput:
        """The executor raised: every request of the step, forked samples included, fails with ``error``.

        The culprit is unknown and a retry would likely raise again, so none is retried (vLLM goes
        further: the engine dies, with every request). The step may have stopped before writing
        its KV, so the blocks it was to fill first leave the prefix cache (``evict_blocks``);
        blocks of earlier steps stay cached. Returns the output ``update_from_output`` finishes them with.
        """
        untrusted: set[int] = set()
        failed: dict[str, BaseException] = {}
        manager = self.kv_cache_manager
        for s in scheduler_output.scheduled:  # the output sends new block ids only: the tables are the manager's
            first = s.num_computed_tokens // self.block_size
            if s.request_id in manager.req_to_blocks:
                untrusted.update(*(table[first:] for table in manager.get_block_ids_per_group(s.request_id)))
            else:  # freed already: the blocks the step sent are the ones it can have written
                untrusted.update(*(table[first:] if s.whole_table else table for table in s.new_block_ids))
            failed.update(dict.fromkeys((s.request_id, *(child for child, _ in s.forked)), error))
        self.kv_cache_manager.block_pool.evict_blocks(untrusted, notify=False)
        self.finished_req_ids |= scheduler_output.finished_req_ids  # the executor may not have seen them
        return ModelRunnerOutput({}, failed)

    @checked
    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> list[RequestOutput]:
        """Finish requests from outside a step (vLLM's ``finish_requests``: an abort), freeing their blocks.

        Unknown or finished ids are ignored, as in vLLM; a parent takes its samples not yet forked
        along. A request whose KV a connector is still loading keeps its blocks until the load is reported
        done. Returns one output per request finished (vLLM returns the requests).
        """
        if not isinstance(finished_status, RequestStatus) or not RequestStatus.is_finished(finished_status):
            raise KvlabValueError(f"finished_status must be a finished RequestStatus, got {finished_status!r}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in dict.fromkeys(ids):
            request = self.requests.get(request_id) if isinstance(request_id, str) else None
            if request is not None and not request.is_finished():
                outputs += self._finish(request, finished_status)
        return outputs

    def _finish(self, request: GenerationRequest, status: RequestStatus, error: BaseException | None = None
                ) -> list[RequestOutput]:
        """Finish a running or waiting request with ``status``; its samples not yet forked finish with it."""
        delay_free = False
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # vLLM: the load still writes into its blocks
            delay_free = request.request_id not in self.finished_recving_kv_req_ids
            self.finished_recving_kv_req_ids.discard(request.request_id)
            self.failed_recving_kv_req_ids.discard(request.request_id)
        request.status = status
        self._free_request(request, delay_free)  # its kv_transfer_params are dropped, as vLLM's finish_requests does
        n, pending = request.sampling_params.n, request.num_pending_forks
        request.num_pending_forks = 0
        ids = [request.request_id, *(child_request_id(request.request_id, k) for k in range(n - pending, n))]
        return [RequestOutput(i, (), True, request.get_finished_reason(), error) for i in ids]

    def _check_stop(self, request: GenerationRequest) -> bool:
        """vLLM's ``check_stop``: an end-of-sequence token, else ``max_tokens`` or ``max_model_len``."""
        last = request.output_token_ids[-1]
        if not request.sampling_params.ignore_eos and last in request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if request.num_tokens >= self.max_model_len or request.num_output_tokens >= request.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _free_request(self, request: GenerationRequest, delay_free_blocks: bool = False) -> dict[str, Any] | None:
        """Take a finished request out of its queue and free everything it holds; return the connector's
        ``kv_transfer_params``.

        The connector sees the request first (``request_finished``, with the blocks of its computed
        tokens) and may keep its blocks, to send them: they are freed when the worker reports the request
        in ``finished_sending`` (``_free_blocks``), and the request stays in ``requests`` until then.
        """
        for queue in (self.running, self.waiting, self.kv_holding_waiting):
            if request in queue:
                queue.remove(request)
                break
        self._pending_copies.pop(request.request_id, None)
        self._tables_to_send.discard(request.request_id)
        self._computed_before_preemption.pop(request.request_id, None)
        kv_transfer_params = None
        if self.connector is not None:
            held = self.kv_cache_manager.req_to_blocks.get(request.request_id, ())
            block_ids = [b.block_id for b in held[:cdiv(request.num_computed_tokens, self.block_size)]]
            connector_delay, kv_transfer_params = self.connector.request_finished(request, block_ids)
            delay_free_blocks |= connector_delay
        self.finished_req_ids.add(request.request_id)
        if not delay_free_blocks:
            self._free_blocks(request)
        return kv_transfer_params

    def _free_blocks(self, request: GenerationRequest) -> None:
        """Give a finished request's blocks back and forget it (at once, or when its connector is done)."""
        assert request.is_finished()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def make_stats(self) -> SchedulerStats:
        """The gauges and this step's counters, after ``update_from_output`` (one row of the history)."""
        out = self._last_step
        if out is None:
            raise RequestStateError("make_stats() describes the last step: call schedule() first")
        return SchedulerStats(
            step=out.step,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.kv_holding_waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            num_preempted_reqs=len(out.preempted_req_ids),
            num_scheduled_tokens=out.total_num_scheduled_tokens,
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_block_copies=len(out.blocks_to_copy),
            connector_prefix_cache_stats=self._take_connector_prefix_cache_stats(),
        )

    def _take_connector_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """This step's connector lookups, then a fresh count (vLLM's ``make_stats`` takes them so too)."""
        stats = self.connector_prefix_cache_stats
        if stats is not None:
            self.connector_prefix_cache_stats = PrefixCacheStats()
        return stats


def _token_problem(token_id: object, expected: bool) -> str | None:
    """Why an executor's token cannot be appended to a request, or None if it can."""
    if not expected:
        return f"returned token {token_id!r} for it, but it does not sample in this step"
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
        return f"returned {token_id!r}, which is not a token id (a non-negative integer)"
    return None
