"""Input checks for the cache write and paged attention, run before anything is launched or written.

The kernels trust their inputs: a block id outside the cache or a sequence longer than its block
table would read or write foreign memory silently. So every entry point (the Triton kernels and
the torch reference alike) first passes its tensors through here. A failed check raises
``KernelInputError`` naming the argument and what is allowed, and nothing has been written.

The checks need the values of three small integer tensors (``seq_lens``, ``query_start_loc``,
``block_table``). vLLM's runner builds them on the host and keeps the host copies beside the device
ones (``CommonAttentionMetadata.query_start_loc_cpu`` and ``seq_lens_cpu_upper_bound`` in
``vllm/v1/attention/backend.py``; the block table's ``CpuGpuBuffer`` in ``vllm/v1/worker/block_table.py``);
``HostMetadata`` is kvlab's version. Given one, the checks read only host
memory and the device tensors' shapes and strides: no device-to-host synchronisation, so a call
can be captured in a CUDA graph. Without one, the wrapper copies the three to the host in one
transfer (one synchronisation on a GPU, none on the CPU). ``AttentionBatch`` is what the checks
return: the batch as host numbers.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np
import torch
from kvlab.kernels._backend import TRITON_CUDA

from kvlab.errors import KernelInputError
from kvlab.units import cdiv

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The most split-KV ranges a caller may ask for. vLLM 0.33.0's Triton backend launches 16
#: (``NUM_PAR_SOFTMAX_SEGMENTS`` in ``vllm/v1/attention/backends/triton_attn.py``) and 64 on
#: SM120 GPUs whose 16-segment grid under-fills the SMs (the same file): 64 is its largest.
MAX_NUM_KV_SPLITS = 64
#: Positions and window sizes reach the kernels as int32.
MAX_INT32 = 2**31 - 1
FP8_DTYPE = torch.float8_e4m3fn
INDEX_DTYPES = (torch.int32, torch.int64)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_ndim(name: str, tensor: object, ndim: int, layout: str) -> torch.Tensor:
    """``tensor`` must be a torch tensor with ``ndim`` dimensions (``layout`` names them)."""
    if not isinstance(tensor, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor shaped {layout}, got {type(tensor).__name__}")
    if tensor.is_meta:
        raise KernelInputError(
            f"{name} is a meta tensor (a shape without data): the kernels read and write real memory, so create it "
            "on the CPU or a GPU"
        )
    if tensor.dim() != ndim:
        raise KernelInputError(f"{name} must be {ndim}-D {layout}, got shape {tuple(tensor.shape)}")
    return tensor


def check_index_tensor(name: str, tensor: object, ndim: int, layout: str) -> torch.Tensor:
    """An integer tensor (int32 or int64) with ``ndim`` dimensions, laid out as the kernels read it.

    The kernels read index tensors with unit stride along their last dimension (a block table's
    row stride is passed), while the checks read values through the tensor's own strides. A strided
    view (``seq_lens[::2]``, a transposed block table) would make the two disagree, so the kernels
    would act on values nobody checked: such views are refused, not followed.
    """
    check_ndim(name, tensor, ndim, layout)
    if tensor.dtype not in INDEX_DTYPES:
        raise KernelInputError(f"{name}.dtype must be int32 or int64, got {_name(tensor.dtype)}")
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise KernelInputError(
            f"{name} must be contiguous in its last dimension (stride 1), got strides {tuple(tensor.stride())}: "
            f"pass {name}.contiguous()"
        )
    return tensor


def has_internal_overlap(tensor: torch.Tensor) -> bool:
    """True unless distinct indices of ``tensor`` provably address distinct elements.

    Sorted by stride, each dimension must step past everything the smaller ones reach; an
    ``expand``ed dimension (stride 0) or a hand-made ``as_strided`` view that folds back fails.
    """
    if tensor.is_contiguous():                          # the usual case, answered in C
        return False
    reach = 0                                           # the largest offset the dimensions so far reach
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape, strict=True) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first, last]`` address of the bytes ``tensor`` can touch (a view's, not its storage's); empty: (0, -1)."""
    if tensor.numel() == 0:
        return 0, -1
    first = tensor.data_ptr()
    if tensor.is_contiguous():                          # the usual case: numel elements in a row
        return first, first + tensor.numel() * tensor.element_size() - 1
    span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return first, first + (span + 1) * tensor.element_size() - 1


