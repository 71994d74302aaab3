"""Notebook 07's exercises (is the pool too small? swap or recompute?) and self-test."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

from kvlab.capacity.cost_model import CostModel, cost_model
from kvlab.capacity.hardware import GB
from kvlab.capacity.playbook import Deployment, Workload, rank_levers
from kvlab.capacity.source_deployments import reproduce
from kvlab.core.kv_cache_metrics import STEPS_BUCKETS, Histogram, nearest_rank
from kvlab.core.kv_cache_metrics import pool_too_small as _pool_too_small
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.sim.serving_sim import ChatWorkload, simulate_chat
from kvlab.units import GiB

# ----------------------------------------------------------------- 07.pool_too_small


def pool_too_small(reuse_gaps: list[float], idle_before_evict: list[float]) -> bool:
    """Reference: the p90 reuse gap exceeds the median idle time before eviction (nearest-rank quantiles)."""
    return _pool_too_small(reuse_gaps, idle_before_evict)


def _pool_with(reuse_gaps: list[float], idle_before_evict: list[float], *, strict: bool = True,
               average_middle: bool = False, means: bool = False) -> bool:
    """pool_too_small with one step taken the wrong way: >= for >, the median of an even count as the average of
    its two middle values, or the means compared."""
    if not reuse_gaps or not idle_before_evict:
        return False
    if means:
        p90, p50 = sum(reuse_gaps) / len(reuse_gaps), sum(idle_before_evict) / len(idle_before_evict)
    else:
        p90, p50, ordered = nearest_rank(reuse_gaps, 0.9), nearest_rank(idle_before_evict, 0.5), sorted(
            idle_before_evict)
        if average_middle and len(ordered) % 2 == 0:
            p50 = (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    return p90 > p50 if strict else p90 >= p50


def _explain_pool(case: Case, expected: Any, actual: Any) -> str | None:
    gaps, idle = case.args
    if type(actual) is not bool:
        return "return True or False"
    if not gaps or not idle:  # the one wrong answer here is True
        return "with no reuse gaps or no evictions there is nothing to compare: answer False"
    return None


POOL_MISTAKES = (
    Mistake(lambda gaps, idle: _pool_with(gaps, idle, strict=False),
            "the rule says *exceeds*: a p90 gap equal to the median idle time is not too small"),
    Mistake(lambda gaps, idle: _pool_with(gaps, idle, average_middle=True),
            "use the nearest-rank quantile, sorted(values)[ceil(q * n) - 1]: the median of an even count is the "
            "lower middle value, not the average of the two"),
    Mistake(lambda gaps, idle: _pool_with(gaps, idle, means=True),
            "compare quantiles, not means: one long gap moves the mean but not the 90th percentile"),
)


def _random_pool_case(rng: random.Random) -> Case:
    gaps = [rng.randint(1, 60) for _ in range(rng.randint(0, 12))]
    idle = [rng.randint(1, 60) for _ in range(rng.randint(0, 12))]
    return Case((gaps, idle), probes="random reuse gaps and idle times, in steps")


register(Exercise(
    id="07.pool_too_small",
    title="Is the pool too small?",
    task=(
        "You have scraped two of vLLM's block lifetime histograms as raw values (in scheduler steps): the gaps "
        "between consecutive prefix-cache hits on a block (`vllm:kv_block_reuse_gap_seconds`) and each evicted "
        "block's idle time before eviction (`vllm:kv_block_idle_before_evict_seconds`). Return True when the "
        "90th-percentile reuse gap is larger than the median idle time before eviction: blocks are then usually "
        "evicted before they are needed again. Use nearest-rank quantiles (the q-quantile of n values is "
        "`sorted(values)[ceil(q * n) - 1]`), and return False when either list is empty."
    ),
    signature="def pool_too_small(reuse_gaps: list[float], idle_before_evict: list[float]) -> bool:",
    reference=pool_too_small,
    shown=plain.pool_too_small,
    edge_cases=[
        Case(([2, 3, 40], [5, 6, 7]), probes="one long gap: p90 is 40, the median idle time 6"),
        Case(([2, 3, 4], [5, 6, 7]), probes="every gap shorter than the typical idle time"),
        Case(([6], [6]), probes="p90 equal to the median: 'exceeds' is strict"),
        Case(([], [1, 2]), probes="no block was hit twice: no gaps to judge"),
        Case(([3], []), probes="no block was evicted yet"),
        Case(([6, 6, 6, 6], [1, 3, 9, 9]), probes="an even count: the nearest-rank median is 3, not 6"),
        Case(([1] * 9 + [100], [5] * 10), probes="a skewed tail: the mean gap is 10.9, the p90 gap only 1"),
    ],
    random_case=_random_pool_case,
    explain=_explain_pool,
    mistakes=POOL_MISTAKES,
    hints=[
        "Two quantiles: q = 0.9 of reuse_gaps and q = 0.5 of idle_before_evict.",
        "Nearest rank: sort, then take the element at index ceil(q * n) - 1 (math.ceil).",
        "Guard the empty lists first, and compare with a strict >.",
    ],
))


# ----------------------------------------------------------------- 07.swap_or_recompute


def swap_or_recompute(model: CostModel, computed_tokens: int, hit_tokens: int) -> str:
    """Reference: the cheaper way to resume a preempted request, in ``model``'s modelled seconds."""
    return model.swap_or_recompute(computed_tokens, hit_tokens)


