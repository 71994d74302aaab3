"""Notebook 02's exercises (blocks and concurrency from a budget; the longest context at a concurrency), self-test."""

from __future__ import annotations

import math
import random
from typing import Any

from kvlab.capacity.budget import PRESETS, max_concurrency, num_gpu_blocks, plan_kv_cache, plan_preset
from kvlab.capacity.budget import max_model_len_for as _max_model_len_for
from kvlab.capacity.models import get_model
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.exercises.core import Case, Exercise, ask, register
from kvlab.sim.fragmentation import simulate
from kvlab.sim.workloads import sharegpt_like
from kvlab.units import GiB, KiB, format_bytes

# ----------------------------------------------------------------- 02.num_blocks


def num_blocks_and_concurrency(available_bytes: int, bytes_per_token: int, block_size: int,
                               max_model_len: int) -> tuple[int, int]:
    """Reference: vLLM's num_gpu_blocks and the floor of its maximum concurrency."""
    blocks = num_gpu_blocks(available_bytes, bytes_per_token * block_size)
    return blocks, math.floor(max_concurrency(blocks, max_model_len, block_size))


def _explain_blocks(case: Case, expected: Any, actual: Any) -> str | None:
    if not (isinstance(actual, tuple) and len(actual) == 2 and all(isinstance(x, int) for x in actual)):
        return "return a tuple of two ints: (num_blocks, concurrency)"
    available, per_token, block_size, length = case.args
    if actual[0] < 0:
        return "with nothing available there are no blocks: clamp at 0, never a negative count"
    if actual[0] == expected[0] - 1:
        return "vLLM's num_gpu_blocks and its 'Maximum concurrency' both count the null block: do not subtract it"
    if actual[0] == expected[0] and actual[1] == max(available, 0) // (per_token * length) != expected[1]:
        return "a request takes whole blocks: ceil(max_model_len / block_size) of them, not max_model_len tokens"
    return None


def _random_budget(rng: random.Random) -> Case:
    per_token = rng.choice([32 * KiB, 64 * KiB, 128 * KiB, 160 * KiB, 320 * KiB, 70272])
    available = rng.randint(-GiB, 200 * GiB)
    return Case((available, per_token, rng.choice([16, 32, 64, 128]), rng.randint(1, 200_000)),
                probes="a random budget")


_A = plan_preset("A")

register(Exercise(
    id="02.num_blocks",
    title="Blocks and concurrency from a KV budget",
    task=(
        "Given the bytes left for the KV cache, the KV bytes of one token, the block size and max_model_len, "
        "return `(num_blocks, concurrency)` as vLLM computes them: the pool is cut into whole blocks of "
        "`block_size` tokens, and the concurrency vLLM logs is the number of blocks divided by the blocks one "
        "request of max_model_len tokens needs, rounded down. Like vLLM's own figures, count every block "
        "(the null block included)."
    ),
    signature=("def num_blocks_and_concurrency(available_bytes: int, bytes_per_token: int, block_size: int, "
               "max_model_len: int) -> tuple[int, int]:"),
    reference=num_blocks_and_concurrency,
    edge_cases=[
        Case((_A.available_bytes, _A.kv_bytes_per_token, 64, 8192),
             probes="preset A: 20 MiB blocks, 128 of them per 8K request"),
        Case((8 * GiB, 128 * KiB, 16, 4096), probes="8 GiB in 2 MiB blocks: vLLM counts all 4096 and logs 16.00x"),
        Case((8 * GiB, 128 * KiB, 64, 1025),
             probes="max_model_len one token past a block boundary: the request takes 17 whole blocks"),
        Case((-5 * GiB, 320 * KiB, 64, 8192), probes="weights exceed the budget: available is negative"),
        Case((1000, 128 * KiB, 16, 100), probes="less than one block of memory"),
        Case((_A.available_bytes, _A.kv_bytes_per_token, 64, 131072), probes="preset C: one request does not fit"),
    ],
    random_case=_random_budget,
    explain=_explain_blocks,
    hints=[
        "Two steps: bytes_per_block = bytes_per_token * block_size; num_blocks = available // bytes_per_block.",
        "A request of max_model_len tokens needs ceil(max_model_len / block_size) blocks; kvlab.units.cdiv does "
        "the ceiling division.",
        "Negative available memory means 0 blocks, and 0 blocks means concurrency 0.",
    ],
))


# ----------------------------------------------------------------- 02.max_model_len_for


def max_model_len_for(num_blocks: int, block_size: int, concurrency: int) -> int:
    """Reference: the longest max_model_len at which ``concurrency`` requests all hold their blocks."""
    return _max_model_len_for(num_blocks, block_size, concurrency)


