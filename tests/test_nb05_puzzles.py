"""Notebook 05's puzzles beyond their checks: the per-program view they show, and puzzle 6 on check_kernel's bench."""

import kvlab.kernels as K
import pytest

pytestmark = pytest.mark.skipif(K.backend() != K.TRITON_INTERPRETER, reason="the puzzles' view runs the interpreter")


def test_the_view_of_a_stub_is_a_correct_kernels_and_says_so():
    from kvlab.exercises import nb05_puzzles as puzzles

    def through_table(*args):
        raise NotImplementedError("your code here")

    view = puzzles.show_programs("05.through_table", through_table)
    assert "a correct kernel (yours is still the stub)" in repr(view)
    table = view.launch.tensors["block_table_ptr"].tolist()
    for seq, head, _ in view.trace.busy():                       # each program reads its own row, in table order
        blocks = [block for block, *_ in view.trace.touched((seq, head), "load", "key_cache_ptr")]
        assert set(blocks) == set(table[seq][:len(set(blocks))])
        assert view.trace.summary((seq, head), "load", "block_table_ptr", 0, 1).startswith(f"axis 0 {seq} ")


def test_puzzle_six_runs_on_check_kernels_batches_and_a_wrong_kernel_is_caught_there():
    from wrong_solutions.nb05 import interleaved_heads

    from kvlab.exercises import nb05_puzzles as puzzles

    report = puzzles.kernel_bench(puzzles.gqa, ["GQA group 3"])
    assert report.passed and [r.name for r in report.results] == ["GQA group 3"]
    wrong = puzzles.kernel_bench(interleaved_heads, ["GQA group 3"])
    assert [r.name for r in wrong.failed] == ["GQA group 3"]
    assert "still the stub" in str(puzzles.kernel_bench(None))
