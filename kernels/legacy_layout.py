"""How vLLM's hand-written CUDA PagedAttention kernel divides one (sequence, head) among its threads.

The kernel (``csrc/attention/attention_kernels.cuh``, launched by ``paged_attention_v1.cu`` and
``paged_attention_v2.cu``; read at vLLM v0.6.6) runs one thread block of ``NUM_THREADS = 128``
threads per (query head, sequence) of a decode batch, ``grid(num_heads, num_seqs[, partitions])``.
Its layout is compile-time arithmetic on the template arguments, mirrored here with the source's names:

* ``THREAD_GROUP_SIZE = MAX(WARP_SIZE / BLOCK_SIZE, 1)`` threads share one key token; a warp holds
  ``BLOCK_SIZE`` groups, so one warp covers one KV block per step, and warp ``w`` takes blocks
  ``w, w + NUM_WARPS, ...`` (``warp_blocks``);
* ``VEC_SIZE = MAX(16 / (THREAD_GROUP_SIZE * sizeof(scalar_t)), 1)``: a group loads 16 bytes of
  query/key at a time; ``x = 16 / sizeof(cache_t)`` is the K layout's innermost dimension;
* for ``p . v``: ``V_VEC_SIZE = MIN(16 / sizeof(scalar_t), BLOCK_SIZE)``, ``NUM_V_VECS_PER_ROW =
  BLOCK_SIZE / V_VEC_SIZE``, ``NUM_ROWS_PER_ITER = WARP_SIZE / NUM_V_VECS_PER_ROW``, and each
  thread accumulates ``NUM_ROWS_PER_THREAD = DIVIDE_ROUND_UP(HEAD_SIZE, NUM_ROWS_PER_ITER)`` rows
  of ``head_size`` in registers (``accs[]``).

This is not vLLM 0.33.0's default path (its Triton and FlashAttention backends read the flash layout);
kvlab's Triton kernel divides the same work differently (``compare_work_division``).
"""

from __future__ import annotations

import dataclasses

from kvlab.kernels.checks import AttentionBatch
from kvlab.kernels.grid import plan_launch, program_reads

from kvlab.errors import KernelInputError
from kvlab.units import cdiv

VECTOR_BYTES = 16                                             # the widest load a CUDA thread issues
NUM_THREADS = 128                                             # paged_attention_v1/v2_launcher's default
PARTITION_SIZE = 512                                          # paged_attention_v2: tokens per partition
COMPILED_BLOCK_SIZES = (8, 16, 32)                            # "we omitted block sizes 1, 2, 4, 64, 128, 256"
COMPILED_HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
SCALAR_BYTES = (2, 4)                                         # scalar_t: half, bfloat16 (2) or float (4)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KernelInputError(f"{name} must be a positive int, got {value!r}")
    return value


