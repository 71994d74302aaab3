"""Notebook 02's exercises (blocks and concurrency from a budget; the longest context at a concurrency), self-test."""

from __future__ import annotations

import math
import random
from typing import Any

from kvlab.capacity.budget import PRESETS, num_gpu_blocks, plan_kv_cache, plan_preset
from kvlab.capacity.budget import max_model_len_for as _max_model_len_for
from kvlab.capacity.models import ModelSpec, get_model, list_models, weights_bytes
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.exercises.predictions import Prediction, log_line_numbers, register_prediction
from kvlab.sim.fragmentation import simulate
from kvlab.sim.workloads import sharegpt_like
from kvlab.units import GiB, cdiv, format_bytes

# ----------------------------------------------------------------- 02.num_blocks (a prediction)

_LOG_CASE = dict(gpu_memory_gib=80, kv_cache_memory_gib=20, max_model_len=9000)  # Llama-3-8B, bf16, blocks of 16


def _log_line(*, unit: int = GiB, per_request: Any = cdiv, blocks_less: int = 0, tokens: str = "int(X x M)",
              floor_x: bool = False) -> str:
    """The KV line of _LOG_CASE reasoned one step the wrong way (by default, the right way)."""
    per_token, block_size, length = kv_bytes_per_token(get_model("llama-3-8b")), 16, _LOG_CASE["max_model_len"]
    num_blocks = _LOG_CASE["kv_cache_memory_gib"] * unit // (per_token * block_size) - blocks_less
    x = num_blocks / per_request(length, block_size)
    x = math.floor(x) if floor_x else x
    n = num_blocks * block_size if tokens == "blocks" else int(x * length)
    return f"GPU KV cache size: {n:,} tokens, Maximum concurrency for {length:,} tokens per request: {x:.2f}x"