_MODELS: dict[str, Callable[[], CostModel]] = {
    "llama-3-8b on H100, PCIe 5": lambda: cost_model("llama-3-8b", "H100-SXM-80GB"),
    "llama-3-8b on H100 behind PCIe 4": lambda: cost_model("llama-3-8b", "H100-SXM-80GB", "PCIe 4.0 x16"),
    "llama-2-7b (MHA) on A100, PCIe 4": lambda: cost_model("llama-2-7b", "A100-80GB"),
    "llama-3-70b on 4 x H100": lambda: cost_model("llama-3-70b", "H100-SXM-80GB", tp=4),
}


def _explain_swap(case: Case, expected: Any, actual: Any) -> str | None:
    return None if actual in ("swap", "recompute") else 'return the string "swap" or "recompute"'


def _swap_rule(swap: Callable[[CostModel, int, int], float], recompute: Callable[[CostModel, int, int], float],
               tie: str = "recompute") -> Callable[[CostModel, int, int], str]:
    """A decision from two prices (a known mistake when either is priced wrong, or the tie goes to swap)."""
    def decide(model: CostModel, computed: int, hits: int) -> str:
        a, b = swap(model, computed, hits), recompute(model, computed, hits)
        return "swap" if a < b or (a == b and tie == "swap") else "recompute"
    return decide


def _recompute(model: CostModel, computed: int, hits: int) -> float:
    return model.recompute_seconds(computed, hits)


def _swap(model: CostModel, computed: int, hits: int) -> float:
    return model.swap_seconds(computed, hits)


SWAP_MISTAKES = (
    Mistake(_swap_rule(_swap, _recompute, tie="swap"),
            "a tie goes to recompute, vLLM V1's way: swap only when it is strictly cheaper"),
    Mistake(_swap_rule(lambda m, c, h: m.copy_seconds(c), _recompute),
            "swap pays twice: every block goes out to the CPU, then the blocks not cached on the GPU come back"),
    Mistake(_swap_rule(lambda m, c, h: 2 * m.copy_seconds(c), _recompute),
            "blocks still cached on the GPU need not be copied back: only computed_tokens - hit_tokens return"),
    Mistake(_swap_rule(_swap, lambda m, c, h: m.prefill_seconds(c - h)),
            "the recomputed tokens attend to the cached ones too: pass hit_tokens as num_cached_tokens to "
            "prefill_seconds"),
)


def _random_swap_case(rng: random.Random) -> Case:
    name = rng.choice(list(_MODELS))
    computed = rng.randint(64, 60_000)
    return Case((_MODELS[name](), computed, rng.randint(0, computed)), probes=f"a random request on {name}")


