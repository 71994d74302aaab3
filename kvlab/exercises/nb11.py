"""Notebook 11's exercises and self-test. Part 1, tensor parallelism: a rank's KV tensors, the rows of ``k_proj``
a rank loads, what replication wastes. Part 2, prefill and decode apart: what the example connector matches,
the bytes a pull moves, move or recompute across machines.

Nothing here starts a rank or an engine, or imports ``kvlab.kernels``: the references build one rank's layer in
this process (``GroupCoordinator.unconnected``) or count with ``kvlab.capacity``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from kvlab.capacity.cost_model import CostModel, cost_model
from kvlab.capacity.disaggregation import crossover_tokens, kv_transfer_bytes, move_or_recompute
from kvlab.capacity.models import ModelSpec, get_model
from kvlab.capacity.parallel import plan_parallel
from kvlab.capacity.sizing import KV_DTYPE_BYTES, kv_bytes_per_token, kv_heads_per_rank
from kvlab.capacity.tp_cost import tp_step_collectives
from kvlab.distributed.parallel_state import GroupCoordinator
from kvlab.engine.linear import ColumnParallelLinear, qkv_partition
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.units import cdiv, format_bytes

DTYPES = ("fp32", "bf16", "fp8")


def _config(name: str) -> dict[str, Any]:
    return {k: v for k, v in get_model(name).config.items() if not k.startswith("_")}


def _gqa(rng: random.Random, kv_heads: int | None = None) -> dict[str, Any]:
    heads = rng.choice([16, 32, 64])
    return {"model_type": "llama", "num_hidden_layers": rng.choice([2, 16, 32, 80]), "num_attention_heads": heads,
            "num_key_value_heads": kv_heads or rng.choice([1, 2, 4, 8]), "hidden_size": heads * 128,
            "head_dim": rng.choice([64, 128])}


def _mla(rng: random.Random) -> dict[str, Any]:
    heads = rng.choice([16, 32, 128])
    return {"model_type": "deepseek_v3", "num_hidden_layers": rng.choice([2, 27, 61]), "num_attention_heads": heads,
            "num_key_value_heads": heads, "hidden_size": 2048, "kv_lora_rank": rng.choice([256, 512]),
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def _valid_tp(rng: random.Random, config: dict[str, Any]) -> int:
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    mla = "kv_lora_rank" in config
    return rng.choice([t for t in (1, 2, 4, 8, 16) if heads % t == 0 and (mla or t % kv == 0 or kv % t == 0)])


# ----------------------------------------------------------------- 11.rank_kv_cache


def rank_kv_cache(config: dict, tp: int, num_blocks: int, block_size: int,
                  kv_dtype: str) -> tuple[tuple[int, ...], int]:
    """Reference: one layer's K tensor (MLA: latent tensor) on one rank, and the bytes of all that rank's KV tensors."""
    spec = ModelSpec.from_hf_config(config)
    if spec.attention == "mla":
        shape: tuple[int, ...] = (num_blocks, block_size, spec.head_dim)
    else:
        shape = (num_blocks, block_size, kv_heads_per_rank(spec, tp), spec.head_dim)
    return shape, num_blocks * block_size * kv_bytes_per_token(spec, kv_dtype, tp)


def _rank_cache_with(case: Case, *, fractional: bool = False, split_latent: bool = False,
                     k_only: bool = False, implied_head_dim: bool = False) -> tuple[tuple[int, ...], int]:
    config, tp, blocks, block_size, kv_dtype = case.args
    if implied_head_dim:
        config = {**config, "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    spec = ModelSpec.from_hf_config(config)
    b, layers = KV_DTYPE_BYTES[kv_dtype], spec.num_layers
    if spec.attention == "mla":
        width = spec.head_dim // (tp if split_latent else 1)
        return (blocks, block_size, width), int(blocks * block_size * layers * width * b)
    heads = spec.num_kv_heads // tp if fractional else kv_heads_per_rank(spec, tp)
    shape = (blocks, block_size, heads, spec.head_dim)
    return shape, int(blocks * block_size * layers * (1 if k_only else 2) * heads * spec.head_dim * b)


RANK_CACHE_MISTAKES = (
    Mistake(lambda *args: _rank_cache_with(Case(args), fractional=True),
            lambda case: (f"with more ranks ({case.args[1]}) than KV heads ({case.args[0]['num_key_value_heads']}) a "
                          "head is not cut into pieces: each rank allocates one whole head (max(1, Hkv // tp))")),
    Mistake(lambda *args: _rank_cache_with(Case(args), split_latent=True),
            "MLA's latent is never split across ranks: every rank's tensor holds the whole kv_lora_rank + "
            "qk_rope_head_dim values of every token"),
    Mistake(lambda *args: _rank_cache_with(Case(args), k_only=True),
            "a full-attention layer allocates two tensors, K and V, of that shape (MLA one: no V)"),
    Mistake(lambda *args: _rank_cache_with(Case(args), implied_head_dim=True),
            lambda case: (f"this config gives head_dim = {case.args[0].get('head_dim')}, not hidden_size // "
                          f"num_attention_heads = {case.args[0]['hidden_size'] // case.args[0]['num_attention_heads']}"
                          ": when head_dim is there, use it")),
)


def _explain_rank_cache(case: Case, expected: Any, actual: Any) -> str | None:
    if not (type(actual) in (list, tuple) and len(actual) == 2):
        return "return a pair: (one layer's K tensor shape as a tuple, the rank's KV bytes as an int)"
    return None


register(Exercise(
    id="11.rank_kv_cache",
    title="One rank's KV tensors under tensor parallelism",
    task=(
        "A tensor-parallel engine gives every rank the same `num_blocks` blocks of `block_size` tokens. Given a "
        "model's `config.json` (GQA, MQA or MLA), `tp` and a KV dtype, return `(shape, nbytes)`: the shape of one "
        "layer's K tensor on one rank, `[num_blocks, block_size, kv_heads_on_the_rank, head_dim]` (for MLA the "
        "layer's one latent tensor, `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`), and the bytes of "
        "all of that rank's KV tensors. `head_dim` is the config's, or `hidden_size // num_attention_heads`."
    ),
    signature=("def rank_kv_cache(config: dict, tp: int, num_blocks: int, block_size: int, "
               "kv_dtype: str) -> tuple[tuple[int, ...], int]:"),
    reference=rank_kv_cache,
    shown=plain.rank_kv_cache,
    edge_cases=[
        Case((_config("llama-3-70b"), 8, 1000, 16, "bf16"), probes="Llama-3-70B's 8 KV heads over 8 ranks: one each"),
        Case((_config("llama-3-70b"), 16, 1000, 16, "bf16"),
             probes="16 ranks for 8 KV heads: each rank still allocates one whole head"),
        Case((_config("deepseek-v3"), 8, 100, 64, "fp8"), probes="DeepSeek-V3 at TP=8: the whole latent per rank"),
        Case((_gqa(random.Random(3), kv_heads=1), 4, 64, 16, "fp32"), probes="MQA on 4 ranks: one head replicated"),
        Case((_gqa(random.Random(4), kv_heads=8), 1, 10, 16, "fp32"), probes="TP=1: all the heads on one rank"),
        Case((_config("gemma-2-9b"), 4, 500, 16, "bf16"),
             probes="Gemma-2-9B: head_dim 256, while hidden_size // num_attention_heads = 224"),
    ],
    random_case=lambda rng: (lambda c: Case((c, _valid_tp(rng, c), rng.randint(2, 4000), rng.choice([16, 32, 64]),
                                             rng.choice(DTYPES)), probes="a random model, tp and pool"))(
        _mla(rng) if rng.random() < 0.3 else _gqa(rng)),
    explain=_explain_rank_cache,
    mistakes=RANK_CACHE_MISTAKES,
    hints=[
        "Every rank has every layer and every block; only the KV heads per layer differ from one GPU's cache.",
        "KV heads on a rank: num_key_value_heads / tp while that is at least one; past that, one whole head.",
        "Bytes: num_blocks x block_size tokens, each 2 (K and V) x layers x heads x head_dim x bytes per value; for "
        "MLA 1 x layers x (kv_lora_rank + qk_rope_head_dim) x bytes, on every rank.",
    ],
))


# ----------------------------------------------------------------- 11.k_proj_rows


def k_proj_rows(num_attention_heads: int, num_kv_heads: int, head_dim: int, tp: int, rank: int) -> tuple[int, int]:
    """Reference: the rows ``[start, end)`` of the checkpoint's ``k_proj.weight`` that rank ``rank`` of ``tp`` loads,
    read off kvlab's own layer built for that rank."""
    part = qkv_partition(num_attention_heads, num_kv_heads, tp)
    layer = ColumnParallelLinear(1, num_kv_heads * head_dim, tp_group=GroupCoordinator.unconnected(rank, tp),
                                 num_replicas=part.num_kv_head_replicas)
    rows = torch.arange(num_kv_heads * head_dim, dtype=torch.float32).unsqueeze(1)  # row i holds i
    layer.weight.weight_loader(layer.weight, rows)
    loaded = layer.weight[:, 0].to(torch.int64).tolist()
    return loaded[0], loaded[-1] + 1


