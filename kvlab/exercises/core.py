"""The exercise harness: tasks, hints, reference solutions, the grader and self-test questions.

A learner writes a function in a notebook cell and calls ``check(exercise_id, fn)``. The
grader runs fixed edge cases, then fresh random cases, against the reference solution kept
here; it stops at the first disagreement and says, in words, what the failing case probes.
A stub that still raises ``NotImplementedError`` is "not attempted yet", so an untouched
notebook runs cleanly under nbval.

What the grader cannot be fooled by: each result is compared in its canonical form (exact
built-in types, numpy and torch values as Python values, at most ``canonical.MAX_VALUES`` of
them; ``canonical.py``), so an object whose ``__eq__`` always says yes, or raises, is a failed
case with its reason; the cases, expected values and verdict are computed in a fresh process
that the notebook's changes to kvlab cannot reach, and the learner's function runs in another,
killed at the time limit (``isolated.py``); the message names what the notebook changed in
kvlab (``state.py``). Where no such process can run, the check runs here (``limits.py``'s
time limit) and says so.
"""

from __future__ import annotations

import dis
import html
import inspect
import pickle
import random
import sys
import textwrap
import types
from collections.abc import Callable, Sequence
from typing import Any

from kvlab._validate import positive_number
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.exercises.canonical import type_name
from kvlab.exercises.catalogue import (
    EXERCISES,
    QUESTIONS,
    ask,
    get_exercise,
    list_exercises,
    register,
    register_question,
)
from kvlab.exercises.grading import cases_for, copies, grade, judge, limit_for, not_attempted, state_note
from kvlab.exercises.isolated import CHECKER, COMPARE_LIMIT_S, START_LIMIT_S, Unavailable
from kvlab.exercises.limits import Outcome, call_with_time_limit
from kvlab.exercises.records import (
    DEFAULT_TIME_LIMIT_S,
    PREPARED_TIME_LIMIT_S,
    Case,
    CheckResult,
    Exercise,
    Mistake,
    Question,
)
from kvlab.exercises.state import STATE, code_changes
from kvlab.exercises.transfer import NotSendable, dumps_function

__all__ = ["DEFAULT_TIME_LIMIT_S", "EXERCISES", "PREPARED_TIME_LIMIT_S", "QUESTIONS", "Case", "CheckResult",
           "Exercise", "Mistake", "Question", "ask", "check", "describe", "get_exercise", "hint", "judge",
           "list_exercises", "register", "register_question", "self_test", "show_solution", "solution"]


def check(exercise_id: str, learner_fn: Callable[..., Any], *, seed: int | None = None,
          time_limit: float | None = None) -> CheckResult:
    """Run ``learner_fn`` against the exercise's edge cases and fresh random cases.

    Stops at the first case where it disagrees with the reference (or raises, or runs longer
    than ``time_limit`` seconds, the exercise's own limit by default) and reports the inputs,
    expected and actual results, and the idea the case probes. ``seed`` fixes the random cases;
    by default each run draws new ones (the seed is reported, so a failure can be replayed).
    The check runs in a fresh process (``isolated``), where what this notebook changed in kvlab
    cannot reach the cases, the expected values or the verdict; the result names those changes.
    """
    exercise = get_exercise(exercise_id)
    if not callable(learner_fn):
        raise KvlabValueError(f"learner_fn must be a function, got {type_name(learner_fn)}")
    limit = positive_number("time_limit", time_limit) if time_limit is not None else None
    seed = random.randrange(2**31) if seed is None else seed
    if _only_raises_not_implemented(learner_fn):  # the stub as shipped: no process needed to see that
        return not_attempted(exercise)
    data_changes = STATE.live_changes()
    try:
        function, modules = dumps_function(learner_fn)
        changes = pickle.dumps(data_changes, protocol=pickle.HIGHEST_PROTOCOL)
        request = {"exercise_id": exercise_id, "function": function, "modules": modules, "changes": changes,
                   "seed": seed, "time_limit": limit, "path": [p for p in sys.path if type(p) is str]}
        cases = len(exercise.edge_cases) + exercise.num_random
        backstop = START_LIMIT_S + max(cases, 64) * (limit_for(exercise, limit) + COMPARE_LIMIT_S)
        result, printed = CHECKER.check(request, backstop)
    except (NotSendable, Unavailable, pickle.PicklingError) as why:
        return _check_here(exercise, learner_fn, seed, limit, str(why))
    if printed:
        sys.stdout.write(printed)
    changed = code_changes(CHECKER.own_code)
    notes = state_note([]) + _code_note(changed)
    if notes:
        result.message = "\n".join([result.message, *notes])
    return result


_STUB_OPS = {"RESUME", "NOP", "CACHE", "PUSH_NULL", "LOAD_GLOBAL", "LOAD_CONST", "PRECALL", "CALL", "RAISE_VARARGS"}


def _only_raises_not_implemented(fn: Any) -> bool:
    """True for a function whose whole body is ``raise NotImplementedError(...)`` (a ``@triton.jit`` one too)."""
    code = getattr(getattr(fn, "fn", fn), "__code__", None)
    if not isinstance(code, types.CodeType) or code.co_names != ("NotImplementedError",):
        return False
    return all(op.opname in _STUB_OPS for op in dis.get_instructions(code))


def _code_note(changed: list[str]) -> list[str]:
    """Lines naming kvlab's functions and classes this notebook replaced, which the check did not use."""
    if not changed:
        return []
    shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
    return ["  note:     this notebook changed kvlab's code: " + shown + ".",
            "            Checked in a fresh process with kvlab as installed, so these changes did not reach the "
            "verdict (nor your function). Restart the kernel to undo them here."]


