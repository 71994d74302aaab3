"""The exercise harness: tasks, hints, reference solutions, the grader and self-test questions.

A learner writes a function in a notebook cell and calls ``check(exercise_id, fn)``. The
grader runs fixed edge cases, then fresh random cases, against the reference solution kept
here; it stops at the first disagreement and says, in words, what the failing case probes.
A stub that still raises ``NotImplementedError`` is "not attempted yet", so an untouched
notebook runs cleanly under nbval.

What the grader cannot be fooled by: each result is compared in its canonical form (exact
built-in types, numpy and torch values as Python values; ``canonical.py``), so an object
whose ``__eq__`` always says yes, or raises, is a failed case with its reason; each call of
the learner's function has a time limit (``limits.py``); and the reference runs on kvlab's
own module data, whatever the notebook changed (``state.py``), which the message reports.
"""

from __future__ import annotations

import dataclasses
import html
import inspect
import random
import textwrap
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from kvlab._validate import positive_number
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.exercises.canonical import type_name
from kvlab.exercises.grading import CheckResult, copies, failure_lines, judge, state_note
from kvlab.exercises.limits import call_with_time_limit
from kvlab.exercises.state import STATE

DEFAULT_TIME_LIMIT_S = 10.0  # per call of the learner's function; generous for a laptop
PREPARED_TIME_LIMIT_S = 60.0  # where `prepare` runs the learner's code in a kernel: its first call compiles it


@dataclasses.dataclass(frozen=True)
class Case:
    """One input to an exercise, with the idea it probes in words a learner can act on."""

    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    probes: str = ""


@dataclasses.dataclass(frozen=True)
class Exercise:
    """A task with its signature, hints, reference solution and cases.

    ``random_case(rng)`` draws a fresh case; ``compare(expected, actual)`` decides agreement
    on canonical values (default: exact types, ``canonical.difference``); ``explain(case,
    expected, actual)`` may return a sharper diagnosis than "the results differ" for a known
    mistake. ``prepare(fn)``, if set, turns the learner's function and the reference into what
    the cases call (notebook 05: a Triton kernel launch that calls the learner's
    ``@triton.jit`` helper). A ``transfer`` exercise asks for the idea on a case the notebook
    did not work through (another model, layout or failure). ``time_limit_s`` bounds each call
    of the learner's function.
    """

    id: str
    title: str
    task: str
    signature: str
    reference: Callable[..., Any]
    edge_cases: Sequence[Case]
    hints: Sequence[str]
    random_case: Callable[[random.Random], Case] | None = None
    num_random: int = 25
    compare: Callable[[Any, Any], bool] | None = None
    explain: Callable[[Case, Any, Any], str | None] | None = None
    prepare: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    transfer: bool = False
    time_limit_s: float | None = None  # None: DEFAULT_TIME_LIMIT_S, or PREPARED_TIME_LIMIT_S with `prepare`

    @property
    def function_name(self) -> str:
        """The name the notebook's stub defines (taken from ``signature``)."""
        return self.signature.split("def ", 1)[1].split("(", 1)[0].strip()

    @property
    def notebook(self) -> str:
        """The notebook number this exercise belongs to ("03" for "03.cow_append")."""
        return self.id.split(".", 1)[0]


@dataclasses.dataclass(frozen=True)
class Question:
    """A self-test question whose answer is written from the numbers kvlab computes (``values``)."""

    id: str
    text: str
    values: Callable[[], Mapping[str, Any]]
    write: Callable[[Any], str]
    transfer: bool = False

    def answer(self) -> str:
        """The answer as text, from one computation of the values."""
        return self.write(self.values())


_EXERCISES: dict[str, Exercise] = {}
_QUESTIONS: dict[str, Question] = {}
EXERCISES: Mapping[str, Exercise] = MappingProxyType(_EXERCISES)  # read-only: a notebook cannot swap a checker
QUESTIONS: Mapping[str, Question] = MappingProxyType(_QUESTIONS)


def register(exercise: Exercise) -> Exercise:
    """Add an exercise to the catalogue (done once, at import of its ``nbXX`` module)."""
    if exercise.id in _EXERCISES:
        raise KvlabValueError(f"exercise id {exercise.id!r} is registered twice")
    _EXERCISES[exercise.id] = exercise
    return exercise


def register_question(question: Question) -> Question:
    """Add a self-test question to the catalogue."""
    if question.id in _QUESTIONS:
        raise KvlabValueError(f"question id {question.id!r} is registered twice")
    _QUESTIONS[question.id] = question
    return question


def ask(question_id: str, text: str, values: Callable[[], Any], answer: Callable[[Any], str], *,
        transfer: bool = False) -> Question:
    """Register a self-test question whose answer ``answer(v)`` is written from ``v = values()``."""
    return register_question(Question(question_id, text, values, answer, transfer))


