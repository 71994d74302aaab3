"""Several GPUs serving one model: tensor-parallel attention against data-parallel attention, counted per GPU.

Under tensor parallelism (``layout="tp"``) every GPU takes part in every request: MHA/GQA split
their KV heads across the ranks, so each GPU stores a share of each token's KV. MLA cannot split
its one latent (vLLM's ``MLAAttentionSpec`` has ``max_tp_shards = 1``), so every rank stores the
whole latent of every token: ``num_gpus`` copies, and the deployment holds no more requests than
one GPU does. Adding the GPUs' memory into one pool and dividing (the source article's "192")
counts every replica as room for another request.

Data-parallel attention (``layout="dp_attention"``, vLLM's ``data_parallel_size`` with
``enable_expert_parallel`` for DeepSeek) gives each GPU its own requests: attention runs on the
GPU that holds the request's latents, so each token is stored once, and the pools add up. The
price is the weights: attention and the dense parts are no longer split, every GPU keeps a full
copy, and only the routed experts are divided among the GPUs (expert parallelism).

kvlab plans each GPU with ``plan_kv_cache`` (weights only, no activations, as the source's tables).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvlab._validate import checked, one_of, positive_int
from kvlab.capacity.budget import DEFAULT_BLOCK_SIZE, DEFAULT_GPU_MEMORY_UTILIZATION, KVCachePlan, plan_kv_cache
from kvlab.capacity.models import ModelSpec, parameter_parts, params_bytes, resolve_model
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.errors import KvlabValueError
from kvlab.units import GiB

Layout = Literal["tp", "dp_attention"]
LAYOUTS: tuple[Layout, ...] = ("tp", "dp_attention")


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """One deployment of ``num_gpus`` GPUs in one layout: each GPU's plan, and what the deployment holds."""

    layout: Layout
    num_gpus: int
    per_gpu: KVCachePlan
    kv_bytes_per_token: int         # one token's KV, unsplit and stored once

    @property
    def requests(self) -> int:
        """Distinct requests of ``max_model_len`` the deployment holds at once.

        TP: every GPU holds (a share or a copy of) every request, so one GPU's concurrency; DP
        attention: each GPU its own, so the sum.
        """
        return self.per_gpu.concurrency * (self.num_gpus if self.layout == "dp_attention" else 1)

    @property
    def stored_bytes_per_token(self) -> int:
        """Bytes the whole deployment stores for one token, over all its GPUs."""
        return self.per_gpu.kv_bytes_per_token * (self.num_gpus if self.layout == "tp" else 1)

    @property
    def kv_copies(self) -> float:
        """How many times each token's KV is stored: 1 when split or data-parallel, ``num_gpus`` for MLA under TP."""
        return self.stored_bytes_per_token / self.kv_bytes_per_token


@checked
def weights_bytes_per_gpu(model: ModelSpec, layout: Layout, num_gpus: int, weights_dtype: str | None = None) -> int:
    """Weights on one GPU: all of them divided by ``num_gpus`` (TP), or replicated except the routed experts (DP).

    The TP figure is the even split the source article uses (625 GiB / 8); data-parallel attention
    keeps attention, embeddings, dense MLPs, shared experts and routers whole on every GPU.
    """
    layout = one_of("layout", layout, LAYOUTS)
    num_gpus = positive_int("num_gpus", num_gpus)
    parts = parameter_parts(model.config)
    if parts is None:
        raise KvlabValueError(f"cannot count the parameters of {model.name!r} from its config: pass weights_gib")
    dtype = weights_dtype or model.weights_dtype
    total = sum(parts.values())
    if layout == "tp":
        return params_bytes(total, dtype) // num_gpus
    routed = parts["routed_experts"]
    return params_bytes(total - routed, dtype) + params_bytes(routed, dtype) // num_gpus


@checked(at_most={"gpu_memory_gib": 2**20, "weights_gib": 2**20})  # past any GPU
def plan_parallel(model: ModelSpec | str, layout: Layout, *, num_gpus: int, gpu_memory_gib: float, max_model_len: int,
                  kv_dtype: str = "bf16", block_size: int = DEFAULT_BLOCK_SIZE, weights_gib: float | None = None,
                  gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> ParallelPlan:
    """Plan every GPU of a ``num_gpus`` deployment in ``layout``; ``weights_gib`` (per GPU) overrides the count."""
    spec = resolve_model(model)
    layout = one_of("layout", layout, LAYOUTS)
    num_gpus = positive_int("num_gpus", num_gpus)
    if weights_gib is None:
        weights_gib = weights_bytes_per_gpu(spec, layout, num_gpus) / GiB
    per_gpu = plan_kv_cache(spec, gpu_memory_gib=gpu_memory_gib, gpu_memory_utilization=gpu_memory_utilization,
                            weights_gib=weights_gib, kv_dtype=kv_dtype, block_size=block_size,
                            max_model_len=max_model_len, tp=num_gpus if layout == "tp" else 1)
    return ParallelPlan(layout, num_gpus, per_gpu, kv_bytes_per_token(spec, kv_dtype))
