"""How much accuracy an FP8 cache's scale decides, measured through the kernels (notebook 05's sweep).

It runs ``kvlab.kernels.paged_attention`` on a bf16 cache and on FP8 caches (``kvlab.kernels.fp8``), so it
sits above the package's facade: ``fp8.py`` stays a leaf the kernels themselves import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from kvlab.kernels import TRITON_CUDA, backend, paged_attention, reshape_and_cache
from kvlab.kernels.fp8 import FP8_DTYPE, K_SCALE_CONSTANT, V_SCALE_CONSTANT, calibrated_scale, synthetic_kv

from kvlab.units import cdiv


def fp8_error_sweep(magnitudes: Sequence[float], *, num_seqs: int = 8, seq_len: int = 128,
                    num_kv_heads: int = 2, num_queries_per_kv: int = 4, head_size: int = 64,
                    block_size: int = 16, seed: int = 0, query_scale: float = 0.02,
                    write: Callable | None = None, attend: Callable | None = None,
                    device: str | None = None) -> list[dict[str, float]]:
    """Attention error of an FP8 cache against a bf16 cache, for activations of growing magnitude.

    For each magnitude: write the same synthetic K/V into a bf16 cache and into two FP8 caches
    (scale 1.0, and the calibrated scales ``amax/200`` for K and ``amax/100`` for V), run
    ``kvlab.kernels.paged_attention`` for one decode token per sequence on all three, and report
    ``‖out_fp8 − out_bf16‖ / ‖out_bf16‖`` with each scale. The query is ``query_scale / magnitude``
    times a standard normal, so the attention weights stay the same across the sweep: only the
    cache's rounding changes. ``write`` and ``attend`` default to ``reshape_and_cache`` and
    ``paged_attention``; pass the ``_ref`` versions for the same numbers without the interpreter's cost.
    ``device`` defaults to the GPU when the kernels run natively.
    """


    device = device or ("cuda" if backend() == TRITON_CUDA else "cpu")

    write = write or reshape_and_cache
    attend = attend or paged_attention

    g = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * num_queries_per_kv
    blocks_per_seq = cdiv(seq_len, block_size)
    num_blocks = num_seqs * blocks_per_seq
    block_table = torch.randperm(num_blocks, generator=g).reshape(num_seqs, blocks_per_seq).int()
    positions = torch.arange(seq_len)
    slots = (block_table.long()[:, positions // block_size] * block_size + positions % block_size).flatten()
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)                  # one decode token each
    block_table, slots, seq_lens, query_start_loc = (t.to(device) for t in (block_table, slots, seq_lens,
                                                                              query_start_loc))
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    rows = []
    for magnitude in magnitudes:
        key = torch.cat([synthetic_kv(seq_len, num_kv_heads, head_size, magnitude, generator=g)
                         for _ in range(num_seqs)]).to(torch.bfloat16)               # [num_seqs * seq_len, Hkv, D]
        value = torch.cat([synthetic_kv(seq_len, num_kv_heads, head_size, magnitude, outlier_factor=4.0,
                                        generator=g) for _ in range(num_seqs)]).to(torch.bfloat16)
        query = torch.randn(num_seqs, num_q_heads, head_size, generator=g) * (query_scale / magnitude)
        scales = {"scale 1.0": (1.0, 1.0),
                  "calibrated": (calibrated_scale(key, K_SCALE_CONSTANT), calibrated_scale(value, V_SCALE_CONSTANT))}
        key, value, query = key.to(device), value.to(device), query.to(torch.bfloat16).to(device)
        outs = {}
        for name, dtype, (ks, vs) in [("bf16", torch.bfloat16, (1.0, 1.0)),
                                      *[(n, FP8_DTYPE, kv) for n, kv in scales.items()]]:
            key_cache = torch.zeros(shape, dtype=dtype, device=device)
            value_cache = torch.zeros(shape, dtype=dtype, device=device)
            write(key, value, key_cache, value_cache, slots, k_scale=ks, v_scale=vs)
            outs[name] = attend(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                                k_scale=ks, v_scale=vs).float()
        ref = outs["bf16"]
        row = {"magnitude": float(magnitude), "amax_k": float(key.float().abs().max()),
               "k_scale_calibrated": scales["calibrated"][0], "v_scale_calibrated": scales["calibrated"][1]}
        for name in scales:
            row[f"error {name}"] = float((outs[name] - ref).norm() / ref.norm())
        rows.append(row)
    return rows
