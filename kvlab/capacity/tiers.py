"""Where a KV prefix can live on one server, modelled: GPU memory, CPU memory, local SSDs.

The source material draws three tiers: hot prefixes in GPU HBM ("µs"), warm ones in CPU DRAM
("ms"), cold ones on a local SSD ("10 ms"), and says the lower tiers hold "10-100x" more.
``kv_tiers`` puts numbers with a source on each tier of a server in ``data/hardware/hosts.json``:
its capacity (every GPU's KV pool, the CPU memory, the data SSDs) and the bandwidth of the path
from the tier to a GPU (its HBM; its PCIe host link; each SSD's own PCIe x4 link, one SSD per
GPU). Every time here is **modelled**: bytes over a datasheet's or a specification's theoretical
bandwidth, with no latency, no contention and no overlap.
"""

from __future__ import annotations

import dataclasses

from kvlab._validate import checked, positive_int
from kvlab.capacity.budget import DEFAULT_BLOCK_SIZE, KVCachePlan, plan_kv_cache
from kvlab.capacity.hardware import HostSpec, get_gpu, get_host, get_link
from kvlab.capacity.models import ModelSpec, resolve_model
from kvlab.capacity.sizing import kv_bytes_per_token


@checked
@dataclasses.dataclass(frozen=True)
class KVTier:
    """One tier of a server: how many KV bytes it holds and how fast they reach a GPU's attention."""

    name: str
    capacity_bytes: int  # the whole server's
    bytes_per_s: float  # the path from this tier into one GPU's attention
    path: str  # what that bandwidth is

    @checked
    def seconds_for(self, num_bytes: int) -> float:
        """Modelled seconds to bring ``num_bytes`` of KV from this tier to one GPU (or to read them there)."""
        return num_bytes / self.bytes_per_s

    @checked
    def holds(self, num_bytes: int) -> int:
        """How many items of ``num_bytes`` the tier holds."""
        return self.capacity_bytes // positive_int("num_bytes", num_bytes)


@dataclasses.dataclass(frozen=True)
class TierTable:
    """A server's three tiers for one model, and the per-GPU plan that sized the top one."""

    host: HostSpec
    model: ModelSpec
    kv_dtype: str
    plan: KVCachePlan  # one GPU's KV cache (one replica per GPU)
    tiers: tuple[KVTier, KVTier, KVTier]  # GPU HBM, CPU DRAM, local SSD

    @checked
    def prefix_bytes(self, prefix_tokens: int) -> int:
        """KV bytes of a prefix of ``prefix_tokens`` tokens."""
        return positive_int("prefix_tokens", prefix_tokens) * kv_bytes_per_token(self.model, self.kv_dtype)

    @checked
    def rows(self, prefix_tokens: int) -> list[dict[str, object]]:
        """Per tier: prefixes of ``prefix_tokens`` tokens held, and modelled seconds to bring one to a GPU."""
        size = self.prefix_bytes(prefix_tokens)
        gpu = self.tiers[0]
        return [{"tier": t.name, "path": t.path, "capacity_bytes": t.capacity_bytes, "prefixes": t.holds(size),
                 "times_the_gpu_tier": t.capacity_bytes / gpu.capacity_bytes, "seconds": t.seconds_for(size)}
                for t in self.tiers]


@checked
def kv_tiers(
    host: str | HostSpec = "DGX-H100",
    model: str | ModelSpec = "llama-3-8b",
    *,
    kv_dtype: str = "bf16",
    max_model_len: int = 8192,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> TierTable:
    """The tiers of ``host`` serving ``model`` with one replica per GPU (TP=1), weights counted from its config.

    The GPU tier is every GPU's KV pool as ``plan_kv_cache`` sizes it (no non-KV memory counted, so an
    upper bound); CPU DRAM is the whole system memory and the SSD tier every data SSD, both upper
    bounds too (the operating system and the weights' files need room).
    """
    host = get_host(host)
    spec = resolve_model(model)
    gpu = get_gpu(host.gpu)
    plan = plan_kv_cache(spec, gpu_memory_gib=gpu.memory_gib, kv_dtype=kv_dtype, block_size=block_size,
                         max_model_len=max_model_len)
    host_link, ssd_link = get_link(gpu.host_link), get_link(host.ssd_link)
    tiers = (
        KVTier("GPU HBM", host.num_gpus * plan.kv_pool_bytes, gpu.memory_bytes_per_s,
               f"read from {gpu.name} memory"),
        KVTier("CPU DRAM", host.system_memory_bytes, host_link.bytes_per_s, f"copied over {host_link.name}"),
        KVTier("local NVMe SSD", host.ssd_bytes, ssd_link.bytes_per_s, f"read over one SSD's {ssd_link.name}"),
    )
    return TierTable(host=host, model=spec, kv_dtype=kv_dtype, plan=plan, tiers=tiers)
