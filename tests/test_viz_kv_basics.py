"""Notebook 01's pictures of the cache: each drawn from a pure function whose numbers are kvlab's."""

import pytest

from kvlab import KiB, format_bytes, get_model, kv_bytes_per_token
from kvlab.capacity.sizing import mha_ratio
from kvlab.errors import KvlabValueError
from kvlab.viz.bytes_per_token import KVContextPanel, figure_bytes_per_token, kv_context_state
from kvlab.viz.kv_basics import (
    figure_kv_factors,
    figure_mla_latent,
    figure_prefill_decode,
    latent_against_mha,
    prefill_decode_steps,
)


def texts(fig):
    return " ".join(a.text for a in fig.layout.annotations if a.text)


def test_prefill_writes_the_prompt_once_and_each_decode_step_writes_one_token_and_reads_them_all():
    steps = prefill_decode_steps(prompt_len=6, decode_steps=3)
    assert [s.kind for s in steps] == ["prefill", "decode", "decode", "decode"]
    assert [len(s.written) for s in steps] == [6, 1, 1, 1]
    assert [s.num_read for s in steps] == [6, 7, 8, 9]          # every earlier token, again, each step
    assert list(steps[2].written) == [7] and list(steps[2].queries) == [7]
    assert sum(len(s.written) for s in steps) == 9               # each token's K and V are written exactly once
    with pytest.raises(KvlabValueError, match="prompt_len"):
        prefill_decode_steps(0, 3)


def test_the_prefill_decode_picture_prices_each_step_with_the_model():
    fig = figure_prefill_decode(6, 3, get_model("llama-3-8b"))
    assert "768 KiB / 768 KiB" in texts(fig) and "128 KiB / 1.125 MiB" in texts(fig)   # 128 KiB a token
    assert "Four" in texts(fig) and "brought" in texts(fig)
    assert len(fig.data[0].x) == 4 * 9                                                    # a cell per step and position


@pytest.mark.parametrize("name, dtype, tp", [("llama-3-8b", "bf16", 1), ("llama-3-70b", "fp8", 8),
                                             ("deepseek-v3", "bf16", 1)])
def test_the_factor_picture_states_the_formula_with_the_models_numbers(name, dtype, tp):
    model = get_model(name)
    fig = figure_kv_factors(model, dtype, tp)
    assert fig.data[0].hovertext[0].endswith(f"= {format_bytes(kv_bytes_per_token(model, dtype, tp))} per token")
    assert fig.layout.width <= 820


def test_mla_stores_one_latent_where_its_mha_form_stores_every_heads_k_and_v():
    deepseek = get_model("deepseek-v3")
    c = latent_against_mha(deepseek)
    assert (c.latent_values, c.mha_values) == (576, 2 * 128 * 128)
    assert c.ratio == pytest.approx(mha_ratio(deepseek)) and round(c.ratio, 1) == 56.9
    assert "576 values" in texts(figure_mla_latent(deepseek))
    with pytest.raises(KvlabValueError, match="MLA"):
        latent_against_mha(get_model("llama-3-8b"))


def test_bars_are_horizontal_labelled_to_three_figures_and_largest_on_top():
    fig = figure_bytes_per_token([get_model("deepseek-v3"), get_model("llama-2-7b")], ("bf16", "fp8"))
    bf16 = next(t for t in fig.data if t.name == "bf16")
    assert bf16.orientation == "h" and list(bf16.y) == ["deepseek-v3", "llama-2-7b"]   # plotly draws y upwards
    fp8 = next(t for t in fig.data if t.name == "fp8")
    assert list(fp8.text) == ["34.3", "256"]                                           # not "34.3125"


def test_n_requests_outgrow_the_weights_n_times_sooner():
    llama70 = get_model("llama-3-70b")
    one, many = kv_context_state(llama70, "bf16", 8, requests=1), kv_context_state(llama70, "bf16", 8, requests=32)
    assert one["crossing_tokens"] > 400_000 and many["crossing_tokens"] == pytest.approx(one["crossing_tokens"] / 32)
    assert one["kv_bytes_per_token"] == 40 * KiB
    panel = KVContextPanel("llama-3-70b", tp=8, requests=1)
    panel.requests.value = 32
    assert panel.state["crossing_tokens"] == many["crossing_tokens"]
    assert "32 requests" in panel.figure.data[0].name and "32 requests" in panel.summary.value
    with pytest.raises(KvlabValueError, match="requests"):
        kv_context_state(llama70, requests=0)
