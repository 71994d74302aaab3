"""How ``check`` judges one case and words what it found: the result box, failure lines, state notes.

``judge`` compares one outcome of the learner's function with the expected value and turns every
problem on the way (an exception, a time-out, a value that is not plain data, a comparison that
raises) into a failed case with its reason; ``failure_lines`` and ``state_note`` write the message.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import random
from collections.abc import Callable
from typing import Any

from kvlab.exercises.canonical import NotComparable, canonical, difference, short_repr, type_name
from kvlab.exercises.limits import Outcome, call_with_time_limit
from kvlab.exercises.records import (
    DEFAULT_TIME_LIMIT_S,
    PREPARED_TIME_LIMIT_S,
    Case,
    CheckResult,
    Exercise,
    Mistake,
)
from kvlab.exercises.state import STATE

__all__ = ["CheckResult", "cases_for", "copies", "failure_lines", "grade", "judge", "limit_for", "named_mistakes",
           "not_attempted", "state_note"]


class ReportedError(Exception):  # noqa: N818  (the learner's exception, as its process reported it)
    """An exception raised by the learner's code in the checking process: its type's name and its message."""

    def __init__(self, kind: str, text: str, not_implemented: bool = False) -> None:
        super().__init__(text)
        self.kind, self.text, self.not_implemented = kind, text, not_implemented


class UnreadableResult(ReportedError):
    """A result the learner's process could not turn into plain data: its type's name and why."""


def describe_error(error: BaseException) -> tuple[str, str]:
    """(type name, message) of the learner's exception; its own ``__str__`` may misbehave, so under a limit."""
    if isinstance(error, ReportedError):
        return error.kind, error.text
    said = call_with_time_limit(str, (error,), seconds=1.0)
    text = said.value if type(said.value) is str else "(its message could not be read)"
    return type_name(error), text[:300]


def copies(case: Case) -> tuple[tuple, dict[str, Any]]:
    """Deep copies of a case's inputs, so no call can change the case for the next."""
    return copy.deepcopy(case.args), copy.deepcopy(dict(case.kwargs))


def format_inputs(case: Case, signature: str) -> str:
    # Parsed, not split on commas: a hint such as dict[str, list[int]] holds commas of its own.
    args = ast.parse(signature.strip() + "\n    pass").body[0].args  # type: ignore[attr-defined]
    names = [a.arg for a in args.posonlyargs + args.args]
    parts = [f"{names[i] if i < len(names) else f'arg{i}'}={short_repr(a)}" for i, a in enumerate(case.args)]
    parts += [f"{k}={short_repr(v)}" for k, v in case.kwargs.items()]
    return ", ".join(parts)


@dataclasses.dataclass
class _Verdict:
    """How one case went: None in ``got`` means it agreed."""

    got: str | None = None
    where: str | None = None
    likely: str | None = None
    actual: Any = None


def _is_tensor(value: Any) -> bool:
    return type_name(value) in ("Tensor", "Parameter") and type(value).__module__.startswith("torch")


def _is_exercise_output(expected: Any, value: Any) -> bool:
    """A result type an exercise module defines itself (05's ``TileOutput``), compared by that exercise's ``compare``.

    Such a value is built by the exercise's own ``prepare`` wrapper around the learner's code, and
    its exact type (not a subclass) holds only tensors, so it needs no canonical form.
    """
    kind = type(expected)
    return type(value) is kind and kind.__module__.startswith("kvlab.exercises.nb")


def judge(exercise: Exercise, case: Case, expected: Any, outcome: Outcome, limit: float) -> _Verdict:
    """Compare one learner outcome with the expected value; every exception on the way is a failed case."""
    if outcome.timed_out:
        left = " It is still running in the background (stuck in C code): restart the kernel." * outcome.still_running
        return _Verdict(f"no answer within {limit:g} s: stopped by the time limit per case (an endless loop?).{left}")
    if isinstance(outcome.error, UnreadableResult):
        return _Verdict(f"<{outcome.error.kind}>", where=outcome.error.text)
    if outcome.error is not None:
        kind, text = describe_error(outcome.error)
        return _Verdict(f"{kind}: {text}")
    try:
        actual = (outcome.value if _is_exercise_output(expected, outcome.value)
                  else canonical(outcome.value, keep_tensors=_is_tensor(expected)))
    except NotComparable as why:
        return _Verdict(f"<{type_name(outcome.value)}>", where=str(why))
    try:
        if exercise.compare is not None:
            said = exercise.compare(expected, actual)
            where = said if isinstance(said, str) else None if said else ""
        else:
            where = difference(expected, actual)
    except Exception as exc:  # a checker must never crash on what a learner returns
        return _Verdict(short_repr(actual), where=f"comparing it raised {type_name(exc)}: {exc}")
    if where is None:
        return _Verdict()
    verdict = _Verdict(short_repr(actual), where=where or None, actual=actual)
    if exercise.explain is not None:
        try:
            verdict.likely = exercise.explain(case, expected, actual)
        except Exception:  # no diagnosis is better than a crash
            verdict.likely = None
    return verdict


def _agrees(exercise: Exercise, wanted: Any, value: Any) -> bool:
    """Whether ``value`` (a known mistake's result, kvlab's own code) compares equal to ``wanted``."""
    try:
        value = value if _is_exercise_output(wanted, value) else canonical(value, keep_tensors=_is_tensor(wanted))
        if exercise.compare is not None:
            said = exercise.compare(wanted, value)
            return not isinstance(said, str) and bool(said)
        return difference(wanted, value) is None
    except Exception:  # a mistake that cannot be compared reproduces nothing
        return False


