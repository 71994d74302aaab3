"""The online softmax on its own: one block of query rows, keys walked tile by tile, no paging.

``attention_by_tiles_kernel`` is the paged kernel with everything but the softmax taken away: one
program, ``BLOCK_M`` query rows, contiguous K and V, a visibility mask. It folds each key tile
into the running ``(m, l, acc)`` with the update function it is given as a compile-time argument,
by default ``online_softmax_update`` from ``attention.py``. Notebook 05's exercise passes
the learner's own update here, and ``softmax_states`` records the running state after each tile
so the notebook can show the maximum being revised.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from kvlab.kernels._backend import require_triton
from kvlab.kernels.attention import online_softmax_update

from kvlab.errors import KernelInputError

require_triton()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def attention_by_tiles_kernel(
    q_ptr,          # [BLOCK_M, HEAD]
    k_ptr,          # [num_keys, HEAD]
    v_ptr,          # [num_keys, HEAD]
    visible_ptr,    # [BLOCK_M, num_keys] int8: 1 where row i may attend to key j
    out_ptr,        # [BLOCK_M, HEAD]
    states_ptr,     # [num_tiles, BLOCK_M, 2] float32: (m, l) after each tile
    num_keys, scale,
    HEAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, UPDATE: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD)
    q = tl.load(q_ptr + rows[:, None] * HEAD + dims[None, :])                    # [BLOCK_M, HEAD]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD], dtype=tl.float32)
    for tile in range(0, tl.cdiv(num_keys, TILE_N)):
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = keys < num_keys
        k = tl.load(k_ptr + keys[:, None] * HEAD + dims[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + keys[:, None] * HEAD + dims[None, :], mask=key_ok[:, None], other=0.0)
        seen = tl.load(visible_ptr + rows[:, None] * num_keys + keys[None, :], mask=key_ok[None, :], other=0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale          # [BLOCK_M, TILE_N]
        scores = tl.where(seen != 0, scores, float("-inf"))
        m_i, l_i, acc = UPDATE(m_i, l_i, acc, scores, v)
        tl.store(states_ptr + (tile * BLOCK_M + rows) * 2, m_i)
        tl.store(states_ptr + (tile * BLOCK_M + rows) * 2 + 1, l_i)
    tl.store(out_ptr + rows[:, None] * HEAD + dims[None, :], acc / l_i[:, None])


def as_kernel_function(fn: Callable) -> object:
    """A ``@triton.jit`` function for this process's backend, from a plain or already-jitted one.

    A function decorated before the interpreter was switched on (or for the other backend) is
    re-decorated from its source, so a notebook cell works whatever ran before it.
    """
    raw = getattr(fn, "fn", fn)
    if not inspect.isfunction(raw):
        raise KernelInputError(f"expected a function (plain or @triton.jit), got {type(fn).__name__}")
    return triton.jit(raw)


def _launch(q, k, v, visible, tile_n, update, scale):
    block_m, head = q.shape
    num_keys = k.shape[0]
    if block_m < 16 or head < 16 or tile_n < 16 or any(n & (n - 1) for n in (block_m, head, tile_n)):
        raise KernelInputError(f"rows={block_m}, head={head} and tile_n={tile_n} must be powers of two >= 16")
    if k.shape != (num_keys, head) or v.shape != (num_keys, head) or visible.shape != (block_m, num_keys):
        raise KernelInputError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and visible "
                               f"{tuple(visible.shape)} must be [M, D], [N, D], [N, D], [M, N]")
    if not bool(visible.any(dim=1).all()):
        raise KernelInputError("every row must see at least one key (a row with none has no softmax)")
    num_tiles = -(-num_keys // tile_n)
    out = torch.empty(block_m, head, dtype=torch.float32, device=q.device)
    states = torch.empty(num_tiles, block_m, 2, dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(head) if scale is None else scale
    attention_by_tiles_kernel[(1,)](
        q.float().contiguous(), k.float().contiguous(), v.float().contiguous(), visible.to(torch.int8).contiguous(),
        out, states, num_keys, scale, HEAD=head, BLOCK_M=block_m, TILE_N=tile_n, UPDATE=update,
    )
    return out, states


def attention_by_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                       tile_n: int = 16, update: Callable | None = None, scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale, masked by visible) v`` computed one key tile at a time: ``[M, D]`` float32.

    ``q`` is ``[M, D]``, ``k``/``v`` ``[N, D]``, ``visible`` ``[M, N]`` (bool); M, D and ``tile_n``
    are powers of two >= 16. ``update`` is the online-softmax step (default: the paged kernel's).
    Its specification is ``kvlab.kernels.masked_attention``.
    """
    update = as_kernel_function(update) if update is not None else online_softmax_update
    return _launch(q, k, v, visible, tile_n, update, scale)[0]


def softmax_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                   tile_n: int = 16, scale: float | None = None) -> torch.Tensor:
    """The running ``(m, l)`` of every row after each tile, ``[num_tiles, M, 2]``, from the kernel itself."""
    return _launch(q, k, v, visible, tile_n, online_softmax_update, scale)[1]