def _rows_with(case: Case, *, interleaved: bool = False, no_replicas: bool = False) -> tuple[int, int]:
    heads, kv, d, tp, rank = case.args
    per = max(1, kv // tp)
    shard = rank % kv if interleaved else rank if no_replicas else rank // max(1, tp // kv)
    return shard * per * d, (shard + 1) * per * d


ROWS_MISTAKES = (
    Mistake(lambda *args: _rows_with(Case(args), interleaved=True),
            lambda case: (f"rank {case.args[4]}'s query heads are heads {case.args[4] * case.args[0] // case.args[3]} "
                          f"to {(case.args[4] + 1) * case.args[0] // case.args[3] - 1}: it needs the KV head those "
                          "read, so consecutive ranks share a head (rank // replicas), not rank % num_kv_heads")),
    Mistake(lambda *args: _rows_with(Case(args), no_replicas=True),
            lambda case: (f"with {case.args[1]} KV heads on {case.args[3]} ranks, each head is replicated on "
                          f"{max(1, case.args[3] // case.args[1])} ranks: rank r loads shard r // "
                          f"{max(1, case.args[3] // case.args[1])}, not shard r")),
)


def _random_rows_case(rng: random.Random) -> Case:
    heads = rng.choice([8, 16, 32, 64])
    kv = rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0])
    tp = rng.choice([t for t in (1, 2, 4, 8, 16) if heads % t == 0 and (t % kv == 0 or kv % t == 0)])
    return Case((heads, kv, rng.choice([64, 128]), tp, rng.randrange(tp)), probes="random heads, tp and rank")


