"""Notebook 02's exercises (blocks and concurrency from a budget; the longest context at a concurrency), self-test."""

from __future__ import annotations

import math
import random
from typing import Any

from kvlab.capacity.budget import PRESETS, max_concurrency, num_gpu_blocks, plan_kv_cache, plan_preset
from kvlab.capacity.budget import max_model_len_for as _max_model_len_for
from kvlab.capacity.models import ModelSpec, get_model, list_models, weights_bytes
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.sim.fragmentation import simulate
from kvlab.sim.workloads import sharegpt_like
from kvlab.units import GiB, KiB, cdiv, format_bytes

# ----------------------------------------------------------------- 02.num_blocks


def num_blocks_and_concurrency(available_bytes: int, bytes_per_token: int, block_size: int,
                               max_model_len: int) -> tuple[int, int]:
    """Reference: vLLM's num_gpu_blocks and the floor of its maximum concurrency."""
    blocks = num_gpu_blocks.__wrapped__(available_bytes, bytes_per_token * block_size)  # a negative budget: 0 blocks
    return blocks, math.floor(max_concurrency(blocks, max_model_len, block_size))


def _explain_blocks(case: Case, expected: Any, actual: Any) -> str | None:
    if not (type(actual) in (list, tuple) and len(actual) == 2 and all(type(x) is int for x in actual)):
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
        "(the null block included). `available_bytes` is negative when the weights and activations already take "
        "more than the budget: then there are no blocks, and the concurrency is 0."
    ),
    signature=("def num_blocks_and_concurrency(available_bytes: int, bytes_per_token: int, block_size: int, "
               "max_model_len: int) -> tuple[int, int]:"),
    reference=num_blocks_and_concurrency,
    shown=plain.num_blocks_and_concurrency,
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
        "First the size of one block in bytes: block_size tokens, each bytes_per_token. The pool is as many whole "
        "blocks as fit into available_bytes (round down).",
        "A request of max_model_len tokens holds whole blocks, so round its block count up (kvlab.units.cdiv "
        "divides rounding up).",
        "The concurrency is the pool's blocks shared by requests of that many blocks, rounded down. Check the "
        "corner first: a negative budget holds no blocks at all.",
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
    shown=plain.max_model_len_for,
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


# ----------------------------------------------------------------- 02.tp_concurrency (transfer)


UTILIZATION = 0.92  # vLLM's default gpu_memory_utilization


def tp_concurrency(config: dict, gpu_memory_gib: float, weights_gib: float, tp: int, kv_dtype: str,
                   block_size: int, max_model_len: int) -> int:
    """Reference: the concurrency vLLM logs (rounded down) for one GPU of a ``tp``-way deployment."""
    plan = plan_kv_cache(ModelSpec.from_hf_config(config), gpu_memory_gib=gpu_memory_gib,
                         gpu_memory_utilization=UTILIZATION, weights_gib=weights_gib / tp, kv_dtype=kv_dtype,
                         block_size=block_size, max_model_len=max_model_len, tp=tp)
    return plan.concurrency


def _concurrency_with(case: Case, per_token: int, weights_gib: float, *, unit: int = GiB,
                      floor_blocks: bool = False) -> int:
    """The same arithmetic with one input taken the wrong way (for the diagnoses): ``unit`` bytes per "GiB",
    or the blocks one request needs rounded down."""
    _, gpu_memory_gib, _, _, _, block_size, max_model_len = case.args
    available = math.ceil(gpu_memory_gib * unit * UTILIZATION) - round(weights_gib * unit)
    per_request = max_model_len // block_size if floor_blocks else cdiv(max_model_len, block_size)
    return num_gpu_blocks.__wrapped__(available, per_token * block_size) // per_request


def _tp_mistake(case: Case, *, unit: int = GiB, floor_blocks: bool = False) -> int:
    config, _, weights_gib, tp, kv_dtype, _, _ = case.args
    per_gpu = kv_bytes_per_token(ModelSpec.from_hf_config(config), kv_dtype, tp)
    return _concurrency_with(case, per_gpu, weights_gib / tp, unit=unit, floor_blocks=floor_blocks)


