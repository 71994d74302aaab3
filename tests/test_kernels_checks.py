"""Bad inputs are refused before launch, with a message that names the argument, and nothing is written."""

import pytest
import torch
from kvlab.kernels import default_device, paged_attention, paged_attention_ref, reshape_and_cache, reshape_and_cache_ref
from kvlab.kernels.batches import make_batch, poisoned_out

from kvlab.errors import KernelInputError, KvlabValueError

DEVICE = default_device()


def good():
    return make_batch([20, 5], [2, 5], group=2)


def first_column(batch, block_id):
    """The batch's block table with every sequence's first block replaced by ``block_id``."""
    table = batch.block_table.clone()
    table[:, 0] = block_id
    return table


def call(batch, **changes):
    args = dict(query=batch.query, key_cache=batch.key_cache, value_cache=batch.value_cache,
                block_table=batch.block_table, seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc)
    kwargs = {k: changes.pop(k) for k in list(changes) if k not in args}
    args.update({k: v.to(batch.query.device) for k, v in changes.items()})   # the same device: only the change is wrong
    return args, kwargs


CASES = [
    ("query is 2-D", lambda b: dict(query=b.query[:, 0]), "query must be 3-D"),
    ("query is an integer tensor", lambda b: dict(query=b.query.int()), "query.dtype=int32 is not supported"),
    ("caches of different shapes", lambda b: dict(value_cache=b.value_cache[:-1]), "same shape"),
    ("cache dtype disagrees with the query",
     lambda b: dict(key_cache=b.key_cache.half(), value_cache=b.value_cache.half()), "key_cache.dtype must be float32"),
    ("head sizes disagree", lambda b: dict(query=b.query[..., :32].contiguous()), "head_size"),
    ("query heads not a multiple of KV heads", lambda b: dict(query=b.query[:, :3].contiguous()),
     "num_q_heads=3 must be a multiple of num_kv_heads=2"),
    ("block table of floats", lambda b: dict(block_table=b.block_table.float()),
     "block_table.dtype must be int32 or int64"),
    ("block id outside the cache", lambda b: dict(block_table=first_column(b, 999)), "is outside the cache"),
    ("negative block id", lambda b: dict(block_table=first_column(b, -1)), "is outside the cache"),
    ("sequence longer than its table", lambda b: dict(seq_lens=torch.tensor([20, 500], dtype=torch.int32)),
     "longer than its table covers"),
    ("query_start_loc not increasing", lambda b: dict(query_start_loc=torch.tensor([0, 2, 2], dtype=torch.int32)),
     "strictly increasing"),
    ("query_start_loc not starting at 0", lambda b: dict(query_start_loc=torch.tensor([1, 2, 7], dtype=torch.int32)),
     "query_start_loc[0] must be 0"),
    ("query_start_loc not ending at num_tokens", lambda b: dict(query_start_loc=torch.tensor([0, 2, 6])),
     "must equal the number of query tokens"),
    ("sequence shorter than its queries", lambda b: dict(seq_lens=torch.tensor([20, 4], dtype=torch.int32)),
     "shorter than its 5 query tokens"),
    ("table rows disagree with seq_lens", lambda b: dict(block_table=b.block_table[:1]), "block_table has 1 rows"),
    ("a scale on a non-FP8 cache", lambda b: dict(k_scale=0.5), "only applies to an FP8 cache"),
    ("a negative softmax scale", lambda b: dict(scale=-1.0), "scale must be a finite number > 0"),
    ("zero splits", lambda b: dict(num_kv_splits=0), "num_kv_splits must be a positive integer"),
    ("an out buffer of the wrong dtype", lambda b: dict(out=b.query.half()), "out must match query"),
    # Strided index views: the checks would read one set of values and the kernel another (issue 14).
    ("seq_lens a strided view hiding huge lengths",
     lambda b: dict(seq_lens=torch.tensor([20, 4000, 5, 4000], dtype=torch.int32)[::2]),
     "seq_lens must be contiguous in its last dimension"),
    ("a block table with transposed storage", lambda b: dict(block_table=b.block_table.t().contiguous().t()),
     "block_table must be contiguous in its last dimension"),
    ("query_start_loc a strided view",
     lambda b: dict(query_start_loc=torch.tensor([0, 9, 2, 9, 7], dtype=torch.int32)[::2]),
     "query_start_loc must be contiguous"),
    ("a cache with no KV heads", lambda b: dict(key_cache=b.key_cache[:, :, :0], value_cache=b.value_cache[:, :, :0]),
     "key_cache has num_kv_heads = 0"),
    ("a cache with blocks of size 0", lambda b: dict(key_cache=b.key_cache[:, :0], value_cache=b.value_cache[:, :0]),
     "key_cache has block_size = 0"),
    ("a query with no heads", lambda b: dict(query=b.query[:, :0]), "needs num_q_heads >= 1"),
]