register(Exercise(
    id="11.k_proj_rows",
    title="Which rows of k_proj rank r loads",
    task=(
        "The checkpoint's `k_proj.weight` has `num_kv_heads x head_dim` rows, head after head. Under tensor "
        "parallelism rank `rank` of `tp` holds the query heads `[rank x H / tp, (rank + 1) x H / tp)` and needs the "
        "KV heads those read (GQA: query head h reads KV head h // (H / num_kv_heads)). Return `(start, end)`, the "
        "rows it loads, as vLLM's `QKVParallelLinear.weight_loader` narrows them. Every `tp` given splits the heads."
    ),
    signature=("def k_proj_rows(num_attention_heads: int, num_kv_heads: int, head_dim: int, tp: int, "
               "rank: int) -> tuple[int, int]:"),
    reference=k_proj_rows,
    shown=plain.k_proj_rows,
    edge_cases=[
        Case((64, 8, 128, 8, 3), probes="Llama-3-70B at TP=8: rank 3 loads KV head 3"),
        Case((64, 8, 128, 16, 7), probes="16 ranks, 8 KV heads: ranks 6 and 7 both load head 3"),
        Case((8, 2, 64, 4, 1), probes="2 KV heads on 4 ranks: rank 1 shares head 0 with rank 0, not head 1"),
        Case((32, 8, 128, 2, 1), probes="8 KV heads on 2 ranks: rank 1 loads heads 4 to 7"),
        Case((32, 1, 128, 4, 3), probes="MQA: every rank loads the one head"),
    ],
    random_case=_random_rows_case,
    mistakes=ROWS_MISTAKES,
    hints=[
        "First, how many KV heads does each rank hold? num_kv_heads / tp, or one when there are fewer than ranks.",
        "With fewer KV heads than ranks, tp / num_kv_heads consecutive ranks share one head: the ranks whose query "
        "heads read it.",
        "Rank r loads shard r // replicas (replicas = 1 when the heads divide); a shard is its heads x head_dim rows.",
    ],
))


# ----------------------------------------------------------------- 11.replication (transfer)


def _accepted(num_attention_heads: int, num_kv_heads: int, tp: int) -> bool:
    """Whether vLLM splits the heads over ``tp`` ranks (``qkv_partition`` does not refuse it)."""
    try:
        qkv_partition(num_attention_heads, num_kv_heads, tp)
    except ValueError:
        return False
    return True


def replication(num_attention_heads: int, num_kv_heads: int, num_gpus: int,
                kv_bytes_per_token: int) -> tuple[int, int, int]:
    """Reference: the largest tp <= num_gpus with no KV head stored twice, the largest tp <= num_gpus vLLM accepts,
    and the bytes per token the deployment stores beyond one copy at that second tp."""
    sizes = [t for t in range(1, num_gpus + 1) if _accepted(num_attention_heads, num_kv_heads, t)]
    no_copies = max(t for t in sizes if num_kv_heads % t == 0)
    largest = max(sizes)
    per_rank = kv_bytes_per_token // num_kv_heads * qkv_partition(num_attention_heads, num_kv_heads,
                                                                  largest).num_kv_heads
    return no_copies, largest, largest * per_rank - kv_bytes_per_token