register(Exercise(
    id="07.swap_or_recompute",
    title="Swap or recompute?",
    task=(
        "A request with `computed_tokens` tokens of KV was preempted. When it resumes, the GPU prefix cache still "
        "holds its first `hit_tokens` tokens. Resuming by *recompute* prefills the other tokens, which attend to "
        "the cached ones: `model.prefill_seconds(computed_tokens - hit_tokens, hit_tokens)`. Resuming by *swap* "
        "copied all of its KV to the CPU at preemption and copies back what the GPU no longer holds, each copy "
        "costing `model.copy_seconds(num_tokens)`. Return \"swap\" if swapping takes less modelled time, else "
        "\"recompute\" (vLLM V1's way wins ties). `computed_tokens` may be 0."
    ),
    signature="def swap_or_recompute(model: CostModel, computed_tokens: int, hit_tokens: int) -> str:",
    reference=swap_or_recompute,
    shown=plain.swap_or_recompute,
    edge_cases=[
        Case((_MODELS["llama-3-8b on H100, PCIe 5"](), 1000, 1000), probes="everything still cached: nothing to redo"),
        Case((_MODELS["llama-3-8b on H100, PCIe 5"](), 1000, 0), probes="nothing cached: a GQA model's KV crosses "
                                                                      "PCIe 5 faster than it prefills"),
        Case((_MODELS["llama-3-8b on H100, PCIe 5"](), 8000, 7400), probes="92.5 % cached, just below the crossover"),
        Case((_MODELS["llama-3-8b on H100, PCIe 5"](), 8000, 7600), probes="95 % cached: recompute wins"),
        Case((_MODELS["llama-3-8b on H100 behind PCIe 4"](), 8000, 7100), probes="a slower link moves the crossover "
                                                                               "down"),
        Case((_MODELS["llama-2-7b (MHA) on A100, PCIe 4"](), 8000, 6640),
             probes="83 % cached: an MHA model's KV is 4 x as large, so recompute wins earlier"),
        Case((_MODELS["llama-3-70b on 4 x H100"](), 32000, 31600), probes="a 70B model's prefill is dear"),
        Case((_MODELS["llama-3-8b on H100, PCIe 5"](), 0, 0),
             probes="preempted before any token was computed: both ways take 0 s, and a tie goes to recompute"),
    ],
    random_case=_random_swap_case,
    num_random=15,
    explain=_explain_swap,
    mistakes=SWAP_MISTAKES,
    hints=[
        "Price each way separately, in modelled seconds, then compare.",
        "Recompute prefills the tokens the GPU no longer holds, and those tokens attend to the cached ones: "
        "prefill_seconds takes both counts.",
        "Swap pays twice: every token's KV went out to the CPU at preemption, and the tokens not cached on the GPU "
        "come back. A tie is not a win for swap.",
    ],
))


# ----------------------------------------------------------------- 07.pool_too_small_from_buckets (transfer)


def _histogram(bounds: list[float], cumulative_counts: list[int]) -> Histogram:
    """A kvlab Histogram whose buckets hold exactly ``cumulative_counts`` (each value on its bucket's upper bound)."""
    histogram = Histogram("scraped", "rebuilt from its buckets", bounds)
    below = 0
    for upper, count in zip([*bounds, bounds[-1] + 1], cumulative_counts, strict=True):
        for _ in range(count - below):
            histogram.observe(upper)
        below = count
    return histogram


def pool_too_small_from_buckets(bounds: list[float], reuse_gap_counts: list[int], idle_counts: list[int]) -> bool:
    """Reference: the rule of 07.pool_too_small on two scraped Prometheus histograms (histogram_quantile)."""
    gaps, idle = _histogram(bounds, reuse_gap_counts), _histogram(bounds, idle_counts)
    if not gaps.count or not idle.count:
        return False
    return gaps.histogram_quantile(0.9) > idle.histogram_quantile(0.5)


def _upper_bound_quantile(bounds: list[float], counts: list[int], q: float) -> float:
    rank = q * counts[-1]
    return next((b for b, c in zip(bounds, counts, strict=False) if c >= rank), bounds[-1])


def _upper_bounds(bounds: list[float], gaps: list[int], idle: list[int]) -> bool:
    """The rule with each quantile answered by its bucket's upper bound, not interpolated (a known mistake)."""
    if not gaps[-1] or not idle[-1]:
        return False
    return _upper_bound_quantile(bounds, gaps, 0.9) > _upper_bound_quantile(bounds, idle, 0.5)