@pytest.mark.parametrize(("change", "message"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fn", [paged_attention, paged_attention_ref], ids=["kernel", "reference"])
def test_paged_attention_refuses_bad_input_and_writes_nothing(fn, change, message):
    batch = good()
    out = poisoned_out(batch)
    changes = change(batch)
    args, kwargs = call(batch, **changes)
    kwargs.setdefault("out", out)
    with pytest.raises(KernelInputError, match=message.replace("[", r"\[").replace("(", r"\(")):
        fn(**args, **kwargs)
    assert torch.isnan(out).all(), "a refused call must not write its output"


def test_kernel_input_errors_are_value_errors():
    assert issubclass(KernelInputError, KvlabValueError) and issubclass(KernelInputError, ValueError)


def write_args(num_tokens=6, dtype=torch.float32, cache_dtype=None):
    key = torch.randn(num_tokens, 2, 32).to(dtype)
    caches = [torch.full((4, 8, 2, 32), float("nan")).to(cache_dtype or dtype) for _ in range(2)]
    return dict(key=key, value=key.clone(), key_cache=caches[0], value_cache=caches[1],
                slot_mapping=torch.arange(num_tokens, dtype=torch.int32))


WRITE_CASES = [
    ("slot past the cache", dict(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 32], dtype=torch.int32)),
     r"slot_mapping\[5\] = 32 is outside the cache"),
    ("slot below -1", dict(slot_mapping=torch.tensor([0, 1, -2, 3, 4, 5], dtype=torch.int32)), "outside the cache"),
    ("two tokens in one slot", dict(slot_mapping=torch.tensor([0, 1, 1, 3, -1, -1], dtype=torch.int32)),
     "names slot 1 more than once"),
    ("slot_mapping of the wrong length", dict(slot_mapping=torch.arange(5, dtype=torch.int32)),
     "5 entries for 6 tokens"),
    ("key and cache head_size disagree", dict(key=torch.randn(6, 2, 16), value=torch.randn(6, 2, 16)),
     "num_kv_heads and head_size must agree"),
    ("float slot_mapping", dict(slot_mapping=torch.arange(6.0)), "slot_mapping.dtype must be int32 or int64"),
    ("scale on a float32 cache", dict(k_scale=2.0), "only applies to an FP8 cache"),
    ("slot_mapping a strided view hiding slots far past the cache",
     dict(slot_mapping=torch.tensor([1, 5e7, 5, 5e7, 9, 5e7, 11, 5e7, 13, 5e7, 15, 5e7]).long()[::2]),
     "slot_mapping must be contiguous in its last dimension"),
    ("a cache with no KV heads", dict(key=torch.randn(6, 0, 32), value=torch.randn(6, 0, 32),
                                     key_cache=torch.full((4, 8, 0, 32), float("nan")),
                                     value_cache=torch.full((4, 8, 0, 32), float("nan"))),
     "key_cache has num_kv_heads = 0"),
]


@pytest.mark.parametrize(("changes", "message"), [(c[1], c[2]) for c in WRITE_CASES], ids=[c[0] for c in WRITE_CASES])
@pytest.mark.parametrize("fn", [reshape_and_cache, reshape_and_cache_ref], ids=["kernel", "reference"])
def test_reshape_and_cache_refuses_bad_input_and_writes_nothing(fn, changes, message):
    args = {k: v.to(DEVICE) for k, v in write_args().items()}
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in changes.items()})
    with pytest.raises(KernelInputError, match=message):
        fn(**args)
    assert torch.isnan(args["key_cache"]).all() and torch.isnan(args["value_cache"]).all()


def test_a_strided_view_of_safe_values_is_refused_too_and_its_contiguous_copy_runs():
    """The rule is about layout, not values: the same numbers pass once they are laid out as the kernel reads."""
    batch = good()
    view = torch.stack([batch.seq_lens, batch.seq_lens], dim=1)[:, 0]         # stride 2, values unchanged
    args, _ = call(batch)
    with pytest.raises(KernelInputError, match="seq_lens must be contiguous"):
        paged_attention(**{**args, "seq_lens": view})
    torch.testing.assert_close(paged_attention(**{**args, "seq_lens": view.contiguous()}),
                               paged_attention_ref(**args), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fn", [reshape_and_cache, reshape_and_cache_ref], ids=["kernel", "reference"])
def test_nan_and_infinities_written_to_an_fp8_cache_store_what_torch_stores(fn):
    """NaN stays NaN (with its sign), ±inf saturate to ±448: the kernel's bits equal torch's cast."""
    key = torch.randn(4, 2, 32)
    key[0, 0, :4] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    key[1, 1, :2] = torch.tensor([1e30, -1e-30])
    caches = [torch.zeros(4, 8, 2, 32, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
    slots = torch.tensor([3, 9, 17, 30], device=DEVICE)
    fn(key.to(DEVICE), key.to(DEVICE), *caches, slots)
    expected = (key / 1.0).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)        # [4, 2, 32]
    stored = caches[0].view(torch.uint8).reshape(-1, 2, 32)[slots.cpu()].cpu()
    assert torch.equal(stored, expected)
    assert stored[0, 0, :4].tolist() == [0x7F, 0xFF, 0x7E, 0xFE]
