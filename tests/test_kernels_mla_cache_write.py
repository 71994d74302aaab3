"""concat_and_cache_mla writes each token's [c_kv, k_pe] into its slot, skips -1 padding, rounds FP8 as torch does."""

import pytest
import torch
from kvlab.kernels import (
    compute_slot_mapping,
    concat_and_cache_mla,
    concat_and_cache_mla_ref,
    default_device,
    quantize_fp8,
)
from kvlab.kernels.batches import fresh_seed

DEVICE = default_device()

FP8 = torch.float8_e4m3fn
RANK, ROPE = 32, 8


def latents(num_tokens, generator, dtype=torch.float32, rank=RANK, rope=ROPE):
    """``kv_c`` and ``k_pe`` as the model makes them: two column ranges of one ``kv_a_proj_with_mqa`` output."""
    both = torch.randn(num_tokens, rank + rope, generator=generator).to(dtype).to(DEVICE)
    return both[:, :rank], both[:, rank:]                       # strided views: row stride rank + rope


def nan_cache(num_blocks, block_size, dtype=torch.float32, width=RANK + ROPE):
    return torch.full((num_blocks, block_size, width), float("nan"), device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_each_token_lands_in_its_slot_c_kv_first_and_padding_is_skipped(dtype):
    g = torch.Generator().manual_seed(fresh_seed())
    num_tokens, num_blocks, block_size = 20, 6, 8
    kv_c, k_pe = latents(num_tokens, g, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[3, 7, 19]] = -1                                                    # padding tokens
    slots = slots.to(DEVICE)
    cache = nan_cache(num_blocks, block_size, dtype)
    concat_and_cache_mla(kv_c, k_pe, cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(cache[slot // block_size, slot % block_size, :RANK], kv_c[t])
            assert torch.equal(cache[slot // block_size, slot % block_size, RANK:], k_pe[t])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert torch.isnan(cache.flatten(0, 1)[untouched].float()).all()             # no other slot was written
    reference = nan_cache(num_blocks, block_size, dtype)
    concat_and_cache_mla_ref(kv_c, k_pe, reference, slots)
    assert torch.equal(cache.isnan(), reference.isnan())
    assert torch.equal(cache.nan_to_num(), reference.nan_to_num())


def test_slots_from_a_block_table_fill_a_prefill_and_a_decode():
    # a 19-token prompt over blocks [4, 1] (block size 16) and one decode token at position 5 in block 2
    g = torch.Generator().manual_seed(fresh_seed())
    table = torch.tensor([[4, 1], [2, 0]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([19, 6], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 19, 20], dtype=torch.int32, device=DEVICE)
    slots = compute_slot_mapping(table, seq_lens, qsl, 16)
    kv_c, k_pe = latents(20, g)
    cache = nan_cache(5, 16)
    concat_and_cache_mla(kv_c, k_pe, cache, slots)
    assert torch.equal(cache[4, :, :RANK], kv_c[:16]) and torch.equal(cache[1, :3, :RANK], kv_c[16:19])
    assert torch.equal(cache[2, 5, RANK:], k_pe[19])


def test_fp8_writes_store_x_over_scale_bit_identical_to_torch():
    g = torch.Generator().manual_seed(fresh_seed())
    kv_c, k_pe = latents(12, g)
    kv_c, k_pe = kv_c * 30, k_pe * 0.01                  # saturating values in one part, subnormals in the other
    kv_c[0, :4] = torch.tensor([1000.0, -1e6, -0.0, 7.94])
    cache = torch.zeros(2, 8, RANK + ROPE, dtype=FP8, device=DEVICE)
    concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(12, device=DEVICE), k_scale=0.5)
    expected = quantize_fp8(torch.cat([kv_c, k_pe], dim=-1), 0.5)
    assert torch.equal(cache.flatten(0, 1)[:12].view(torch.uint8), expected.view(torch.uint8))


def test_the_mutant_that_writes_k_pe_over_c_kv_is_caught():
    # kvlab.kernels.mutants' mla_latent_write_offset stores k_pe at the slot's start: c_kv's head is overwritten,
    # the rope part left unwritten (NaN)
    from kvlab.kernels import mutants

    g = torch.Generator().manual_seed(fresh_seed())
    kv_c, k_pe = latents(3, g)
    slots = torch.tensor([5, 0, 17], device=DEVICE)
    broken, reference = nan_cache(3, 8), nan_cache(3, 8)
    mutants.load_mutant("mla_latent_write_offset").concat_and_cache_mla_triton(kv_c, k_pe, broken, slots)
    concat_and_cache_mla_ref(kv_c, k_pe, reference, slots)
    assert torch.equal(broken[0, 5, :ROPE], k_pe[0]) and broken[0, 5, RANK:].isnan().all()
    assert not torch.equal(broken.nan_to_num(), reference.nan_to_num())