def check_no_aliasing(written: dict[str, torch.Tensor], read: dict[str, torch.Tensor]) -> None:
    """Each tensor a kernel writes has no internal overlap and shares no byte with another tensor of the call.

    The kernels write through raw pointers, so two slots (or rows) that are one memory lose a
    write, and an output over an input overwrites what is still to be read. A shared byte range
    is refused (as torch's own ``out=`` check does): vLLM's ``kv[0]`` / ``kv[1]`` halves share none.
    Reads only shapes, strides and addresses: nothing is synchronised.
    """
    for name, tensor in written.items():
        if has_internal_overlap(tensor):
            raise KernelInputError(
                f"{name} has internal overlap (strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}): "
                f"two of its elements are one memory (an expand()ed view?), so one write would overwrite another; "
                f"pass {name}.contiguous()"
            )
    tensors = {**written, **read}
    ranges = {n: _byte_range(t) for n, t in tensors.items()}
    names = list(tensors)
    for i, name in enumerate(written):
        lo, hi = ranges[name]
        for other in names[i + 1:]:
            o_lo, o_hi = ranges[other]
            if lo <= o_hi and o_lo <= hi:
                raise KernelInputError(
                    f"{name} shares memory with {other}: the kernel writes {name} while it reads (or writes) "
                    f"{other}, so give {name} memory of its own (a fresh tensor or {name}.clone())"
                )


def check_kv_scales(cache_dtype: torch.dtype, k_scale: object, v_scale: object) -> tuple[float, float]:
    """Per-tensor FP8 scales: finite and > 0, and left at 1.0 unless the cache is FP8."""
    scales = []
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            raise KernelInputError(f"{name} must be a finite number > 0, got {value!r}")
        if cache_dtype != FP8_DTYPE and value != 1.0:
            raise KernelInputError(
                f"{name}={value!r} only applies to an FP8 cache; this cache is {_name(cache_dtype)}, "
                "so leave it at 1.0"
            )
        scales.append(float(value))
    return scales[0], scales[1]


