"""The cost model: FLOPs and bytes counted exactly, turned into modelled seconds, and the swap/recompute choice."""

import pytest

from kvlab.capacity.cost_model import DEFAULT_PREFILL_MFU, CostModel, cost_model
from kvlab.capacity.hardware import get_gpu, get_link
from kvlab.capacity.models import ModelSpec
from kvlab.errors import KvlabValueError

TINY = ModelSpec.from_hf_config({
    "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_size": 16, "intermediate_size": 32, "vocab_size": 100, "tie_word_embeddings": False,
}, name="tiny")


def _tiny(**kwargs):
    return CostModel(TINY, get_gpu("H100-SXM-80GB"), get_link("PCIe 5.0 x16"), **kwargs)


def test_prefill_flops_count_the_matmuls_the_causal_attention_and_one_lm_head():
    c = _tiny()
    assert c.matmul_params == TINY.num_params - 2 * 100 * 16
    # 3 new tokens after 5 cached: 3 x 5 + (1 + 2 + 3) = 21 query-key pairs per head and layer.
    attention = 2 * 4 * (4 + 4) * 21 * 2
    assert c.prefill_flops(3, 5) == 2 * c.matmul_params * 3 + attention + 2 * 100 * 16
    assert c.prefill_flops(0, 5) == 0


def test_prefill_seconds_divide_by_the_assumed_share_of_the_dense_peak():
    c = _tiny(tp=2, prefill_mfu=0.25)
    assert c.flops_per_second == 2 * 989.4e12 * 0.25
    assert c.prefill_seconds(7, 1) == c.prefill_flops(7, 1) / c.flops_per_second
    assert _tiny().prefill_mfu == DEFAULT_PREFILL_MFU


def test_copy_seconds_are_bytes_over_the_links_theoretical_bandwidth():
    c = cost_model("llama-3-8b", "H100-SXM-80GB")
    assert c.link.name == "PCIe 5.0 x16" and c.kv_bytes_per_token == 128 * 1024
    assert c.copy_seconds(1000) == 1000 * 128 * 1024 / get_link("PCIe 5.0 x16").bytes_per_s
    assert cost_model("llama-3-8b", "H100-SXM-80GB", link_efficiency=0.5).copy_seconds(1000) == 2 * c.copy_seconds(1000)
    assert cost_model("llama-3-8b", "H100-SXM-80GB", tp=2).copy_seconds(1000) == c.copy_seconds(1000) / 2


def test_ttft_a_gpu_hit_beats_a_cpu_hit_which_beats_recompute():
    c = cost_model("llama-3-8b", "H100-SXM-80GB")
    for reused in (1, 1000, 3999):
        gpu, cpu, recompute = (c.ttft(4000, reused, w) for w in ("gpu", "cpu", "recompute"))
        assert gpu < cpu < recompute
        assert cpu - gpu == pytest.approx(c.copy_seconds(reused))
    assert c.ttft(4000, 0, "gpu") == c.ttft(4000, 0, "cpu") == c.ttft(4000, 0, "recompute")
    with pytest.raises(KvlabValueError, match="last token"):
        c.ttft(4000, 4000, "gpu")
    with pytest.raises(KvlabValueError, match="where"):
        c.ttft(4000, 10, "disk")


def test_swap_moves_everything_out_and_the_uncached_part_back():
    c = cost_model("llama-3-8b", "H100-SXM-80GB")
    assert c.swap_seconds(1000, 400) == c.copy_seconds(1000) + c.copy_seconds(600)
    assert c.recompute_seconds(1000, 400) == c.prefill_seconds(600, 400)
    assert c.recompute_seconds(1000, 1000) == 0 and c.swap_or_recompute(1000, 1000) == "recompute"
    assert c.swap_or_recompute(1000, 0) == "swap"            # a GQA model's KV crosses PCIe 5 faster than it prefills


def test_the_crossover_rises_with_prompt_length_and_link_bandwidth():
    fast, slow = cost_model("llama-3-8b", "H100-SXM-80GB"), cost_model("llama-3-8b", "H100-SXM-80GB", "PCIe 4.0 x16")
    lengths = (1000, 8000, 32000, 128000)
    crossovers = [fast.crossover_hit_rate(n) for n in lengths]
    assert crossovers == sorted(crossovers) and all(0 < x < 1 for x in crossovers)
    assert all(slow.crossover_hit_rate(n) < fast.crossover_hit_rate(n) for n in lengths)
    mha = cost_model("llama-2-7b", "H100-SXM-80GB")                 # 4x the KV bytes per token
    assert mha.crossover_hit_rate(8000) < fast.crossover_hit_rate(8000)