def _random_replication_case(rng: random.Random) -> Case:
    kv = rng.choice([1, 2, 4, 8, 12, 16])
    heads = kv * rng.choice([1, 2, 4, 5, 8])
    per_token = 2 * rng.choice([16, 32, 80]) * kv * rng.choice([64, 128]) * rng.choice([1, 2])
    return Case((heads, kv, rng.randint(1, 40), per_token), probes="random heads, GPUs and bytes")


def _replication_with(h: int, kv: int, g: int, b: int, *, total: bool = False,
                      kv_only: bool = False) -> tuple[int, int, int]:
    no_copies, largest, extra = replication(h, kv, g, b)
    if kv_only:  # any tp the KV heads allow, query heads ignored
        largest = max(t for t in range(1, g + 1) if kv % t == 0 or t % kv == 0)
        extra = largest * max(1, kv // largest) * b // kv - b
    if total:
        extra += b
    return no_copies, largest, extra


REPLICATION_MISTAKES = (
    Mistake(lambda h, kv, g, b: _replication_with(h, kv, g, b, total=True),
            "count only what is stored beyond one copy: the deployment's total minus the model's own bytes per token"),
    Mistake(lambda h, kv, g, b: _replication_with(h, kv, g, b, kv_only=True),
            "the query heads must split too: every rank holds num_attention_heads / tp of them"),
)


register(Exercise(
    id="11.replication",
    title="How far the KV heads split, and what copying them costs",
    task=(
        "A model has `num_attention_heads` query heads and `num_kv_heads` KV heads (GQA: the KV heads divide the "
        "query heads); one token's KV, stored once, is `kv_bytes_per_token` bytes. With `num_gpus` GPUs, return "
        "`(no_copies, largest, extra_bytes)`: the largest tensor-parallel size up to `num_gpus` at which no KV head "
        "is stored twice, the largest one vLLM accepts (query heads divide by it; KV heads divide by it, or it is a "
        "multiple of them), and, at that largest size, the bytes per token all its GPUs store beyond one copy."
    ),
    signature=("def replication(num_attention_heads: int, num_kv_heads: int, num_gpus: int, "
               "kv_bytes_per_token: int) -> tuple[int, int, int]:"),
    reference=replication,
    shown=plain.replication,
    edge_cases=[
        Case((64, 8, 16, 327680), probes="Llama-3-70B on 16 GPUs: 8 is as far as its heads split; 16 copies twice"),
        Case((64, 8, 12, 327680), probes="12 GPUs: vLLM accepts no size between 8 and 16"),
        Case((32, 1, 8, 16384), probes="MQA on 8 GPUs: the one head on all of them"),
        Case((40, 8, 16, 163840), probes="40 query heads: 16 ranks cannot split them, whatever the KV heads allow"),
        Case((48, 12, 24, 12288), probes="12 KV heads on 24 GPUs: no copies up to 12, not a power of two"),
    ],
    random_case=_random_replication_case,
    mistakes=REPLICATION_MISTAKES,
    transfer=True,
    hints=[
        "Try every size from 1 to num_gpus. vLLM takes it when the query heads divide by it and the KV heads either "
        "divide by it or divide it.",
        "No KV head is stored twice when the KV heads divide by it.",
        "Past the KV heads each rank keeps one whole head: a rank's bytes per token times the GPUs, minus one copy.",
    ],
))


# ----------------------------------------------------------------- 11.matched_tokens


def matched_tokens(prompt: list[int], stored: list[list[int]], block_size: int, num_computed_tokens: int) -> int:
    """Reference: ``ExampleConnector.get_num_new_matched_tokens``'s count, its folders being ``stored``.

    The folder it looks for holds the prompt's first ``(len(prompt) - 2) // block_size * block_size`` tokens
    (vLLM's ``align_to_block_size`` of ``len(prompt) - 1``): whole blocks, never the last token.
    """
    aligned = (len(prompt) - 2) // block_size * block_size
    if aligned <= 0 or prompt[:aligned] not in stored:
        return 0
    return max(aligned - num_computed_tokens, 0)


def _matched_with(prompt: list[int], stored: list[list[int]], block_size: int, num_computed_tokens: int, *,
                  minus: int = 2, any_prefix: bool = False, clamp: bool = True, local_hit: bool = True) -> int:
    """matched_tokens with one step taken the wrong way: the folder named by align_to_block_size(len(prompt))
    (``minus=1``), any stored prefix taken as a match, the count left negative, or the local hit not subtracted."""
    aligned = (len(prompt) - minus) // block_size * block_size
    if any_prefix:
        found = [len(s) for s in stored if s and prompt[:len(s)] == s and len(s) <= len(prompt)]
        aligned = max(found, default=0)
    if aligned <= 0 or (not any_prefix and prompt[:aligned] not in stored):
        return 0
    left = aligned - (num_computed_tokens if local_hit else 0)
    return max(left, 0) if clamp else left


MATCHED_MISTAKES = (
    Mistake(lambda *args: _matched_with(*args, minus=1),
            "the folder is named by whole blocks *before the last token* of the prompt minus one: "
            "align_to_block_size(len(prompt) - 1) = (len(prompt) - 2) // block_size * block_size"),
    Mistake(lambda *args: _matched_with(*args, any_prefix=True),
            "the match is one exact folder, the prompt's own aligned prefix: a shorter or longer stored prefix is a "
            "miss"),
    Mistake(lambda *args: _matched_with(*args, clamp=False),
            "the local hit can exceed what the folder holds: then there is nothing to load (0, never negative)"),
    Mistake(lambda *args: _matched_with(*args, local_hit=False),
            "return tokens beyond num_computed_tokens: the local prefix-cache hit is not loaded again"),
)


def _random_matched_case(rng: random.Random) -> Case:
    block_size = rng.choice([2, 4, 16])
    prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 5 * block_size))]
    aligned = (len(prompt) - 2) // block_size * block_size
    stored = [prompt[:max(aligned + rng.choice([0, 0, -block_size, block_size]), 0)]]
    computed = rng.randrange(0, max(aligned, 0) + 2 * block_size, block_size)
    return Case((prompt, stored, block_size, computed), probes="random prompt, folder and local hit")