def check_cache_pair(key_cache: object, value_cache: object, compute_dtype: torch.dtype) -> None:
    """K and V caches: 4-D ``[num_blocks, block_size, num_kv_heads, head_size]``, same shape and dtype."""
    layout = "[num_blocks, block_size, num_kv_heads, head_size]"
    check_ndim("key_cache", key_cache, 4, layout)
    check_ndim("value_cache", value_cache, 4, layout)
    if key_cache.shape != value_cache.shape:
        raise KernelInputError(
            f"key_cache and value_cache must have the same shape, got {tuple(key_cache.shape)} "
            f"and {tuple(value_cache.shape)}"
        )
    if key_cache.dtype != value_cache.dtype:
        raise KernelInputError(
            f"key_cache and value_cache must share a dtype, got {_name(key_cache.dtype)} and {_name(value_cache.dtype)}"
        )
    if key_cache.dtype not in (compute_dtype, FP8_DTYPE):
        raise KernelInputError(
            f"key_cache.dtype must be {_name(compute_dtype)} (as the activations) or float8_e4m3fn, "
            f"got {_name(key_cache.dtype)}"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise KernelInputError("key_cache and value_cache must be contiguous in head_size (stride 1)")
    for dim, size in zip(("num_blocks", "block_size", "num_kv_heads", "head_size"), key_cache.shape, strict=True):
        if size < 1:
            raise KernelInputError(f"key_cache has {dim} = {size}: every dimension of {layout} must be at least 1")


def check_float_activations(name: str, tensor: torch.Tensor) -> None:
    """Activations are float32, float16 or bfloat16 and contiguous in their last dimension."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise KernelInputError(
            f"{name}.dtype={_name(tensor.dtype)} is not supported; choose one of float32, float16, bfloat16"
        )
    if tensor.stride(-1) != 1:
        raise KernelInputError(f"{name} must be contiguous in its last dimension (stride 1)")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Every tensor on one device (the kernels cannot follow a pointer into another one)."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise KernelInputError(f"all tensors must be on one device, got {listed}")


def check_kernel_device(backend_name: str, device: torch.device) -> None:
    """Native Triton kernels read GPU memory only: on ``triton-cuda`` the tensors must be CUDA tensors.

    Without this check a CPU tensor reaches the launch and Triton fails with a pointer error that
    names neither the tensor nor the fix.
    """
    if backend_name == TRITON_CUDA and device.type != "cuda":
        raise KernelInputError(
            f"the triton-cuda backend runs its kernels on CUDA tensors, got tensors on {device}: create them "
            "with device=kvlab.kernels.default_device() (or move them with .to('cuda'))"
        )


def check_slot_mapping(slot_mapping: object, num_tokens: int, num_blocks: int, block_size: int,
                       slot_mapping_cpu: object = None) -> None:
    """One slot per token, each in ``[0, num_blocks * block_size)`` or -1 (padding), no slot twice.

    The values are read from ``slot_mapping_cpu`` (its host copy: no synchronisation) when given,
    else from one host copy of ``slot_mapping`` (none needed on the CPU).
    """
    check_index_tensor("slot_mapping", slot_mapping, 1, "[num_tokens]")
    if slot_mapping.shape[0] != num_tokens:
        raise KernelInputError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens: one slot per token "
            "(-1 for a padding token)"
        )
    if slot_mapping_cpu is not None:
        check_index_tensor("slot_mapping_cpu", slot_mapping_cpu, 1, "[num_tokens]")
        if slot_mapping_cpu.device.type != "cpu" or slot_mapping_cpu.shape != slot_mapping.shape:
            raise KernelInputError(
                f"slot_mapping_cpu must be a CPU tensor shaped as slot_mapping, {tuple(slot_mapping.shape)}; got "
                f"{tuple(slot_mapping_cpu.shape)} on {slot_mapping_cpu.device}"
            )
        slot_mapping = slot_mapping_cpu
    elif slot_mapping.device.type != "cpu":
        slot_mapping = slot_mapping.cpu()                          # the one synchronisation
    num_slots = num_blocks * block_size
    values = slot_mapping.tolist()                                 # host values: a step's few, or a prompt's
    if values and (min(values) < -1 or max(values) >= num_slots):
        token = next(i for i, slot in enumerate(values) if not -1 <= slot < num_slots)
        raise KernelInputError(
            f"slot_mapping[{token}] = {values[token]} is outside the cache: slots are "
            f"0..{num_slots - 1} ({num_blocks} blocks of {block_size}), or -1 for padding"
        )
    written = [slot for slot in values if slot >= 0]
    if len(set(written)) != len(written):
        seen: set[int] = set()
        twice = next(slot for slot in written if slot in seen or seen.add(slot))
        raise KernelInputError(
            f"slot_mapping names slot {twice} more than once: two tokens cannot share a slot"
        )


def check_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, lens: list[int], block_size: int,
                      num_blocks: int) -> None:
    """Each sequence's table row covers its length, and every entry it uses names a block of the cache.

    ``block_table`` and ``seq_lens`` are host tensors (``HostMetadata``'s): this reads their values.
    """
    max_blocks = block_table.shape[1]
    for i, length in enumerate(lens):
        if cdiv(length, block_size) > max_blocks:
            raise KernelInputError(
                f"seq_lens[{i}] = {length} needs {cdiv(length, block_size)} blocks of {block_size}, but "
                f"block_table has only {max_blocks} columns: the sequence is longer than its table covers"
            )
    table = block_table.numpy()                                    # host values: numpy is quicker on a few
    if table.size == 0 or (int(table.min()) >= 0 and int(table.max()) < num_blocks):
        return  # every entry names a block (the runner pads rows with block 0): no need to find the used ones
    blocks_needed = (seq_lens.numpy().astype(np.int64) + block_size - 1) // block_size  # [num_seqs]
    used = np.arange(max_blocks)[None, :] < blocks_needed[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        seq, col = (int(i) for i in np.argwhere(bad)[0])
        raise KernelInputError(
            f"block_table[{seq}, {col}] = {int(table[seq, col])} is outside the cache: block ids must be "
            f"in [0, {num_blocks}) for a cache of {num_blocks} blocks"
        )


# --------------------------------------------------------------------------- cache write


@dataclasses.dataclass(frozen=True)
class CacheWrite:
    """What ``reshape_and_cache`` learned from its inputs (host-side numbers)."""

    num_tokens: int
    num_kv_heads: int
    head_size: int
    num_blocks: int
    block_size: int
    fp8: bool
    k_scale: float
    v_scale: float


def check_cache_write(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0,
                      slot_mapping_cpu=None) -> CacheWrite:
    """Validate ``reshape_and_cache``'s arguments; return their sizes (``slot_mapping_cpu``: ``check_slot_mapping``)."""
    layout = "[num_tokens, num_kv_heads, head_size]"
    check_ndim("key", key, 3, layout)
    check_ndim("value", value, 3, layout)
    if key.shape != value.shape:
        raise KernelInputError(
            f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_float_activations("key", key)
    check_float_activations("value", value)
    if key.dtype != value.dtype:
        raise KernelInputError(f"key and value must share a dtype, got {_name(key.dtype)} and {_name(value.dtype)}")
    check_cache_pair(key_cache, value_cache, key.dtype)
    check_index_tensor("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_size = key.shape
    num_blocks, block_size, cache_heads, cache_head_size = key_cache.shape
    if (cache_heads, cache_head_size) != (num_kv_heads, head_size):
        raise KernelInputError(
            f"key is [num_tokens, {num_kv_heads}, {head_size}] but key_cache holds "
            f"[.., .., {cache_heads}, {cache_head_size}]: num_kv_heads and head_size must agree"
        )
    check_slot_mapping(slot_mapping, num_tokens, num_blocks, block_size, slot_mapping_cpu)
    check_no_aliasing(dict(key_cache=key_cache, value_cache=value_cache),
                      dict(key=key, value=value, slot_mapping=slot_mapping))
    ks, vs = check_kv_scales(key_cache.dtype, k_scale, v_scale)
    return CacheWrite(num_tokens, num_kv_heads, head_size, num_blocks, block_size,
                      key_cache.dtype == FP8_DTYPE, ks, vs)


# --------------------------------------------------------------------------- paged attention


@dataclasses.dataclass
class PagedTensors:
    """The six tensors of a ``paged_attention`` call, in its argument order (tests and benchmarks)."""

    query: torch.Tensor             # [num_tokens, num_q_heads, head_size]
    key_cache: torch.Tensor         # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor       # [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor          # [num_seqs]
    query_start_loc: torch.Tensor   # [num_seqs + 1]

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens, self.query_start_loc)


@dataclasses.dataclass(frozen=True, eq=False)
class HostMetadata:
    """A batch's index tensors as the host built them, before the copy to the device (vLLM's ``*_cpu`` fields).

    The caller vouches that the device tensors hold the same values, as vLLM's runner does: they
    are copies of these. ``query_start_loc_cpu`` is None for MLA decode (one query token each).
    """

    seq_lens_cpu: torch.Tensor                     # [num_seqs]
    block_table_cpu: torch.Tensor                  # [num_seqs, max_blocks_per_seq]
    query_start_loc_cpu: torch.Tensor | None = None  # [num_seqs + 1]

    @classmethod
    def from_device(cls, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: torch.Tensor | None = None) -> HostMetadata:
        """The host copies of already-checked index tensors: themselves on the CPU, else one transfer (one sync)."""
        tensors = [t for t in (seq_lens, block_table, query_start_loc) if t is not None]
        if all(t.device.type == "cpu" for t in tensors):
            return cls(seq_lens, block_table, query_start_loc)
        flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]).cpu()       # the one synchronisation
        parts = [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]
        return cls(*parts)


def check_host_metadata(host: object, seq_lens: torch.Tensor, block_table: torch.Tensor,
                        query_start_loc: torch.Tensor | None = None) -> HostMetadata:
    """``host``: a ``HostMetadata`` of CPU index tensors shaped as the device tensors it stands for."""
    if not isinstance(host, HostMetadata):
        raise KernelInputError(
            f"host_metadata must be a kvlab.kernels.HostMetadata or None, got {type(host).__name__}"
        )
    pairs = [("seq_lens", host.seq_lens_cpu, seq_lens), ("block_table", host.block_table_cpu, block_table)]
    if query_start_loc is not None:
        pairs.append(("query_start_loc", host.query_start_loc_cpu, query_start_loc))
    for name, cpu, device in pairs:
        check_index_tensor(f"host_metadata.{name}_cpu", cpu, device.dim(), f"as {name}")
        if cpu.device.type != "cpu" or cpu.shape != device.shape:
            raise KernelInputError(
                f"host_metadata.{name}_cpu must be a CPU tensor shaped as {name}, {tuple(device.shape)}; got "
                f"{tuple(cpu.shape)} on {cpu.device}"
            )
    return host


@dataclasses.dataclass(frozen=True)
class AttentionBatch:
    """The host-side description of one varlen batch, as the launcher and the reference need it."""

    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    num_blocks: int
    block_size: int
    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]
    fp8: bool
    scale: float
    k_scale: float
    v_scale: float
    causal: bool
    sliding_window: int | None = None    # query at position q sees keys q - sliding_window + 1 .. q

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.query_start_loc, self.query_start_loc[1:], strict=False))

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def num_queries_per_kv(self) -> int:
        """GQA group size: query heads that read one KV head (vLLM's ``num_queries_per_kv``)."""
        return self.num_q_heads // self.num_kv_heads