def _index(name: str, value: object, bound: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
        raise KernelInputError(f"{name} must be an int in [0, {bound}), got {value!r}")


@dataclasses.dataclass(frozen=True)
class CudaThreadLayout:
    """The legacy kernel's compile-time constants for one (HEAD_SIZE, BLOCK_SIZE, dtype) instantiation."""

    head_size: int
    block_size: int
    dtype_bytes: int            # sizeof(scalar_t): the query's and the arithmetic's element
    cache_dtype_bytes: int      # sizeof(cache_t): 1 for an FP8 cache, else dtype_bytes
    num_threads: int
    warp_size: int
    THREAD_GROUP_SIZE: int
    NUM_THREAD_GROUPS: int
    NUM_TOKENS_PER_THREAD_GROUP: int
    NUM_WARPS: int
    VEC_SIZE: int
    NUM_ELEMS_PER_THREAD: int
    NUM_VECS_PER_THREAD: int
    x: int
    V_VEC_SIZE: int
    NUM_V_VECS_PER_ROW: int
    NUM_ROWS_PER_ITER: int
    NUM_ROWS_PER_THREAD: int

    @property
    def compiled(self) -> bool:
        """Whether vLLM builds this instantiation (128 threads, a listed head size and block size)."""
        return (self.num_threads == NUM_THREADS and self.block_size in COMPILED_BLOCK_SIZES
                and self.head_size in COMPILED_HEAD_SIZES)

    @property
    def article_rows_per_thread(self) -> int:
        """The source article's ``HEAD_SIZE / WARP_SIZE``: right only when one V vector spans a block row."""
        return self.head_size // self.warp_size

    def warp_blocks(self, num_blocks: int) -> tuple[tuple[int, ...], ...]:
        """The KV blocks (indices into the block table) each warp reads: warp ``w`` takes ``w, w + NUM_WARPS, ...``."""
        _positive_int("num_blocks", num_blocks)
        return tuple(tuple(range(w, num_blocks, self.NUM_WARPS)) for w in range(self.NUM_WARPS))

    def group_tokens(self, thread_group_idx: int) -> tuple[int, ...]:
        """The offsets inside a KV block whose key thread group ``thread_group_idx`` dots with the query."""
        _index("thread_group_idx", thread_group_idx, self.NUM_THREAD_GROUPS)
        return tuple((thread_group_idx + i * self.warp_size) % self.block_size
                     for i in range(self.NUM_TOKENS_PER_THREAD_GROUP))

    def lane_rows(self, lane: int) -> tuple[int, ...]:
        """The ``head_size`` rows lane ``lane`` sums in ``accs[]`` for ``p . v`` (rows past HEAD_SIZE dropped)."""
        _index("lane", lane, self.warp_size)
        rows = (lane // self.NUM_V_VECS_PER_ROW + i * self.NUM_ROWS_PER_ITER for i in range(self.NUM_ROWS_PER_THREAD))
        return tuple(r for r in rows if r < self.head_size)


def cuda_thread_layout(head_size: int, block_size: int, dtype_bytes: int, *, cache_dtype_bytes: int | None = None,
                       num_threads: int = NUM_THREADS, warp_size: int = 32) -> CudaThreadLayout:
    """The legacy CUDA kernel's thread layout, computed as the kernel computes it (``attention_kernels.cuh``).

    ``dtype_bytes`` is ``sizeof(scalar_t)`` (2 for fp16/bf16, 4 for fp32); ``cache_dtype_bytes`` is
    ``sizeof(cache_t)``, 1 for an FP8 cache (default: the same as ``dtype_bytes``). A configuration
    whose integer divisions would leave part of the work to no thread is refused.
    """
    for name, value in (("head_size", head_size), ("block_size", block_size), ("dtype_bytes", dtype_bytes),
                        ("num_threads", num_threads), ("warp_size", warp_size)):
        _positive_int(name, value)
    cache_bytes = dtype_bytes if cache_dtype_bytes is None else _positive_int("cache_dtype_bytes", cache_dtype_bytes)
    if dtype_bytes not in SCALAR_BYTES:
        raise KernelInputError(f"dtype_bytes must be one of {SCALAR_BYTES} (fp16/bf16, fp32), got {dtype_bytes}")
    if cache_bytes not in (1, dtype_bytes):
        raise KernelInputError(f"cache_dtype_bytes must be 1 (an FP8 cache) or dtype_bytes={dtype_bytes}, "
                               f"got {cache_bytes}")
    if num_threads % warp_size:
        raise KernelInputError(f"num_threads={num_threads} must be a multiple of warp_size={warp_size}")
    tgs = max(warp_size // block_size, 1)
    if num_threads % tgs or (warp_size % block_size if block_size < warp_size else block_size % warp_size):
        raise KernelInputError(f"block_size={block_size} must divide warp_size={warp_size} (or be a multiple of "
                               f"it) so that thread groups of {tgs} tile the warp")
    vec = max(VECTOR_BYTES // (tgs * dtype_bytes), 1)
    if head_size % (tgs * vec):
        raise KernelInputError(f"head_size={head_size} must be a multiple of THREAD_GROUP_SIZE * VEC_SIZE = "
                               f"{tgs * vec} for block_size={block_size} and dtype_bytes={dtype_bytes}")
    x = VECTOR_BYTES // cache_bytes
    if head_size % x:
        raise KernelInputError(f"head_size={head_size} must be a multiple of x={x} (the K layout's last dimension)")
    v_vec = min(VECTOR_BYTES // dtype_bytes, block_size)
    if block_size % v_vec or warp_size % (block_size // v_vec):
        raise KernelInputError(f"block_size={block_size} must be a multiple of V_VEC_SIZE={v_vec} and its "
                               f"{block_size // v_vec} vectors per row must divide warp_size={warp_size}")
    rows_per_iter = warp_size // (block_size // v_vec)
    return CudaThreadLayout(
        head_size, block_size, dtype_bytes, cache_bytes, num_threads, warp_size,
        THREAD_GROUP_SIZE=tgs, NUM_THREAD_GROUPS=num_threads // tgs,
        NUM_TOKENS_PER_THREAD_GROUP=cdiv(block_size, warp_size), NUM_WARPS=num_threads // warp_size,
        VEC_SIZE=vec, NUM_ELEMS_PER_THREAD=head_size // tgs, NUM_VECS_PER_THREAD=head_size // tgs // vec,
        x=x, V_VEC_SIZE=v_vec, NUM_V_VECS_PER_ROW=block_size // v_vec, NUM_ROWS_PER_ITER=rows_per_iter,
        NUM_ROWS_PER_THREAD=cdiv(head_size, rows_per_iter),
    )


@dataclasses.dataclass(frozen=True)
class WorkDivision:
    """How one kernel divides a decode batch's attention among its programs (CUDA: thread blocks)."""

    kernel: str
    grid: tuple[int, ...]
    programs: int                   # programs that do work
    query_heads_per_program: int
    keys_per_step: int              # keys one program takes per loop iteration
    steps: int                      # loop iterations of one program over one sequence
    kv_block_reads: int             # KV blocks read, summed over the programs (per layer)


def compare_work_division(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                          seq_len: int, dtype_bytes: int = 2) -> tuple[WorkDivision, WorkDivision]:
    """The legacy CUDA kernel (v1, one thread block per query head) against kvlab's Triton kernel on one decode step.

    Every sequence has ``seq_len`` tokens and one query token. The Triton side is kvlab's own launch
    plan and its mirror (``kvlab.kernels.grid``): one program per KV head serves all its query heads.
    The mirror lists every key each program reads, so keep the batch small (a few sequences, a few K tokens).
    """
    for name, value in (("num_seqs", num_seqs), ("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("seq_len", seq_len)):
        _positive_int(name, value)
    if num_q_heads % num_kv_heads:
        raise KernelInputError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    layout = cuda_thread_layout(head_size, block_size, dtype_bytes)
    blocks = cdiv(seq_len, block_size)
    cuda = WorkDivision("legacy CUDA (paged_attention_v1)", (num_q_heads, num_seqs, 1), num_q_heads * num_seqs, 1,
                        layout.NUM_WARPS * block_size, cdiv(blocks, layout.NUM_WARPS),
                        num_q_heads * num_seqs * blocks)
    batch = AttentionBatch(num_tokens=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                           head_size=head_size, num_blocks=num_seqs * blocks, block_size=block_size,
                           query_start_loc=tuple(range(num_seqs + 1)), seq_lens=(seq_len,) * num_seqs, fp8=False,
                           scale=head_size ** -0.5, k_scale=1.0, v_scale=1.0, causal=True)
    plan = plan_launch(batch)
    table = [list(range(s * blocks, (s + 1) * blocks)) for s in range(num_seqs)]
    reads = program_reads(plan, table)
    triton = WorkDivision("kvlab Triton (paged_attention_kernel)", plan.grid, len(reads),
                          num_q_heads // num_kv_heads, plan.config.tile_n, max(len(r.tiles) for r in reads),
                          sum(len(r.blocks_in_order()) for r in reads))
    return cuda, triton
