"""The exercise harness's records: a case, an exercise, a question and what ``check`` found.

A leaf module: the catalogue (``core``), the judge (``grading``) and the checking process
(``isolated``) all read these, and none of them is imported here.
"""

from __future__ import annotations

import dataclasses
import html
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

Status = Literal["pass", "fail", "not attempted"]

DEFAULT_TIME_LIMIT_S = 10.0  # per call of the learner's function; generous for a laptop
PREPARED_TIME_LIMIT_S = 60.0  # where `prepare` runs the learner's code in a kernel: its first call compiles it


class LazyCases(Sequence):
    """Edge cases built on first use: notebook 05's are paged batches from ``kvlab.kernels``, which imports
    Triton, and ``import kvlab.exercises`` must not (the kernel backend is chosen before Triton is imported)."""

    def __init__(self, build: Callable[[], Sequence[Any]]) -> None:
        self._build: Callable[[], Sequence[Any]] | None = build
        self._cases: Sequence[Any] = ()

    def _built(self) -> Sequence[Any]:
        if self._build is not None:
            self._cases, self._build = tuple(self._build()), None
        return self._cases

    def __getitem__(self, index):  # type: ignore[override]
        return self._built()[index]

    def __len__(self) -> int:
        return len(self._built())


@dataclasses.dataclass(frozen=True)
class Case:
    """One input to an exercise, with the idea it probes in words a learner can act on."""

    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    probes: str = ""


@dataclasses.dataclass(frozen=True)
class Mistake:
    """A known wrong answer as a small function with the learner's signature, and what to say when it is the one.

    ``says`` is the diagnosis, or a function of the failing case that words it. The grader names a
    mistake only when it reproduces the learner's outputs on every case run so far (the failing one
    and the ones passed before it), never on a guess.
    """

    fn: Callable[..., Any]
    says: str | Callable[[Case], str]

    def words(self, case: Case) -> str:
        """The diagnosis for ``case``."""
        return self.says if isinstance(self.says, str) else self.says(case)


@dataclasses.dataclass(frozen=True)
class Exercise:
    """A task with its signature, hints, reference solution and cases.

    ``random_case(rng)`` draws a fresh case; ``compare(expected, actual)`` decides agreement
    on canonical values (default: exact types, ``canonical.difference``); ``explain(case,
    expected, actual)`` may say what is wrong with the answer's form (a type, a shape), never
    guess a mistake; ``mistakes`` lists known wrong answers the grader runs on a failing case to
    name the one that reproduces the learner's outputs (tried before ``explain``). ``shown``, if set, is
    the reference written as plain lines, what ``show_solution`` prints (it must pass the check
    too). ``prepare(fn)``, if set, turns the learner's function and the reference into what
    the cases call (notebook 05: a Triton kernel launch that calls the learner's
    ``@triton.jit`` helper). A ``transfer`` exercise asks for the idea on a case the notebook
    did not work through (another model, layout or failure). ``time_limit_s`` bounds each call
    of the learner's function. ``spec(*case)``, if set, computes the expected value of a case in place
    of ``prepare(reference)`` (notebook 05's puzzles: a torch specification, where the reference is a
    kernel; the reference is then checked against it like any learner's answer). ``compare`` may
    return a string instead of False: the disagreement, said where it is, for the failure message.
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
    mistakes: Sequence[Mistake] = ()
    shown: Callable[..., Any] | None = None
    time_limit_s: float | None = None  # None: DEFAULT_TIME_LIMIT_S, or PREPARED_TIME_LIMIT_S with `prepare`
    spec: Callable[..., Any] | None = None

    def expected_function(self) -> Callable[..., Any]:
        """What computes a case's expected value: ``spec``, else the reference (through ``prepare``)."""
        if self.spec is not None:
            return self.spec
        return self.prepare(self.reference) if self.prepare else self.reference

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
