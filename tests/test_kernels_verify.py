"""check_kernel passes the real kernel, fails known-wrong ones, and points at where they are wrong.

The known-wrong kernels are of two kinds: hand-made functions whose one wrong element is known,
so the report's worst (sequence, query token, head) can be checked exactly; and the mutants of
``kvlab.kernels.mutants``, each of which must be caught by the packaged batch that probes its bug.
"""

import pytest
import torch
from kvlab.kernels import PACKAGED_BATCHES, check_kernel, paged_attention, paged_attention_ref
from kvlab.kernels import mutants as M
from kvlab.kernels.batches import make_batch

from kvlab.errors import KernelInputError, UnknownNameError

BY_NAME = {b.name: b for b in PACKAGED_BATCHES}

#: Which packaged batch catches which attention mutant (each must fail there; the real kernel passes it).
CAUGHT_BY = {
    "no_rescale": "decode at block edges",
    "no_empty_row_guard": "split-KV, mixed batch",
    "causal_off_by_one": "prefill",
    "gqa_head_mapping": "decode at block edges",
    "tile_to_block": "tile spans 4 blocks",
    "merge_weights": "split-KV, 3 splits",
    "fp8_scale_direction": "FP8 cache",
    "window_off_by_one": "window inside a block",
}


def test_the_kernel_and_the_reference_pass_every_packaged_batch():
    for fn in (paged_attention, paged_attention_ref):
        report = check_kernel(fn)
        assert report.passed, str(report)
        assert [r.name for r in report.results] == [b.name for b in PACKAGED_BATCHES]
        for r, spec in zip(report.results, PACKAGED_BATCHES, strict=True):
            assert r.relative_error < 1e-4
            assert tuple(r.errors.shape) == (sum(spec.query_lens), spec.num_kv_heads * spec.group)


def test_the_packaged_batches_cover_the_paths_the_issue_names():
    specs = PACKAGED_BATCHES
    assert any(max(s.query_lens) == 1 for s in specs) and any(s.query_lens == s.seq_lens for s in specs)
    assert any(1 in s.query_lens and max(s.query_lens) > 1 for s in specs)                  # mixed
    assert {s.group for s in specs} >= {1, 2, 3, 4, 8}
    assert any(s.num_kv_splits > 1 for s in specs) and any(s.num_kv_splits == 1 for s in specs)
    windows = [(s.sliding_window, max(s.seq_lens)) for s in specs if s.sliding_window]
    assert any(w < n for w, n in windows) and any(w >= n for w, n in windows)
    assert any(s.sliding_window % s.block_size for s in specs if s.sliding_window)           # edge inside a block
    assert any(s.fp8_scales for s in specs)
    tile = {s.name: s.config.tile_n for s in specs}
    assert any(tile[s.name] > s.block_size for s in specs) and any(tile[s.name] < s.block_size for s in specs)
    edges = {n % 16 for s in specs for n in s.seq_lens}
    assert {0, 1, 15} <= edges                                                              # around tile edges


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_attention_mutant_is_caught_by_the_batch_that_probes_its_bug(mutant):
    spec = BY_NAME[CAUGHT_BY[mutant]]
    report = check_kernel(M.mutant_attention(mutant), [spec], seed=7)
    assert not report.passed, f"mutant {mutant} passed {spec.name!r}"
    assert check_kernel(paged_attention, [spec], seed=7).passed
    assert mutant in report.function and spec.name in str(report)


def test_every_attention_mutant_in_the_catalogue_has_a_batch_that_catches_it():
    assert set(CAUGHT_BY) == {m.name for m in M.MUTANTS.values() if m.module == "attention"}


def test_the_worst_element_is_where_the_error_is():
    def one_wrong_element(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, **kwargs):
        out = paged_attention_ref(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, **kwargs)
        out[int(query_start_loc[3]) + 3, 1] += 0.5          # sequence 3, its fourth query token, head 1
        return out

    spec = BY_NAME["chunked prefill + decodes"]                  # sequence 3 is a 9-token prompt
    (result,) = check_kernel(one_wrong_element, [spec]).results
    assert not result.passed and result.worst == (3, 3, 1)
    assert result.max_error == pytest.approx(0.5, abs=1e-5)
    assert int((result.errors > 1e-4).sum()) == 1