def get_exercise(exercise_id: str) -> Exercise:
    """The exercise called ``exercise_id``; an unknown id raises and lists the known ones."""
    if exercise_id not in _EXERCISES:
        raise UnknownNameError("exercise_id", exercise_id, _EXERCISES)
    return _EXERCISES[exercise_id]


def list_exercises(notebook: str | None = None) -> list[str]:
    """Exercise ids, optionally only those of one notebook ("01")."""
    return sorted(e for e in _EXERCISES if notebook is None or e.startswith(f"{notebook}."))


def check(exercise_id: str, learner_fn: Callable[..., Any], *, seed: int | None = None,
          time_limit: float | None = None) -> CheckResult:
    """Run ``learner_fn`` against the exercise's edge cases and fresh random cases.

    Stops at the first case where it disagrees with the reference (or raises, or runs longer
    than ``time_limit`` seconds, the exercise's own limit by default) and reports the inputs,
    expected and actual results, and the idea the case probes. ``seed`` fixes the random cases;
    by default each run draws new ones (the seed is reported, so a failure can be replayed).
    """
    exercise = get_exercise(exercise_id)
    if not callable(learner_fn):
        raise KvlabValueError(f"learner_fn must be a function, got {type_name(learner_fn)}")
    if time_limit is not None:
        limit = positive_number("time_limit", time_limit)
    else:
        limit = exercise.time_limit_s or (PREPARED_TIME_LIMIT_S if exercise.prepare else DEFAULT_TIME_LIMIT_S)
    seed = random.randrange(2**31) if seed is None else seed
    rng = random.Random(seed)
    cases = list(exercise.edge_cases) + [exercise.random_case(rng) for _ in range(exercise.num_random)
                                         if exercise.random_case is not None]
    prepare = exercise.prepare or (lambda fn: fn)
    reference, learner = prepare(exercise.reference), prepare(learner_fn)
    before = STATE.fingerprint()  # to tell the learner's changes from the notebook's
    for number, case in enumerate(cases, start=1):
        args, kwargs = copies(case)
        outcome = call_with_time_limit(learner, args, kwargs, limit)
        if number == 1 and isinstance(outcome.error, NotImplementedError):
            return CheckResult(exercise_id, "not attempted", 0,
                               f"… {exercise.id} ({exercise.title}): not attempted yet. Replace the "
                               f"`raise NotImplementedError` and run the cell again; hint(\"{exercise_id}\") gives "
                               "a first nudge.")
        ref_args, ref_kwargs = copies(case)
        with STATE.own_values():  # the reference reads kvlab's own values, never a patched one
            expected = reference(*ref_args, **ref_kwargs)
        verdict = judge(exercise, case, expected, outcome, limit)
        if verdict.got is not None:
            lines, actual = failure_lines(exercise, number, cases, seed, expected, verdict)
            note = state_note(STATE.changed_since(before))
            return CheckResult(exercise_id, "fail", number, "\n".join(lines + note), case, expected, actual, seed)
    note = state_note(STATE.changed_since(before))
    return CheckResult(exercise_id, "pass", len(cases), "\n".join([
        f"✓ {exercise.id} ({exercise.title}): passed all {len(cases)} cases ({len(exercise.edge_cases)} edge, "
        f"{len(cases) - len(exercise.edge_cases)} random).", *note]), seed=seed)


# --------------------------------------------------------------------------- hints and solutions


class Note(str):
    """Text that renders as Markdown in JupyterLab and as itself in plain text."""

    def _repr_markdown_(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return str(self)


_hints_shown: dict[str, int] = {}  # UI progress only: which hint each exercise reached


def hint(exercise_id: str, number: int | None = None) -> Note:
    """The next hint for an exercise (or hint ``number``, counting from 1)."""
    exercise = get_exercise(exercise_id)
    total = len(exercise.hints)
    if number is None:
        number = min(_hints_shown.get(exercise_id, 0) + 1, total)
    if not 1 <= number <= total:
        raise KvlabValueError(f"number must be between 1 and {total} for {exercise_id}, got {number}")
    _hints_shown[exercise_id] = max(number, _hints_shown.get(exercise_id, 0))
    more = " (that was the last one)" if number == total else f" ({total - number} more)"
    return Note(f"**Hint {number} of {total}** for `{exercise_id}`{more}: {exercise.hints[number - 1]}")


def solution(exercise_id: str) -> Callable[..., Any]:
    """The reference solution as a function (used to run notebooks with every exercise solved)."""
    return get_exercise(exercise_id).reference


def show_solution(exercise_id: str) -> Note:
    """The reference solution's source, for when you have tried and want to compare."""
    exercise = get_exercise(exercise_id)
    source = textwrap.dedent(inspect.getsource(exercise.reference))
    return Note(f"Reference solution for `{exercise_id}`:\n\n```python\n{source}```")


def describe(exercise_id: str) -> Note:
    """The task and signature of an exercise, as the notebook shows them."""
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
