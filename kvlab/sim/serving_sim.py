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

from kvlab._validate import non_negative_int, positive_int
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector, PoolDiagnosis
from kvlab.core.kv_offload import CPUOffloadingManager, OffloadingConnector, OffloadStats
from kvlab.core.sched.loop import NoComputeExecutor, step
from kvlab.core.sched.output import GenerationRequest, SamplingParams
from kvlab.core.sched.scheduler import Scheduler
from kvlab.errors import KvlabValueError

VOCAB_SIZE = 32_000


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

    def diagnose(self) -> PoolDiagnosis:
        """The block-lifetime diagnostic, in steps."""
        return self.metrics.diagnose("steps")


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
) -> ChatRun:
    """Serve ``workload`` from a GPU pool of ``num_gpu_blocks`` blocks (and a CPU tier), counting what happens."""
    workload = workload or ChatWorkload()
    if not isinstance(workload, ChatWorkload):
        raise KvlabValueError(f"workload must be a ChatWorkload, got {type(workload).__name__}")
    non_negative_int("cpu_offload_blocks", cpu_offload_blocks)
    rng = random.Random(workload.seed)
    metrics = KVCacheMetricsCollector()
    manager = KVCacheManager(num_gpu_blocks, block_size, hash_seed="kvlab-chat")
    manager.block_pool.metrics_collector = metrics
    connector = (OffloadingConnector(manager, CPUOffloadingManager(cpu_offload_blocks))
                 if cpu_offload_blocks else None)
    scheduler = Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          connector=connector, preemption_mode=preemption_mode)
    executor = NoComputeExecutor(VOCAB_SIZE)

    system = [rng.randrange(VOCAB_SIZE) for _ in range(workload.system_len)]
    history: dict[int, list[int]] = {}  # open conversations: their history so far
    turn: dict[int, int] = {}
    due: dict[int, int] = {}  # step at which a conversation's next turn arrives
    live: dict[str, tuple[int, list[int], list[int]]] = {}  # request id -> (conversation, prompt, reply so far)
    opened = computed = steps = 0

    def open_conversation() -> None:
        nonlocal opened
        history[opened], turn[opened], due[opened] = list(system), 0, steps + rng.randrange(workload.think_steps + 1)
        opened += 1

    while opened < min(workload.max_active, workload.num_conversations):
        open_conversation()
    while history:
        if steps >= positive_int("max_steps", max_steps):
            raise KvlabValueError(f"the chat was still running after max_steps={max_steps} steps")
        busy = {conversation for conversation, _, _ in live.values()}
        for conversation in sorted(history):
            if conversation not in busy and due[conversation] <= steps:
                prompt = history[conversation] + [rng.randrange(VOCAB_SIZE) for _ in range(workload.user_len)]
                request_id = f"chat{conversation}-turn{turn[conversation]}"
                scheduler.add_request(GenerationRequest(
                    request_id, prompt, SamplingParams(max_tokens=workload.reply_len, ignore_eos=True)))
                live[request_id] = (conversation, prompt, [])
                due[conversation] = steps + 10**9  # until the reply ends
        if scheduler.has_unfinished_requests():
            output, finished, _ = step(scheduler, executor)
            computed += output.total_num_scheduled_tokens
            for out in finished:
                conversation, prompt, reply = live[out.request_id]
                reply.extend(out.new_token_ids)
                if out.finished:
                    del live[out.request_id]
                    history[conversation] = prompt + reply
                    turn[conversation] += 1
                    due[conversation] = steps + workload.think_steps
                    if turn[conversation] == workload.turns:
                        del history[conversation], turn[conversation], due[conversation]
                        if opened < workload.num_conversations:
                            open_conversation()
        steps += 1
        metrics.advance()
    stats = manager.prefix_cache_stats
    return ChatRun(
        num_gpu_blocks=num_gpu_blocks, cpu_offload_blocks=cpu_offload_blocks, preemption_mode=preemption_mode,
        prompt_tokens=stats.queries, gpu_hit_tokens=stats.hits,
        cpu_hit_tokens=0 if connector is None else connector.stats.external_prefix_cache_hits,
        computed_tokens=computed, recomputed_tokens=scheduler.num_recomputed_tokens, num_steps=steps,
        num_preemptions=scheduler.num_preemptions, offload=None if connector is None else connector.stats,
        metrics=metrics,
    )
