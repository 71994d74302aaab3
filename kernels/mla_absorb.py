"""Two ways to attend over MLA's latent cache, in plain torch: decompress (naive) or absorb.

Multi-head latent attention caches one vector per token, ``c_kv`` (``L = kv_lora_rank`` values,
after ``kv_a_layernorm``) and the rotated ``k_pe`` (``R = qk_rope_head_dim`` values, shared by
every head). Head ``n``'s key and value are *linear* in ``c_kv``:
``k_nope[n] = c_kv · W_UK[:, n]`` (``P = qk_nope_head_dim``) and ``v[n] = c_kv · W_UV[:, n]``
(``V = v_head_dim``), with ``W_UK`` and ``W_UV`` the two halves of ``kv_b_proj``.

* **Naive** (vLLM's ``forward_mha``, the "compute friendly" path its prefill takes): decompress
  every cached latent into full per-head K ``[S, N, P + R]`` and V ``[S, N, V]``, then ordinary
  multi-head attention.
* **Absorbed** (vLLM's ``forward_mqa``, its decode path): since ``q_nope · k_nope[n] =
  (q_nope · W_UK[:, n]ᵀ) · c_kv``, fold ``W_UK`` into the query once per query token
  (``q_latent``, ``L`` values per head), attend directly over the latents (scores
  ``q_latent · c_kvᵀ + q_pe · k_peᵀ``, values ``c_kv`` itself: multi-*query* attention with head
  size ``L + R``), and fold ``W_UV`` into the output afterwards. K and V never exist.

The two are the same function of their inputs, so they agree to rounding
(``tests/test_kernels_mla_absorb.py``); which one is cheaper depends on how many query tokens
share the decompression (``kvlab.capacity.mla`` counts it). The names and shapes follow
``vllm/model_executor/layers/attention/mla_attention.py`` (its header comment, and
``split_kv_b_proj``). The query tokens of a call are the *last* ``Sq`` of the ``S`` latents.
"""

from __future__ import annotations

import torch

from kvlab.errors import KernelInputError


def split_kv_b_proj(weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
                    v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight [N * (P + V), L]`` as vLLM splits it: ``W_UK [L, N, P]`` and ``W_UV [L, N, V]`` (views).

    The rows of ``kv_b_proj`` are head-major: head ``n`` owns ``P`` rows of its key then ``V`` rows
    of its value.
    """
    rows, rank = weight.shape
    if rows != num_heads * (qk_nope_head_dim + v_head_dim):
        raise KernelInputError(f"kv_b_proj.weight has {rows} rows; {num_heads} heads x ({qk_nope_head_dim} + "
                               f"{v_head_dim}) = {num_heads * (qk_nope_head_dim + v_head_dim)} expected")
    per_head = weight.T.unflatten(1, (num_heads, qk_nope_head_dim + v_head_dim))    # [L, N, P + V]
    return per_head[..., :qk_nope_head_dim], per_head[..., qk_nope_head_dim:]


def decompress(kv_c: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head's ``k_nope [S, N, P]`` and ``v [S, N, V]`` from ``kv_c [S, L]``: what naive pays per key."""
    k_nope = torch.einsum("sl,lnp->snp", kv_c, w_uk)
    v = torch.einsum("sl,lnv->snv", kv_c, w_uv)
    return k_nope, v


def causal_mask(num_queries: int, num_keys: int, device: torch.device | str) -> torch.Tensor:
    """``[Sq, S]`` True where query ``i`` (position ``S - Sq + i``) may see key ``j``."""
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)
    return torch.arange(num_keys, device=device)[None, :] <= q_pos[:, None]


def softmax_attend(scores: torch.Tensor, values: torch.Tensor, causal: bool) -> torch.Tensor:
    """``softmax(scores) · values``: ``scores [N, Sq, S]``, ``values [S, N, D]`` (or ``[S, D]``) -> ``[Sq, N, D]``."""
    if causal:
        visible = causal_mask(scores.shape[1], scores.shape[2], scores.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)                                       # [N, Sq, S]
    if values.dim() == 2:                                                       # one value vector per key (MQA)
        return torch.einsum("nqs,sd->qnd", probs, values)
    return torch.einsum("nqs,snd->qnd", probs, values)


def naive_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                    w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, causal: bool = True) -> torch.Tensor:
    """Decompress, then multi-head attention (vLLM's ``forward_mha``): ``[Sq, N, V]``.

    ``q_nope [Sq, N, P]``, ``q_pe [Sq, N, R]`` (rotated), ``kv_c [S, L]``, ``k_pe [S, R]`` (rotated).
    """
    k_nope, v = decompress(kv_c, w_uk, w_uv)                                    # [S, N, P], [S, N, V]
    num_heads = q_nope.shape[1]
    key = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)   # [S, N, P + R]
    query = torch.cat([q_nope, q_pe], dim=-1)                                   # [Sq, N, P + R]
    scores = torch.einsum("qnd,snd->nqs", query, key) * scale                   # [N, Sq, S]
    return softmax_attend(scores, v, causal)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_latent = q_nope · W_UKᵀ`` per head: ``[Sq, N, P] -> [Sq, N, L]`` (vLLM's ``ql_nope``)."""
    return torch.einsum("qnp,lnp->qnl", q_nope, w_uk)


def absorb_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Back from latent space: ``o_latent [Sq, N, L] · W_UV -> [Sq, N, V]`` (vLLM's ``_v_up_proj``)."""
    return torch.einsum("qnl,lnv->qnv", o_latent, w_uv)


def latent_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                     scale: float, causal: bool = True) -> torch.Tensor:
    """Multi-query attention over the latents, output in latent space: ``[Sq, N, L]``.

    Scores ``q_latent · c_kvᵀ + q_pe · k_peᵀ`` (scaled), values ``c_kv``: what ``mla_decode`` computes.
    """
    scores = (torch.einsum("qnl,sl->nqs", q_latent, kv_c) + torch.einsum("qnr,sr->nqs", q_pe, k_pe)) * scale
    return softmax_attend(scores, kv_c, causal)


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                       w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, causal: bool = True) -> torch.Tensor:
    """Absorb ``W_UK`` into the query, attend over the latents, absorb ``W_UV`` (``forward_mqa``): ``[Sq, N, V]``.

    Same arguments and result as ``naive_attention``; no ``[S, N, *]`` tensor is ever made.
    """
    o_latent = latent_attention(absorb_query(q_nope, w_uk), q_pe, kv_c, k_pe, scale, causal)
    return absorb_output(o_latent, w_uv)
