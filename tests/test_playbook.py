"""The capacity-planning playbook: GPU facts, concurrency with a shared prefix, the decision flow, levers,
and the source material's three worked deployments, rounded and exact."""

import math

import pytest

from kvlab.capacity.budget import plan_kv_cache
from kvlab.capacity.hardware import GB, get_gpu, get_link, list_gpus, list_links
from kvlab.capacity.playbook import (
    LEVERS,
    UTILIZATION_STEP,
    Deployment,
    Workload,
    concurrency_at,
    decide,
    fp8_kv_verdict,
    plan_deployment,
    rank_levers,
)
from kvlab.capacity.source_deployments import (
    SOURCE_DEPLOYMENTS,
    comparison_rows,
    reproduce,
    source_arithmetic,
)
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.units import GiB, KiB, MiB

# ----------------------------------------------------------------- hardware


def test_every_gpu_names_its_sources_and_the_driver_reports_less_than_or_about_its_label():
    for name in list_gpus():
        gpu = get_gpu(name)
        assert gpu.sources and gpu.bf16_dense_tflops > 0 and gpu.host_link in list_links()
        if gpu.memory_is_reported:
            assert gpu.memory_bytes == gpu.memory_total_mib * MiB
            assert gpu.memory_bytes <= gpu.label_gb * GiB                     # never more than the label as GiB
            assert gpu.memory_bytes >= 0.99 * gpu.label_gb * GB               # never much less than it as GB


def test_gb_and_gib_disagree_in_both_directions():
    l40s, h100 = get_gpu("L40S"), get_gpu("H100-SXM-80GB")
    assert l40s.memory_bytes > 48 * GB and l40s.memory_bytes < 45 * GiB      # "48 GB": 48.3e9 B, 44.99 GiB
    assert 79 * GiB < h100.memory_bytes < 80 * GiB                           # "80 GB": 79.65 GiB
    assert get_gpu("A100-80GB").memory_bytes == 80 * GiB


def test_a_gpu_without_a_driver_figure_is_taken_at_its_label_and_the_playbook_says_so():
    h200 = get_gpu("H200-SXM-141GB")
    assert not h200.memory_is_reported and h200.memory_bytes == 141 * GiB
    result = plan_deployment(Deployment("llama-3-8b", h200, max_model_len=8192), Workload(1000, 200))
    assert any("no source for the memory" in w for w in result.warnings)


def test_pcie_bandwidth_per_direction_matches_the_datasheets_bidirectional_figures():
    pcie4, pcie5 = get_link("PCIe 4.0 x16"), get_link("PCIe 5.0 x16")
    assert pcie4.bytes_per_s == 16e9 * 16 * 128 / 130 / 8
    assert pcie5.bytes_per_s == 2 * pcie4.bytes_per_s
    assert 2 * pcie4.bytes_per_s == pytest.approx(64e9, rel=0.02)           # "64 GB/s bidirectional"
    assert 2 * pcie5.bytes_per_s == pytest.approx(128e9, rel=0.02)


def test_unknown_gpus_and_links_list_the_known_ones():
    with pytest.raises(UnknownNameError, match="L40S"):
        get_gpu("RTX 9090")
    with pytest.raises(UnknownNameError, match="PCIe 5.0 x16"):
        get_link("NVLink 9")


# ----------------------------------------------------------------- concurrency with a shared prefix


def test_concurrency_at_counts_whole_blocks_and_shares_only_full_prefix_blocks():
    assert concurrency_at(10, 16, 40) == 3                          # 3 blocks each
    assert concurrency_at(10, 16, 40, shared_prefix_tokens=32) == 8  # 2 shared blocks, 1 own block each
    assert concurrency_at(10, 16, 40, shared_prefix_tokens=31) == 4  # 1 shared block, 2 own blocks each: 9 // 2
    assert concurrency_at(2, 16, 40) == 0 and concurrency_at(0, 16, 1) == 0


def test_concurrency_at_max_model_len_without_sharing_is_the_plans_usable_concurrency():
    for length in (1, 1000, 8192, 131072):
        plan = plan_kv_cache("llama-3-8b", gpu_memory_gib=80, max_model_len=length)
        assert concurrency_at(plan.num_usable_blocks, plan.block_size, length) == plan.usable_concurrency