def _counts_per_bucket(bounds: list[float], gaps: list[int], idle: list[int]) -> bool:
    """The rule with the cumulative counts read as counts per bucket (a known mistake): summed up before use, the
    last (+Inf) entry taken as the total of the others."""
    def cumulate(counts: list[int]) -> list[int]:
        running = list(itertools.accumulate(counts[:-1]))
        return [*running, running[-1]]
    return pool_too_small_from_buckets(bounds, cumulate(gaps), cumulate(idle))


def _explain_buckets(case: Case, expected: Any, actual: Any) -> str | None:
    bounds, gaps, idle = case.args
    if type(actual) is not bool:
        return "return True or False"
    if not gaps[-1] or not idle[-1]:  # the one wrong answer here is True
        return "with no reuse gaps or no evictions (a total count of 0) there is nothing to compare: answer False"
    return None


BUCKET_MISTAKES = (
    Mistake(_upper_bounds,
            "histogram_quantile does not answer a bucket's upper bound: it interpolates linearly inside the bucket "
            "that holds rank q x total, from the bucket's lower bound (the previous le, or 0)"),
    Mistake(_counts_per_bucket,
            "the bucket counts are cumulative, as Prometheus exports them: le=\"5\" counts every value up to 5, and "
            "le=\"+Inf\" is the total"),
)


def _random_buckets_case(rng: random.Random) -> Case:
    bounds = list(STEPS_BUCKETS[:rng.randint(4, len(STEPS_BUCKETS))])
    while True:
        gaps = [rng.lognormvariate(rng.uniform(0, 5), 1) for _ in range(rng.randint(0, 40))]
        idle = [rng.lognormvariate(rng.uniform(0, 5), 1) for _ in range(rng.randint(0, 40))]
        counts = []
        for values in (gaps, idle):
            histogram = Histogram("random", "", bounds)
            for value in values:
                histogram.observe(value)
            counts.append(histogram.cumulative_counts())
        p90, p50 = (_histogram(bounds, c).histogram_quantile(q) for c, q in zip(counts, (0.9, 0.5), strict=True))
        if p90 is None or p50 is None or abs(p90 - p50) > 1e-6 * max(p50, 1):  # no near-ties: float order
            return Case((bounds, counts[0], counts[1]), probes="random histograms on vLLM-style 1-2-5 buckets")


_BOUNDS = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0]

register(Exercise(
    id="07.pool_too_small_from_buckets",
    title="Is the pool too small? From a dashboard's buckets",
    task=(
        "A dashboard has no raw values, only the histograms vLLM exports: for each bucket bound `le` in `bounds` "
        "(ascending), how many values were at most `le`, then the total (the `+Inf` bucket). `reuse_gap_counts` "
        "and `idle_counts` are those cumulative counts, len(bounds) + 1 of each, for the reuse gaps and the idle "
        "times before eviction. Apply 07.pool_too_small's rule (p90 of the gaps > p50 of the idle times; False when "
        "either histogram is empty) with Prometheus' `histogram_quantile`: take the first bucket whose cumulative "
        "count reaches q x total and interpolate linearly inside it, from its lower bound (the previous `le`, or 0) "
        "to its `le`; if that bucket is `+Inf`, the answer is the largest finite bound."
    ),
    signature=("def pool_too_small_from_buckets(bounds: list[float], reuse_gap_counts: list[int], "
               "idle_counts: list[int]) -> bool:"),
    reference=pool_too_small_from_buckets,
    shown=plain.pool_too_small_from_buckets,
    edge_cases=[
        Case((_BOUNDS, [0, 0, 0, 10, 10, 10, 10], [0, 0, 0, 10, 10, 10, 10]),
             probes="both in the bucket (5, 10]: interpolation decides, p90 = 9.5 against p50 = 7.5"),
        Case((_BOUNDS, [5, 9, 10, 10, 10, 10, 10], [0, 0, 1, 4, 10, 10, 10]),
             probes="short gaps, long idle times: p90 = 2 against p50 = 11.7"),
        Case((_BOUNDS, [0, 0, 0, 0, 0, 0, 8], [0, 2, 4, 6, 6, 6, 6]),
             probes="every gap beyond the last bound: the +Inf bucket answers the largest finite bound, 50"),
        Case((_BOUNDS, [0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7]),
             probes="no block was hit twice: nothing to judge"),
        Case((_BOUNDS, [3, 3, 3, 3, 3, 3, 3], [0, 0, 0, 0, 0, 0, 0]), probes="no block was evicted yet"),
        Case((_BOUNDS, [0, 1, 1, 1, 1, 2, 2], [2, 2, 2, 2, 2, 2, 2]),
             probes="two gaps, one of them long; two idle times of at most 1 step"),
    ],
    random_case=_random_buckets_case,
    num_random=20,
    explain=_explain_buckets,
    mistakes=BUCKET_MISTAKES,
    transfer=True,
    hints=[
        "Write one function, the quantile of one histogram, and call it twice: q = 0.9 for the gaps, 0.5 for the "
        "idle times. The total is the last count.",
        "The rank is q x total. Walk the buckets until the cumulative count reaches it; the values below that bucket "
        "are the previous bucket's count.",
        "Inside the bucket, go the fraction (rank - count below) / (count inside) of the way from the lower bound "
        "to the upper one. The +Inf bucket has no upper bound: answer the largest finite one.",
    ],
))


