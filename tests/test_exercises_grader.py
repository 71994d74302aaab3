"""The grader cannot be fooled: each reproducer of issue 14's "The grader" section, as a test.

* an object whose ``__eq__`` always says yes (or raises) fails every exercise, with its reason;
* ``np.array(correct)`` passes (numpy values are compared as the Python values they hold);
* ``while True: pass`` is stopped by the per-case time limit, in the main thread and in another;
* patching kvlab's module data cannot move the expected values, and the message says what changed.

And issue 28's (items 15-17): a result too large to compare is refused by its size; a bare ``except:``
cannot outlast the time limit; what a notebook replaces in kvlab (the judge, ``difference``, the
function a reference calls, a method, the case list) cannot pass a wrong answer and is named; the
grader's frames hold no reference; what the learner's function prints is shown; the checking process
ends with its kernel.
"""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvlab.capacity.sizing as sizing
import kvlab.exercises as ex
from kvlab.exercises.canonical import NotComparable, canonical, difference, short_repr
from kvlab.exercises.core import Case, Exercise
from kvlab.exercises.grading import judge
from kvlab.exercises.limits import Outcome, call_with_time_limit

IDS = ex.list_exercises()
PLAIN = [i for i in IDS if ex.get_exercise(i).prepare is None]  # the learner's function returns the answer itself


class AlwaysEqual:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


class EqualRaises:
    def __eq__(self, other):
        raise RuntimeError("no comparing me")

    __hash__ = object.__hash__