def _explain_length(case: Case, expected: Any, actual: Any) -> str | None:
    num_blocks, block_size, concurrency = case.args
    if actual == (num_blocks // concurrency) * block_size != expected:
        return "block 0 is the null block: only num_blocks - 1 blocks can hold KV"
    if actual == (num_blocks - 1) * block_size // concurrency != expected:
        return "each request holds whole blocks, so the answer is a multiple of block_size"
    return None


register(Exercise(
    id="02.max_model_len_for",
    title="The longest context at a given concurrency",
    task=(
        "A pool has `num_blocks` blocks of `block_size` tokens, block 0 being the null block that never holds "
        "KV. Return the largest max_model_len at which `concurrency` requests of max_model_len tokens can all "
        "hold every one of their blocks at the same time (0 if not even one block each fits)."
    ),
    signature="def max_model_len_for(num_blocks: int, block_size: int, concurrency: int) -> int:",
    reference=max_model_len_for,
    edge_cases=[
        Case((880, 64, 6), probes="preset A: 879 usable blocks shared by 6 requests"),
        Case((4096, 16, 16), probes="the 8 GiB example: the null block costs the 16 requests one block"),
        Case((12318, 64, 24), probes="preset B: one GPU of a TP=8 DeepSeek-V3 deployment"),
        Case((880, 64, 1000), probes="more requests than usable blocks: nothing fits"),
        Case((1, 16, 1), probes="a pool holding only the null block"),
    ],
    random_case=lambda rng: Case((rng.randint(1, 20000), rng.choice([16, 32, 64, 128]), rng.randint(1, 300)),
                                 probes="a random pool"),
    explain=_explain_length,
    hints=[
        "How many blocks can each request have? Share the usable blocks (num_blocks - 1) equally, rounding down.",
        "A request of max_model_len tokens holds ceil(max_model_len / block_size) blocks; the longest length "
        "that fits in k blocks is k * block_size.",
    ],
))


# ----------------------------------------------------------------- self-test


def _startup_values() -> dict[str, Any]:
    plan = plan_preset("A")
    return {"log": plan.startup_log(), "num_blocks": plan.num_blocks, "usable_tokens": plan.usable_tokens,
            "block_bytes": plan.bytes_per_block, "max_model_len": plan.max_model_len,
            "max_concurrency": plan.max_concurrency, "usable_concurrency": plan.usable_concurrency}


ask(
    "02.q1",
    ("Preset A: Llama-3-70B in bf16 on a 160 GiB GPU at gpu_memory_utilization 0.92, 130 GiB of weights, block "
     "64, max_model_len 8192. What two lines does vLLM print at start-up, and how many token slots can requests "
     "really use?"),
    _startup_values,
    lambda v: (
        f"{v['log'][0]} and {v['log'][1]}. The pool has {v['num_blocks']} blocks of {format_bytes(v['block_bytes'])}, "
        f"but block 0 is the null block, so requests can use {v['usable_tokens']:,} token slots: "
        f"{v['usable_concurrency']} requests of {v['max_model_len']:,} tokens held whole at once "
        f"({v['max_concurrency']:.3f} before rounding down)."
    ),
)


def _pooled_values() -> dict[str, Any]:
    model = get_model("deepseek-v3")
    per_gpu = plan_preset("B")
    pooled = plan_kv_cache(model, gpu_memory_gib=8 * 141, weights_gib=8 * PRESETS["B"]["weights_gib"],
                           max_model_len=32768)
    return {"per_gpu": per_gpu.concurrency, "pooled": pooled.concurrency,
            "per_token_tp1": kv_bytes_per_token(model, "bf16", 1),
            "per_token_tp8": kv_bytes_per_token(model, "bf16", 8)}


ask(
    "02.q2",
    ("Pooling 8 x 141 GiB and 625 GiB of DeepSeek-V3 weights gives room for 192 requests of 32K tokens. How many does "
     "an 8-GPU TP=8 deployment actually hold, and why?"),
    _pooled_values,
    lambda v: (
        f"{v['per_gpu']}. MLA's latent cannot be split across tensor-parallel ranks: each GPU stores the whole "
        f"{format_bytes(v['per_token_tp8'])} per token (the same as at TP=1, {format_bytes(v['per_token_tp1'])}), "
        f"so every request's KV sits on all 8 GPUs at once. The pooled {v['pooled']} adds up memory that holds "
        "eight copies of the same tokens."
    ),
)


def _block_size_values() -> dict[str, Any]:
    settings = {k: v for k, v in PRESETS["A"].items() if k not in ("model", "block_size")}
    plans = {b: plan_kv_cache("llama-3-70b", block_size=b, **settings) for b in (16, 256)}
    return {b: {"max_concurrency": p.max_concurrency, "usable_tokens": p.usable_tokens} for b, p in plans.items()}


ask(
    "02.q3",
    "Preset A with block size 256 instead of 16: does vLLM's maximum concurrency go up?",
    _block_size_values,
    lambda v: (
        f"No: {v[16]['max_concurrency']:.2f}x at block 16, {v[256]['max_concurrency']:.2f}x at block 256. A block "
        "holds the same bytes per token whatever its size, so bigger blocks only round the pool down more coarsely "
        f"({v[16]['usable_tokens']:,} against {v[256]['usable_tokens']:,} usable slots) and waste more of each "
        "request's last block. Block size buys kernel efficiency and shorter block tables, not capacity."
    ),
)


def _fragmentation_values() -> dict[str, Any]:
    requests = sharegpt_like(2000, seed=0)
    pool = plan_preset("A").usable_tokens
    return {p: simulate(requests, pool_tokens=pool, max_model_len=2048, policy=p).utilization
            for p in ("max", "paged")}


ask(
    "02.q4",
    ("2,000 ShareGPT-like requests share preset A's usable KV slots, max_model_len 2048. Reserving max_model_len "
     "contiguous slots per request, what share of the pool holds tokens? And with 16-token blocks?"),
    _fragmentation_values,
    lambda v: (
        f"About {100 * v['max']:.0f}% against {100 * v['paged']:.1f}%. A reservation of 2,048 slots is mostly "
        "empty: the average request ends near 500 tokens and fills its slots one per step. Paging allocates a "
        "block only when the previous one is full, so fewer than 16 slots per request wait empty."
    ),
)
