"""Statements two learners' walk-throughs found stale against vLLM 0.33.0 (issue 29 §3), each held once fixed.

The numbers behind them are asserted where they are taught (notebooks 02, 07, 08) and against vLLM's own
functions in ``tests/vllm/test_startup_messages.py``; this file holds the words, and kvlab's behaviour
that the words describe.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from kvlab.capacity.models import get_model
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

ROOT = Path(__file__).resolve().parents[1]


def text(notebook: str) -> str:
    """Every cell's source of ``notebooks/<notebook>*.ipynb``, joined."""
    (path,) = (ROOT / "notebooks").glob(f"{notebook}_*.ipynb")
    return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])


@pytest.mark.parametrize(("where", "stale"), [
    ("02", "_report_kv_cache_config"), ("07", "_report_kv_cache_config"),      # a function 0.33.0 does not have
    ("02", "Some later vLLM revisions"), ("02", "The-two-lines-vLLM-prints"), ("08", "The-two-lines-vLLM-prints"),
    ("05", "--calculate-kv-scales"),                                           # no such flag in 0.33.0
    ("08", "8,192 batched tokens"), ("08", "1,033 blocks"), ("08", "1.78×"),  # the LLM class gets 16,384 there
    ("06", "`length`, `abort`, `error`"),                                      # an abort is never counted
    ("01", "in preparation"),                                                  # notebook 08 exists
    ("03", "One more detail from `KVCacheManager.free`"),                      # the reversal is one level down
])
def test_the_notebooks_no_longer_say(where, stale):
    assert stale not in text(where)


@pytest.mark.parametrize("path", ["kvlab/capacity/budget.py", "kvlab/capacity/startup_log.py", "kernels/fp8.py"])
def test_kvlab_no_longer_cites_what_0_33_0_lacks(path):
    source = (ROOT / path).read_text()
    assert "_report_kv_cache_config" not in source and "--calculate-kv-scales" not in source
    assert "models's" not in source


def test_the_reversed_free_is_single_type_kv_cache_managers_as_in_vllm():
    assert "reversed(" in inspect.getsource(SingleTypeKVCacheManager.free)
    assert "reversed(" not in inspect.getsource(KVCacheManager.free)
    assert "`SingleTypeKVCacheManager.free`" in text("03")


def test_the_request_bytes_exercise_states_the_rule_kvlab_follows():
    """Without ``layer_types`` a window follows the family: Gemma 2 alternates, Qwen2.5 switches it off, Mistral
    slides everywhere; the exercise notebook 01 prints says so."""
    from kvlab.exercises.core import get_exercise

    gemma, qwen, mistral = get_model("gemma-2-9b"), get_model("qwen2.5-32b-instruct"), get_model("mistral-7b-v0.1")
    assert "layer_types" not in gemma.config and "layer_types" not in qwen.config
    assert gemma.layer_types[:4] == ("sliding_attention", "full_attention") * 2
    assert qwen.config["sliding_window"] and qwen.config["use_sliding_window"] is False and qwen.num_sliding_layers == 0
    assert mistral.num_sliding_layers == mistral.num_layers
    task = get_exercise("01.request_bytes").task
    assert "Gemma 2" in task and "use_sliding_window" in task and "applies to every layer" not in task