# ----------------------------------------------------------------- self-test


def _deployment_c() -> dict[str, Any]:
    r = reproduce("c")
    plan = r["exact"].plan
    return {"source": r["arithmetic"].max_concurrency, "exact": plan.max_concurrency,
            "per_token": plan.kv_bytes_per_token * r["source"].deployment.tp, "log": r["exact"].startup_log}


ask(
    "07.q1",
    ("Deployment (c), a 32B model on 2 x A100 80GB at 131,072 tokens: the source's arithmetic gives 3.8x. What does "
     "vLLM really log for Qwen2.5-32B-Instruct, and where does the difference come from?"),
    _deployment_c,
    lambda v: (
        f"{v['log'][1]}, against the source's {v['source']:.2f}x. The source assumes 160 KB of KV per token; the real "
        f"config (64 layers, 8 KV heads of 128 dimensions, bf16) stores {v['per_token'] // 1024} KiB, split over the "
        "two GPUs. The reported 80 GiB per A100 and the source's decimal units move the figure much less."
    ),
)


def _lower_max_model_len() -> dict[str, Any]:
    r = reproduce("a")
    levers = rank_levers(r["source"].deployment, r["source"].workload)
    lever = next(x for x in levers if x.name == "Lower max_model_len")
    return {"before": r["exact"].max_concurrency, "after": lever.max_concurrency, "gain_typical": lever.gain_typical,
            "blocks_before": r["exact"].plan.num_blocks, "blocks_after": lever.plan.num_blocks,
            "new_len": lever.deployment.max_model_len}


ask(
    "07.q2",
    ("Deployment (a), chat on one L40S: halve max_model_len. The logged concurrency doubles. How many more chat "
     "requests run at once?"),
    _lower_max_model_len,
    lambda v: (
        f"None ({v['gain_typical']:+d}). The log goes from {v['before']:.2f}x to {v['after']:.2f}x because it divides "
        f"the same pool by a shorter worst case, max_model_len {v['new_len']:,}. vLLM V1 sizes the pool from the "
        f"memory left after the weights and the profiled peak, not from max_model_len: {v['blocks_before']:,} blocks "
        f"before, {v['blocks_after']:,} after. Only FP8 KV, more memory or fewer bytes of weights grow it."
    ),
)


def _crossover() -> dict[str, Any]:
    fast = cost_model("llama-3-8b", "H100-SXM-80GB")
    slow = cost_model("llama-3-8b", "H100-SXM-80GB", "PCIe 4.0 x16")
    return {"fast": fast.crossover_hit_rate(8000), "slow": slow.crossover_hit_rate(8000), "mfu": fast.prefill_mfu,
            "prefill_us": fast.prefill_seconds(8000) / 8000 * 1e6, "copy_us": fast.copy_seconds(8000) / 8000 * 1e6}


ask(
    "07.q3",
    ("Llama-3-8B on an H100, a preempted request with 8,000 computed tokens. From what prefix-hit rate on resume is "
     "recompute (modelled) no slower than swap over PCIe 5? And over PCIe 4?"),
    _crossover,
    lambda v: (
        f"From {100 * v['fast']:.1f} % over PCIe 5 and {100 * v['slow']:.1f} % over PCIe 4 (modelled: "
        f"{100 * v['mfu']:g} % of the dense BF16 peak, the links' theoretical bandwidth). Per token, prefill "
        f"costs about {v['prefill_us']:.0f} µs and one copy {v['copy_us']:.1f} µs, so swap wins unless the prefix "
        "cache still holds almost all of the request. In V1 a preempted request's full blocks keep their hashes "
        "and usually are still cached when it resumes: recompute then redoes little, with no PCIe traffic and no "
        "swap state to manage."
    ),
)


