"""reshape_and_cache writes each token into its slot, skips -1 padding, and rounds FP8 exactly as torch does."""

import pytest
import torch
from kvlab.kernels import (
    compute_slot_mapping,
    default_device,
    dequantize_fp8,
    quantize_fp8,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from kvlab.kernels.batches import fresh_seed

DEVICE = default_device()
FP8 = torch.float8_e4m3fn


def nan_cache(num_blocks, block_size, heads, head_size, dtype):
    return torch.full((num_blocks, block_size, heads, head_size), float("nan"), device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_each_token_lands_in_its_slot_and_padding_is_skipped(dtype):
    g = torch.Generator().manual_seed(fresh_seed())
    num_tokens, heads, head_size, num_blocks, block_size = 20, 2, 48, 6, 8
    key = torch.randn(num_tokens, heads, head_size, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, heads, head_size, generator=g).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[3, 7, 19]] = -1                                               # padding tokens
    slots = slots.to(DEVICE)
    key_cache, value_cache = (nan_cache(num_blocks, block_size, heads, head_size, dtype) for _ in range(2))
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(key_cache[slot // block_size, slot % block_size], key[t])
            assert torch.equal(value_cache[slot // block_size, slot % block_size], value[t])
    written = slots[slots >= 0]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.isnan(key_cache.flatten(0, 1)[untouched].float()).all()     # no other slot was written
    assert torch.isnan(value_cache.flatten(0, 1)[untouched].float()).all()


def test_fp8_writes_are_bit_identical_to_torch_rounding():
    # every e4m3 value, every midpoint between neighbours (ties to even), subnormals, saturation, -0
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = codes[~codes.isnan()].unique()
    samples = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([1000.0, -1e6, -0.0, 7.94, 1e-4]),
                         torch.randn(2000) * 30, torch.randn(2000) * 0.01])
    scale = 1.0
    key = samples[: len(samples) // 16 * 16].reshape(-1, 1, 16).to(DEVICE)             # [tokens, 1 head, 16]
    value = -key * 3
    key_cache, value_cache = (torch.zeros(key.shape[0], 1, 1, 16, dtype=FP8, device=DEVICE) for _ in range(2))
    reshape_and_cache(key, value, key_cache, value_cache, torch.arange(key.shape[0], device=DEVICE),
                      k_scale=scale, v_scale=0.25)
    assert torch.equal(key_cache.view(torch.uint8).flatten(), quantize_fp8(key, scale).view(torch.uint8).flatten())
    assert torch.equal(value_cache.view(torch.uint8).flatten(), quantize_fp8(value, 0.25).view(torch.uint8).flatten())


def test_fp8_stores_value_over_scale_and_saturates():
    key = torch.tensor([[[1.0, 2.0, -3.0, 5000.0] * 4]], device=DEVICE)                 # [1, 1, 16]
    key_cache, value_cache = (torch.zeros(1, 4, 1, 16, dtype=FP8, device=DEVICE) for _ in range(2))
    reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([2], device=DEVICE), k_scale=0.5, v_scale=4.0)
    assert key_cache[0, 2, 0, :4].float().tolist() == [2.0, 4.0, -6.0, 448.0]          # x / 0.5, clipped at 448
    assert dequantize_fp8(value_cache[0, 2, 0, :4], 4.0).tolist() == [1.0, 2.0, -3.0, 1792.0]


def test_kernel_and_reference_write_the_same_bytes():
    g = torch.Generator().manual_seed(fresh_seed())
    key = torch.randn(12, 3, 80, generator=g).to(torch.bfloat16).to(DEVICE)
    value = torch.randn(12, 3, 80, generator=g).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([5, -1, 0, 9, 31, 30, -1, 17, 2, 3, 4, 8], dtype=torch.int64, device=DEVICE)
    for dtype, (ks, vs) in ((torch.bfloat16, (1.0, 1.0)), (FP8, (0.03, 0.2))):
        caches = [[torch.zeros(4, 8, 3, 80, dtype=dtype, device=DEVICE) for _ in range(2)] for _ in range(2)]
        reshape_and_cache(key, value, *caches[0], slots, ks, vs)
        reshape_and_cache_ref(key, value, *caches[1], slots, ks, vs)
        for mine, theirs in zip(caches[0], caches[1], strict=True):
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


def test_slot_mapping_of_a_mixed_batch():
    # block_size 4: seq 0 decodes position 9 (logical block 2 -> physical 5, offset 1); seq 1 prefills its
    # first 3 tokens; seq 2 writes a chunk at positions 4..5 of a prefix-cached prompt.
    block_table = torch.tensor([[2, 7, 5], [1, 0, 0], [3, 4, 6]])
    seq_lens = torch.tensor([10, 3, 6])
    query_start_loc = torch.tensor([0, 1, 4, 6])
    slots = compute_slot_mapping(block_table, seq_lens, query_start_loc, block_size=4)
    assert slots.tolist() == [5 * 4 + 1, 1 * 4 + 0, 1 * 4 + 1, 1 * 4 + 2, 4 * 4 + 0, 4 * 4 + 1]
