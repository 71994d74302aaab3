"""The kernels see memory, not indices: an output or a cache that aliases itself or an input is refused by name,
and so are split counts, windows, tile configs and tensors the kernels cannot act on (issue 28, items 8-11)."""

import pytest
import torch
from kvlab.kernels import (
    KernelConfig,
    concat_and_cache_mla,
    concat_and_cache_mla_ref,
    default_device,
    mla_decode,
    mla_decode_ref,
    paged_attention,
    paged_attention_ref,
    paged_attention_torch,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from kvlab.kernels.batches import make_batch
from kvlab.kernels.checks import MAX_NUM_KV_SPLITS

from kvlab.errors import KernelInputError

DEVICE = default_device()
ATTENTION = [paged_attention, paged_attention_ref, paged_attention_torch]
ATTENTION_IDS = ["kernel", "reference", "torch"]


def batch():
    return make_batch([20, 5], [2, 1], group=2, head_size=16, device=DEVICE)


def args(b, **changes):
    return {**dict(query=b.query, key_cache=b.key_cache, value_cache=b.value_cache, block_table=b.block_table,
                   seq_lens=b.seq_lens, query_start_loc=b.query_start_loc), **changes}


# --------------------------------------------------------------------------- 8. out= that overlaps


@pytest.mark.parametrize("fn", ATTENTION, ids=ATTENTION_IDS)
def test_an_out_whose_rows_are_one_memory_is_refused(fn):
    b = batch()
    out = torch.full((1, *b.query.shape[1:]), float("nan"), device=DEVICE).expand(b.query.shape)
    with pytest.raises(KernelInputError, match="out has internal overlap"):
        fn(**args(b), out=out)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("fn", ATTENTION, ids=ATTENTION_IDS)
@pytest.mark.parametrize("victim", ["query", "key_cache", "value_cache"])
def test_an_out_sharing_memory_with_an_input_is_refused(fn, victim):
    b = batch()
    source = args(b)[victim]
    out = source.view(-1)[:b.query.numel()].view(b.query.shape)      # the input's first bytes, shaped as out
    before = source.clone()
    with pytest.raises(KernelInputError, match=f"out shares memory with {victim}"):
        fn(**args(b), out=out)
    assert torch.equal(source.nan_to_num(), before.nan_to_num())


def mla_args():
    return dict(q_latent=torch.randn(2, 4, 32, device=DEVICE), q_pe=torch.randn(2, 4, 8, device=DEVICE),
                kv_cache=torch.randn(6, 8, 40, device=DEVICE),
                block_table=torch.tensor([[0, 3, 5], [2, 0, 0]], dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor([20, 5], dtype=torch.int32, device=DEVICE), scale=0.2)


@pytest.mark.parametrize("fn", [mla_decode, mla_decode_ref], ids=["kernel", "reference"])
def test_mla_decode_refuses_an_overlapping_or_aliasing_out(fn):
    a = mla_args()
    with pytest.raises(KernelInputError, match="out has internal overlap"):
        fn(**a, out=torch.empty(1, 4, 32, device=DEVICE).expand(2, 4, 32))
    with pytest.raises(KernelInputError, match="out shares memory with kv_cache"):
        fn(**a, out=a["kv_cache"].view(-1)[:256].view(2, 4, 32))


# --------------------------------------------------------------------------- 9. cache writes through aliased memory


def write_args():
    key = torch.randn(6, 2, 16, device=DEVICE)
    return dict(key=key, value=key + 1, key_cache=torch.zeros(4, 8, 2, 16, device=DEVICE),
                value_cache=torch.zeros(4, 8, 2, 16, device=DEVICE),
                slot_mapping=torch.tensor([0, 1, 5, 9, 17, 30], device=DEVICE))


@pytest.mark.parametrize("fn", [reshape_and_cache, reshape_and_cache_ref], ids=["kernel", "reference"])
def test_a_cache_whose_slots_are_one_memory_is_refused(fn):
    """An expanded cache: slots 1 and 5 are different indices but the same bytes, so token 0's K would be lost."""
    a = write_args()
    a["key_cache"] = torch.zeros(4, 1, 2, 16, device=DEVICE).expand(4, 8, 2, 16)
    with pytest.raises(KernelInputError, match="key_cache has internal overlap"):
        fn(**a)
    assert not a["key_cache"].any() and not a["value_cache"].any()


@pytest.mark.parametrize("fn", [reshape_and_cache, reshape_and_cache_ref], ids=["kernel", "reference"])
def test_one_tensor_as_both_caches_is_refused(fn):
    a = write_args()
    a["value_cache"] = a["key_cache"]
    with pytest.raises(KernelInputError, match="key_cache shares memory with value_cache"):
        fn(**a)
    assert not a["key_cache"].any()


@pytest.mark.parametrize("fn", [reshape_and_cache, reshape_and_cache_ref], ids=["kernel", "reference"])
def test_vllm_s_two_halves_of_one_tensor_are_separate_caches(fn):
    """vLLM's flash layout ``[2, num_blocks, ...]``: ``kv[0]`` and ``kv[1]`` share a storage but no byte."""
    a = write_args()
    kv = torch.zeros(2, 4, 8, 2, 16, device=DEVICE)
    fn(**{**a, "key_cache": kv[0], "value_cache": kv[1]})
    assert torch.equal(kv[0].reshape(-1, 2, 16)[a["slot_mapping"]], a["key"])
    assert torch.equal(kv[1].reshape(-1, 2, 16)[a["slot_mapping"]], a["value"])


@pytest.mark.parametrize("fn", [concat_and_cache_mla, concat_and_cache_mla_ref], ids=["kernel", "reference"])
def test_the_latent_cache_write_sees_memory_too(fn):
    kv_c, k_pe = torch.randn(3, 32, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    slots = torch.tensor([1, 5, 9], device=DEVICE)
    expanded = torch.zeros(4, 1, 40, device=DEVICE).expand(4, 8, 40)
    with pytest.raises(KernelInputError, match="kv_cache has internal overlap"):
        fn(kv_c, k_pe, expanded, slots)
    cache = torch.zeros(4, 8, 40, device=DEVICE)
    with pytest.raises(KernelInputError, match="kv_cache shares memory with kv_c"):
        fn(cache.view(-1)[:96].view(3, 32), k_pe, cache, slots)
    assert not cache.any()


# --------------------------------------------------------------------------- 10. num_kv_splits has a ceiling


@pytest.mark.parametrize("fn", ATTENTION, ids=ATTENTION_IDS)
@pytest.mark.parametrize("splits", [MAX_NUM_KV_SPLITS + 1, 10**6, 10**12])
def test_more_splits_than_vllm_launches_are_refused_by_name(fn, splits):
    with pytest.raises(KernelInputError, match=f"num_kv_splits must be at most {MAX_NUM_KV_SPLITS}"):
        fn(**args(batch()), num_kv_splits=splits)


@pytest.mark.parametrize("fn", [mla_decode, mla_decode_ref], ids=["kernel", "reference"])
def test_mla_decode_refuses_too_many_splits(fn):
    with pytest.raises(KernelInputError, match="num_kv_splits must be at most"):
        fn(**mla_args(), num_kv_splits=10**6)


def test_the_engine_refuses_a_split_count_no_kernel_takes():
    from kvlab.engine.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)          # the setter's check runs before it touches any layer
    with pytest.raises(KernelInputError, match="decode_kv_splits must be at most"):
        runner.decode_kv_splits = 10**6


def test_the_largest_split_count_runs():
    b = batch()
    torch.testing.assert_close(paged_attention(**args(b), num_kv_splits=MAX_NUM_KV_SPLITS),
                               paged_attention_ref(**args(b)), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- 11. clear errors


@pytest.mark.parametrize("fn", ATTENTION, ids=ATTENTION_IDS)
@pytest.mark.parametrize("window", [2**31, 2**70])
def test_a_window_past_int32_is_refused_by_name(fn, window):
    with pytest.raises(KernelInputError, match="sliding_window must be at most 2147483647"):
        fn(**args(batch()), sliding_window=window)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("block_q", 1.5, "KernelConfig.block_q must be an int"),
    ("block_q", "1", "KernelConfig.block_q must be an int"),
    ("block_q", True, "KernelConfig.block_q must be an int"),
    ("tile_n", 64.0, "KernelConfig.tile_n must be an int"),
    ("num_warps", -3, "KernelConfig.num_warps must be a power of two"),
    ("num_warps", 3, "KernelConfig.num_warps must be a power of two"),
    ("num_warps", 64, "KernelConfig.num_warps must be a power of two"),
    ("num_stages", 0, "KernelConfig.num_stages must be"),
    ("num_stages", 2.5, "KernelConfig.num_stages must be"),
])
def test_a_kernel_config_of_the_wrong_type_or_range_is_refused_by_name(field, value, message):
    fields = {**dict(block_q=1, block_m=16, tile_n=16, num_warps=4, num_stages=3), field: value}
    with pytest.raises(KernelInputError, match=message):
        KernelConfig(**fields)


@pytest.mark.parametrize("fn", ATTENTION, ids=ATTENTION_IDS)
def test_meta_tensors_are_refused_by_name(fn):
    b = batch()
    with pytest.raises(KernelInputError, match="seq_lens is a meta tensor"):
        fn(**args(b, seq_lens=b.seq_lens.to("meta")))
    meta = {k: v.to("meta") for k, v in args(b).items()}
    with pytest.raises(KernelInputError, match="query is a meta tensor"):
        fn(**meta)


def test_meta_tensors_are_refused_by_the_writes_and_mla_too():
    a = write_args()
    with pytest.raises(KernelInputError, match="key_cache is a meta tensor"):
        reshape_and_cache_ref(**{**a, "key_cache": a["key_cache"].to("meta")})
    with pytest.raises(KernelInputError, match="kv_cache is a meta tensor"):
        mla_decode_ref(**{**mla_args(), "kv_cache": torch.empty(6, 8, 40, device="meta")})
