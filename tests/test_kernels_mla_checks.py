"""MLA's kernels refuse bad input before launch, naming the argument, and write nothing: neither output nor cache."""

import pytest
import torch
from kvlab.kernels import (
    KernelConfig,
    concat_and_cache_mla,
    concat_and_cache_mla_ref,
    default_device,
    mla_decode,
    mla_decode_ref,
)

from kvlab.errors import KernelInputError

DEVICE = default_device()

RANK, ROPE, HEADS = 32, 8, 4


def decode_args():
    """Two sequences of 20 and 5 latents over blocks of 8 (3 + 1 blocks of a 6-block cache)."""
    return dict(q_latent=torch.randn(2, HEADS, RANK), q_pe=torch.randn(2, HEADS, ROPE),
                kv_cache=torch.randn(6, 8, RANK + ROPE),
                block_table=torch.tensor([[0, 3, 5], [2, 0, 0]], dtype=torch.int32),
                seq_lens=torch.tensor([20, 5], dtype=torch.int32))


def table_with(block_id):
    return torch.tensor([[0, block_id, 5], [2, 0, 0]], dtype=torch.int32)


DECODE_CASES = [
    ("q_latent is 2-D", dict(q_latent=torch.randn(2, RANK)), "q_latent must be 3-D"),
    ("q_pe of another dtype", dict(q_pe=torch.randn(2, HEADS, ROPE).half()), "q_latent and q_pe must share a dtype"),
    ("q_pe for other heads", dict(q_pe=torch.randn(2, 3, ROPE)), "the same heads in both"),
    ("a cache narrower than c_kv + k_pe", dict(kv_cache=torch.randn(6, 8, RANK)), "c_kv followed by k_pe"),
    ("a K/V-style 4-D cache", dict(kv_cache=torch.randn(6, 8, 1, RANK + ROPE)), "kv_cache must be 3-D"),
    ("a cache in another dtype", dict(kv_cache=torch.randn(6, 8, RANK + ROPE).half()),
     "kv_cache.dtype must be float32"),
    ("a cache with blocks of size 0", dict(kv_cache=torch.randn(6, 0, RANK + ROPE)), "block_size = 0"),
    ("block id outside the cache", dict(block_table=table_with(6)), r"block_table\[0, 1\] = 6 is outside the cache"),
    ("negative block id", dict(block_table=table_with(-1)), "is outside the cache"),
    ("sequence longer than its table", dict(seq_lens=torch.tensor([25, 5], dtype=torch.int32)),
     "longer than its table covers"),
    ("a sequence with no latent", dict(seq_lens=torch.tensor([20, 0], dtype=torch.int32)), r"seq_lens\[1\] = 0"),
    ("seq_lens for another batch", dict(seq_lens=torch.tensor([20], dtype=torch.int32)), "one of each per sequence"),
    ("seq_lens a strided view hiding huge lengths",
     dict(seq_lens=torch.tensor([20, 4000, 5, 4000], dtype=torch.int32)[::2]),
     "seq_lens must be contiguous in its last dimension"),
    ("a block table with transposed storage",
     dict(block_table=torch.tensor([[0, 2], [3, 0], [5, 0]], dtype=torch.int32).t()),
     "block_table must be contiguous in its last dimension"),
    ("no scale", dict(scale=None), "scale must be a finite number > 0"),
    ("a negative scale", dict(scale=-0.1), "scale must be a finite number > 0"),
    ("a k_scale on a float32 cache", dict(k_scale=0.5), "only applies to an FP8 cache"),
    ("zero splits", dict(num_kv_splits=0), "num_kv_splits must be a positive integer"),
    ("an out buffer in value space", dict(out=torch.full((2, HEADS, 16), float("nan"))), "out must match q_latent"),
]


@pytest.mark.parametrize(("changes", "message"), [(c[1], c[2]) for c in DECODE_CASES],
                         ids=[c[0] for c in DECODE_CASES])
@pytest.mark.parametrize("fn", [mla_decode, mla_decode_ref], ids=["kernel", "reference"])
def test_mla_decode_refuses_bad_input_and_writes_nothing(fn, changes, message):
    args = {**decode_args(), "scale": 0.2, **changes}
    out = args.pop("out", torch.full((2, HEADS, RANK), float("nan")))
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out = out.to(DEVICE)
    with pytest.raises(KernelInputError, match=message):
        fn(**args, out=out)
    assert torch.isnan(out).all(), "a refused call must not write its output"


def test_a_config_serving_more_than_one_query_token_is_refused():
    args = {k: v.to(DEVICE) for k, v in decode_args().items()}
    with pytest.raises(KernelInputError, match="block_q must be 1"):
        mla_decode(**args, scale=0.2, config=KernelConfig(block_q=2, block_m=16, tile_n=16))


def write_args(num_tokens=6):
    return dict(kv_c=torch.randn(num_tokens, RANK), k_pe=torch.randn(num_tokens, ROPE),
                kv_cache=torch.full((4, 8, RANK + ROPE), float("nan")),
                slot_mapping=torch.arange(num_tokens, dtype=torch.int32))


WRITE_CASES = [
    ("slot past the cache", dict(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 32], dtype=torch.int32)),
     r"slot_mapping\[5\] = 32 is outside the cache"),
    ("slot below -1", dict(slot_mapping=torch.tensor([0, 1, -2, 3, 4, 5], dtype=torch.int32)), "outside the cache"),
    ("two tokens in one slot", dict(slot_mapping=torch.tensor([0, 1, 1, 3, -1, -1], dtype=torch.int32)),
     "names slot 1 more than once"),
    ("slot_mapping of the wrong length", dict(slot_mapping=torch.arange(5, dtype=torch.int32)),
     "5 entries for 6 tokens"),
    ("slot_mapping a strided view hiding slots far past the cache",
     dict(slot_mapping=torch.tensor([1, 5e7, 5, 5e7, 9, 5e7, 11, 5e7, 13, 5e7, 15, 5e7]).long()[::2]),
     "slot_mapping must be contiguous in its last dimension"),
    ("k_pe for fewer tokens", dict(k_pe=torch.randn(5, ROPE)), "kv_c has 6 tokens but k_pe has 5"),
    ("k_pe as [num_tokens, 1, rope]", dict(k_pe=torch.randn(6, 1, ROPE)), "k_pe must be 2-D"),
    ("kv_c in another dtype", dict(kv_c=torch.randn(6, RANK).half()), "kv_c and k_pe must share a dtype"),
    ("a cache of the wrong width", dict(kv_cache=torch.full((4, 8, RANK), float("nan"))), "c_kv followed by k_pe"),
    ("a k_scale on a float32 cache", dict(k_scale=2.0), "only applies to an FP8 cache"),
]


@pytest.mark.parametrize(("changes", "message"), [(c[1], c[2]) for c in WRITE_CASES], ids=[c[0] for c in WRITE_CASES])
@pytest.mark.parametrize("fn", [concat_and_cache_mla, concat_and_cache_mla_ref], ids=["kernel", "reference"])
def test_concat_and_cache_mla_refuses_bad_input_and_writes_nothing(fn, changes, message):
    args = {**write_args(), **changes}
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(KernelInputError, match=message):
        fn(**args)
    assert torch.isnan(args["kv_cache"]).all(), "a refused write must leave the cache as it was"
