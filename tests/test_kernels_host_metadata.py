"""The checks run from host-side metadata without reading a device tensor (issue 27 item 5).

On a GPU every read of a device tensor's values (``.tolist()``, ``.item()``, ``.cpu()``, ``bool(t.any())``)
is a device-to-host synchronisation, which rules out CUDA graphs. ``DeviceOnly`` stands for a GPU
tensor on any machine: its shape, strides, dtype, device and address may be read, nothing else.
"""

import pytest
import torch
from kvlab.kernels import (
    HostMetadata,
    check_attention,
    check_cache_write,
    check_concat_and_cache_mla,
    check_mla_decode,
    paged_attention,
    paged_attention_ref,
    paged_attention_torch,
    plan_launch,
    reshape_and_cache,
)
from kvlab.kernels.batches import make_batch

from kvlab.errors import KernelInputError

#: What a check may ask a device tensor without synchronising: its metadata, never its values.
METADATA = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
            torch.Tensor.is_meta.__get__, torch.Tensor.ndim.__get__, torch.Tensor.stride, torch.Tensor.dim,
            torch.Tensor.size, torch.Tensor.data_ptr, torch.Tensor.element_size, torch.Tensor.numel,
            torch.Tensor.__len__, torch.Tensor.is_contiguous}


class DeviceOnly(torch.Tensor):
    """A tensor whose values the host may not read (a stand-in for a GPU tensor)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in METADATA:
            raise AssertionError(f"the check read a device tensor's values: {getattr(func, '__name__', func)}")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def device_only(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(DeviceOnly)


def batch():
    return make_batch([20, 5, 33], [2, 1, 33], group=2, head_size=16, device="cpu")


def host(b) -> HostMetadata:
    """What a runner keeps on the host (vLLM's ``query_start_loc_cpu`` and friends): separate copies."""
    return HostMetadata(seq_lens_cpu=b.seq_lens.clone(), block_table_cpu=b.block_table.clone(),
                        query_start_loc_cpu=b.query_start_loc.clone())


def test_device_only_tensors_refuse_a_value_read():
    t = device_only(torch.arange(3))
    for read in (t.tolist, t.cpu, lambda: bool(t.any()), lambda: t[0].item()):
        with pytest.raises(AssertionError, match="read a device tensor"):
            read()


def test_check_attention_reads_no_device_value_when_given_host_metadata():
    b = batch()
    tensors = [device_only(t) for t in b.args()]
    out = device_only(torch.empty_like(b.query))
    checked = check_attention(*tensors, out=out, sliding_window=8, num_kv_splits=2, host_metadata=host(b))
    assert checked == check_attention(*b.args(), sliding_window=8, num_kv_splits=2)
    assert checked.seq_lens == (20, 5, 33) and checked.query_start_loc == (0, 2, 3, 36)
    plan_launch(checked)                                 # the launch plan needs nothing more from the device


def test_without_host_metadata_the_same_call_must_read_the_device():
    """The structural proof's other half: the old path (and the default one) does read values."""
    b = batch()
    with pytest.raises(AssertionError, match="read a device tensor"):
        check_attention(*[device_only(t) for t in b.args()])


def test_check_mla_decode_reads_no_device_value_when_given_host_metadata():
    q_latent, q_pe, kv_cache = torch.randn(2, 4, 32), torch.randn(2, 4, 8), torch.randn(6, 8, 40)
    table, lens = torch.tensor([[0, 3, 5], [2, 0, 0]], dtype=torch.int32), torch.tensor([20, 5], dtype=torch.int32)
    meta = HostMetadata(seq_lens_cpu=lens.clone(), block_table_cpu=table.clone())
    checked = check_mla_decode(*map(device_only, (q_latent, q_pe, kv_cache, table, lens)), scale=0.2,
                               host_metadata=meta)
    assert checked.seq_lens == (20, 5)


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_ref, paged_attention_torch],
                         ids=["kernel", "reference", "torch"])
def test_host_metadata_gives_the_same_answer_and_its_values_are_checked(fn):
    b = batch()
    torch.testing.assert_close(fn(*b.args(), host_metadata=host(b)), paged_attention_ref(*b.args()),
                               atol=1e-4, rtol=1e-4)
    bad = host(b)
    bad.block_table_cpu[0, 0] = 10**6
    with pytest.raises(KernelInputError, match=r"block_table\[0, 0\] = 1000000 is outside the cache"):
        fn(*b.args(), host_metadata=bad)


@pytest.mark.parametrize(("meta", "message"), [
    ("not metadata", "host_metadata must be a kvlab.kernels.HostMetadata"),
    (lambda b: HostMetadata(b.seq_lens[:2].clone(), b.block_table.clone(), b.query_start_loc.clone()),
     r"host_metadata.seq_lens_cpu must be a CPU tensor shaped as seq_lens, \(3,\)"),
    (lambda b: HostMetadata(b.seq_lens.float(), b.block_table.clone(), b.query_start_loc.clone()),
     "host_metadata.seq_lens_cpu.dtype must be int32 or int64"),
    (lambda b: HostMetadata(b.seq_lens.clone(), b.block_table.clone(), None),
     "host_metadata.query_start_loc_cpu must be a torch.Tensor"),
])
def test_host_metadata_that_cannot_stand_for_the_device_tensors_is_refused(meta, message):
    b = batch()
    with pytest.raises(KernelInputError, match=message):
        check_attention(*b.args(), host_metadata=meta(b) if callable(meta) else meta)


def test_the_cache_writes_check_their_slots_from_the_host_copy():
    key, caches = torch.randn(3, 2, 16), [torch.zeros(4, 8, 2, 16) for _ in range(2)]
    slots = torch.tensor([1, 5, 30])
    checked = check_cache_write(*map(device_only, (key, key + 1, *caches, slots)), slot_mapping_cpu=slots.clone())
    assert checked.num_tokens == 3
    mla = (torch.randn(3, 32), torch.randn(3, 8), torch.zeros(4, 8, 40), slots)
    latent = check_concat_and_cache_mla(*map(device_only, mla), slot_mapping_cpu=slots.clone())
    assert latent.num_tokens == 3
    with pytest.raises(AssertionError, match="read a device tensor"):
        check_cache_write(*map(device_only, (key, key + 1, *caches, slots)))
    with pytest.raises(KernelInputError, match="slot_mapping names slot 5 more than once"):
        reshape_and_cache(key, key, *caches, slots, slot_mapping_cpu=torch.tensor([1, 5, 5]))
    assert not caches[0].any(), "a refused write writes nothing"