LOG_MISTAKES = (
    Mistake(lambda: _log_line(unit=10**9), "kv_cache_memory_gib is in GiB (2**30 bytes), not GB (10**9): the pool is "
                                           "7 % larger than 20 GB"),
    Mistake(lambda: _log_line(per_request=lambda m, b: m // b),
            "a request of 9,000 tokens takes ceil(9000 / 16) = 563 blocks: its last block is partly filled, but whole"),
    Mistake(lambda: _log_line(blocks_less=1),
            "vLLM's line counts every block, the null block included: do not subtract it here"),
    Mistake(lambda: _log_line(tokens="blocks"),
            "the token count is int(X x max_model_len), the tokens that many requests hold; it equals num_blocks x "
            "block_size only when max_model_len is a multiple of the block size"),
    Mistake(lambda: _log_line(floor_x=True), "vLLM prints the ratio with two decimals; it does not round it down to "
                                             "whole requests"),
)

register_prediction(Prediction(
    id="02.num_blocks",
    title="the KV line vLLM prints at start-up",
    question=(
        "Llama-3-8B (bf16 KV, 128 KiB per token) is started with kv_cache_memory_gib=20 (the pool's size, given "
        "directly), blocks of 16 tokens and max_model_len=9000. Predict, number for number, the line vLLM 0.33.0 logs: "
        "`GPU KV cache size: N tokens, Maximum concurrency for M tokens per request: X.XXx`."
    ),
    form='"GPU KV cache size: 123,456 tokens, Maximum concurrency for 9,000 tokens per request: 12.34x"',
    run=lambda: plan_kv_cache("llama-3-8b", **_LOG_CASE).startup_log()[0],
    runs='plan_kv_cache("llama-3-8b", gpu_memory_gib=80, kv_cache_memory_gib=20, max_model_len=9000).startup_log()',
    normal=log_line_numbers,
    mistakes=LOG_MISTAKES,
    hints=[
        "First the pool: how many whole blocks of 16 tokens x 128 KiB fit into 20 GiB?",
        "Then one request: how many blocks does a request of 9,000 tokens hold? X is the pool's blocks over that.",
        "N is not the pool's slots here: section 3 says how vLLM turns X back into tokens.",
    ],
))


# ----------------------------------------------------------------- 02.max_model_len_for


def max_model_len_for(num_blocks: int, block_size: int, concurrency: int) -> int:
    """Reference: the longest max_model_len at which ``concurrency`` requests all hold their blocks."""
    return _max_model_len_for(num_blocks, block_size, concurrency)


def _explain_length(case: Case, expected: Any, actual: Any) -> str | None:
    return "return a number of tokens (an int)" if type(actual) is not int else None


LENGTH_MISTAKES = (
    Mistake(lambda num_blocks, block_size, concurrency: num_blocks // concurrency * block_size,
            "block 0 is the null block: only num_blocks - 1 blocks can hold KV"),
    Mistake(lambda num_blocks, block_size, concurrency: max(num_blocks - 1, 0) * block_size // concurrency,
            "each request holds whole blocks, so the answer is a multiple of block_size"),
)


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
    mistakes=LENGTH_MISTAKES,
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


def _tp_mistake(case: Case, *, unit: int = GiB, floor_blocks: bool = False, whole_weights: bool = False,
                split: bool = False, unsplit: bool = False, implied_head_dim: bool = False) -> int:
    """tp_concurrency with one step taken the wrong way: GB for GiB, floor for ceil, all the weights on every GPU,
    everything split by tp (a latent, or a head below one), no KV split at all, or D as hidden_size // heads."""
    config, _, weights_gib, tp, kv_dtype, _, _ = case.args
    if implied_head_dim:
        config = {**config, "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    spec = ModelSpec.from_hf_config(config)
    per_gpu = kv_bytes_per_token(spec, kv_dtype, tp)
    if split:
        per_gpu = max(kv_bytes_per_token(spec, kv_dtype, 1) // tp, 1)
    elif unsplit:
        per_gpu = kv_bytes_per_token(spec, kv_dtype, 1)
    return _concurrency_with(case, per_gpu, weights_gib if whole_weights else weights_gib / tp, unit=unit,
                             floor_blocks=floor_blocks)


def _split_says(case: Case) -> str:
    config, tp = case.args[0], case.args[3]
    if config.get("kv_lora_rank"):
        return "MLA's latent is not split by tensor parallelism: every GPU stores it whole for every token"
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return (f"a GPU never holds less than one whole KV head: with {kv_heads} KV heads and tp = {tp}, each GPU stores "
            "max(1, heads // tp) of them")


TP_MISTAKES = (
    Mistake(lambda *args: _tp_mistake(Case(args), unit=10**9),
            lambda case: (f"GB for GiB: gpu_memory_gib and weights_gib count GiB, 2**30 = 1,073,741,824 bytes each, "
                          f"not 10**9 (a {case.args[1]:g} GiB GPU holds {case.args[1] * GiB / 10**9:.1f} GB)")),
    Mistake(lambda *args: _tp_mistake(Case(args), floor_blocks=True),
            "floor for ceil: a request of max_model_len tokens takes ceil(max_model_len / block_size) blocks, its "
            "last one partly filled, not max_model_len // block_size"),
    Mistake(lambda *args: _tp_mistake(Case(args), whole_weights=True),
            lambda case: (f"each GPU holds 1/tp of the weights: {case.args[2]:g} / {case.args[3]} GiB, not all "
                          f"{case.args[2]:g} GiB")),
    Mistake(lambda *args: _tp_mistake(Case(args), split=True), _split_says),
    Mistake(lambda *args: _tp_mistake(Case(args), unsplit=True),
            "tensor parallelism splits the KV heads too: each GPU stores only its share of every token's KV"),
    Mistake(lambda *args: _tp_mistake(Case(args), implied_head_dim=True),
            lambda case: (f"this config gives head_dim = {case.args[0].get('head_dim')}, not hidden_size // "
                          f"num_attention_heads = {case.args[0]['hidden_size'] // case.args[0]['num_attention_heads']}"
                          ": when head_dim is there, use it")),
)


def _explain_tp(case: Case, expected: Any, actual: Any) -> str | None:
    return "return the concurrency as an int (vLLM's figure, rounded down)" if type(actual) is not int else None


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
    shown=plain.tp_concurrency,
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
        Case((_config("gpt-oss-20b"), 80, 13, 2, "bf16", 16, 131072),
             probes="gpt-oss-20b at TP=2: head_dim 64, while hidden_size // num_attention_heads = 45"),
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