def check_sliding_window(sliding_window: object, causal: bool) -> int | None:
    """``None`` (full attention) or a positive integer window, on causal attention only.

    The window follows vLLM 0.33.0 (``TritonAttentionImpl`` turns ``sliding_window`` into
    ``window_size = (sliding_window - 1, 0)``; the kernel masks ``q - k >= sliding_window``) and
    transformers' Mistral and Gemma-2 masks (``k > q - sliding_window``): a query at position ``q``
    sees the ``sliding_window`` keys ``q - sliding_window + 1 .. q``, itself included.
    """
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1:
        raise KernelInputError(
            f"sliding_window must be a positive integer (the keys a query sees, itself included) or None "
            f"(full attention), got {sliding_window!r}"
        )
    if sliding_window > MAX_INT32:
        raise KernelInputError(
            f"sliding_window must be at most {MAX_INT32} (positions are int32 in the kernels), got {sliding_window}; "
            "a window longer than every sequence is full causal attention: pass None"
        )
    if not causal:
        raise KernelInputError(
            "sliding_window needs causal=True: kvlab's kernels implement the decoder's window, which looks back "
            "only (vLLM's encoder window, which also looks ahead, is not implemented)"
        )
    return int(sliding_window)


def check_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *,
                    scale=None, causal=True, k_scale=1.0, v_scale=1.0, num_kv_splits=None,
                    out=None, sliding_window=None, host_metadata=None) -> AttentionBatch:
    """Validate ``paged_attention``'s arguments; return the batch as host-side numbers.

    With ``host_metadata`` the values are read from its CPU tensors and the device tensors only
    for their shapes, strides and addresses (no synchronisation); without, from one host copy.
    """
    check_ndim("query", query, 3, "[num_tokens, num_q_heads, head_size]")
    check_float_activations("query", query)
    check_cache_pair(key_cache, value_cache, query.dtype)
    check_index_tensor("block_table", block_table, 2, "[num_seqs, max_blocks_per_seq]")
    check_index_tensor("seq_lens", seq_lens, 1, "[num_seqs]")
    check_index_tensor("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    check_same_device(query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                      seq_lens=seq_lens, query_start_loc=query_start_loc)
    num_tokens, num_q_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if cache_head_size != head_size:
        raise KernelInputError(f"query has head_size {head_size} but the caches hold head_size {cache_head_size}")
    if num_q_heads < 1:
        raise KernelInputError(
            f"query has {num_q_heads} heads: [num_tokens, num_q_heads, head_size] needs num_q_heads >= 1"
        )
    if num_q_heads % num_kv_heads:
        raise KernelInputError(
            f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}: "
            "each KV head serves the same number of query heads (GQA)"
        )
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        raise KernelInputError("seq_lens is empty: a batch needs at least one sequence")
    if block_table.shape[0] != num_seqs:
        raise KernelInputError(f"block_table has {block_table.shape[0]} rows for {num_seqs} sequences (seq_lens)")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise KernelInputError(
            f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, got {query_start_loc.shape[0]}"
        )
    if host_metadata is None:
        host = HostMetadata.from_device(seq_lens, block_table, query_start_loc)
    else:
        host = check_host_metadata(host_metadata, seq_lens, block_table, query_start_loc)
    starts = host.query_start_loc_cpu.tolist()
    if starts[0] != 0:
        raise KernelInputError(f"query_start_loc[0] must be 0, got {starts[0]}")
    for i in range(num_seqs):
        if starts[i + 1] <= starts[i]:
            raise KernelInputError(
                f"query_start_loc must be strictly increasing (every sequence has at least one query token); "
                f"query_start_loc[{i + 1}] = {starts[i + 1]} <= query_start_loc[{i}] = {starts[i]}"
            )
    if starts[-1] != num_tokens:
        raise KernelInputError(
            f"query_start_loc[-1] = {starts[-1]} must equal the number of query tokens, {num_tokens}"
        )
    lens = host.seq_lens_cpu.tolist()
    for i, (length, start, end) in enumerate(zip(lens, starts, starts[1:], strict=False)):
        if length < end - start:
            raise KernelInputError(
                f"seq_lens[{i}] = {length} is shorter than its {end - start} query tokens: the query tokens "
                "are the last tokens of their sequence"
            )
    check_block_table(host.block_table_cpu, host.seq_lens_cpu, lens, block_size, num_blocks)
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise KernelInputError(f"scale must be a finite number > 0 or None (1/sqrt(head_size)), got {scale!r}")
    if not isinstance(causal, bool):
        raise KernelInputError(f"causal must be True or False, got {causal!r}")
    window = check_sliding_window(sliding_window, causal)
    check_num_kv_splits(num_kv_splits)
    check_out(out, "query", query, "[num_tokens, num_q_heads, head_size]",
              dict(query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                   seq_lens=seq_lens, query_start_loc=query_start_loc))
    ks, vs = check_kv_scales(key_cache.dtype, k_scale, v_scale)
    return AttentionBatch(
        num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        num_blocks=num_blocks, block_size=block_size, query_start_loc=tuple(starts), seq_lens=tuple(lens),
        fp8=key_cache.dtype == FP8_DTYPE, scale=float(scale), k_scale=ks, v_scale=vs, causal=causal,
        sliding_window=window,
    )


