"""Notebook 09's exercises (MLA's bytes, the absorbed query, which path reads less, KV per GPU under TP) and self-test.

Nothing here imports ``kvlab.kernels`` (and so Triton): the absorbed query is one matrix product in torch.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from kvlab.capacity.budget import plan_kv_cache
from kvlab.capacity.mla import MLADims, absorb_crossover, mla_attention_cost, mla_dims
from kvlab.capacity.models import ModelSpec, get_model
from kvlab.capacity.parallel import plan_parallel
from kvlab.capacity.sizing import KV_DTYPE_BYTES, kv_bytes_per_token, kv_heads_per_rank, mha_ratio
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.units import KiB, format_bytes

DTYPES = ("fp32", "bf16", "fp16", "fp8")


def _deepseek_config() -> dict[str, Any]:
    return {k: v for k, v in get_model("deepseek-v3").config.items() if not k.startswith("_")}


def _mla_config(rng: random.Random) -> dict[str, Any]:
    """A plausible MLA config: layers, heads, latent and head sizes (num_key_value_heads listed, as DeepSeek's are)."""
    heads = rng.choice([16, 32, 64, 128])
    return {"model_type": "deepseek_v3", "num_hidden_layers": rng.choice([2, 26, 27, 60, 61]),
            "num_attention_heads": heads, "num_key_value_heads": heads, "hidden_size": rng.choice([2048, 7168]),
            "kv_lora_rank": rng.choice([256, 512]), "qk_rope_head_dim": rng.choice([32, 64]),
            "qk_nope_head_dim": rng.choice([64, 128]), "v_head_dim": rng.choice([64, 128])}


# ----------------------------------------------------------------- 09.latent_bytes


def latent_and_mha_bytes(config: dict, kv_dtype: str) -> tuple[int, int]:
    """Reference: one token's KV bytes over all layers, as MLA stores it and as the same model would in MHA."""
    spec = ModelSpec.from_hf_config(config)
    return kv_bytes_per_token(spec, kv_dtype), kv_bytes_per_token(spec.mha_equivalent(), kv_dtype)


def _explain_latent(case: Case, expected: Any, actual: Any) -> str | None:
    if not (type(actual) in (list, tuple) and len(actual) == 2):
        return "return a pair: (bytes as MLA stores them, bytes as the same model's MHA would)"
    return None


def _latent_with(config: dict, kv_dtype: str, *, f: int = 1, mha_keys: str = "v_head_dim") -> tuple[int, int]:
    """latent_and_mha_bytes with one step taken the wrong way: the latent counted twice like a K and a V (``f``), or
    the MHA keys given their nope and rope parts (``mha_keys="nope+rope"``)."""
    b, layers, heads = KV_DTYPE_BYTES[kv_dtype], config["num_hidden_layers"], config["num_attention_heads"]
    latent = f * layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b
    keys = config["v_head_dim"] if mha_keys == "v_head_dim" else config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    return int(latent), int(layers * heads * (keys + config["v_head_dim"]) * b)


LATENT_MISTAKES = (
    Mistake(lambda config, kv_dtype: _latent_with(config, kv_dtype, f=2),
            "MLA stores one vector per token and layer, c_kv and k_pe side by side: f = 1, no separate V"),
    Mistake(lambda config, kv_dtype: _latent_with(config, kv_dtype, mha_keys="nope+rope"),
            "the source's MHA equivalent (its 56.9x) gives every head v_head_dim values for K and for V: "
            "2 x layers x heads x v_head_dim x bytes"),
    Mistake(lambda config, kv_dtype: _latent_with(config, kv_dtype, f=2, mha_keys="nope+rope"),
            "MLA stores one vector per token and layer (f = 1), and the source's MHA equivalent gives every head "
            "v_head_dim values for K and for V"),
)


register(Exercise(
    id="09.latent_bytes",
    title="An MLA token's bytes, and the MHA it replaces",
    task=(
        "Given an MLA model's `config.json` (as a dict) and a KV dtype (`fp32`, `bf16`, `fp16` or `fp8`), return "
        "`(mla_bytes, mha_bytes)`: the bytes one token's KV takes over all layers as MLA caches it, and as the same "
        "model would cache it with multi-head attention, one K and one V of `v_head_dim` values per query head (the "
        "source articles' comparison, which gives DeepSeek-V3's 56.9x)."
    ),
    signature="def latent_and_mha_bytes(config: dict, kv_dtype: str) -> tuple[int, int]:",
    reference=latent_and_mha_bytes,
    shown=plain.latent_and_mha_bytes,
    edge_cases=[
        Case((_deepseek_config(), "bf16"), probes="DeepSeek-V3 in bf16: the source's 68.625 KiB per token"),
        Case((_deepseek_config(), "fp8"), probes="an FP8 latent cache: one byte per value"),
        Case(({**_mla_config(random.Random(1)), "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
               "v_head_dim": 16}, "fp32"), probes="the notebook's tiny model in float32, as its engine allocates it"),
        Case(({**_mla_config(random.Random(2)), "qk_nope_head_dim": 128, "v_head_dim": 64}, "bf16"),
             probes="v_head_dim differs from qk_nope_head_dim: the MHA side uses v_head_dim"),
    ],
    random_case=lambda rng: Case((_mla_config(rng), rng.choice(DTYPES)), probes="a random MLA config"),
    explain=_explain_latent,
    mistakes=LATENT_MISTAKES,
    hints=[
        "MLA caches per token and layer one vector: the latent c_kv (kv_lora_rank values) followed by the rotated "
        "k_pe (qk_rope_head_dim values). num_key_value_heads plays no part.",
        "The MHA side caches, per layer, a K and a V for each of num_attention_heads heads.",
        "Bytes per value: 4 for fp32, 2 for bf16 and fp16, 1 for fp8.",
    ],
))


# ----------------------------------------------------------------- 09.absorbed_query


def absorbed_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """Reference: one head's ``q_nope [T, P]`` taken into latent space by its ``W_UK [Lkv, P]``: ``[T, Lkv]``."""
    return q_nope @ w_uk.T


def _query_case(rng: random.Random, tokens: int, rank: int, nope: int, *, loud: float = 1.0, probes: str) -> Case:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return Case((torch.randn(tokens, nope, generator=g) * loud, torch.randn(rank, nope, generator=g)), probes=probes)


def _close_tensors(expected: torch.Tensor, actual: Any) -> bool:
    """Equal to float rounding; a numpy array or nested list of the right values (canonical form) passes too."""
    if not isinstance(actual, torch.Tensor):
        try:
            actual = torch.tensor(actual, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            return False
    if actual.shape != expected.shape or not actual.is_floating_point():
        return False
    return bool(torch.allclose(actual.to(torch.float64), expected.to(torch.float64), rtol=1e-4,
                               atol=1e-4 * float(expected.abs().max().clamp(min=1.0))))


def _explain_query(case: Case, expected: torch.Tensor, actual: Any) -> str | None:
    q_nope = case.args[0]
    if not isinstance(actual, torch.Tensor):
        try:
            actual = torch.tensor(actual, dtype=q_nope.dtype)
        except (TypeError, ValueError, RuntimeError):
            return "return a torch tensor [num_tokens, kv_lora_rank]"
    if actual.shape != expected.shape:
        return (f"the absorbed query has one value per latent dimension: [num_tokens, kv_lora_rank] = "
                f"{list(expected.shape)}, got {list(actual.shape)}")
    return None


QUERY_MISTAKES = (
    Mistake(lambda q_nope, w_uk: torch.nn.functional.pad(q_nope, (0, w_uk.shape[0] - q_nope.shape[1])),
            "q_nope lives in the key's nope space; only W_UK takes it to the latent, so multiply by W_UK"),
    Mistake(lambda q_nope, w_uk: q_nope @ w_uk.T * q_nope.shape[1] ** -0.5,
            "the softmax scale is applied once, to the score, inside the kernel: the absorbed query is the bare "
            "product"),
)


register(Exercise(
    id="09.absorbed_query",
    title="The absorbed query of one head",
    task=(
        "For one attention head, `q_nope` [num_tokens, qk_nope_head_dim] is the part of its queries without rotary, "
        "and `w_uk` [kv_lora_rank, qk_nope_head_dim] is that head's slice of W_UK (`W_UK[:, head, :]` as "
        "`split_kv_b_proj` returns it), which decompresses a latent c_kv into the head's key: "
        "`k_nope = c_kv @ w_uk`. Return the absorbed query `q_latent` [num_tokens, kv_lora_rank], the one for which "
        "`q_latent @ c_kv` equals `q_nope @ k_nope` for every latent `c_kv`."
    ),
    signature="def absorbed_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:",
    reference=absorbed_query,
    edge_cases=[
        _query_case(random.Random(1), 1, 32, 16, probes="one decode token of the tiny model's head (Lkv 32, P 16)"),
        _query_case(random.Random(2), 5, 512, 128, probes="DeepSeek-V3's sizes (Lkv 512, P 128), five query tokens"),
        _query_case(random.Random(3), 3, 24, 24, probes="a latent as wide as the nope part: the shapes do not tell"),
        _query_case(random.Random(4), 2, 40, 8, loud=30.0, probes="large queries: nothing to normalise"),
    ],
    random_case=lambda rng: _query_case(rng, rng.randint(1, 6), rng.choice([16, 32, 64, 96]), rng.choice([8, 16, 32]),
                                        probes="a random head"),
    compare=_close_tensors,
    explain=_explain_query,
    mistakes=QUERY_MISTAKES,
    hints=[
        "Write the score of one key: q_nope . k_nope with k_nope = c_kv @ w_uk, i.e. a sum over the nope dimension "
        "p and the latent dimension l of q_nope[p] * c_kv[l] * w_uk[l, p].",
        "Group the sum so that c_kv stands alone: what multiplies c_kv[l] is a sum over p that depends only on the "
        "query and the weight.",
        "For several query tokens that is one matrix product with w_uk transposed; the softmax scale stays out.",
    ],
))


# ----------------------------------------------------------------- 09.fewer_bytes


def fewer_bytes_read(query_len: int, context_len: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                     qk_rope_head_dim: int, v_head_dim: int) -> str:
    """Reference: "naive" or "absorbed", the path kvlab.capacity.mla counts fewer bytes read for (naive on a tie)."""
    dims = MLADims(num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    return mla_attention_cost(dims, query_len, context_len).fewer_bytes_read


def _explain_bytes(case: Case, expected: Any, actual: Any) -> str | None:
    return None if actual in ("naive", "absorbed") else 'return "naive" or "absorbed"'


def _by_flops(sq: int, ctx: int, heads: int, rank: int, nope: int, rope: int, v: int) -> str:
    return mla_attention_cost(MLADims(heads, rank, nope, rope, v), sq, ctx).fewer_flops


BYTES_MISTAKES = (
    Mistake(lambda sq, ctx, heads, rank, nope, rope, v: "naive" if (sq + ctx) * (nope + rope + v) < 2 * sq * rank
            else "absorbed", 'a tie goes to "naive": absorbed must read strictly fewer bytes'),
    Mistake(_by_flops, "that is the path with fewer FLOPs; count the bytes each path reads instead"),
    Mistake(lambda sq, *rest: "absorbed" if sq == 1 else "naive",
            "the query length alone does not decide: what naive reads back grows with every cached latent "
            "(K and V of all heads), what absorbed adds grows with the query tokens only"),
)


def _random_bytes_case(rng: random.Random) -> Case:
    rank, nope, rope, v = rng.choice([128, 256, 512]), rng.choice([32, 64, 128]), rng.choice([16, 64]), rng.choice(
        [32, 64, 128])
    sq = rng.choice([1, 2, 8, 64, 512])
    return Case((sq, rng.choice([0, 0, 10, 100, 1000, 10000]), rng.choice([1, 16, 128]), rank, nope, rope, v),
                probes="a random step shape")


register(Exercise(
    id="09.fewer_bytes",
    title="Which path reads fewer bytes",
    task=(
        "One sequence runs `query_len` query tokens after `context_len` cached latents through one MLA layer of the "
        "given shapes. Counted as `kvlab.capacity.mla` counts (every tensor crosses memory once per use; both paths "
        "read every latent once and the same weights), which reads fewer bytes: decompressing (`\"naive\"`: K and V "
        "of every head written, then read back) or absorbing (`\"absorbed\"`: q_latent and o_latent written, then "
        "read back)? Return `\"naive\"` on a tie."
    ),
    signature=("def fewer_bytes_read(query_len: int, context_len: int, num_heads: int, kv_lora_rank: int, "
               "qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int) -> str:"),
    reference=fewer_bytes_read,
    shown=plain.fewer_bytes_read,
    edge_cases=[
        Case((1, 4095, 128, 512, 128, 64, 128), probes="DeepSeek-V3, one decode token after 4,095 cached"),
        Case((64, 0, 128, 512, 128, 64, 128), probes="DeepSeek-V3, a 64-token prefill with nothing cached"),
        Case((64, 4096, 128, 512, 128, 64, 128),
             probes="a 64-token chunk after 4,096 cached: more query tokens, yet absorbing reads less"),
        Case((64, 140, 128, 512, 128, 64, 128), probes="just below the balance: 204 x 320 < 2 x 512 x 64"),
        Case((64, 141, 128, 512, 128, 64, 128), probes="just past it: 205 x 320 > 2 x 512 x 64"),
        Case((1, 0, 16, 512, 128, 64, 128), probes="a first token with nothing cached: one latent, one query"),
        Case((5, 11, 128, 512, 128, 64, 128), probes="a tie: 16 x 320 = 2 x 512 x 5 per head, and a tie is naive"),
    ],
    random_case=_random_bytes_case,
    explain=_explain_bytes,
    mistakes=BYTES_MISTAKES,
    hints=[
        "Both paths read every cached latent once and the same W_UK and W_UV: those cancel. Compare only what each "
        "path writes and then reads back.",
        "Naive reads back K (qk_nope_head_dim + qk_rope_head_dim per head) and V (v_head_dim per head) for every "
        "latent, cached or new; absorbed reads back q_latent and o_latent, kv_lora_rank each, per head and query "
        "token.",
        "The heads and the element size multiply both sides alike.",
    ],
))


# ----------------------------------------------------------------- 09.kv_per_gpu (transfer)


def kv_bytes_per_gpu(config: dict, tp: int, kv_dtype: str) -> int:
    """Reference: one token's KV bytes on one GPU of a TP=``tp`` deployment."""
    return kv_bytes_per_token(ModelSpec.from_hf_config(config), kv_dtype, tp)


def _gqa_config(rng: random.Random, kv_heads: int | None = None, own_head_dim: bool = False) -> dict[str, Any]:
    """A GQA or MQA config; with ``own_head_dim``, half the time a head_dim of its own, not hidden_size / heads
    (as Qwen3's and Gemma's are)."""
    heads = rng.choice([32, 64])
    config = {"model_type": "llama", "num_hidden_layers": rng.choice([16, 32, 80]), "num_attention_heads": heads,
              "num_key_value_heads": kv_heads or rng.choice([1, 2, 4, 8]), "hidden_size": heads * 128, "head_dim": 128}
    if own_head_dim and rng.random() < 0.5:
        config.update(hidden_size=rng.choice([2880, 3584, 5120]), head_dim=rng.choice([64, 128, 256]))
    return config


def _per_gpu_with(config: dict, tp: int, kv_dtype: str, *, implied_head_dim: bool = False,
                  split_latent: bool = False, fractional_heads: bool = False) -> int:
    """kv_bytes_per_gpu with one step taken the wrong way (a known mistake, for naming it)."""
    spec = ModelSpec.from_hf_config(config)
    b, layers = KV_DTYPE_BYTES[kv_dtype], spec.num_layers
    if spec.attention == "mla":
        return kv_bytes_per_token(spec, kv_dtype) // (tp if split_latent else 1)
    head_dim = config["hidden_size"] // config["num_attention_heads"] if implied_head_dim else spec.head_dim
    heads = spec.num_kv_heads / tp if fractional_heads else kv_heads_per_rank(spec, tp)
    return int(2 * layers * heads * head_dim * b)


def _implied_head_dim_says(case: Case) -> str:
    config = case.args[0]
    return (f"this config gives head_dim = {config.get('head_dim')}, which is not hidden_size // num_attention_heads = "
            f"{config['hidden_size'] // config['num_attention_heads']}: when head_dim is there, use it")


def _replica_says(case: Case) -> str:
    config, tp = case.args[0], case.args[1]
    return (f"with more ranks ({tp}) than KV heads ({config['num_key_value_heads']}) a head cannot be cut: each rank "
            "keeps a whole copy of one KV head")


TP_MISTAKES = (
    Mistake(lambda c, tp, d: _per_gpu_with(c, tp, d, split_latent=True),
            "MLA's latent cannot be split across ranks (max_tp_shards = 1): every GPU stores the whole of it, "
            "so TP leaves its bytes per token unchanged"),
    Mistake(lambda c, tp, d: _per_gpu_with(c, tp, d, fractional_heads=True), _replica_says),
    Mistake(lambda c, tp, d: _per_gpu_with(c, tp, d, implied_head_dim=True), _implied_head_dim_says),
)


def _random_tp_case(rng: random.Random) -> Case:
    config = _mla_config(rng) if rng.random() < 0.4 else _gqa_config(rng, own_head_dim=True)
    kv_heads = 1 if config.get("kv_lora_rank") else config["num_key_value_heads"]
    tp = rng.choice([t for t in (1, 2, 4, 8, 16) if t % kv_heads == 0 or kv_heads % t == 0])
    return Case((config, tp, rng.choice(DTYPES)), probes="a random model and TP size")


def _explain_tp(case: Case, expected: Any, actual: Any) -> str | None:
    return "return a whole number of bytes (an int)" if type(actual) is not int else None


register(Exercise(
    id="09.kv_per_gpu",
    title="KV bytes per token on one GPU under tensor parallelism",
    task=(
        "Given a model's `config.json` (GQA, MQA or MLA), a tensor-parallel size `tp` and a KV dtype, return the "
        "bytes one token's KV takes on each GPU. GQA and MQA split their KV heads across the ranks (a head is never "
        "cut: with more ranks than heads each rank keeps one whole head); an MLA layer's latent is never split. "
        "A head's size is `head_dim`, or `hidden_size // num_attention_heads` where the config has none. Every `tp` "
        "given divides the KV heads or is a multiple of them."
    ),
    signature="def kv_bytes_per_gpu(config: dict, tp: int, kv_dtype: str) -> int:",
    reference=kv_bytes_per_gpu,
    shown=plain.kv_bytes_per_gpu,
    edge_cases=[
        Case((_deepseek_config(), 8, "bf16"), probes="DeepSeek-V3 at TP=8: still 68.625 KiB on every GPU"),
        Case(({k: v for k, v in get_model("llama-3-70b").config.items() if not k.startswith("_")}, 8, "bf16"),
             probes="Llama-3-70B's 8 KV heads over 8 GPUs: one head each"),
        Case(({k: v for k, v in get_model("llama-3-70b").config.items() if not k.startswith("_")}, 16, "bf16"),
             probes="16 GPUs for 8 KV heads: each head is kept by two ranks"),
        Case((_gqa_config(random.Random(1), kv_heads=1), 4, "fp8"), probes="MQA: its one KV head on every GPU"),
        Case((_gqa_config(random.Random(2), kv_heads=8), 1, "fp32"), probes="TP=1: the whole model on one GPU"),
        Case(({k: v for k, v in get_model("gemma-2-9b").config.items() if not k.startswith("_")}, 4, "bf16"),
             probes="Gemma-2-9B: head_dim 256, while hidden_size // num_attention_heads = 224"),
        Case(({k: v for k, v in get_model("gpt-oss-20b").config.items() if not k.startswith("_")}, 8, "fp8"),
             probes="gpt-oss-20b at TP=8: head_dim 64, while hidden_size // num_attention_heads = 45"),
    ],
    random_case=_random_tp_case,
    explain=_explain_tp,
    mistakes=TP_MISTAKES,
    transfer=True,
    hints=[
        "Start from bytes per token on one GPU: f x L x Hkv x D x b, where only Hkv can change with TP.",
        "For GQA and MQA, Hkv per rank is num_key_value_heads / tp while that is at least 1; past that, 1.",
        "For MLA, f = 1, Hkv = 1 and D = kv_lora_rank + qk_rope_head_dim, on every rank.",
    ],
))


# ----------------------------------------------------------------- self-test


def _bytes_question() -> dict[str, Any]:
    ds = get_model("deepseek-v3")
    return {"latent": ds.head_dim, "rank": ds.kv_lora_rank, "rope": ds.qk_rope_head_dim, "layers": ds.num_layers,
            "bf16": kv_bytes_per_token(ds, "bf16"), "mha": kv_bytes_per_token(ds.mha_equivalent(), "bf16"),
            "ratio": mha_ratio(ds), "heads": ds.num_attention_heads, "v": ds.mha_head_dim}


ask(
    "09.q1",
    "How many bytes does one token of DeepSeek-V3 take in a bf16 KV cache, and how many would the same model take "
    "with multi-head attention?",
    _bytes_question,
    lambda v: (
        f"{v['layers']} layers x one latent of {v['rank']} + {v['rope']} = {v['latent']} values x 2 bytes = "
        f"{v['bf16']:,} bytes ({v['bf16'] / KiB:g} KiB). As MHA, {v['heads']} heads x {v['v']} values for K "
        f"and for V: {format_bytes(v['mha'])}, {v['ratio']:.1f}x more."),
)


def _paths_question() -> dict[str, Any]:
    ds = get_model("deepseek-v3")
    decode, prefill = mla_attention_cost(ds, 1, 4095), mla_attention_cost(ds, 64, 0)
    return {"decode_bytes": decode.bytes_read_ratio, "decode_flops": decode.flops_ratio,
            "prefill_flops": prefill.flops_ratio, "prefill_fewer": prefill.fewer_flops,
            "crossover": absorb_crossover(ds, 4096)}


ask(
    "09.q2",
    "DeepSeek-V3, one layer: a decode token after 4,095 cached latents, and a 64-token prompt with nothing cached. "
    "Which way does each attend in vLLM, and why?",
    _paths_question,
    lambda v: (
        f"The decode absorbs: decompressing would read {v['decode_bytes']:.0f}x the bytes (K and V of 128 heads for "
        f"every cached latent) and compute {v['decode_flops']:.0f}x the FLOPs, all for one query. The prefill "
        f"decompresses: with as many queries as keys the decompression is shared, and absorbing would cost "
        f"{1 / v['prefill_flops']:.2f}x its FLOPs; a prefill is bound by compute. After 4,096 cached latents the "
        f"FLOPs cross at {v['crossover']} query tokens: a prefill chunk that long decompresses too."),
)


def _parallel_question() -> dict[str, Any]:
    kw = dict(num_gpus=8, gpu_memory_gib=141, max_model_len=32768)
    tp, dp = plan_parallel("deepseek-v3", "tp", **kw), plan_parallel("deepseek-v3", "dp_attention", **kw)
    pooled = plan_kv_cache("deepseek-v3", gpu_memory_gib=8 * 141, weights_gib=tp.per_gpu.weights_bytes * 8 / 2**30,
                           max_model_len=32768)
    return {"tp": tp.requests, "dp": dp.requests, "pooled": pooled.concurrency, "copies": tp.kv_copies,
            "tp_weights": tp.per_gpu.weights_bytes, "dp_weights": dp.per_gpu.weights_bytes,
            "dp_per_gpu": dp.per_gpu.concurrency}


ask(
    "09.q3",
    "DeepSeek-V3 on 8 x 141 GiB GPUs, bf16 KV, requests of 32K tokens: how many requests does it hold with TP=8, "
    "and with data-parallel attention (experts split by expert parallelism)?",
    _parallel_question,
    lambda v: (
        f"TP=8: {v['tp']}. Every rank keeps the whole latent of every request ({v['copies']:.0f} copies), so the "
        f"8 pools hold the same {v['tp']} requests; pooling the memory and dividing gives {v['pooled']}, which "
        f"counts each copy as another request. DP attention: each GPU serves its own requests, {v['dp_per_gpu']} "
        f"each, {v['dp']} in all, although each GPU now carries {format_bytes(v['dp_weights'])} of weights "
        f"(attention and dense parts whole) against {format_bytes(v['tp_weights'])} under TP."),
)


def _gqa_tp_question() -> dict[str, Any]:
    llama = get_model("llama-3-70b")
    return {"tp8": kv_bytes_per_token(llama, "bf16", 8), "tp16": kv_bytes_per_token(llama, "bf16", 16),
            "heads16": kv_heads_per_rank(llama, 16), "kv_heads": llama.num_kv_heads,
            "ds_tp16": kv_bytes_per_token(get_model("deepseek-v3"), "bf16", 16),
            "ds_heads": mla_dims(get_model("deepseek-v3"), tp=16).num_heads}


ask(
    "09.q4",
    "Llama-3-70B has 8 KV heads. What does one GPU store per token at TP=8 and at TP=16, and what does that share "
    "with MLA under TP?",
    _gqa_tp_question,
    lambda v: (
        f"TP=8: one KV head per GPU, {format_bytes(v['tp8'])}. TP=16: still {v['heads16']} head, "
        f"{format_bytes(v['tp16'])}: a head cannot be cut, so two ranks keep each of the {v['kv_heads']} heads, "
        f"and past 8 GPUs the KV per GPU stops shrinking. MLA is that case from the first rank on: its one latent "
        f"is replicated, {format_bytes(v['ds_tp16'])} on each of 16 GPUs, while its query heads still split "
        f"({v['ds_heads']} per GPU)."),
    transfer=True,
)
