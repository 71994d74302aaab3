"""Notebook 11, part 2's exercises (what the example connector matches, the bytes a pull moves, move or recompute
across machines) and self-test questions.

Part 1 (tensor parallelism) registers its own in ``nb11``; both parts share notebook 11's ids (``11.``).
"""

from __future__ import annotations

import random
from typing import Any

from kvlab.capacity.cost_model import CostModel, cost_model
from kvlab.capacity.disaggregation import crossover_tokens, kv_transfer_bytes, move_or_recompute
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, Mistake, ask, register
from kvlab.units import cdiv

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