def test_mixtures_of_experts_need_their_active_parameters():
    with pytest.raises(KvlabValueError, match="active_params"):
        cost_model("deepseek-v3")
    assert cost_model("deepseek-v3", active_params=37_000_000_000).prefill_seconds(10) > 0


@pytest.mark.parametrize(("name", "value"), [("prefill_mfu", 0), ("prefill_mfu", 1.5), ("link_efficiency", -1),
                                             ("tp", 0)])
def test_bad_parameters_are_refused(name, value):
    with pytest.raises(KvlabValueError, match=name):
        cost_model("llama-3-8b", **{name: value})


def test_the_figures_draw_the_cost_models_numbers_and_say_they_are_modelled():
    from kvlab.viz.cost_model import figure_crossover, figure_swap_vs_recompute, figure_ttft_vs_reuse, ttft_curves

    c = cost_model("llama-3-8b", "H100-SXM-80GB")
    curves = ttft_curves(c, 4000, num_points=5)
    assert curves["reuse_rate"] == [0, 0.25, 0.5, 0.75, 3999 / 4000]
    assert curves["cpu"][2] == c.ttft(4000, 2000, "cpu")
    for fig in (figure_ttft_vs_reuse(c, 4000), figure_swap_vs_recompute(c, [1000, 8000]),
                figure_crossover([c], [1000, 8000])):
        assert fig.layout.title.text.startswith("Modelled, not measured")
    fig = figure_swap_vs_recompute(c, [1000])
    assert fig.data[0].y[-1] == 0 and fig.data[1].y[0] == pytest.approx(2000 * c.copy_seconds(1000))


def test_the_roofline_takes_the_longer_of_compute_and_one_read_of_the_weights_and_kv():
    c = cost_model("llama-3-70b", "H100-SXM-80GB", tp=8)
    assert c.weights_bytes_per_gpu == 70_553_706_496 * 2 // 8          # bf16 weights, an eighth per GPU
    reads = c.weights_bytes_per_gpu + 2050 * c.kv_bytes_per_token
    assert c.memory_read_seconds(50, 2000) == reads / (3350e9)
    assert c.forward_seconds(2050) == c.prefill_seconds(2050) > c.memory_read_seconds(2050)   # compute-bound
    assert c.forward_seconds(50, 2000) == c.memory_read_seconds(50, 2000) > c.prefill_seconds(50, 2000)
    fp8 = cost_model("llama-3-70b", "H100-SXM-80GB", tp=8, weights_dtype="fp8")
    assert fp8.weights_bytes_per_gpu == c.weights_bytes_per_gpu // 2
    moe = cost_model("deepseek-v3", "H200-SXM-141GB", tp=8, active_params=37_000_000_000)
    assert moe.weights_bytes_per_gpu == 37_000_000_000 // 8            # fp8 weights, active experts only


def test_a_prefix_hit_speeds_the_first_token_up_at_most_to_the_weights_read():
    c = cost_model("llama-3-8b", "H100-SXM-80GB")
    speedups = [c.prefix_hit_speedup(8000, r) for r in (0, 4000, 7200, 7600, 7999)]
    assert speedups[0] == 1 and speedups == sorted(speedups)
    assert speedups[1] < 8000 / 4000                                      # attention over the cached half still costs
    assert speedups[-1] == c.forward_seconds(8000) / c.forward_seconds(1, 7999) < 8000
    with pytest.raises(KvlabValueError, match="last token"):
        c.prefix_hit_speedup(100, 100)


def test_the_mfu_a_measured_time_implies_inverts_prefill_seconds():
    c = cost_model("llama-3-70b", "H100-SXM-80GB", tp=8)
    assert c.implied_mfu(c.prefill_seconds(2050), 2050) == pytest.approx(c.prefill_mfu)
    with pytest.raises(KvlabValueError, match="seconds"):
        c.implied_mfu(0, 2050)
    with pytest.raises(KvlabValueError, match="weights_dtype"):
        cost_model("llama-3-8b", weights_dtype="fp7")


def test_the_peak_and_the_bandwidth_come_from_the_hardware_data():
    h100, h200 = get_gpu("H100-SXM-80GB"), get_gpu("H200-SXM-141GB")
    assert h100.bf16_dense_flops == h200.bf16_dense_flops == 989.4e12
    assert (h100.memory_bytes_per_s, h200.memory_bytes_per_s) == (3.35e12, 4.8e12)
    assert h100.num_sms == h200.num_sms == 132
    c = cost_model("llama-3-8b", "H200-SXM-141GB", prefill_mfu=1.0)
    assert c.prefill_seconds(16) == c.prefill_flops(16) / 989.4e12