TP_MISTAKES = (
    Mistake(lambda *args: _tp_mistake(Case(args), unit=10**9),
            lambda case: (f"GB for GiB: gpu_memory_gib and weights_gib count GiB, 2**30 = 1,073,741,824 bytes each, "
                          f"not 10**9 (a {case.args[1]:g} GiB GPU holds {case.args[1] * GiB / 10**9:.1f} GB)")),
    Mistake(lambda *args: _tp_mistake(Case(args), floor_blocks=True),
            "floor for ceil: a request of max_model_len tokens takes ceil(max_model_len / block_size) blocks, its "
            "last one partly filled, not max_model_len // block_size"),
)


def _explain_tp(case: Case, expected: Any, actual: Any) -> str | None:
    config, _, weights_gib, tp, kv_dtype, _, _ = case.args
    if type(actual) is not int:
        return "return the concurrency as an int (vLLM's figure, rounded down)"
    spec = ModelSpec.from_hf_config(config)
    per_gpu, whole = kv_bytes_per_token(spec, kv_dtype, tp), kv_bytes_per_token(spec, kv_dtype, 1)
    if actual == _concurrency_with(case, per_gpu, weights_gib) != expected:
        return f"each GPU holds 1/tp of the weights: {weights_gib:g} / {tp} GiB, not all {weights_gib:g} GiB"
    if spec.attention == "mla" and actual == _concurrency_with(case, max(whole // tp, 1), weights_gib / tp):
        return "MLA's latent is not split by tensor parallelism: every GPU stores it whole for every token"
    if actual == _concurrency_with(case, max(whole // tp, 1), weights_gib / tp) != expected:
        return (f"a GPU never holds less than one whole KV head: with {spec.num_kv_heads} KV heads and tp = {tp}, "
                "each GPU stores max(1, heads // tp) of them")
    if actual == _concurrency_with(case, whole, weights_gib / tp) != expected:
        return "tensor parallelism splits the KV heads too: each GPU stores only its share of every token's KV"
    return None


def _random_tp_case(rng: random.Random) -> Case:
    spec = get_model(rng.choice(list_models()))
    kv_heads = 1 if spec.attention == "mla" else spec.num_kv_heads
    tp = rng.choice([t for t in (1, 2, 4, 8) if spec.attention == "mla" or kv_heads % t == 0 or t % kv_heads == 0])
    per_gpu_weights = round(weights_bytes(spec) / tp / GiB * 64) / 64  # an exact binary fraction of a GiB
    config = {k: v for k, v in spec.config.items() if not k.startswith("_")}
    return Case((config, rng.choice([24, 48, 80, 141, 192]), per_gpu_weights * tp, tp, rng.choice(["bf16", "fp8"]),
                 rng.choice([16, 32, 64]), rng.choice([2048, 8192, 32768, 131072]) + rng.randint(-7, 7)),
                probes=f"{spec.name} at TP={tp}")


def _config(name: str) -> dict[str, Any]:
    return {k: v for k, v in get_model(name).config.items() if not k.startswith("_")}


register(Exercise(
    id="02.tp_concurrency",
    title="Concurrency of a tensor-parallel deployment",
    task=(
        "A model with `weights_gib` GiB of weights in all is served with tensor parallelism on `tp` GPUs of "
        "`gpu_memory_gib` GiB each, at vLLM's default gpu_memory_utilization of 0.92. Each GPU takes "
        "`math.ceil(gpu_memory_gib * GiB * 0.92)` bytes, holds 1/tp of the weights (ignore activations and CUDA "
        "graphs) and gives the rest to its KV cache, cut into blocks of `block_size` tokens at the bytes one token "
        "takes *on that GPU* (notebook 01 §5). Return the concurrency vLLM logs for `max_model_len`, rounded down. "
        "Size every layer as full attention, as vLLM does with its hybrid KV cache manager off."
    ),
    signature=("def tp_concurrency(config: dict, gpu_memory_gib: float, weights_gib: float, tp: int, kv_dtype: str, "
               "block_size: int, max_model_len: int) -> int:"),
    reference=tp_concurrency,
    edge_cases=[
        Case((_config("deepseek-v3"), 141, 625, 8, "bf16", 64, 32768),
             probes="section 5's deployment: MLA on 8 GPUs, each with an eighth of the weights and the whole latent"),
        Case((_config("llama-3-70b"), 80, 130, 4, "bf16", 16, 8192),
             probes="GQA at TP=4: each GPU holds 2 of the 8 KV heads and a quarter of the weights"),
        Case((_config("llama-3-70b"), 80, 130, 4, "bf16", 16, 8200),
             probes="max_model_len 8,200 is not a multiple of 16: a request's last block is partly filled"),
        Case((_config("llama-3-70b"), 24, 130, 16, "fp8", 16, 8192),
             probes="16 small GPUs for 8 KV heads: each head is stored twice"),
        Case((_config("qwen2.5-32b-instruct"), 48, 61, 2, "fp8", 16, 32768),
             probes="another model: Qwen2.5-32B on two 48 GiB GPUs with an FP8 cache"),
        Case((_config("gemma-2-9b"), 24, 17.25, 1, "bf16", 16, 8192),
             probes="TP=1, and a head_dim (256) that is not hidden_size // heads"),
        Case((_config("deepseek-v3"), 80, 625, 8, "bf16", 64, 32768),
             probes="an eighth of the weights does not fit into 80 GiB x 0.92: nothing is left for the KV cache"),
    ],
    random_case=_random_tp_case,
    num_random=15,
    explain=_explain_tp,
    mistakes=TP_MISTAKES,
    transfer=True,
    hints=[
        "Everything here is per GPU. Start with the budget of one GPU and subtract that GPU's share of the weights.",
        "The bytes of one token on one GPU: notebook 01's formula with that GPU's KV heads (split by tp, never below "
        "one whole head; MLA's latent is never split).",
        "Then notebook 02's steps: whole blocks in the budget (none if it is negative), whole blocks per request of "
        "max_model_len tokens, and the floor of their ratio.",
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
     "64, max_model_len 8192. What line does vLLM 0.33.0 print at start-up, and how many token slots can requests "
     "really use?"),
    _startup_values,
    lambda v: (
        f"{v['log'][0]}. The pool has {v['num_blocks']} blocks of {format_bytes(v['block_bytes'])}, "
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


def _pooling_gqa_values() -> dict[str, Any]:
    model = get_model("llama-3-70b")
    per_gpu = plan_kv_cache(model, gpu_memory_gib=80, weights_gib=130 / 4, tp=4, block_size=16, max_model_len=32768)
    pooled = plan_kv_cache(model, gpu_memory_gib=4 * 80, weights_gib=130, block_size=16, max_model_len=32768)
    return {"per_gpu": per_gpu.concurrency, "pooled": pooled.concurrency,
            "per_token_tp1": kv_bytes_per_token(model, "bf16", 1),
            "per_token_tp4": kv_bytes_per_token(model, "bf16", 4)}


ask(
    "02.q5",
    ("Section 5 showed pooled arithmetic overstating DeepSeek-V3 eightfold. Does it mislead for Llama-3-70B at TP=4 "
     "on four 80 GiB GPUs (130 GiB of weights, max_model_len 32,768, block 16)?"),
    _pooling_gqa_values,
    lambda v: (
        f"{'No' if v['per_gpu'] == v['pooled'] else 'Barely'}: the deployment logs {v['per_gpu']} requests, the "
        f"pooled arithmetic {v['pooled']}. A GQA model "
        f"splits its 8 KV heads over the 4 GPUs, so each stores {format_bytes(v['per_token_tp4'])} per token, a "
        f"quarter of {format_bytes(v['per_token_tp1'])}: every token is stored once across the group, which is what "
        "pooling assumes. Only the rounding to whole blocks on each GPU differs. MLA's latent cannot be split, so "
        "there each GPU stores every token whole."
    ),
    transfer=True,
)
