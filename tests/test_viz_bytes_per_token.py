"""Notebook 01's panel is a thin view over panel_state: same numbers, figures with data, visible errors."""

import pytest

from kvlab import KiB, get_model, kv_bytes_per_token
from kvlab.viz.bytes_per_token import BytesPerTokenPanel, figure_bytes_per_token, panel_state


def test_panel_state_is_the_library_arithmetic():
    s = panel_state("llama-3-70b", "fp8", 8, 8192)
    assert s["bytes_per_token"] == 20 * KiB
    assert s["bytes_per_request"] == 20 * KiB * 8192
    assert len(s["figure"].data) == 2  # KV line and weights line


def test_panel_accepts_a_pasted_config():
    cfg = {k: v for k, v in get_model("deepseek-v3").config.items() if not k.startswith("_")}
    assert panel_state(cfg, "bf16", 1, 4096)["bytes_per_token"] == 68.625 * KiB


def test_controls_drive_the_state_and_bad_pasted_configs_show_an_error():
    panel = BytesPerTokenPanel()
    panel.kv_dtype.value = "nvfp4"
    assert panel.state["bytes_per_token"] == kv_bytes_per_token(get_model("llama-3-70b"), "nvfp4")
    panel.config.value = '{"num_attention_heads": 8}'
    before = panel.state
    panel.model.value = "pasted config"
    assert panel.state is before  # nothing changed ...
    assert "num_hidden_layers" in str(panel.errors.outputs)  # ... and the learner sees why


@pytest.mark.parametrize("dtypes", [("bf16",), ("bf16", "fp8", "nvfp4")])
def test_bytes_figure_has_a_bar_group_per_dtype(dtypes):
    fig = figure_bytes_per_token([get_model("llama-3-8b"), get_model("deepseek-v3")], dtypes)
    assert [t.name for t in fig.data] == list(reversed(dtypes))   # drawn bottom-up: the first dtype on top
