"""Real GPUs and host links, with their sources: memory as the datasheet labels it and as the driver reports it.

A datasheet's "80 GB" is a label, not a byte count. vLLM budgets from what the driver reports
(``torch.cuda.mem_get_info()``, the ``memory.total`` nvidia-smi prints in MiB), and that figure
sits on either side of the label read as decimal GB: an L40S labelled 48 GB reports 46,068 MiB
(48.3 x 10**9 B, 44.99 GiB), an H100 labelled 80 GB reports 81,559 MiB (79.65 GiB). The facts
live in ``data/hardware/*.json``, each with the sources it was taken from.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from fractions import Fraction

from kvlab._validate import checked
from kvlab.data import DATA_DIR
from kvlab.errors import UnknownNameError
from kvlab.units import GiB, MiB

HARDWARE_DIR = DATA_DIR / "hardware"
GB = 10**9  # the decimal gigabyte datasheets and link specifications use


@checked
@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One GPU: its memory (label, reported, bandwidth), FP8 support, dense BF16 compute, SMs and host link."""

    name: str
    full_name: str
    architecture: str
    memory_label: str  # the datasheet's words, e.g. "48 GB GDDR6 with ECC"
    memory_total_mib: int | None  # nvidia-smi memory.total; None where kvlab has no source
    native_fp8: bool  # FP8 tensor cores (Ada, Hopper and later)
    bf16_dense_tflops: float  # without sparsity
    memory_bandwidth_gb_s: float  # the datasheet's figure, decimal GB/s
    num_sms: int  # streaming multiprocessors
    host_link: str
    sources: tuple[str, ...]

    def __post_init__(self) -> None:
        _known("host_link", self.host_link, "links")

    @property
    def bf16_dense_flops(self) -> float:
        """The dense BF16 tensor-core peak in FLOP/s."""
        return self.bf16_dense_tflops * 1e12

    @property
    def memory_bytes_per_s(self) -> float:
        """The datasheet's memory bandwidth in bytes per second."""
        return self.memory_bandwidth_gb_s * GB

    @property
    def label_gb(self) -> float:
        """The number in the label: 48.0 for "48 GB GDDR6 with ECC"."""
        return float(re.match(r"\s*([\d.]+)\s*GB", self.memory_label).group(1))  # type: ignore[union-attr]

    @property
    def memory_is_reported(self) -> bool:
        """Whether ``memory_bytes`` is the driver's figure (True) or the label read as GiB (False)."""
        return self.memory_total_mib is not None

    @property
    def memory_bytes(self) -> int:
        """What vLLM would budget from: the reported total, else the label's number taken as GiB."""
        if self.memory_total_mib is not None:
            return self.memory_total_mib * MiB
        return round(self.label_gb * GiB)

    @property
    def memory_gib(self) -> float:
        """``memory_bytes`` in GiB, the unit ``kvlab.capacity.budget.plan_kv_cache`` takes."""
        return self.memory_bytes / GiB

    @checked
    def memory_row(self) -> dict[str, object]:
        """The label beside the bytes, read three ways: for the notebook's GB-against-GiB table."""
        return {
            "label": self.memory_label,
            "label as GB (10**9 B)": f"{self.label_gb * GB / GiB:.2f} GiB",
            "label as GiB": f"{self.label_gb:g} GiB",
            "reported (nvidia-smi)": (f"{self.memory_total_mib:,} MiB = {self.memory_gib:.2f} GiB"
                                      if self.memory_is_reported else "no source"),
        }


@checked
@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """A host link (PCIe generation and width): its theoretical bandwidth per direction."""

    name: str
    gigatransfers_per_s: int
    lanes: int
    encoding: tuple[int, int]  # payload bits, line bits: 128b/130b since PCIe 3.0
    sources: tuple[str, ...]

    @property
    def bytes_per_s(self) -> float:
        """Theoretical bytes per second in one direction: rate x lanes x encoding / 8."""
        payload, line = self.encoding
        return float(Fraction(self.gigatransfers_per_s * GB * self.lanes * payload, line * 8))


