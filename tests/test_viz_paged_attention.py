"""Notebook 05's figures and read-order panel: thin views over the kernels' own numbers."""

import random

import pytest
import torch
from kvlab.kernels import PACKAGED_BATCHES, check_kernel, compute_slot_mapping
from kvlab.kernels.bench import GOAL_COPY_FRACTION
from kvlab.kernels.fp8_sweep import fp8_error_sweep
from kvlab.kernels.layouts import legacy_x
from kvlab.kernels.reference import paged_attention_ref, reshape_and_cache_ref

from kvlab.exercises.nb05 import slot_mapping
from kvlab.viz.paged_attention import (
    ReadOrderPanel,
    figure_fp8_error,
    figure_gpu_bench,
    figure_kernel_errors,
    figure_layout_offsets,
    figure_program_reads,
    figure_softmax_states,
    reads_state,
)
from kvlab.viz.widgets import ERROR_CSS_CLASS

BATCH = dict(query_lens=[1, 6, 9], seq_lens=[21, 14, 9], block_table=[[5, 2, 9], [5, 7, 0], [3, 8, 0]],
             block_size=8, num_kv_heads=1, num_queries_per_kv=4)


def test_reads_state_replays_the_grid():
    state = reads_state(**BATCH, tile_n=16, block_q=4, num_kv_splits=1)
    assert state["plan"].grid == (16 // 4 + 3, 1, 1)
    assert state["working_programs"] == 6 and len(state["table"]) == 6
    decode = state["table"][0]
    assert decode["sequence"] == 0 and decode["blocks in order"] == [5, 2, 9]


def test_the_picture_has_one_labelled_cell_per_tile():
    state = reads_state(**BATCH, tile_n=16, block_q=4, num_kv_splits=1)
    fig = figure_program_reads(state["reads"])
    assert len(fig.layout.annotations) == sum(len(r.tiles) for r in state["reads"])
    assert fig.layout.annotations[0].text == "5 → 2"                  # A's first tile: blocks 5 then 2


def test_panel_controls_rerun_the_pure_function_and_show_errors():
    panel = ReadOrderPanel(**BATCH)
    panel.tile_n.value = 64
    assert all(len(r.tiles) == 1 for r in panel.state["reads"])
    panel.num_kv_splits.value = 3
    assert panel.state["plan"].grid[2] == 3 and "grid (7, 1, 3)" in panel.summary.value
    panel._batch["block_size"] = 4                                    # a table that no longer covers seq A
    panel.block_q.value = 2
    assert ERROR_CSS_CLASS in str(panel.errors.outputs)


def test_other_figures_draw_from_their_data():
    states = torch.tensor([[[0.5, 1.0]], [[2.0, 1.5]]])               # [tiles, rows, (m, l)]
    assert [t.y for t in figure_softmax_states(states, rows=(0,)).data] == [(0.5, 2.0), (1.0, 1.5)]
    assert len(figure_layout_offsets(8, 32, legacy_x(torch.float16), 2).data) == 3
    rows = fp8_error_sweep([1e-3, 1.0], num_seqs=2, seq_len=16, write=reshape_and_cache_ref,
                           attend=paged_attention_ref, device="cpu")
    fig = figure_fp8_error(rows)
    assert list(fig.data[1].y) == [r["error calibrated"] for r in rows]


def test_the_gpu_figure_draws_each_decode_shape_against_the_goal():
    def row(batch, context, block_size, fraction):
        return {"shape": f"decode b{batch} ctx{context} bs{block_size}", "kind": "decode", "batch": batch,
                "context": context, "block_size": block_size, "kernel_us": 10.0, "copy_fraction": fraction}

    results = {"rows": [row(64, 8192, 16, 0.85), row(1, 1024, 16, 0.1), row(64, 8192, 64, 0.8),
                        {"shape": "decode b256 ctx32768 bs64", "error": "OutOfMemoryError"},
                        {**row(4, 2048, 16, 0.5), "kind": "prefill"}]}
    fig = figure_gpu_bench(results, title="made-up rows")
    assert [list(bar.x) for bar in fig.data] == [["b64 × 8K", "b1 × 1K"], ["b64 × 8K"]]
    assert list(fig.data[0].y) == [0.85, 0.1]
    assert fig.layout.shapes[0].y0 == GOAL_COPY_FRACTION


def test_the_exercise_reference_is_vllms_slot_mapping():
    rng = random.Random(7)
    for _ in range(20):
        seq_lens = [rng.randint(1, 30) for _ in range(3)]
        query_lens = [rng.randint(1, s) for s in seq_lens]
        tables = [[rng.randrange(50) for _ in range(8)] for _ in seq_lens]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        expected = compute_slot_mapping(torch.tensor(tables), torch.tensor(seq_lens), torch.tensor(starts), 4)
        assert slot_mapping(tables, seq_lens, query_lens, 4) == expected.tolist()


def test_the_error_map_shows_one_cell_per_token_and_head_and_marks_nan():
    spec = PACKAGED_BATCHES[2]                                        # chunked prefill + decodes: 4 sequences

    def nan_in_one_row(*args, **kwargs):
        out = paged_attention_ref(*args, **kwargs)
        out[5, 1] = float("nan")
        return out

    report = check_kernel(nan_in_one_row, [spec])
    fig = figure_kernel_errors(report)
    heat = fig.data[0]
    assert len(heat.z) == sum(spec.query_lens) and len(heat.z[0]) == spec.num_kv_heads * spec.group
    assert heat.text[5][1] == "NaN or inf" and heat.z[5][1] == pytest.approx(3.0)     # drawn at the cap
    assert len(fig.layout.shapes) == len(spec.seq_lens) - 1                           # lines between sequences
    assert "fails" in fig.layout.title.text and heat.y[20] == "seq 1 · q 0"


def test_the_error_map_of_a_raising_batch_says_so():
    def raises(*args, **kwargs):
        raise RuntimeError("boom")

    fig = figure_kernel_errors(check_kernel(raises, PACKAGED_BATCHES[:1]))
    assert "boom" in fig.layout.annotations[0].text


def test_the_reads_table_counts_the_keys_each_program_reads():
    state = reads_state(**BATCH, tile_n=16, block_q=4, num_kv_splits=1)
    assert state["table"][0]["keys read"] == 21                         # A's decode: its 21 keys
