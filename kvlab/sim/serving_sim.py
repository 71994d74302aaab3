"""Multi-turn chat served by the no-compute scheduler: block lifetimes, a CPU tier and preemption at scale.

Conversations share a system prompt; every turn re-sends the whole history (earlier replies
included) plus a new user message, and the next turn arrives ``think_steps`` steps after the
reply ends. At most ``max_active`` conversations are open; when one ends, the next begins.
So a conversation's blocks are needed again about once per turn, and whether they survive
until then depends on the pool: the situation the block-lifetime diagnostic reads.

Requests run through ``kvlab.core.sched.scheduler.Scheduler`` with ``NoComputeExecutor``: the scheduling,
prefix hits, evictions, preemptions and CPU-tier transfers are the engine's own; only the
model is missing (its made-up tokens become the next turn's history). A step is one engine
iteration, idle ones included, so lifetimes in steps are comparable across runs. The seconds
histograms hold this simulation's own wall-clock time on this machine and mean little.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from kvlab._validate import MAX_OBJECTS, checked, non_negative_int, positive_int
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector, PoolDiagnosis
from kvlab.core.kv_offload import CPUOffloadingManager, OffloadingConnector, OffloadStats
from kvlab.core.sched.loop import NoComputeExecutor, step
from kvlab.core.sched.output import GenerationRequest, SamplingParams
from kvlab.core.sched.scheduler import Scheduler
from kvlab.errors import KvlabValueError

VOCAB_SIZE = 32_000


@checked
@dataclasses.dataclass(frozen=True)
class ChatWorkload:
    """The shape of the chat traffic: how many conversations, how long each part, how long users think."""

    num_conversations: int = 24
    max_active: int = 10
    turns: int = 6
    system_len: int = 128
    user_len: int = 32
    reply_len: int = 32
    think_steps: int = 30
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_conversations", "max_active", "turns", "system_len", "user_len", "reply_len"):
            positive_int(name, getattr(self, name))
        non_negative_int("think_steps", self.think_steps)

    @property
    def longest_prompt(self) -> int:
        """The last turn's prompt: system prompt, every earlier turn and reply, and its own message."""
        return self.system_len + self.turns * self.user_len + (self.turns - 1) * self.reply_len