def check_num_kv_splits(num_kv_splits: object, name: str = "num_kv_splits") -> int | None:
    """``num_kv_splits``: an integer in ``[1, MAX_NUM_KV_SPLITS]``, or None to let the kernel choose.

    Each split is a program per query block and KV head and a partial result in memory: an
    unbounded count hangs the launch (10**6) or fails the allocator (10**12).
    """
    if num_kv_splits is None:
        return None
    if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, numbers.Integral) or num_kv_splits < 1:
        raise KernelInputError(f"{name} must be a positive integer or None (choose), got {num_kv_splits!r}")
    if num_kv_splits > MAX_NUM_KV_SPLITS:
        raise KernelInputError(
            f"{name} must be at most {MAX_NUM_KV_SPLITS} (the most segments vLLM 0.33.0's Triton backend "
            f"launches), got {num_kv_splits}"
        )
    return int(num_kv_splits)


def check_out(out: torch.Tensor | None, like_name: str, like: torch.Tensor, layout: str,
              inputs: dict[str, torch.Tensor]) -> None:
    """An ``out`` tensor the kernel writes: the shape, dtype and device of ``like``, unit stride last,
    no internal overlap and no byte shared with any of ``inputs``."""
    if out is None:
        return
    check_ndim("out", out, 3, layout)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise KernelInputError(
            f"out must match {like_name}: shape {tuple(like.shape)}, {_name(like.dtype)} on {like.device}; got "
            f"{tuple(out.shape)}, {_name(out.dtype)} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise KernelInputError("out must be contiguous in its last dimension (stride 1)")
    check_no_aliasing(dict(out=out), inputs)