register(Exercise(
    id="11.matched_tokens",
    title="the tokens the example connector says it can load",
    task=("`stored` lists the token sequences whose folders exist (each folder is named by the hash of exactly its "
          "tokens). Return what `ExampleConnector.get_num_new_matched_tokens(request, num_computed_tokens)` returns "
          "for a request with these `prompt` tokens: the tokens it will load beyond the local hit, 0 if none. It "
          "looks for one folder, named by the prompt's whole blocks before its last token *minus one* (vLLM's "
          "example assumes the consumer's prompt is the producer's plus the one token the producer generated)."),
    signature="def matched_tokens(prompt: list[int], stored: list[list[int]], block_size: int, "
              "num_computed_tokens: int) -> int:",
    reference=matched_tokens,
    edge_cases=[
        Case((list(range(1, 35)), [list(range(1, 33))], 16, 0), probes="34 tokens: the folder of the first 32 hits"),
        Case((list(range(1, 34)), [list(range(1, 33))], 16, 0),
             probes="33 tokens: align_to_block_size(32) is 16, so the 32-token folder is not the one looked for"),
        Case((list(range(1, 35)), [list(range(1, 33))], 16, 16), probes="a local hit of one block: 16 left to load"),
        Case((list(range(1, 35)), [list(range(1, 33))], 16, 48), probes="the local hit covers it all: 0, not negative"),
        Case((list(range(1, 35)), [list(range(1, 17))], 16, 0), probes="only a shorter prefix is stored: a miss"),
        Case(([5, 6, 7], [[]], 4, 0), probes="a prompt with no whole block to load"),
    ],
    random_case=_random_matched_case,
    mistakes=MATCHED_MISTAKES,
    hints=["First find the folder the connector looks for: align_to_block_size(n) is (n - 1) // block_size * "
           "block_size, applied to n = len(prompt) - 1.",
           "No folder with exactly those tokens (or no whole block at all) means nothing to load.",
           "Otherwise the count is what the folder holds beyond num_computed_tokens, and never below zero."],
))


# ----------------------------------------------------------------- 11.bytes_moved


