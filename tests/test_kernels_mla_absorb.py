"""Decompressing the latents and absorbing the weights are the same attention: they agree to rounding.

The naive path builds every head's K and V from ``c_kv`` with ``kv_b_proj``; the absorbed path
folds ``W_UK`` into the query and ``W_UV`` into the output and attends over the latents. In
float64 they agree to 1e-12, in float32 to float32 rounding; and the paged Triton decode kernel,
followed by ``absorb_output``, gives the naive answer.
"""

import pytest
import torch
from kvlab.kernels import KernelConfig, compute_slot_mapping, concat_and_cache_mla, default_device, mla_decode
from kvlab.kernels.batches import fresh_seed, relative_error
from kvlab.kernels.mla_absorb import (
    absorb_output,
    absorb_query,
    absorbed_attention,
    naive_attention,
    split_kv_b_proj,
)

from kvlab.errors import KernelInputError

DEVICE = default_device()

HEADS, RANK, ROPE, NOPE, V = 4, 32, 8, 16, 16
SCALE = (NOPE + ROPE) ** -0.5


def mla_inputs(num_queries, num_keys, dtype=torch.float64, seed=None, heads=HEADS):
    """Rotated queries and latents of one sequence, and a ``kv_b_proj`` weight, drawn from ``seed``."""
    g = torch.Generator().manual_seed(fresh_seed() if seed is None else seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    weight = draw(heads * (NOPE + V), RANK) / RANK**0.5                  # kv_b_proj.weight [N * (P + V), L]
    return dict(q_nope=draw(num_queries, heads, NOPE), q_pe=draw(num_queries, heads, ROPE),
                kv_c=draw(num_keys, RANK), k_pe=draw(num_keys, ROPE)), weight


def test_split_kv_b_proj_is_kv_b_proj_applied_per_head():
    # what transformers' expand_kv does: kv_b_proj(c_kv) viewed [S, N, P + V] and split into k_nope and v
    inputs, weight = mla_inputs(1, 7)
    w_uk, w_uv = split_kv_b_proj(weight, HEADS, NOPE, V)
    assert w_uk.shape == (RANK, HEADS, NOPE) and w_uv.shape == (RANK, HEADS, V)
    full = (inputs["kv_c"] @ weight.T).view(7, HEADS, NOPE + V)
    torch.testing.assert_close(torch.einsum("sl,lnp->snp", inputs["kv_c"], w_uk), full[..., :NOPE])
    torch.testing.assert_close(torch.einsum("sl,lnv->snv", inputs["kv_c"], w_uv), full[..., NOPE:])
    with pytest.raises(KernelInputError, match="kv_b_proj.weight has"):
        split_kv_b_proj(weight, HEADS + 1, NOPE, V)


@pytest.mark.parametrize(("num_queries", "num_keys"), [(1, 1), (1, 37), (9, 9), (5, 40)])
@pytest.mark.parametrize("causal", [True, False])
def test_absorbed_equals_naive_in_float64(num_queries, num_keys, causal):
    inputs, weight = mla_inputs(num_queries, num_keys)
    w_uk, w_uv = split_kv_b_proj(weight, HEADS, NOPE, V)
    naive = naive_attention(**inputs, w_uk=w_uk, w_uv=w_uv, scale=SCALE, causal=causal)
    absorbed = absorbed_attention(**inputs, w_uk=w_uk, w_uv=w_uv, scale=SCALE, causal=causal)
    assert naive.shape == absorbed.shape == (num_queries, HEADS, V)
    assert relative_error(absorbed, naive) < 1e-12


def test_absorbed_equals_naive_to_float32_rounding():
    inputs, weight = mla_inputs(6, 50, dtype=torch.float32)
    w_uk, w_uv = split_kv_b_proj(weight, HEADS, NOPE, V)
    naive = naive_attention(**inputs, w_uk=w_uk, w_uv=w_uv, scale=SCALE)
    absorbed = absorbed_attention(**inputs, w_uk=w_uk, w_uv=w_uv, scale=SCALE)
    exact = naive_attention(**{k: v.double() for k, v in inputs.items()}, w_uk=w_uk.double(), w_uv=w_uv.double(),
                            scale=SCALE)
    assert relative_error(absorbed, naive) < 1e-5
    assert relative_error(naive, exact) < 1e-5 and relative_error(absorbed, exact) < 1e-5


def test_the_causal_mask_lets_the_last_queries_see_their_context():
    # 3 query tokens after 4 cached ones: query 0 sees 5 latents; changing latent 5 must not move it
    inputs, weight = mla_inputs(3, 7)
    w_uk, w_uv = split_kv_b_proj(weight, HEADS, NOPE, V)
    before = absorbed_attention(**inputs, w_uk=w_uk, w_uv=w_uv, scale=SCALE)
    inputs["kv_c"][5] += 10.0
    after = absorbed_attention(**inputs, w_uk=w_uk, w_uv=w_uv, scale=SCALE)
    assert torch.equal(before[0], after[0]) and not torch.allclose(before[1], after[1])


def test_the_paged_decode_kernel_then_w_uv_gives_the_naive_answer():
    # three sequences decoding at lengths around a block edge, their latents written by concat_and_cache_mla
    seq_lens, block_size = [17, 16, 33], 16
    table = torch.tensor([[3, 0, 0], [1, 0, 0], [5, 4, 2]], dtype=torch.int32, device=DEVICE)
    cache = torch.full((6, block_size, RANK + ROPE), float("nan"), device=DEVICE)
    w_uk, w_uv = split_kv_b_proj(mla_inputs(1, 1, dtype=torch.float32)[1], HEADS, NOPE, V)
    q_latent, q_pe, naive = [], [], []
    for i, n in enumerate(seq_lens):
        inputs = mla_inputs(1, n, dtype=torch.float32)[0]
        naive.append(naive_attention(**inputs, w_uk=w_uk, w_uv=w_uv, scale=SCALE))        # [1, N, V]
        q_latent.append(absorb_query(inputs["q_nope"], w_uk))                             # [1, N, L]
        q_pe.append(inputs["q_pe"])
        whole_prompt = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
        slots = compute_slot_mapping(table[i:i + 1], table.new_tensor([n]), whole_prompt, block_size)
        concat_and_cache_mla(inputs["kv_c"].to(DEVICE), inputs["k_pe"].to(DEVICE), cache, slots)
    config = KernelConfig(block_q=1, block_m=16, tile_n=16)
    o_latent = mla_decode(torch.cat(q_latent).to(DEVICE), torch.cat(q_pe).to(DEVICE), cache, table,
                          table.new_tensor(seq_lens), scale=SCALE, config=config)
    assert relative_error(absorb_output(o_latent.cpu(), w_uv), torch.cat(naive)) < 1e-5