def _l4_levers() -> dict[str, Any]:
    chat = ChatWorkload()
    l4 = Deployment("llama-3-8b", "L4", max_model_len=1024, block_size=16, non_kv_gib=6 * GB / GiB)
    levers = {r.name: r for r in rank_levers(l4, Workload(chat.longest_prompt, chat.reply_len))}
    pools = {"as configured": l4.plan().num_blocks, "FP8 KV cache": levers["FP8 KV cache"].plan.num_blocks,
             "Higher gpu_memory_utilization": levers["Higher gpu_memory_utilization"].plan.num_blocks}
    runs = {name: simulate_chat(blocks, chat) for name, blocks in pools.items()}
    freed = (levers["Higher gpu_memory_utilization"].plan.requested_bytes - l4.plan().requested_bytes) / GiB
    return {"freed_gib": freed, **{name: {"blocks": pools[name], "hit_rate": run.hit_rate,
                                          "too_small": run.diagnose().too_small} for name, run in runs.items()}}


ask(
    "07.q4",
    ("Llama-3-8B on an L4 serves the chat of section 7 from 76 blocks, and the lifetime diagnostic says the pool is "
     "too small. Which of FP8 KV cache and gpu_memory_utilization 0.95 clears it, and what happens to the hit rate?"),
    _l4_levers,
    lambda v: (
        f"Only the higher utilization. FP8 doubles the pool to {v['FP8 KV cache']['blocks']} blocks and lifts the hit "
        f"rate from {100 * v['as configured']['hit_rate']:.0f} % to {100 * v['FP8 KV cache']['hit_rate']:.0f} %, but "
        "blocks are still evicted sooner than conversations come back. At 0.95 the L4 gives the budget another "
        f"{v['freed_gib']:.2f} GiB, the pool grows to {v['Higher gpu_memory_utilization']['blocks']} blocks, the "
        "diagnostic clears and the hit rate reaches "
        f"{100 * v['Higher gpu_memory_utilization']['hit_rate']:.0f} %. On a 24 GB card a few hundredths of "
        "utilization are worth more than halving every block's bytes, because the weights already take most of it."
    ),
)


def _cpu_tier_ttft() -> dict[str, Any]:
    model, llama = cost_model("qwen2.5-32b-instruct", "L40S", tp=2), cost_model("llama-3-8b", "H100-SXM-80GB")
    prompt, reused = 16384, 15360
    times = {where: model.ttft(prompt, reused, where) for where in ("recompute", "cpu", "gpu")}
    return {"link": model.link.name, **times, "copy": model.copy_seconds(reused),
            "llama_speedup": llama.ttft(prompt, reused, "recompute") / llama.ttft(prompt, reused, "cpu")}


ask(
    "07.q5",
    ("Section 10 modelled Llama-3-8B on an H100. Take Qwen2.5-32B on two L40S instead (TP=2, each behind its own "
     "PCIe 4.0 link): a 16,384-token prompt whose first 15,360 tokens were computed before. What is the modelled "
     "time to first token if those tokens are recomputed, copied back from the CPU tier, or still on the GPU?"),
    _cpu_tier_ttft,
    lambda v: (
        f"Recompute {v['recompute']:.2f} s, CPU tier {v['cpu']:.2f} s, GPU hit {v['gpu']:.2f} s (modelled). The CPU "
        f"tier costs only the copy over {v['link']}, {v['copy']:.2f} s, on top of prefilling the last 1,024 tokens: "
        f"about {v['recompute'] / v['cpu']:.0f}x faster than recomputing (Llama-3-8B on an H100 over PCIe 5: "
        f"{v['llama_speedup']:.0f}x). A larger model makes every recomputed token dearer, while its KV per token "
        "(8 KV heads, split over the 2 GPUs) stays small, and a slower GPU makes prefill dearer still."
    ),
    transfer=True,
)