def test_concurrency_at_refuses_a_prefix_longer_than_the_request():
    with pytest.raises(KvlabValueError, match="shared_prefix_tokens"):
        concurrency_at(10, 16, 40, shared_prefix_tokens=41)


def test_a_larger_shared_prefix_never_lowers_concurrency():
    counts = [concurrency_at(5000, 16, 4000, s) for s in range(0, 4001, 250)]
    assert counts == sorted(counts) and counts[-1] > 10 * counts[0]


# ----------------------------------------------------------------- the decision flow


@pytest.mark.parametrize(("value", "band"), [(0, "< 10"), (9.99, "< 10"), (10, "10 to 50"), (49.99, "10 to 50"),
                                             (50, ">= 50"), (1e6, ">= 50")])
def test_decision_bands_follow_the_source_flow(value, band):
    assert decide(value).band == band


def test_decision_steps_start_with_fp8_kv_when_memory_is_short():
    assert decide(3).steps[0] == decide(30).steps[0] == "FP8 KV cache"
    assert "max_num_batched_tokens" in decide(80).steps[-1]
    with pytest.raises(KvlabValueError, match="max_concurrency"):
        decide(-1)


def test_the_utilization_step_is_the_sources_range_and_the_lever_takes_its_top():
    assert UTILIZATION_STEP == (0.93, 0.95)
    assert "0.93 to 0.95" in decide(20).steps[1]
    lever = next(r for r in rank_levers(*_chat_on_l40s()) if r.name == "Higher gpu_memory_utilization")
    assert lever.deployment.gpu_memory_utilization == UTILIZATION_STEP[1]


@pytest.mark.parametrize(("value", "verdict"), [(100.01, "not needed"), (100, "weigh it"), (20, "weigh it"),
                                                (19.99, "cheapest doubling"), (0, "cheapest doubling")])
def test_the_fp8_switch_points_are_the_sources(value, verdict):
    assert fp8_kv_verdict(value) == verdict


def test_the_weights_line_reads_as_vllm_0_33_0_prints_it():
    result = plan_deployment(*_chat_on_l40s())
    weights = round(result.plan.weights_bytes / GiB, 2)
    assert result.startup_log[0] == f"Model loading took {weights} GiB memory and … seconds"


# ----------------------------------------------------------------- levers


def _chat_on_l40s():
    return Deployment("qwen3-8b", "L40S", max_model_len=8192, non_kv_gib=2.0), Workload(1000, 500)


def test_each_lever_is_the_plan_of_its_changed_deployment():
    deployment, workload = _chat_on_l40s()
    for lever in rank_levers(deployment, workload):
        if lever.applicable:
            assert lever.plan == lever.deployment.plan()
            assert lever.gain_max_concurrency == lever.plan.max_concurrency - deployment.plan().max_concurrency


def test_lowering_max_model_len_raises_the_logged_concurrency_but_not_the_pool():
    deployment, workload = _chat_on_l40s()
    lever = next(r for r in rank_levers(deployment, workload) if r.name == "Lower max_model_len")
    assert lever.plan.num_blocks == deployment.plan().num_blocks
    assert lever.gain_max_concurrency > 0 and lever.gain_typical == 0
    assert lever.deployment.max_model_len == 4096


def test_fp8_kv_doubles_the_blocks_and_tp_halves_the_per_gpu_bytes():
    deployment, workload = _chat_on_l40s()
    levers = {r.name: r for r in rank_levers(deployment, workload)}
    base = deployment.plan()
    assert levers["FP8 KV cache"].plan.kv_bytes_per_token * 2 == base.kv_bytes_per_token
    assert levers["More tensor parallelism"].plan.kv_bytes_per_token * 2 == base.kv_bytes_per_token
    assert levers["A GQA/MLA model"].applicable is False                    # Qwen3-8B is already GQA


def test_levers_rank_by_the_chosen_figure_and_inapplicable_ones_come_last():
    deployment, workload = _chat_on_l40s()
    for rank_by, key in (("max_model_len", "gain_max_concurrency"), ("typical", "gain_typical")):
        ranked = rank_levers(deployment, workload, rank_by=rank_by)
        applicable = [r for r in ranked if r.applicable]
        assert [getattr(r, key) for r in applicable] == sorted((getattr(r, key) for r in applicable), reverse=True)
        assert all(r.applicable for r in ranked[: len(applicable)])
        assert {r.name for r in ranked} == {name for name, _, _ in LEVERS}


