"""The older CUDA layout (5-D K, 4-D V) holds the same values, where its offset formulas say."""

import pytest
import torch
from kvlab.kernels.layouts import (
    flash_offsets,
    from_legacy_layout,
    legacy_key_offsets,
    legacy_value_offsets,
    legacy_x,
    to_legacy_layout,
)

from kvlab.errors import KernelInputError


def test_x_is_sixteen_bytes_of_elements():
    assert (legacy_x(torch.float16), legacy_x(torch.bfloat16), legacy_x(torch.float8_e4m3fn),
            legacy_x(torch.float32)) == (8, 8, 16, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_round_trip_is_exact_and_shapes_are_vllms(dtype):
    nb, bs, h, d = 5, 16, 2, 128
    key = torch.randn(nb, bs, h, d).to(dtype)
    value = torch.randn(nb, bs, h, d).to(dtype)
    k5, v4 = to_legacy_layout(key, value)
    x = legacy_x(dtype)
    assert tuple(k5.shape) == (nb, h, d // x, bs, x) and tuple(v4.shape) == (nb, h, d, bs)
    back_k, back_v = from_legacy_layout(k5, v4)
    assert torch.equal(back_k.view(torch.uint8), key.view(torch.uint8))
    assert torch.equal(back_v.view(torch.uint8), value.view(torch.uint8))


def test_offset_formulas_point_at_the_stored_values():
    nb, bs, h, d = 3, 16, 4, 64
    key, value = torch.randn(nb, bs, h, d, dtype=torch.float16), torch.randn(nb, bs, h, d, dtype=torch.float16)
    k5, v4 = to_legacy_layout(key, value)
    block, head = 2, 3
    assert torch.equal(k5[block, head].flatten()[legacy_key_offsets(bs, d, legacy_x(key.dtype))], key[block, :, head])
    assert torch.equal(v4[block, head].flatten()[legacy_value_offsets(bs, d)], value[block, :, head])
    assert torch.equal(key[block].flatten()[flash_offsets(bs, h, d)], key[block, :, 0])


def test_one_vector_of_each_key_sits_side_by_side_in_the_old_layout():
    # The same 16-byte chunk (x dims) of the block's 16 keys is one contiguous run of 16 * 16 bytes.
    bs, d, x = 16, 128, 8
    offsets = legacy_key_offsets(bs, d, x)
    chunk = offsets[:, 8:16]                                   # dims 8..15 of every key
    assert chunk.flatten().tolist() == list(range(int(chunk.min()), int(chunk.min()) + bs * x))
    # In the flash layout the same chunk of neighbouring keys is num_kv_heads * head_size apart.
    assert (flash_offsets(bs, 8, d)[1:, 8] - flash_offsets(bs, 8, d)[:-1, 8]).unique().tolist() == [8 * d]
    # V keeps the tokens of one dimension contiguous: the direction p . v sums over.
    assert legacy_value_offsets(bs, d)[:, 5].tolist() == list(range(5 * bs, 6 * bs))


def test_shapes_that_do_not_fit_are_refused():
    half = torch.float16
    with pytest.raises(KernelInputError, match="multiple of x=8"):
        to_legacy_layout(torch.zeros(1, 16, 1, 12, dtype=half), torch.zeros(1, 16, 1, 12, dtype=half))
    with pytest.raises(KernelInputError, match="do not form one legacy cache"):
        from_legacy_layout(torch.zeros(1, 1, 16, 16, 8, dtype=half), torch.zeros(1, 1, 64, 16, dtype=half))