def test_a_row_left_unwritten_is_an_infinite_error_and_the_row_is_named():
    def forgets_the_last_token(query, *args, out=None, **kwargs):
        ref = paged_attention_ref(query, *args, **kwargs)
        out[:-1] = ref[:-1]                                     # the last row keeps the NaN poison
        return out

    spec = BY_NAME["prefill"]
    (result,) = check_kernel(forgets_the_last_token, [spec]).results
    assert not result.passed and result.max_error == float("inf")
    assert result.worst[:2] == (1, spec.query_lens[1] - 1)
    assert torch.isinf(result.errors[-1]).all() and torch.isfinite(result.errors[:-1]).all()


def test_a_function_that_raises_is_reported_per_batch_and_the_run_goes_on():
    def no_windows(*args, sliding_window=None, **kwargs):
        if sliding_window is not None:
            raise NotImplementedError("no sliding windows yet")
        return paged_attention_ref(*args, **kwargs)

    report = check_kernel(no_windows)
    failed = {r.name for r in report.failed}
    assert failed == {b.name for b in PACKAGED_BATCHES if b.sliding_window}
    assert all("NotImplementedError: no sliding windows yet" in r.exception for r in report.failed)
    assert "no sliding windows yet" in str(report)


def test_stop_at_first_failure_ends_the_run_there():
    report = check_kernel(M.mutant_attention("fp8_scale_direction"), stop_at_first_failure=True)
    assert [r.passed for r in report.results][-1] is False and len(report.failed) == 1
    assert report.results[-1].name == "FP8 cache"


def test_report_rows_hold_what_the_table_shows():
    report = check_kernel(M.mutant_attention("tile_to_block"), [BY_NAME["tile spans 4 blocks"]], seed=3)
    (row,) = report.rows()
    assert row["batch"] == "tile spans 4 blocks" and row["passed"] is False and row["seed"] == 3
    assert row["worst sequence"] in (0, 1) and row["relative error"] > 1e-2


def test_check_kernel_refuses_what_is_not_a_function():
    with pytest.raises(KernelInputError, match="fn must be a function"):
        check_kernel("paged_attention")


def test_mutants_change_one_line_and_leave_the_real_kernel_alone():
    real = paged_attention(*make_batch([30], [30], head_size=32, seed=1).args())
    for mutant in M.MUTANTS.values():
        source = mutant.source()
        assert source.count(mutant.mutated) >= 1 and mutant.original not in source
    M.load_mutant("no_rescale")
    assert torch.equal(paged_attention(*make_batch([30], [30], head_size=32, seed=1).args()), real)
    with pytest.raises(UnknownNameError):
        M.get_mutant("no_such_bug")
    with pytest.raises(KernelInputError, match="not the attention kernel"):
        M.mutant_attention("cache_write_offset")


def test_the_cache_write_mutant_writes_the_wrong_slot():
    from kvlab.kernels import default_device

    write = M.load_mutant("cache_write_offset").reshape_and_cache_triton
    device = default_device()
    key = torch.randn(5, 2, 32, device=device)
    cache = [torch.zeros(4, 8, 2, 32, device=device) for _ in range(2)]
    write(key, key, *cache, torch.tensor([0, 9, 10, 17, 31], device=device))
    assert not torch.equal(cache[0][1, 1], key[1])                          # slot 9 is block 1, offset 1


def test_using_kernels_swaps_for_the_block_only(tmp_path):
    import kvlab.kernels as K

    original = K.paged_attention
    with M.using_kernels(paged_attention=paged_attention_ref):
        assert K.paged_attention is paged_attention_ref
    assert K.paged_attention is original
    with pytest.raises(RuntimeError), M.using_kernels(paged_attention=paged_attention_ref):
        raise RuntimeError("the block fails")
    assert K.paged_attention is original


def test_a_learners_kernel_file_loads_beside_the_real_one(tmp_path):
    mine = tmp_path / "my_attention.py"
    mine.write_text(M.get_mutant("causal_off_by_one").source())
    module = M.load_kernel_file(mine)
    assert not check_kernel(module.paged_attention_triton, [BY_NAME["prefill"]]).passed
    with pytest.raises(KernelInputError, match="no such file"):
        M.load_kernel_file(tmp_path / "missing.py")
