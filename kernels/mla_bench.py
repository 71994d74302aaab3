"""Time MLA decode two ways on the same paged latent cache: decompress (naive) against absorb (the Triton kernel).

Shapes are DeepSeek-V3's attention (``kv_lora_rank`` 512, rope 64, nope 128, V 128, bf16) with 16
heads (one GPU of eight under tensor parallelism: the heads split, the latent is replicated) or
all 128, decode at several batches and contexts. Method, per shape:

* inputs: a latent cache whose blocks are handed out in random order (scattered block tables), one
  decode query per sequence (``q_nope``, rotated ``q_pe``), random ``W_UK``/``W_UV``;
* naive (what vLLM's prefill path would do for these queries): gather each sequence's latents through
  its block table, decompress them with ``W_UK``/``W_UV`` into per-head K ``[B, N, S, P + R]`` and V,
  then SDPA, fastest of torch's backends;
* absorbed (vLLM's decode path): ``q_latent = q_nope · W_UK``, ``mla_decode`` over the paged
  latents (launch plan and checks done once), ``o_latent · W_UV``; the kernel is also timed alone;
* timing: ``triton.testing.do_bench`` medians, rotating enough independent input sets to overflow
  L2; correctness: the two outputs' relative error on the first set.

``benchmarks/bench_mla.py`` adds the bytes and FLOPs each path needs by ``kvlab.capacity.mla``'s
count (the ratio of bytes read is the headline) and saves the rows with the machine. On CPU
``--smoke`` runs one tiny shape through the interpreter and says the times are not performance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from kvlab.kernels import TRITON_CUDA, backend, check_mla_decode
from kvlab.kernels.bench import median_seconds, rotating
from kvlab.kernels.mla_absorb import absorb_output, absorb_query


@dataclasses.dataclass(frozen=True)
class MLAShape:
    """One decode point: ``batch`` sequences of ``context`` latents each (their own token included)."""

    batch: int
    context: int
    num_heads: int = 16
    block_size: int = 64
    kv_lora_rank: int = 512
    rope_dim: int = 64
    nope_dim: int = 128
    v_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        return f"mla decode b{self.batch} ctx{self.context} h{self.num_heads}"

    @property
    def scale(self) -> float:
        return (self.nope_dim + self.rope_dim) ** -0.5

    @property
    def naive_bytes(self) -> int:
        """What the naive path materialises, K and V for every head: the memory it needs beyond the cache."""
        return self.batch * self.context * self.num_heads * (self.nope_dim + self.rope_dim + self.v_dim) \
            * self.dtype.itemsize


def gpu_shapes() -> list[MLAShape]:
    """16 heads (TP 8) at batch 1/16/64 x 4K, batch 16 x 16K and 64 x 8K; all 128 heads at batch 16 x 4K."""
    return [MLAShape(b, c) for b, c in ((1, 4096), (16, 4096), (64, 4096), (16, 16384), (64, 8192))] + [
        MLAShape(16, 4096, num_heads=128)]


def smoke_shapes() -> list[MLAShape]:
    """One tiny shape: enough to run every line through the interpreter."""
    return [MLAShape(2, 40, num_heads=4, block_size=16, kv_lora_rank=32, rope_dim=8, nope_dim=16, v_dim=16,
                     dtype=torch.float32)]


@dataclasses.dataclass
class MLAInputs:
    """One independent set of tensors for a shape."""

    q_nope: torch.Tensor        # [batch, num_heads, nope_dim]
    q_pe: torch.Tensor          # [batch, num_heads, rope_dim]
    kv_cache: torch.Tensor      # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor   # [batch, blocks_per_seq], scattered
    seq_lens: torch.Tensor      # [batch]
    w_uk: torch.Tensor          # [kv_lora_rank, num_heads, nope_dim]
    w_uv: torch.Tensor          # [kv_lora_rank, num_heads, v_dim]
    out: torch.Tensor           # [batch, num_heads, kv_lora_rank], the kernel's output buffer


def make_inputs(s: MLAShape, device: str, generator: torch.Generator) -> MLAInputs:
    """Random latents scattered over a shuffled block pool, random queries and up-projections."""
    blocks_per_seq = -(-s.context // s.block_size)
    num_blocks = s.batch * blocks_per_seq
    table = torch.randperm(num_blocks, generator=generator).reshape(s.batch, blocks_per_seq).to(torch.int32)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(s.dtype).to(device)

    return MLAInputs(
        q_nope=draw(s.batch, s.num_heads, s.nope_dim), q_pe=draw(s.batch, s.num_heads, s.rope_dim),
        kv_cache=draw(num_blocks, s.block_size, s.kv_lora_rank + s.rope_dim), block_table=table.to(device),
        seq_lens=torch.full((s.batch,), s.context, dtype=torch.int32, device=device),
        w_uk=draw(s.kv_lora_rank, s.num_heads, s.nope_dim, scale=s.kv_lora_rank ** -0.5),
        w_uv=draw(s.kv_lora_rank, s.num_heads, s.v_dim, scale=s.kv_lora_rank ** -0.5),
        out=torch.empty(s.batch, s.num_heads, s.kv_lora_rank, dtype=s.dtype, device=device),
    )


def naive_decode(s: MLAShape, x: MLAInputs) -> torch.Tensor:
    """Gather, decompress every latent into per-head K and V, SDPA: ``[batch, num_heads, v_dim]``."""
    latents = x.kv_cache[x.block_table.long()].flatten(1, 2)[:, :s.context]             # [B, S, L + R]
    kv_c, k_pe = latents.split([s.kv_lora_rank, s.rope_dim], dim=-1)
    k_nope = torch.einsum("bsl,lnp->bnsp", kv_c, x.w_uk)                                # [B, N, S, P]
    v = torch.einsum("bsl,lnv->bnsv", kv_c, x.w_uv)                                     # [B, N, S, V]
    key = torch.cat([k_nope, k_pe[:, None].expand(-1, s.num_heads, -1, -1)], dim=-1)    # [B, N, S, P + R]
    query = torch.cat([x.q_nope, x.q_pe], dim=-1)[:, :, None]                           # [B, N, 1, P + R]
    return torch.nn.functional.scaled_dot_product_attention(query, key, v, scale=s.scale)[:, :, 0]


def bench_shape(s: MLAShape, device: str) -> dict[str, Any]:
    """Time one shape; a row of the results table (times in microseconds)."""
    from kvlab.kernels.attention import num_sms
    from kvlab.kernels.mla_decode import launch_mla_decode  # importing it needs Triton
    from kvlab.kernels.mla_grid import plan_mla_decode

    g = torch.Generator().manual_seed(0)
    per_set = s.batch * s.context * (s.kv_lora_rank + s.rope_dim) * s.dtype.itemsize
    if device == "cuda":
        if 3 * s.naive_bytes + 2 * per_set > 0.8 * torch.cuda.mem_get_info()[0]:
            return {"shape": s.name, "skipped": "the naive path's K and V do not fit in free GPU memory"}
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 * 2**20)
        sets = [make_inputs(s, device, g) for _ in range(max(1, min(8, math.ceil(3 * l2 / per_set))))]
    else:
        sets = [make_inputs(s, device, g)]
    x = sets[0]
    q_latent = absorb_query(x.q_nope, x.w_uk)
    batch = check_mla_decode(q_latent, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, scale=s.scale)
    plan = plan_mla_decode(batch, num_sms=num_sms(x.kv_cache.device))

    def kernel(y: MLAInputs, q_lat: torch.Tensor) -> torch.Tensor:
        return launch_mla_decode(plan, q_lat, y.q_pe, y.kv_cache, y.block_table, y.seq_lens, y.out)

    def absorbed(y: MLAInputs) -> torch.Tensor:
        return absorb_output(kernel(y, absorb_query(y.q_nope, y.w_uk)), y.w_uv)

    reference = naive_decode(s, x).float()
    error = (absorbed(x).float() - reference).norm() / reference.norm()
    with_latents = [(y, absorb_query(y.q_nope, y.w_uk)) for y in sets]     # the kernel alone: q_latent made once
    times = {"naive": median_seconds(rotating(sets, lambda y: naive_decode(s, y)), device),
             "absorbed": median_seconds(rotating(sets, absorbed), device),
             "kernel": median_seconds(rotating(with_latents, lambda pair: kernel(*pair)), device)}
    return {"shape": s.name, "batch": s.batch, "context": s.context, "num_heads": s.num_heads,
            "block_size": s.block_size, "dtype": str(s.dtype).removeprefix("torch."), "input_sets": len(sets),
            "num_kv_splits": plan.num_kv_splits, "tile_n": plan.config.tile_n, "heads_per_program": plan.config.block_m,
            "naive_us": times["naive"] * 1e6, "absorbed_us": times["absorbed"] * 1e6,
            "kernel_us": times["kernel"] * 1e6, "speedup": times["naive"] / times["absorbed"],
            "rel_error_vs_naive": float(error)}


def run(shapes: Iterable[MLAShape], device: str | None = None,
        on_row: Callable[[MLAShape, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Benchmark ``shapes``: ``{"device", "backend", "performance", "rows"}``; a shape that fails is recorded."""
    device = device or ("cuda" if backend() == TRITON_CUDA else "cpu")
    rows = []
    for shape in shapes:
        try:
            row = bench_shape(shape, device)
        except Exception as exc:  # a compile error or memory: keep the other shapes
            row = {"shape": shape.name, "error": f"{type(exc).__name__}: {exc}"[:300]}
        if on_row:
            on_row(shape, row)
        rows.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (Triton interpreter)"
    return {"device": name, "backend": backend(), "performance": device == "cuda", "rows": rows}
