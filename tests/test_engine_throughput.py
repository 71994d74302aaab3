"""``kvlab.engine.throughput``: the three ways of serving a workload count the same tokens and the KV they hold.

Timings are never asserted (they belong to ``benchmarks/bench_throughput.py``): these tests check
what a run must say whatever the machine: every requested token, nothing more; a static batch's
cache is its padded rows; kvlab's pool holds blocks of what each request wrote.
"""

import pytest
import torch

from kvlab.data import TINY_MODEL_DIR
from kvlab.engine.throughput import Workload, run_hf_serial, run_hf_static, run_kvlab, text_workload, torch_threads
from kvlab.errors import KvlabValueError
from kvlab.machine import load_measurement
from kvlab.viz.engine import THROUGHPUT_SYSTEMS, figure_throughput, throughput_table


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def hf_trained():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()


def test_the_workload_mixes_output_lengths_behind_one_system_prompt(tokenizer):
    w = text_workload(tokenizer, 6, output_lens=(2, 5))
    assert w.output_lens == (2, 5, 2, 5, 2, 5) and w.num_tokens == 21
    assert len({p[:13] for p in w.prompts}) == 1 and len(set(w.prompts)) == 6


def test_every_system_serves_exactly_the_tokens_asked_for(tokenizer, hf_trained):
    w = text_workload(tokenizer, 3, output_lens=(1, 4))                    # 1 + 4 + 1 tokens
    with torch_threads(1):
        runs = [run_kvlab(TINY_MODEL_DIR, w, 2, dtype="float32"), run_hf_static(hf_trained, w, 2),
                run_hf_serial(hf_trained, w)]
    assert torch.get_num_threads() >= 1
    assert [r["tokens"] for r in runs] == [6, 6, 6]
    kvlab, static = runs[0], runs[1]
    # the static batches: rows x (padded prompt + longest output); two rows of the first batch are the largest
    assert static["peak_kv_tokens"] == 2 * (max(len(p) for p in w.prompts[:2]) + 4)
    assert kvlab["peak_kv_tokens"] % 16 == 0 and kvlab["steps"] >= 4


def test_kvlab_batching_statically_waits_for_each_batch_longest_output(tokenizer):
    w = text_workload(tokenizer, 3, output_lens=(1, 4))                    # batches of 2: (1, 4), then (1,)
    with torch_threads(1):
        continuous = run_kvlab(TINY_MODEL_DIR, w, 2, dtype="float32")
        static = run_kvlab(TINY_MODEL_DIR, w, 2, static=True, dtype="float32")
    assert static["tokens"] == continuous["tokens"] == 6                   # what was asked for, not the padding
    assert static["steps"] == 4 + 1                                        # each batch as long as its longest output
    assert continuous["steps"] == 4                                        # the third request took the first's slot


@pytest.mark.parametrize(("prompts", "lens", "match"), [(((1, 2),), (1, 2), "one output length per prompt"),
                                                         (((1, 2),), (0,), "output_lens")])
def test_a_workload_pairs_each_prompt_with_a_positive_length(prompts, lens, match):
    with pytest.raises(KvlabValueError, match=match):
        Workload(prompts, lens)


def test_the_saved_measurement_makes_a_table_and_a_figure():
    saved = load_measurement("engine_throughput")
    rows = saved["results"]["rows"]
    table = throughput_table(rows)
    assert [r["concurrency"] for r in table] == [r["concurrency"] for r in rows]
    fig = figure_throughput(rows, "title")
    assert len(fig.data) == 3 * len(THROUGHPUT_SYSTEMS)
    assert list(fig.data[0].x) == [r["concurrency"] for r in rows]
