"""The exercise harness: tasks, hints, reference solutions, checkers and self-test questions.

A learner writes a function in a notebook cell and calls ``check(exercise_id, fn)``.
The checker runs fixed edge cases, then fresh random cases, against the reference
solution kept here; it stops at the first disagreement and says, in words, what
the failing case probes. A stub that still raises ``NotImplementedError`` is
"not attempted yet", so an untouched notebook runs cleanly under nbval.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import html
import inspect
import random
import reprlib
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from kvlab.errors import KvlabValueError, UnknownNameError

Status = Literal["pass", "fail", "not attempted"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One input to an exercise, with the idea it probes in words a learner can act on."""

    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    probes: str = ""


@dataclasses.dataclass(frozen=True)
class Exercise:
    """A task with its signature, hints, reference solution and cases.

    ``random_case(rng)`` draws a fresh case; ``compare(expected, actual)`` decides
    agreement (default ``==``); ``explain(case, expected, actual)`` may return a
    sharper diagnosis than "the results differ" for a known mistake. ``prepare(fn)``,
    if set, turns the learner's function and the reference into what the cases call
    (notebook 05: a Triton kernel launch that calls the learner's ``@triton.jit`` helper).
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
    """A self-test question whose answer kvlab computes (``values`` holds the numbers)."""

    id: str
    text: str
    answer: Callable[[], str]
    values: Callable[[], Mapping[str, Any]] = lambda: {}


EXERCISES: dict[str, Exercise] = {}
QUESTIONS: dict[str, Question] = {}


def register(exercise: Exercise) -> Exercise:
    """Add an exercise to the catalogue (done once, at import of its ``nbXX`` module)."""
    if exercise.id in EXERCISES:
        raise KvlabValueError(f"exercise id {exercise.id!r} is registered twice")
    EXERCISES[exercise.id] = exercise
    return exercise


def register_question(question: Question) -> Question:
    """Add a self-test question to the catalogue."""
    if question.id in QUESTIONS:
        raise KvlabValueError(f"question id {question.id!r} is registered twice")
    QUESTIONS[question.id] = question
    return question


def get_exercise(exercise_id: str) -> Exercise:
    """The exercise called ``exercise_id``; an unknown id raises and lists the known ones."""
    if exercise_id not in EXERCISES:
        raise UnknownNameError("exercise_id", exercise_id, EXERCISES)
    return EXERCISES[exercise_id]


def list_exercises(notebook: str | None = None) -> list[str]:
    """Exercise ids, optionally only those of one notebook ("01")."""
    return sorted(e for e in EXERCISES if notebook is None or e.startswith(f"{notebook}."))


# --------------------------------------------------------------------------- results

_short = reprlib.Repr()
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 12
_short.maxstring = _short.maxother = 160
_short.maxlevel = 4


def short_repr(value: Any) -> str:
    """A repr small enough to read in a failure message."""
    return _short.repr(value)


@dataclasses.dataclass
class CheckResult:
    """What ``check`` found. Shows as a coloured box in JupyterLab and as text elsewhere."""

    exercise_id: str
    status: Status
    cases_run: int
    message: str
    case: Case | None = None
    expected: Any = None
    actual: Any = None
    seed: int | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return self.message

    def _repr_html_(self) -> str:
        colour = {"pass": "#1b7f3b", "fail": "#b42318", "not attempted": "#6b7280"}[self.status]
        body = html.escape(self.message)
        return (
            f'<div class="kvlab-check kvlab-check-{self.status.replace(" ", "-")}" '
            f'style="border-left:4px solid {colour};padding:4px 10px;margin:4px 0;'
            f'font-family:var(--jp-code-font-family,monospace);white-space:pre-wrap">{body}</div>'
        )


def _call(fn: Callable[..., Any], case: Case) -> Any:
    """Call ``fn`` on a deep copy of the case, so no call can change the case for the next."""
    return fn(*copy.deepcopy(case.args), **copy.deepcopy(dict(case.kwargs)))


def _format_inputs(case: Case, signature: str) -> str:
    # Parsed, not split on commas: a hint such as dict[str, list[int]] holds commas of its own.
    args = ast.parse(signature.strip() + "\n    pass").body[0].args  # type: ignore[attr-defined]
    names = [a.arg for a in args.posonlyargs + args.args]
    parts = [f"{names[i] if i < len(names) else f'arg{i}'}={short_repr(a)}" for i, a in enumerate(case.args)]
    parts += [f"{k}={short_repr(v)}" for k, v in case.kwargs.items()]
    return ", ".join(parts)


def check(exercise_id: str, learner_fn: Callable[..., Any], *, seed: int | None = None) -> CheckResult:
    """Run ``learner_fn`` against the exercise's edge cases and fresh random cases.

    Stops at the first case where it disagrees with the reference (or raises) and
    reports the inputs, expected and actual results, and the idea the case probes.
    ``seed`` fixes the random cases; by default each run draws new ones (the seed
    is reported, so a failure can be replayed).
    """
    exercise = get_exercise(exercise_id)
    if not callable(learner_fn):
        raise KvlabValueError(f"learner_fn must be a function, got {type(learner_fn).__name__}")
    seed = random.randrange(2**31) if seed is None else seed
    rng = random.Random(seed)
    cases = list(exercise.edge_cases)
    if exercise.random_case is not None:
        cases += [exercise.random_case(rng) for _ in range(exercise.num_random)]
    head = f"{exercise_id} ({exercise.title})"
    prepare = exercise.prepare or (lambda fn: fn)
    reference, learner = prepare(exercise.reference), prepare(learner_fn)
    for number, case in enumerate(cases, start=1):
        expected = _call(reference, case)
        try:
            actual = _call(learner, case)
        except NotImplementedError:
            if number == 1:
                return CheckResult(
                    exercise_id, "not attempted", 0,
                    f"… {head}: not attempted yet. Replace the `raise NotImplementedError` "
                    f"and run the cell again; hint(\"{exercise_id}\") gives a first nudge.",
                )
            actual = NotImplementedError("raised NotImplementedError")
            error: BaseException | None = actual
        except Exception as exc:  # the learner's bug, reported rather than raised
            error = exc
        else:
            error = None
        agree = exercise.compare or (lambda e, a: e == a)
        if error is None and agree(expected, actual):
            continue
        where = "edge case" if number <= len(exercise.edge_cases) else f"random case (seed={seed})"
        lines = [f"✗ {head}: failed on case {number} of {len(cases)} ({where})."]
        if case.probes:
            lines.append(f"  This case probes: {case.probes}")
        lines.append(f"  inputs:   {_format_inputs(case, exercise.signature)}")
        lines.append(f"  expected: {short_repr(expected)}")
        if error is not None:
            lines.append(f"  got:      {type(error).__name__}: {error}")
        else:
            lines.append(f"  got:      {short_repr(actual)}")
            if exercise.explain is not None:
                diagnosis = exercise.explain(case, expected, actual)
                if diagnosis:
                    lines.append(f"  likely:   {diagnosis}")
        return CheckResult(
            exercise_id, "fail", number, "\n".join(lines), case, expected,
            None if error is not None else actual, seed,
        )
    return CheckResult(
        exercise_id, "pass", len(cases),
        f"✓ {head}: passed all {len(cases)} cases ({len(exercise.edge_cases)} edge, "
        f"{len(cases) - len(exercise.edge_cases)} random).",
        seed=seed,
    )


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