def bytes_moved(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int,
                prompt_tokens: int, cached_tokens: int) -> int:
    """Reference: bytes ``P2pGlooConnector`` pulls for a prompt: every block of it (the partial last one whole)
    but those the decode engine's prefix cache already holds (its whole blocks)."""
    bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes  # K and V
    return (cdiv(prompt_tokens, block_size) - min(cached_tokens, prompt_tokens) // block_size) * bytes_per_block


def _moved_with(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int,
                prompt_tokens: int, cached_tokens: int, *, k_only: bool = False, by_token: bool = False,
                hit_stays: bool = True) -> int:
    """bytes_moved with one step taken the wrong way: K only, tokens moved instead of whole blocks, or the decode
    engine's hit pulled again."""
    per_token = (1 if k_only else 2) * num_layers * num_kv_heads * head_dim * dtype_bytes
    if by_token:
        return per_token * (prompt_tokens - (cached_tokens if hit_stays else 0))
    kept = min(cached_tokens, prompt_tokens) // block_size if hit_stays else 0
    return (cdiv(prompt_tokens, block_size) - kept) * block_size * per_token


MOVED_MISTAKES = (
    Mistake(lambda *args: _moved_with(*args, k_only=True), "a block carries both K and V: two tensors per layer"),
    Mistake(lambda *args: _moved_with(*args, by_token=True),
            "blocks move whole: the partial last block crosses as a block, and a hit counts only whole blocks of the "
            "decode engine's cache"),
    Mistake(lambda *args: _moved_with(*args, hit_stays=False),
            "the decode engine's prefix hit is not pulled again: subtract its whole blocks"),
)


def _random_bytes_case(rng: random.Random) -> Case:
    bs = rng.choice([8, 16, 32])
    prompt = rng.randint(1, 20 * bs)
    return Case((rng.randint(1, 80), rng.choice([1, 2, 8]), rng.choice([64, 128]), rng.choice([1, 2]), bs, prompt,
                 rng.randint(0, prompt)), probes="random model, block size, prompt and hit")


register(Exercise(
    id="11.bytes_moved",
    title="the bytes a decode engine pulls for one prompt",
    task=("A prefill engine hands a decode engine a prompt of `prompt_tokens` tokens; the decode engine already holds "
          "its first `cached_tokens` in its prefix cache. Return the bytes `P2pGlooConnector` pulls: it moves whole "
          "blocks of `block_size` tokens (K and V of `num_kv_heads` heads of `head_dim` values, `dtype_bytes` each, "
          "in `num_layers` layers), all of the prompt's blocks, the partial last one included, but those the "
          "decode engine's cache holds whole."),
    signature="def bytes_moved(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, "
              "block_size: int, prompt_tokens: int, cached_tokens: int) -> int:",
    reference=bytes_moved,
    edge_cases=[
        Case((32, 8, 128, 2, 16, 2048, 0), probes="Llama-3-8B, 2,048 tokens: 128 blocks of 2 MiB"),
        Case((32, 8, 128, 2, 16, 2050, 0), probes="two tokens past a block: one more block, whole"),
        Case((32, 8, 128, 2, 16, 2050, 1030), probes="a hit of 1,030 tokens saves 64 whole blocks, not 64.4"),
        Case((4, 2, 64, 4, 16, 59, 0), probes="the tiny model in float32, 59 tokens: 4 blocks"),
        Case((4, 2, 64, 4, 16, 59, 59), probes="everything but the partial block is cached: that block still crosses"),
    ],
    random_case=_random_bytes_case,
    mistakes=MOVED_MISTAKES,
    hints=["Work out one block's bytes first: a K and a V for every token slot, head and layer.",
           "Count blocks, not tokens: a prompt of n tokens fills cdiv(n, block_size) of them.",
           "The decode engine's hit is whole blocks only: cached_tokens // block_size of them stay home."],
))


# ----------------------------------------------------------------- 11.move_or_recompute


def move_or_recompute_reference(cost: CostModel, prompt_tokens: int, cached_tokens: int) -> str:
    """Reference: ``kvlab.capacity.disaggregation.move_or_recompute`` for the tokens the decode side lacks."""
    return move_or_recompute(cost, prompt_tokens - cached_tokens, cached_tokens)


move_or_recompute_reference.__name__ = "move_or_recompute"


def _explain_move(case: Case, expected: Any, actual: Any) -> str | None:
    return None if actual in ("move", "recompute") else 'return the string "move" or "recompute"'


MOVE_MISTAKES = (
    Mistake(lambda cost, prompt, cached: move_or_recompute(cost, prompt),
            "the decode side already holds cached_tokens: only the rest would move or be recomputed"),
    Mistake(lambda cost, prompt, cached: "move" if cost.copy_seconds(prompt - cached) < cost.forward_seconds(
        prompt - cached, cached) else "recompute",
            "recomputing inside a decode step costs its FLOPs only (prefill_seconds): that step reads the weights "
            "anyway, so forward_seconds' roofline overstates it"),
)


_COSTS = {name: cost_model(model, "H100-SXM-80GB", link)
          for name, model, link in (("8b-ndr", "llama-3-8b", "InfiniBand NDR 400G"),
                                    ("7b-eth", "llama-2-7b", "Ethernet 100G"),
                                    ("7b-nvme", "llama-2-7b", "PCIe 4.0 x4"))}


def _random_move_case(rng: random.Random) -> Case:
    prompt = rng.choice([16, 512, 4096, 20_000, 40_000, 100_000])
    return Case((_COSTS[rng.choice(sorted(_COSTS))], prompt, rng.choice([0, 0, prompt // 2])),
                probes="random model, link, prompt and hit")


register(Exercise(
    id="11.move_or_recompute",
    title="move the KV across machines, or recompute it on the decode side",
    task=("A prompt of `prompt_tokens` tokens was prefilled on another machine; the decode engine already holds its "
          "first `cached_tokens`. `cost` is a `kvlab.capacity.cost_model.CostModel`: its `link` joins the two "
          "machines, its `gpu` is the decode engine's. Return \"move\" if copying the missing tokens' KV over the "
          "link (`cost.copy_seconds`) is faster than computing them again inside a decode step, which costs their "
          "FLOPs only (`cost.prefill_seconds(new, cached)`: the step reads the weights anyway), else \"recompute\"."),
    signature="def move_or_recompute(cost: CostModel, prompt_tokens: int, cached_tokens: int) -> str:",
    reference=move_or_recompute_reference,
    shown=plain.move_or_recompute,
    edge_cases=[
        Case((_COSTS["8b-ndr"], 2048, 0), probes="a GQA model over 400 Gb/s: moving wins"),
        Case((_COSTS["7b-eth"], 2048, 0), probes="an MHA model (4x the KV) over 100 Gb/s: recompute wins"),
        Case((_COSTS["7b-eth"], 60_000, 0), probes="the same at 60K tokens: attention makes recompute dearer"),
        Case((_COSTS["7b-eth"], 60_000, 40_000), probes="a 40K-token hit: the 20K missing tokens, after 40K cached"),
        Case((_COSTS["7b-eth"], 20_000, 10_000),
             probes="20K tokens would recompute, but the 10K missing ones attend to 10K cached: moving wins"),
    ],
    random_case=_random_move_case,
    explain=_explain_move,
    mistakes=MOVE_MISTAKES,
    hints=["Only prompt_tokens - cached_tokens tokens are missing on the decode side: both ways handle just those.",
           "Moving costs their bytes over the link; recomputing costs the FLOPs of those tokens attending to "
           "everything before them.",
           "Compare the two seconds; a tie is not a win for moving."],
    transfer=True,
))


# ----------------------------------------------------------------- self-test


def _replica_question() -> dict[str, Any]:
    spec = get_model("llama-3-70b")
    return {"tp8": kv_bytes_per_token(spec, "bf16", 8), "tp16": kv_bytes_per_token(spec, "bf16", 16),
            "one": kv_bytes_per_token(spec, "bf16", 1)}


ask("11.q1",
    "Llama-3-70B (8 KV heads), bf16 KV: what does one GPU allocate per token at TP=8, and at TP=16?",
    _replica_question,
    lambda v: (f"{format_bytes(v['tp8'])} at both: at TP=8 one KV head per rank (an eighth of the "
               f"{format_bytes(v['one'])} one GPU would hold), and at TP=16 still one whole head, since a head is "
               "not cut: two ranks hold each. Doubling the GPUs doubles the pools, not the tokens they hold."))


def _collectives_question() -> dict[str, Any]:
    step = tp_step_collectives("llama-3-70b", 8, num_seqs=64)
    return {"all_reduces": step.all_reduces, "payload": step.all_reduce_payload_bytes,
            "hidden": get_model("llama-3-70b").hidden_size,
            "nvlink": step.seconds("NVLink 4 (H100/H200 SXM)"), "pcie": step.seconds("PCIe 5.0 x16")}


ask("11.q2",
    "Llama-3-70B at TP=8, a decode step of 64 sequences in bf16: how many all-reduces, how large, and how long does "
    "bandwidth alone make them on NVLink 4 and on PCIe 5.0?",
    _collectives_question,
    lambda v: (f"{v['all_reduces']}: two per layer (after o_proj and down_proj) and one for the embedding, each of "
               f"{format_bytes(v['payload'])} (64 tokens x {v['hidden']:,} values x 2 bytes). By bandwidth alone "
               f"{v['nvlink'] * 1e3:.2f} ms on NVLink and {v['pcie'] * 1e3:.2f} ms on PCIe per step; with a few "
               "microseconds of latency per ring hop, latency dominates at this size."))


def _mla_question() -> dict[str, Any]:
    tp = plan_parallel("deepseek-v3", "tp", num_gpus=8, gpu_memory_gib=141, max_model_len=32768)
    return {"per_gpu": tp.per_gpu.kv_bytes_per_token, "copies": tp.kv_copies, "requests": tp.requests}


ask("11.q3",
    "Transfer: a TP=2 engine of notebook 11's tiny DeepSeek allocates, on each rank, the same bytes per token as a "
    "one-rank engine. What does that mean for DeepSeek-V3 on 8 GPUs at TP=8?",
    _mla_question,
    lambda v: (f"Each GPU stores the whole latent of every token ({format_bytes(v['per_gpu'])}), {v['copies']:.0f} "
               f"copies in all, so the 8 GPUs hold {v['requests']} requests of 32K, what one GPU's pool holds: "
               "notebook 09's 24-not-192, here measured on real ranks' tensors."))


def _bytes_question() -> dict[str, Any]:
    return {"8b": kv_transfer_bytes("llama-3-8b", 8192), "70b": kv_transfer_bytes("llama-3-70b", 8192),
            "7b": kv_transfer_bytes("llama-2-7b", 8192),
            "ndr": cost_model("llama-3-8b", "H100-SXM-80GB", "InfiniBand NDR 400G").copy_seconds(8192)}


ask("11.q4",
    "How many bytes of KV does an 8,192-token prompt hand from a prefill GPU to a decode GPU for Llama-3-8B, "
    "Llama-3-70B and Llama-2-7B (BF16), and how long does the first take over one 400 Gb/s link?",
    _bytes_question,
    lambda v: (f"{v['8b'] / 2**30:.1f} GiB, {v['70b'] / 2**30:.1f} GiB and {v['7b'] / 2**30:.1f} GiB: the 70B model "
               f"has 8 KV heads like the 8B (GQA), the 7B has 32 (MHA). Over NDR 400G the first takes "
               f"{v['ndr'] * 1000:.0f} ms, modelled: the link, not the compute, is what a disaggregated deployment "
               "sizes first."))


def _crossover_question() -> dict[str, Any]:
    return {"ndr": crossover_tokens(cost_model("llama-2-7b", "H100-SXM-80GB", "InfiniBand NDR 400G")),
            "eth": crossover_tokens(cost_model("llama-2-7b", "H100-SXM-80GB", "Ethernet 100G"))}


ask("11.q5",
    "Transfer: Llama-2-7B (MHA) on H100s. From what prompt length is moving its KV faster than recomputing it on the "
    "decode side, over InfiniBand NDR 400G, and over 100 Gb Ethernet?",
    _crossover_question,
    lambda v: (f"Over NDR from {v['ndr']} token(s): always. Over 100 GbE only from {v['eth']:,} tokens: below that a "
               "decode engine would recompute faster than it pulls, which is why NIXL has a kv_recompute_threshold "
               "and why disaggregation needs a fast fabric for MHA models (notebook 07's swap-or-recompute, now "
               "across machines)."),
    transfer=True)


def _trade_question() -> dict[str, Any]:
    from kvlab.capacity.disaggregation import transfer_seconds
    from kvlab.sim.disaggregation import ModelledEngine, PDWorkload, serve_colocated, serve_disaggregated

    cost = cost_model("llama-3-8b", "H100-SXM-80GB", "InfiniBand NDR 400G")
    workload = PDWorkload(prompt_tokens=2048, output_tokens=32, rate=8.0, num_requests=24)
    together = serve_colocated(lambda: ModelledEngine(cost), workload).summary()
    apart = serve_disaggregated(lambda: ModelledEngine(cost), lambda: ModelledEngine(cost), workload,
                                lambda n: transfer_seconds(cost, n)).summary()
    return {"together": together, "apart": apart}


ask("11.q6",
    "Two H100s serve Llama-3-8B, 2,048-token prompts at 8 requests per second: as two colocated replicas, or as one "
    "prefill and one decode GPU. Which has the shorter p99 inter-token latency, and which the shorter median TTFT?",
    _trade_question,
    lambda v: (f"Disaggregated: p99 ITL {v['apart']['itl_p99'] * 1000:.1f} ms against "
               f"{v['together']['itl_p99'] * 1000:.1f} ms colocated, where a prompt's chunk shares a step with the "
               f"decodes. Colocated wins TTFT: {v['together']['ttft_p50'] * 1000:.0f} ms against "
               f"{v['apart']['ttft_p50'] * 1000:.0f} ms, since two GPUs prefill instead of one and nothing crosses a "
               "link (modelled)."))
