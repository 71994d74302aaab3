"""Where a KV prefix can live on one server: capacities and modelled times with their sources."""

import pytest

from kvlab.capacity.hardware import get_host, get_link, list_hosts
from kvlab.capacity.tiers import kv_tiers
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.units import MiB


def test_the_dgx_h100_has_its_datasheet_memory_and_ssds():
    host = get_host("DGX-H100")
    assert list_hosts() == ["DGX-H100"] and host.sources
    assert (host.num_gpus, host.system_memory_bytes, host.ssd_bytes) == (8, 2 * 10**12, 8 * 384 * 10**10)
    assert get_link(host.ssd_link).bytes_per_s == 16e9 * 4 * 128 / 130 / 8
    with pytest.raises(UnknownNameError, match="DGX-H100"):
        get_host("DGX-A1000")


def test_each_tier_is_larger_and_slower_than_the_one_above():
    table = kv_tiers("DGX-H100", "llama-3-8b")
    gpu, dram, ssd = table.tiers
    assert gpu.capacity_bytes == 8 * table.plan.kv_pool_bytes
    assert gpu.capacity_bytes < dram.capacity_bytes < ssd.capacity_bytes
    assert gpu.bytes_per_s > dram.bytes_per_s > ssd.bytes_per_s
    rows = table.rows(2000)
    assert table.prefix_bytes(2000) == 250 * MiB
    assert [r["seconds"] for r in rows] == sorted(r["seconds"] for r in rows)
    assert rows[0]["times_the_gpu_tier"] == 1 and rows[0]["prefixes"] == gpu.capacity_bytes // (250 * MiB)
    with pytest.raises(KvlabValueError, match="prefix_tokens"):
        table.rows(0)
