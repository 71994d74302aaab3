"""Prefill and decode apart, modelled: the bytes a request's KV moves, a batch's seconds, when moving beats recomputing.

Every figure here is **modelled, not measured**, on ``kvlab.capacity.cost_model``'s assumptions (FLOPs over a
share of the dense BF16 peak, bytes over the theoretical bandwidth of ``data/hardware``'s links):

* ``kv_transfer_bytes``: a prompt's KV, all layers, as a prefill engine hands it to a decode engine
  (``kv_bytes_per_token x prompt``; with TP each GPU sends its share over its own link, in parallel);
* ``step_seconds``: one forward pass over a batch of sequences, each ``(new tokens, cached tokens)``, on the
  roofline: the longer of its FLOPs at the assumed rate and one read of the weights and of every token's KV
  from HBM (a decode step reads the weights once for the whole batch, which is why batching decodes pays);
* ``move_or_recompute`` and ``crossover_tokens``: for tokens whose KV exists on another machine, whether
  copying them over the link beats computing them again here. Recomputing ``n`` tokens inside a decode
  engine's step costs their FLOPs (the step reads the weights anyway); moving them costs ``n`` tokens of KV
  over the link. Per token, recompute grows with the context (attention) while a copy stays the same, so
  past some prompt length moving wins, if it does not already for one token: vLLM's NIXL connector has
  ``kv_recompute_threshold`` (64 tokens by default) for this choice. kvlab's model has no per-transfer
  latency, which that threshold also pays for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvlab._validate import checked, non_negative_int, positive_int
from kvlab.capacity.cost_model import CostModel
from kvlab.capacity.models import ModelSpec, resolve_model
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.errors import KvlabValueError


@checked
def kv_transfer_bytes(model: str | ModelSpec, prompt_tokens: int, kv_dtype: str = "bf16") -> int:
    """Bytes of KV a prefill engine hands a decode engine for a prompt of ``prompt_tokens`` tokens (all GPUs)."""
    return kv_bytes_per_token(resolve_model(model), kv_dtype) * non_negative_int("prompt_tokens", prompt_tokens)


@checked
def transfer_seconds(cost: CostModel, prompt_tokens: int) -> float:
    """Modelled seconds for a prompt's KV to cross ``cost.link`` (each GPU of the TP group its share, in parallel)."""
    return cost.copy_seconds(prompt_tokens)


@checked
def step_seconds(cost: CostModel, sequences: Sequence[tuple[int, int]]) -> float:
    """Modelled seconds of one forward pass over ``sequences``, each ``(new tokens, cached tokens)``: a prefill
    chunk is ``(chunk, tokens before it)``, a decode ``(1, context)``. The roofline: compute or one read of the
    weights and every attended token's KV, whichever takes longer; an empty batch takes 0."""
    if not sequences:
        return 0.0
    flops = read = 0.0
    for i, pair in enumerate(sequences):
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise KvlabValueError(f"sequences[{i}] must be (new tokens, cached tokens), got {pair!r}")
        new, cached = non_negative_int(f"sequences[{i}][0]", pair[0]), non_negative_int(f"sequences[{i}][1]", pair[1])
        flops += cost.prefill_flops(new, cached)
        read += (new + cached) * cost.kv_bytes_per_token
    return max(flops / cost.flops_per_second, (cost.weights_bytes_per_gpu + read) / cost.gpu.memory_bytes_per_s)


@checked
def move_or_recompute(cost: CostModel, num_tokens: int, cached_tokens: int = 0) -> Literal["move", "recompute"]:
    """For ``num_tokens`` tokens (after ``cached_tokens`` already here) whose KV exists across ``cost.link``: copy
    them ("move") or compute them again ("recompute"), whichever the model says is faster (ties recompute)."""
    n = positive_int("num_tokens", num_tokens)
    move = cost.copy_seconds(n)
    return "move" if move < cost.prefill_seconds(n, non_negative_int("cached_tokens", cached_tokens)) else "recompute"


@checked(at_most={"max_tokens": 10**9})
def crossover_tokens(cost: CostModel, max_tokens: int = 1 << 20) -> int | None:
    """The shortest prompt whose KV is faster to move over ``cost.link`` than to recompute; 1 if moving always wins,
    None if recompute wins up to ``max_tokens`` (the answer is monotone: recompute's cost per token only grows)."""
    limit = positive_int("max_tokens", max_tokens)
    if move_or_recompute(cost, limit) == "recompute":
        return None
    low, high = 1, limit  # move wins at high; find the first n where it does
    while low < high:
        mid = (low + high) // 2
        if move_or_recompute(cost, mid) == "move":
            high = mid
        else:
            low = mid + 1
    return low