@checked
@dataclasses.dataclass(frozen=True)
class HostSpec:
    """A GPU server: its GPUs, CPU memory and local NVMe SSDs, the tiers below the GPUs' KV caches."""

    name: str
    full_name: str
    gpu: str
    num_gpus: int
    system_memory_tb: float  # decimal TB, as the datasheet prints it
    num_data_ssds: int
    data_ssd_tb: float
    ssd_link: str  # each SSD's own link (an NVMe drive: PCIe x4)
    sources: tuple[str, ...]

    def __post_init__(self) -> None:
        _known("gpu", self.gpu, "gpus")
        _known("ssd_link", self.ssd_link, "links")

    @property
    def system_memory_bytes(self) -> int:
        """CPU memory in bytes."""
        return round(self.system_memory_tb * 1000 * GB)

    @property
    def ssd_bytes(self) -> int:
        """All data SSDs together, in bytes."""
        return round(self.num_data_ssds * self.data_ssd_tb * 1000 * GB)


def _known(parameter: str, name: str, kind: str) -> None:
    """Refuse a GPU or link name the hardware tables do not have."""
    known = _load(kind)
    if name not in known:
        raise UnknownNameError(parameter, name, known)


def _load(kind: str) -> dict[str, dict]:
    with open(HARDWARE_DIR / f"{kind}.json", encoding="utf-8") as fh:
        return {k: v for k, v in json.load(fh).items() if not k.startswith("_")}


@functools.cache
def _gpus() -> dict[str, GPUSpec]:
    return {name: GPUSpec(name=name, **{**raw, "sources": tuple(raw["sources"])})
            for name, raw in _load("gpus").items()}


@functools.cache
def _links() -> dict[str, LinkSpec]:
    return {name: LinkSpec(name=name, gigatransfers_per_s=raw["gigatransfers_per_s"], lanes=raw["lanes"],
                           encoding=tuple(raw["encoding"]), sources=tuple(raw["sources"]))
            for name, raw in _load("links").items()}


@functools.cache
def _hosts() -> dict[str, HostSpec]:
    return {name: HostSpec(name=name, **{**raw, "sources": tuple(raw["sources"])})
            for name, raw in _load("hosts").items()}


def _find(kind: str, name: object, table: dict[str, object], cls: type) -> object:
    """``table[name]``, or ``name`` itself when it is already a ``cls``; an unknown name lists the known ones."""
    if isinstance(name, cls):
        return name
    if name not in table:
        raise UnknownNameError(kind, name, table)
    return table[name]  # type: ignore[index]


@checked
def list_gpus() -> list[str]:
    """The GPUs in ``data/hardware/gpus.json``."""
    return list(_gpus())


@checked
def get_gpu(gpu: str | GPUSpec) -> GPUSpec:
    """The GPU called ``gpu`` (see ``list_gpus()``); a ``GPUSpec`` is returned as it is."""
    return _find("gpu", gpu, _gpus(), GPUSpec)  # type: ignore[arg-type, return-value]


@checked
def list_links() -> list[str]:
    """The host links in ``data/hardware/links.json``."""
    return list(_links())


@checked
def get_link(link: str | LinkSpec) -> LinkSpec:
    """The link called ``link`` (see ``list_links()``); a ``LinkSpec`` is returned as it is."""
    return _find("link", link, _links(), LinkSpec)  # type: ignore[arg-type, return-value]


@checked
def list_hosts() -> list[str]:
    """The servers in ``data/hardware/hosts.json``."""
    return list(_hosts())


@checked
def get_host(host: str | HostSpec) -> HostSpec:
    """The server called ``host`` (see ``list_hosts()``); a ``HostSpec`` is returned as it is."""
    return _find("host", host, _hosts(), HostSpec)  # type: ignore[arg-type, return-value]