def named_mistakes(exercise: Exercise, passed: list[tuple[Case, Any]], case: Case, actual: Any) -> list[Mistake]:
    """The known mistakes that reproduce the learner's outputs: ``actual`` on the failing ``case`` and the expected
    value on every case passed before it. Empty when none does (then none is named)."""
    found = []
    for mistake in exercise.mistakes:
        fn = exercise.prepare(mistake.fn) if exercise.prepare else mistake.fn
        try:
            with STATE.own_values():
                if _agrees(exercise, actual, fn(*copies(case)[0], **copies(case)[1])) and all(
                        _agrees(exercise, wanted, fn(*copies(c)[0], **copies(c)[1])) for c, wanted in passed):
                    found.append(mistake)
        except Exception:  # a mistake that raises on these cases is not the learner's
            continue
    return found


def state_note(during: list[tuple[str, str]]) -> list[str]:
    """Lines saying that kvlab's module data differs from its own, and whether the learner's function did it."""
    now = STATE.changes()
    if not now:
        return []
    by_function = [c for c in now if c in during]
    said = ("your function changed kvlab's state while check() ran: " if by_function else
            "kvlab's state differs from its own (changed by the notebook): ")
    return ["  note:     " + said + "; ".join(STATE.describe(by_function or now)),
            "            Expected values come from kvlab's own values; your function ran with the notebook's. "
            "restore_kvlab_state() puts kvlab's back (or restart the kernel)."]


def failure_lines(exercise: Exercise, number: int, cases: list[Case], seed: int, expected: Any,
             verdict: _Verdict) -> tuple[list[str], Any]:
    case = cases[number - 1]
    where = "edge case" if number <= len(exercise.edge_cases) else f"random case (seed={seed})"
    lines = [f"✗ {exercise.id} ({exercise.title}): failed on case {number} of {len(cases)} ({where})."]
    if case.probes:
        lines.append(f"  This case probes: {case.probes}")
    lines.append(f"  inputs:   {format_inputs(case, exercise.signature)}")
    lines.append(f"  expected: {short_repr(expected)}")
    lines.append(f"  got:      {verdict.got}")
    lines += [f"  {label:<9} {text}" for label, text in (("where:", verdict.where), ("likely:", verdict.likely))
              if text]
    return lines, verdict.actual


def limit_for(exercise: Exercise, time_limit: float | None) -> float:
    """The time limit per case: the caller's, else the exercise's own, else the default for its kind."""
    if time_limit is not None:
        return time_limit
    return exercise.time_limit_s or (PREPARED_TIME_LIMIT_S if exercise.prepare else DEFAULT_TIME_LIMIT_S)


def cases_for(exercise: Exercise, seed: int) -> list[Case]:
    """The edge cases, then ``num_random`` random cases drawn from ``seed``."""
    rng = random.Random(seed)
    return list(exercise.edge_cases) + [exercise.random_case(rng) for _ in range(exercise.num_random)
                                        if exercise.random_case is not None]


def _not_attempted(error: BaseException | None) -> bool:
    return isinstance(error, NotImplementedError) or (isinstance(error, ReportedError) and error.not_implemented)


def not_attempted(exercise: Exercise) -> CheckResult:
    """The result for a function that still raises ``NotImplementedError`` on the first case."""
    return CheckResult(exercise.id, "not attempted", 0,
                       f"… {exercise.id} ({exercise.title}): not attempted yet. Replace the "
                       f"`raise NotImplementedError` and run the cell again; hint(\"{exercise.id}\") gives "
                       "a first nudge.")


def grade(exercise: Exercise, cases: list[Case], seed: int, limit: float, run_case: Callable[[int, Case], Outcome],
          expected_for: Callable[[Case], Any], notes: Callable[[], list[str]]) -> CheckResult:
    """Run the cases in order (``run_case`` calls the learner's function, ``expected_for`` the reference) and
    stop at the first that disagrees; ``notes`` adds the lines about kvlab's state to the message."""
    passed: list[tuple[Case, Any]] = []
    for number, case in enumerate(cases, start=1):
        outcome = run_case(number, case)
        if number == 1 and _not_attempted(outcome.error):
            return not_attempted(exercise)
        expected = expected_for(case)
        verdict = judge(exercise, case, expected, outcome, limit)
        passed.append((case, expected))
        if verdict.got is not None:
            found = named_mistakes(exercise, passed[:-1], case, verdict.actual) if verdict.actual is not None else []
            if found:  # what the outputs match beats what explain guesses; several that match are all named
                verdict.likely = "\n            or: ".join(dict.fromkeys(m.words(case) for m in found))  # once each
            lines, actual = failure_lines(exercise, number, cases, seed, expected, verdict)
            return CheckResult(exercise.id, "fail", number, "\n".join(lines + notes()), case, expected, actual, seed)
    return CheckResult(exercise.id, "pass", len(cases), "\n".join([
        f"✓ {exercise.id} ({exercise.title}): passed all {len(cases)} cases ({len(exercise.edge_cases)} edge, "
        f"{len(cases) - len(exercise.edge_cases)} random).", *notes()]), seed=seed)