class SneakyInt(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize("exercise_id", IDS)
def test_an_object_that_equals_everything_fails_every_exercise(exercise_id):
    result = ex.check(exercise_id, lambda *a, **k: AlwaysEqual(), seed=5)
    assert result.status == "fail", result.message
    if exercise_id in PLAIN:
        assert "AlwaysEqual" in result.message and "not a plain Python value" in result.message


@pytest.mark.parametrize("exercise_id", PLAIN)
def test_an_object_whose_eq_raises_is_a_failed_case_not_a_crash(exercise_id):
    result = ex.check(exercise_id, lambda *a, **k: EqualRaises(), seed=5)
    assert result.status == "fail" and "EqualRaises" in result.message


def test_a_subclass_of_int_is_refused_even_when_its_value_is_right():
    reference = ex.solution("02.max_model_len_for")
    result = ex.check("02.max_model_len_for", lambda *a: SneakyInt(reference(*a)), seed=1)
    assert result.status == "fail" and "SneakyInt" in result.message


def _as_numpy(reference):
    def learner(*args, **kwargs):
        return np.array(reference(*args, **kwargs))
    return learner


RAGGED = ("03.cow_append", "11.rank_kv_cache")  # answers whose parts have different shapes: no numpy array holds them


@pytest.mark.parametrize("exercise_id", [i for i in PLAIN if i not in RAGGED])
def test_numpy_arrays_and_scalars_of_the_right_values_pass(exercise_id):
    result = ex.check(exercise_id, _as_numpy(ex.solution(exercise_id)), seed=3)
    assert result.passed, result.message


@pytest.mark.parametrize("exercise_id", RAGGED)
def test_a_ragged_numpy_answer_is_refused_with_numpys_own_reason(exercise_id):
    # (table, copies) and (shape, nbytes) have parts of different shapes: numpy itself refuses to build the array.
    result = ex.check(exercise_id, _as_numpy(ex.solution(exercise_id)), seed=3)
    assert result.status == "fail" and "ValueError" in result.message and "inhomogeneous" in result.message


def test_numpy_scalars_become_python_values_but_a_float_is_not_an_int():
    assert type(canonical(np.int64(7))) is int and type(canonical(np.bool_(True))) is bool
    assert canonical(np.array([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert difference(7, canonical(np.float64(7.0))) == "the result is a float (7.0), expected an int; return int(...)"
    assert difference(7, True).startswith("the result is a bool")
    assert difference([1, (2, 3)], ((1, [2, 3]))) is None            # lists and tuples are both sequences
    assert difference({"a": [1, 2]}, {"a": [1, 3]}) == "the result['a'][1] is 3, expected 2"
    assert difference(0.1 + 0.2, 0.3) is None and difference(float("nan"), float("nan")) is None


def test_a_float_must_agree_to_one_part_in_a_billion_not_roughly():
    # the documented tolerance: rounding noise passes, an answer a little off (0.1 %, 10 ppm) does not
    assert difference(147.2, 147.2 * (1 + 1e-10)) is None and difference(1.0, 1.0 + 1e-13) is None
    assert difference(147.2, 147.2 * 1.001) is not None and difference(147.2, 147.2 * (1 + 1e-5)) is not None
    assert difference([2.0, 3.0], [2.0, 3.003]) == "the result[1] is 3.003, expected 3.0"


def test_what_the_grader_cannot_compare_is_named():
    with pytest.raises(NotComparable, match="generator"):
        canonical(x for x in [1])
    loop: list = []
    loop.append(loop)
    with pytest.raises(NotComparable, match="contains itself"):
        canonical(loop)
    with pytest.raises(NotComparable, match=r"the result\[1\] is a AlwaysEqual"):
        canonical([1, AlwaysEqual()])


def test_hashes_are_shown_as_short_hex():
    digest = bytes(range(32))
    assert short_repr([digest]) == "[<hash 00010203…>]" and short_repr(b"seed") == "b'seed'"
    from kvlab.exercises.grading import grade

    digests = Exercise("99.h", "hashes", "t", "def hashes(n: int) -> list:", lambda n: [bytes(range(32))] * n,
                       [Case((2,), probes="two")], ["h"], num_random=0)
    result = grade(digests, list(digests.edge_cases), 0, 1.0, lambda n, c: Outcome(value=[b"\x00" * 32]),
                   lambda c: digests.reference(*c.args), list)
    assert "<hash " in result.message and "\\x" not in result.message.split("got:")[1]


def test_a_comparison_that_raises_is_a_failed_case_with_its_reason():
    def fussy(expected, actual):
        raise ZeroDivisionError("compare broke")

    exercise = Exercise("99.x", "t", "t", "def f():", lambda: 1, [Case()], ["h"], compare=fussy)
    verdict = judge(exercise, Case(), 1, Outcome(value=1), 1.0)
    assert verdict.got is not None and "ZeroDivisionError: compare broke" in verdict.where


def _endless(*args, **kwargs):
    while True:
        pass


def _endless_and_stubborn(*args, **kwargs):
    while True:
        try:
            while True:
                pass
        except Exception:  # a learner's catch-all does not swallow the time limit
            pass


@pytest.mark.parametrize("learner", [_endless, _endless_and_stubborn])
def test_an_endless_loop_is_stopped_and_the_case_named(learner):
    result = ex.check("02.max_model_len_for", learner, seed=1, time_limit=0.3)
    assert result.status == "fail" and result.cases_run == 1
    assert "failed on case 1 of" in result.message and "no answer within 0.3 s" in result.message
    # the timer is disarmed afterwards: the next check runs normally
    assert ex.check("02.max_model_len_for", ex.solution("02.max_model_len_for"), seed=1).passed


def test_the_time_limit_holds_off_the_main_thread_too():
    box = {}
    worker = threading.Thread(target=lambda: box.update(r=ex.check("02.max_model_len_for", _endless, time_limit=0.3)))
    worker.start()
    worker.join(30)
    assert not worker.is_alive() and "no answer within 0.3 s" in box["r"].message


def test_a_call_within_its_time_returns_its_value_and_its_errors():
    assert call_with_time_limit(lambda x: x + 1, (1,), seconds=5).value == 2
    assert isinstance(call_with_time_limit(lambda: 1 / 0, seconds=5).error, ZeroDivisionError)
    assert call_with_time_limit(_endless, seconds=0.2).timed_out


def _bytes_with_the_table(config, kv_dtype, tp):
    """A correct solution that reads KV_DTYPE_BYTES when it runs."""
    ref = ex.solution("01.tp_group_bytes")
    return int(ref(config, "fp32", tp) // 4 * sizing.KV_DTYPE_BYTES[kv_dtype])


@pytest.fixture
def restore():
    yield
    ex.restore_kvlab_state()


def test_patching_kvlab_does_not_move_the_expected_values_and_is_reported(restore):
    expected = ex.check("01.tp_group_bytes", lambda *a: -1, seed=1).expected
    sizing.KV_DTYPE_BYTES["bf16"] = 1                   # what a learner might try in a cell
    result = ex.check("01.tp_group_bytes", _bytes_with_the_table, seed=1)
    assert result.status == "fail" and result.expected == expected
    assert "KV_DTYPE_BYTES['bf16'] is 1, kvlab's own value is Fraction(2, 1)" in result.message
    assert "restore_kvlab_state()" in result.message
    assert sizing.KV_DTYPE_BYTES["bf16"] == 1           # the notebook's change is left as the notebook made it
    assert ex.restore_kvlab_state() and sizing.KV_DTYPE_BYTES["bf16"] == 2
    assert ex.check("01.tp_group_bytes", _bytes_with_the_table, seed=1).passed


def test_a_half_answer_cannot_pass_by_halving_kvlab(restore):
    def halves(config, kv_dtype, tp):
        sizing.KV_DTYPE_BYTES.update({k: v / 2 for k, v in sizing.KV_DTYPE_BYTES.items()})
        return ex.solution("01.tp_group_bytes")(config, kv_dtype, tp) // 2

    result = ex.check("01.tp_group_bytes", halves, seed=1)
    assert result.status == "fail" and "changed kvlab's state while check() ran" in result.message


def test_rebinding_a_module_constant_is_seen_too(restore):
    sizing.KV_DTYPE_BYTES = {**sizing.KV_DTYPE_BYTES, "bf16": 3}
    result = ex.check("01.tp_group_bytes", ex.solution("01.tp_group_bytes"), seed=1)
    assert result.expected == 327680 and "KV_DTYPE_BYTES['bf16'] is 3" in result.message


# --------------------------------------------------------------------------- issue 28, items 15-17


def _within(seconds, fn):
    """fn() run in a thread, or None if it is still running after ``seconds`` (the old grader hung)."""
    box = {}
    worker = threading.Thread(target=lambda: box.update(r=fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    return box.get("r")


def _aliased_rows(config, kv_dtype, tp):
    return [[0] * 20000] * 20000        # one row, 20,000 times: built in a millisecond, 400 M values to compare


def test_a_huge_result_is_refused_by_its_size_not_compared_for_minutes():
    result = _within(30, lambda: ex.check("01.tp_group_bytes", _aliased_rows, seed=1))
    assert result is not None, "still comparing after 30 s"
    assert result.status == "fail" and "holds more than 100,000 values" in result.message
    assert "[row] * n" in result.message


def test_every_expected_value_is_far_inside_the_size_bound(monkeypatch):
    import kvlab.exercises.canonical as canonical_module
    from kvlab.exercises.grading import cases_for, copies

    monkeypatch.setattr(canonical_module, "MAX_VALUES", canonical_module.MAX_VALUES // 20)
    for exercise_id in PLAIN:
        exercise = ex.get_exercise(exercise_id)
        for case in cases_for(exercise, seed=0):
            args, kwargs = copies(case)
            canonical(exercise.reference(*args, **kwargs))   # raises past a twentieth of the bound


_CATCHES_EVERYTHING = """
import kvlab.exercises as ex

def catches_everything(*args, **kwargs):
    while True:
        try:
            while True:
                pass
        except:  # a retry loop that swallows even the time limit's exception
            pass

result = ex.check("02.max_model_len_for", catches_everything, seed=1, time_limit=0.5)
print(result.status, result.cases_run)
print(result.message)
"""


def test_a_bare_except_in_a_retry_loop_cannot_outlast_the_time_limit():
    # In a process of its own, as a notebook runs it (main thread): the old grader never returned there.
    done = subprocess.run([sys.executable, "-c", _CATCHES_EVERYTHING], capture_output=True, text=True, timeout=120)
    status, message = done.stdout.split("\n", 1)
    assert status == "fail 1" and "no answer within 0.5 s" in message, done.stdout + done.stderr


def _zero(config, kv_dtype, tp):
    return 0


def _asks_the_grader(config, kv_dtype, tp):
    """Looks up the call stack for the grader's reference or expected value, as a curious learner might."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if "expected" in frame.f_locals and type(frame.f_locals["expected"]) is int:
            return frame.f_locals["expected"]
        if callable(frame.f_locals.get("reference")):
            return frame.f_locals["reference"](config, kv_dtype, tp)
        frame = frame.f_back
    return 0


def _always_agree(*args, **kwargs):
    from kvlab.exercises.grading import _Verdict

    return _Verdict()


@pytest.mark.parametrize("patch", ["judge", "difference", "kv_bytes_per_token", "kv_factor"])
def test_what_a_notebook_replaces_in_kvlab_cannot_pass_a_wrong_answer_and_is_named(patch, monkeypatch):
    import kvlab.exercises.core as core
    import kvlab.exercises.grading as grading
    import kvlab.exercises.nb01 as nb01
    from kvlab.capacity.models import ModelSpec

    target, name, value = {
        "judge": (core, "judge", _always_agree),
        "difference": (grading, "difference", lambda expected, actual, path="the result": None),
        "kv_bytes_per_token": (nb01, "kv_bytes_per_token", lambda spec, kv_dtype="bf16", tp=1: 0),
        "kv_factor": (ModelSpec, "kv_factor", property(lambda self: 0)),
    }[patch]
    monkeypatch.setattr(target, name, value)
    result = ex.check("01.tp_group_bytes", _zero, seed=1)
    assert result.status == "fail" and result.expected == 327680, result.message
    assert "this notebook changed kvlab's code" in result.message and name in result.message.split("note:")[-1]
    assert "did not reach the verdict" in result.message


def test_the_grader_s_frames_hold_no_reference_for_the_learner_to_read():
    result = ex.check("01.tp_group_bytes", _asks_the_grader, seed=1)
    assert result.status == "fail" and "got:      0" in result.message


def test_clearing_the_case_list_does_not_shrink_the_check():
    exercise = ex.get_exercise("01.tp_group_bytes")
    saved = list(exercise.edge_cases)
    exercise.edge_cases.clear()
    object.__setattr__(exercise, "num_random", 0)
    try:
        result = ex.check("01.tp_group_bytes", _zero, seed=1)
        assert result.status == "fail" and "failed on case 1 of 32" in result.message
        assert "passed all 32 cases (7 edge, 25 random)" in ex.check(
            "01.tp_group_bytes", ex.solution("01.tp_group_bytes"), seed=1).message
    finally:
        exercise.edge_cases[:] = saved
        object.__setattr__(exercise, "num_random", 25)


def test_what_the_learner_s_function_prints_is_shown_in_the_notebook(capsys):
    def chatty(config, kv_dtype, tp):
        print("layers:", config["num_hidden_layers"])
        return 0

    ex.check("01.tp_group_bytes", chatty, seed=1)
    assert "layers: 80" in capsys.readouterr().out


def test_a_notebook_function_that_uses_a_notebook_helper_is_sent_with_it():
    factor = 2

    def helper(config):
        return config.get("num_key_value_heads") or config["num_attention_heads"]

    def per_token(config, kv_dtype, tp):
        return ex.solution("01.tp_group_bytes")(config, kv_dtype, tp) * helper(config) // helper(config) * factor // 2

    assert ex.check("01.tp_group_bytes", per_token, seed=1).passed


def test_a_function_that_cannot_be_sent_is_checked_here_and_says_so():
    import socket

    with socket.socket() as sock:
        def holds_a_socket(config, kv_dtype, tp):
            return sock.fileno() * 0 + ex.solution("01.tp_group_bytes")(config, kv_dtype, tp)

        result = ex.check("01.tp_group_bytes", holds_a_socket, seed=1)
    assert result.passed and "checked in this kernel, not in a fresh process" in result.message


_ONE_CHECK_AND_EXIT = """
import kvlab.exercises as ex
from kvlab.exercises.isolated import CHECKER

assert ex.check("01.tp_group_bytes", lambda config, kv_dtype, tp: 0, seed=1).status == "fail"
print(CHECKER._process.pid)
"""


def test_the_checking_process_ends_with_the_kernel():
    done = subprocess.run([sys.executable, "-c", _ONE_CHECK_AND_EXIT], capture_output=True, text=True, timeout=120)
    pid = int(done.stdout.split()[-1])
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the checker {pid} outlived its kernel")