def _check_here(exercise: Exercise, learner_fn: Callable[..., Any], seed: int, time_limit: float | None,
                why: str) -> CheckResult:
    """The check in this kernel, where no fresh process can run it; the result says why and what that means."""
    limit = limit_for(exercise, time_limit)
    prepare = exercise.prepare or (lambda fn: fn)
    reference, learner = prepare(exercise.reference), prepare(learner_fn)
    before = STATE.fingerprint()  # to tell the learner's changes from the notebook's

    def run_case(number: int, case: Case) -> Outcome:
        args, kwargs = copies(case)
        return call_with_time_limit(learner, args, kwargs, limit)

    def expected_for(case: Case) -> Any:
        args, kwargs = copies(case)
        with STATE.own_values():  # the reference reads kvlab's own values, never a patched one
            return reference(*args, **kwargs)

    def notes() -> list[str]:
        return state_note(STATE.changed_since(before)) + [
            f"  note:     checked in this kernel, not in a fresh process ({why}): changes this notebook made to "
            "kvlab's code can reach the verdict."]

    return grade(exercise, cases_for(exercise, seed), seed, limit, run_case, expected_for, notes)


# --------------------------------------------------------------------------- hints and solutions


class Note(str):
    """Text that renders as Markdown in JupyterLab and as itself in plain text."""

    def _repr_markdown_(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return str(self)


_hints_shown: dict[str, int] = {}  # UI progress only: which hint each exercise reached


def _hints(exercise_id: str) -> Sequence[str]:
    """The hints of an exercise or of a prediction."""
    from kvlab.exercises.predictions import PREDICTIONS

    return PREDICTIONS[exercise_id].hints if exercise_id in PREDICTIONS else get_exercise(exercise_id).hints


def hint(exercise_id: str, number: int | None = None) -> Note:
    """The next hint for an exercise or a prediction (or hint ``number``, counting from 1)."""
    hints = _hints(exercise_id)
    total = len(hints)
    if number is None:
        number = min(_hints_shown.get(exercise_id, 0) + 1, total)
    if not 1 <= number <= total:
        raise KvlabValueError(f"number must be between 1 and {total} for {exercise_id}, got {number}")
    _hints_shown[exercise_id] = max(number, _hints_shown.get(exercise_id, 0))
    more = " (that was the last one)" if number == total else f" ({total - number} more)"
    return Note(f"**Hint {number} of {total}** for `{exercise_id}`{more}: {hints[number - 1]}")


def solution(exercise_id: str) -> Callable[..., Any]:
    """The reference solution as a function (used to run notebooks with every exercise solved)."""
    return get_exercise(exercise_id).reference


def show_solution(exercise_id: str) -> Note:
    """The reference solution's source, for when you have tried and want to compare: the algorithm in plain
    lines (``Exercise.shown``) where the reference itself calls into kvlab."""
    exercise = get_exercise(exercise_id)
    source = textwrap.dedent(inspect.getsource(exercise.shown or exercise.reference))
    return Note(f"Reference solution for `{exercise_id}`:\n\n```python\n{source}```")


def describe(exercise_id: str) -> Note:
    """The task and signature of an exercise (the question and the form of a prediction), as the notebook shows them."""
    from kvlab.exercises.predictions import PREDICTIONS

    if exercise_id in PREDICTIONS:
        p = PREDICTIONS[exercise_id]
        return Note(f"**{p.id} (predict, then run): {p.title}**\n\n{p.question}\n\nThe form of an answer: `{p.form}`")
    exercise = get_exercise(exercise_id)
    return Note(
        f"**{exercise.id}: {exercise.title}**\n\n{exercise.task}\n\n```python\n{exercise.signature}\n```"
    )


# --------------------------------------------------------------------------- self-test


class SelfTest:
    """A notebook's self-test: questions with answers computed by kvlab, revealed on click."""

    def __init__(self, notebook: str) -> None:
        self.notebook = notebook
        self.questions = [q for qid, q in sorted(QUESTIONS.items()) if qid.startswith(f"{notebook}.")]
        if not self.questions:
            raise UnknownNameError("notebook", notebook, sorted({q.split(".")[0] for q in QUESTIONS}))

    def __getitem__(self, question_id: str) -> Question:
        for q in self.questions:
            if q.id == question_id:
                return q
        raise UnknownNameError("question_id", question_id, [q.id for q in self.questions])

    def answers(self) -> dict[str, str]:
        """Every answer as text (what the buttons reveal)."""
        return {q.id: q.answer() for q in self.questions}

    def __repr__(self) -> str:
        lines = [f"Self-test for notebook {self.notebook} (answers: .answers()):"]
        lines += [f"  {i}. {q.text}" for i, q in enumerate(self.questions, 1)]
        return "\n".join(lines)

    def widget(self) -> Any:
        """An ipywidgets view: each question with a button that reveals its computed answer."""
        import ipywidgets as w

        from kvlab.viz.widgets import guarded

        rows = []
        for i, q in enumerate(self.questions, 1):
            out = w.Output()
            button = w.Button(description="Show answer", layout=w.Layout(width="130px"))

            def reveal(_: Any, q: Question = q, out: w.Output = out, button: w.Button = button) -> None:
                with out:
                    out.clear_output()
                    from IPython.display import Markdown, display

                    display(Markdown(q.answer()))
                button.disabled = True

            button.on_click(guarded(reveal, out))
            rows.append(w.VBox([w.HTML(f"<b>{i}.</b> {html.escape(q.text)}"), button, out]))
        return w.VBox(rows)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())


def self_test(notebook: str) -> SelfTest:
    """The self-test of notebook ``notebook`` ("01"), ready to display."""
    return SelfTest(notebook)