@dataclasses.dataclass(frozen=True)
class ChatRun:
    """What a simulated run counted (tokens are prompt tokens unless named otherwise)."""

    num_gpu_blocks: int
    cpu_offload_blocks: int
    preemption_mode: str
    prompt_tokens: int  # vllm:prefix_cache_queries
    gpu_hit_tokens: int  # vllm:prefix_cache_hits
    cpu_hit_tokens: int  # vllm:external_prefix_cache_hits: loaded from the CPU tier
    computed_tokens: int  # every token the model computed (prefill chunks and decode steps)
    recomputed_tokens: int  # tokens computed again after a preemption
    num_steps: int
    num_preemptions: int
    offload: OffloadStats | None
    metrics: KVCacheMetricsCollector

    @property
    def hit_rate(self) -> float:
        """The GPU prefix cache's hit rate, as vLLM's two counters give it."""
        return self.gpu_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tiered_hit_rate(self) -> float:
        """Prompt tokens found in either tier."""
        return (self.gpu_hit_tokens + self.cpu_hit_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    @checked
    def diagnose(self) -> PoolDiagnosis:
        """The block-lifetime diagnostic, in steps."""
        return self.metrics.diagnose("steps")


class _Chat:
    """The open conversations while a chat runs: their history, turn, next arrival and live request."""

    def __init__(self, workload: ChatWorkload, scheduler: Scheduler) -> None:
        self.workload, self.scheduler = workload, scheduler
        self.rng = random.Random(workload.seed)
        self.system = [self.rng.randrange(VOCAB_SIZE) for _ in range(workload.system_len)]
        self.history: dict[int, list[int]] = {}  # open conversations: their history so far
        self.turn: dict[int, int] = {}
        self.due: dict[int, int] = {}  # step at which a conversation's next turn arrives
        self.live: dict[str, tuple[int, list[int], list[int]]] = {}  # request id -> (conversation, prompt, reply)
        self.opened = 0
        self.turns_done = 0
        while self.opened < min(workload.max_active, workload.num_conversations):
            self.open(0)

    def open(self, steps: int) -> None:
        """Start the next conversation; its first turn arrives within ``think_steps``."""
        c = self.opened
        self.history[c], self.turn[c] = list(self.system), 0
        self.due[c] = steps + self.rng.randrange(self.workload.think_steps + 1)
        self.opened += 1

    def submit_due(self, steps: int) -> None:
        """Every conversation whose next turn is due sends its whole history and a new user message."""
        busy = {conversation for conversation, _, _ in self.live.values()}
        for c in sorted(self.history):
            if c not in busy and self.due[c] <= steps:
                prompt = self.history[c] + [self.rng.randrange(VOCAB_SIZE) for _ in range(self.workload.user_len)]
                request_id = f"chat{c}-turn{self.turn[c]}"
                self.scheduler.add_request(GenerationRequest(
                    request_id, prompt, SamplingParams(max_tokens=self.workload.reply_len, ignore_eos=True)))
                self.live[request_id] = (c, prompt, [])
                self.due[c] = steps + 10**9  # until the reply ends

    def receive(self, outputs: list, steps: int) -> None:
        """Append each step's tokens to their replies; a finished reply closes its turn (and maybe its conversation)."""
        for out in outputs:
            c, prompt, reply = self.live[out.request_id]
            reply.extend(out.new_token_ids)
            if not out.finished:
                continue
            del self.live[out.request_id]
            self.history[c] = prompt + reply
            self.turn[c] += 1
            self.turns_done += 1
            self.due[c] = steps + self.workload.think_steps
            if self.turn[c] == self.workload.turns:
                del self.history[c], self.turn[c], self.due[c]
                if self.opened < self.workload.num_conversations:
                    self.open(steps)


@checked(at_most={"num_gpu_blocks": MAX_OBJECTS, "cpu_offload_blocks": MAX_OBJECTS})
def simulate_chat(
    num_gpu_blocks: int,
    workload: ChatWorkload | None = None,
    *,
    block_size: int = 16,
    cpu_offload_blocks: int = 0,
    preemption_mode: str = "recompute",
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 512,
    max_steps: int = 1_000_000,
    progress: bool = False,
) -> ChatRun:
    """Serve ``workload`` from a GPU pool of ``num_gpu_blocks`` blocks (and a CPU tier), counting what happens.

    ``progress=True`` shows a bar of the turns served (``tqdm.auto``: a widget in a notebook).
    """
    workload = workload or ChatWorkload()
    if not isinstance(workload, ChatWorkload):
        raise KvlabValueError(f"workload must be a ChatWorkload, got {type(workload).__name__}")
    non_negative_int("cpu_offload_blocks", cpu_offload_blocks)
    max_steps = positive_int("max_steps", max_steps)
    metrics = KVCacheMetricsCollector()
    manager = KVCacheManager(num_gpu_blocks, block_size, hash_seed="kvlab-chat")
    manager.block_pool.metrics_collector = metrics
    connector = (OffloadingConnector(manager, CPUOffloadingManager(cpu_offload_blocks))
                 if cpu_offload_blocks else None)
    scheduler = Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          connector=connector, preemption_mode=preemption_mode)
    executor = NoComputeExecutor(VOCAB_SIZE)
    chat = _Chat(workload, scheduler)
    bar = _progress_bar(progress, workload.num_conversations * workload.turns, f"{preemption_mode}, turns served")
    computed = steps = 0
    while chat.history:
        if steps >= max_steps:
            raise KvlabValueError(f"the chat was still running after max_steps={max_steps} steps")
        chat.submit_due(steps)
        if scheduler.has_unfinished_requests():
            output, finished, _ = step(scheduler, executor, atomic=False)  # an interrupted run is discarded
            computed += output.total_num_scheduled_tokens
            before = chat.turns_done
            chat.receive(finished, steps)
            bar.update(chat.turns_done - before)
        steps += 1
        metrics.advance()
    bar.close()
    stats = manager.prefix_cache_stats
    return ChatRun(
        num_gpu_blocks=num_gpu_blocks, cpu_offload_blocks=cpu_offload_blocks, preemption_mode=preemption_mode,
        prompt_tokens=stats.queries, gpu_hit_tokens=stats.hits,
        cpu_hit_tokens=0 if connector is None else connector.stats.external_prefix_cache_hits,
        computed_tokens=computed, recomputed_tokens=scheduler.num_recomputed_tokens, num_steps=steps,
        num_preemptions=scheduler.num_preemptions, offload=None if connector is None else connector.stats,
        metrics=metrics,
    )


class _NoBar:
    def update(self, _n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(show: bool, total: int, desc: str) -> Any:
    """A ``tqdm.auto`` bar (a widget in a notebook, text elsewhere), or one that shows nothing."""
    if not show:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="turn", leave=True)