def test_an_mha_model_gets_the_gqa_lever_and_a_fp8_kv_cache_does_not_get_fp8_again():
    deployment = Deployment("llama-2-7b", "A100-80GB", max_model_len=4096, kv_dtype="fp8")
    levers = {r.name: r for r in rank_levers(deployment, Workload(500, 200))}
    assert levers["A GQA/MLA model"].applicable and levers["A GQA/MLA model"].plan.kv_bytes_per_token * 8 == \
        deployment.plan().kv_bytes_per_token
    assert not levers["FP8 KV cache"].applicable and "already fp8" in levers["FP8 KV cache"].cost
    assert "no FP8 tensor cores" in levers["Weight quantization"].cost       # an A100


def test_bad_settings_raise_naming_the_parameter():
    with pytest.raises(UnknownNameError, match="gpu"):
        Deployment("qwen3-8b", "TPU", max_model_len=8192)
    with pytest.raises(KvlabValueError, match="gpu_memory_utilization"):
        Deployment("qwen3-8b", "L40S", max_model_len=8192, gpu_memory_utilization=1.2)
    with pytest.raises(KvlabValueError, match="shared_prefix"):
        Workload(100, 10, shared_prefix=1.5)
    with pytest.raises(KvlabValueError, match="rank_by"):
        rank_levers(*_chat_on_l40s(), rank_by="price")


# ----------------------------------------------------------------- the source material's three deployments


def test_the_source_arithmetic_reproduces_its_rounded_figures():
    a, b, c = (source_arithmetic(SOURCE_DEPLOYMENTS[k]) for k in "abc")
    assert a.tokens == 171_875 and round(a.tokens / 1000) == 172 and round(a.max_concurrency) == 21
    assert a.typical_concurrency > 100                                       # "100+"
    assert b.tokens == 1_310_720 == 200 * GiB / (160 * KiB) and b.max_concurrency == 40
    assert c.tokens == 500_000 and round(c.max_concurrency, 1) == 3.8


def test_the_exact_plans_log_what_vllm_would_print():
    logs = {k: reproduce(k)["exact"].startup_log for k in "abc"}
    assert logs["a"][1:] == ("GPU KV cache size: 149,600 tokens, Maximum concurrency for 8,192 tokens per request: "
                             "18.26x",)
    assert logs["b"][1].endswith("Maximum concurrency for 32,768 tokens per request: 40.98x")
    assert logs["c"][1].endswith("Maximum concurrency for 131,072 tokens per request: 2.61x")
    assert all(log[0].startswith("Model loading took ") for log in logs.values())


def test_where_the_source_rounds_kvlab_says_why():
    a, b, c = (reproduce(k) for k in "abc")
    # (a): Qwen3-8B stores 144 KiB per token, not the 128 KB of Llama-3-8B; the L40S reports 44.99 GiB.
    assert a["exact"].plan.kv_bytes_per_token == 144 * KiB
    assert a["exact"].max_concurrency < a["arithmetic"].max_concurrency
    # (b): binary units throughout; exact is within 3 % of 40x.
    assert b["exact"].plan.kv_bytes_per_token * 4 == 160 * KiB
    assert b["exact"].max_concurrency == pytest.approx(40, rel=0.03)
    # (c): the real 32B config stores 256 KiB per token, so two thirds of the source's concurrency.
    assert c["exact"].plan.kv_bytes_per_token * 2 == 256 * KiB
    assert c["exact"].max_concurrency / c["arithmetic"].max_concurrency == pytest.approx(0.68, abs=0.02)
    assert any("YaRN" in w for w in c["exact"].warnings)


def test_the_decision_flow_puts_the_deployments_where_the_source_does():
    assert [reproduce(k)["exact"].decision.band for k in "abc"] == ["10 to 50", "10 to 50", "< 10"]


def test_comparison_rows_cover_every_deployment():
    rows = comparison_rows()
    assert [r["deployment"][:3] for r in rows] == ["(a)", "(b)", "(c)"]
    assert rows[1]["source arithmetic: concurrency"] == "40.00x"
    assert all(math.isfinite(float(r["exact: concurrency (vLLM log)"].rstrip("x"))) for r in rows)
