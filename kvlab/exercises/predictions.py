"""Prediction exercises: say what kvlab will print before running it, then run it and compare.

Where an exercise would only ask a learner to retype the formula a notebook has just shown, a
prediction asks for the outcome of one concrete situation instead (the line vLLM logs, the block
ids a window frees, the hashes two requests share) and then runs kvlab on that situation. A
situation usually has a few parts (``run()`` returns a dict, one answer per part), chosen so that
each known wrong way of reasoning gives a different answer somewhere: the verdict names, part by
part, the mistakes whose answer is exactly the learner's (``Mistake.fn`` takes no arguments and
returns what that reasoning predicts), never one guessed.

In a notebook::

    # PREDICT 02.num_blocks
    my_prediction = ...        # replace ... with your prediction, then run the cell
    predict("02.num_blocks", my_prediction)

An untouched cell (``...``) is "not attempted yet", as an untouched exercise is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.exercises.canonical import NotComparable, canonical, difference, short_repr
from kvlab.exercises.records import Case, CheckResult, Mistake
from kvlab.exercises.state import STATE


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A concrete situation to predict, the kvlab code that settles it, and the known wrong ways to reason.

    ``run()`` returns the answer kvlab computes (a dict for a situation of several parts); ``runs``
    is that code in a line or two, shown with the verdict; ``form`` says what an answer looks like;
    ``normal`` turns an answer into what is compared (a log line into its numbers), raising
    ``ValueError`` with the reason where it cannot; ``mistakes`` hold the known wrong reasonings.
    """

    id: str
    title: str
    question: str
    form: str
    run: Callable[[], Any]
    runs: str
    hints: Sequence[str]
    mistakes: Sequence[Mistake] = ()
    normal: Callable[[Any], Any] | None = None
    transfer: bool = False

    @property
    def notebook(self) -> str:
        return self.id.split(".", 1)[0]


_PREDICTIONS: dict[str, Prediction] = {}
PREDICTIONS: Mapping[str, Prediction] = MappingProxyType(_PREDICTIONS)


def register_prediction(prediction: Prediction) -> Prediction:
    """Add a prediction to the catalogue (once, at import of its ``nbXX`` module)."""
    if prediction.id in _PREDICTIONS:
        raise KvlabValueError(f"prediction id {prediction.id!r} is registered twice")
    _PREDICTIONS[prediction.id] = prediction
    return prediction


def get_prediction(prediction_id: str) -> Prediction:
    """The prediction called ``prediction_id``; an unknown id raises and lists the known ones."""
    if prediction_id not in _PREDICTIONS:
        raise UnknownNameError("prediction_id", prediction_id, _PREDICTIONS)
    return _PREDICTIONS[prediction_id]


def list_predictions(notebook: str | None = None) -> list[str]:
    """Prediction ids, optionally only those of one notebook ("02")."""
    return sorted(p for p in _PREDICTIONS if notebook is None or p.startswith(f"{notebook}."))


def answer(prediction_id: str) -> Any:
    """What kvlab computes for the situation (what ``make test-solutions`` predicts)."""
    return get_prediction(prediction_id).run()


def _whole(value: Any) -> Any:
    """Floats that hold a whole number as ints: a prediction worked out as 36 * 8 * 128 * 2 * 0.5625 is 41472."""
    if type(value) is float and value.is_integer():
        return int(value)
    if type(value) in (list, tuple):
        return type(value)(_whole(v) for v in value)
    if type(value) is dict:
        return {k: _whole(v) for k, v in value.items()}
    return value


def _normal(prediction: Prediction, value: Any) -> Any:
    value = _whole(canonical(value))
    return prediction.normal(value) if prediction.normal is not None else value


def _parts(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {None: value}


def _consistent(mistake: dict[Any, Any], truths: dict[Any, Any], givens: dict[Any, Any]) -> bool:
    """Whether a known mistake could be the learner's reasoning: on every part, it gives the learner's answer, or
    it gives kvlab's (a part where that reasoning happens to be harmless)."""
    return all(part in mistake and (difference(mistake[part], givens[part]) is None
                                    or difference(mistake[part], truths[part]) is None) for part in truths)


def _lines_for_part(part: Any, shown: tuple[Any, Any], compared: tuple[Any, Any], named: list[Mistake]) -> list[str]:
    """What to say about one part the learner got wrong: both answers, where they part, and the known mistakes
    that give exactly the learner's answer here and contradict none of the others."""
    (truth, given), (raw_truth, raw_given) = compared, shown
    name = "" if part is None else f"{part}: "
    lines = [f"  {name}you predicted {short_repr(raw_given)}",
             f"  {' ' * len(name)}kvlab computes {short_repr(raw_truth)}"]
    where = difference(truth, given, "your prediction")
    if where and not where.startswith("your prediction is "):
        lines.append(f"      where:  {where}")
    lines += [f"      likely: {m.words(Case())}" for m in named]
    return lines


def predict(prediction_id: str, prediction: Any) -> CheckResult:
    """Compare ``prediction`` with what kvlab computes for the situation, part by part, and say why it differs.

    ``...`` (the cell as shipped) is "not attempted". A part answered wrongly is shown beside kvlab's
    answer, with every known mistake that gives exactly the answer predicted.
    """
    p = get_prediction(prediction_id)
    if prediction is ... or prediction is None:
        return CheckResult(p.id, "not attempted", 0,
                           f"… {p.id} ({p.title}): not predicted yet. Write your prediction in place of `...` and "
                           f"run the cell (the form: {p.form}); hint(\"{p.id}\") gives a first nudge.")
    with STATE.own_values():
        raw_truth = canonical(p.run())
        truth = _normal(p, raw_truth)
        wrong: dict[Mistake, Any] = {}
        for mistake in p.mistakes:
            try:
                wrong[mistake] = _parts(_normal(p, mistake.fn()))
            except Exception:  # a reasoning that does not apply here names nothing
                continue
    head = f"{p.id} ({p.title})"
    try:
        raw_given = canonical(prediction)
        if isinstance(raw_truth, dict) and (not isinstance(raw_given, dict) or set(raw_given) != set(raw_truth)):
            raise ValueError(f"predict one answer for each of {sorted(raw_truth)}, as a dict; got "
                             f"{short_repr(prediction)}")
        given = _normal(p, raw_given)
    except (NotComparable, ValueError, TypeError, KeyError) as why:
        return CheckResult(p.id, "fail", 0, f"✗ {head}: {why}\n  the form: {p.form}", expected=raw_truth)
    truths, givens = _parts(truth), _parts(given)
    raw_truths, raw_givens = _parts(raw_truth), _parts(raw_given)
    failed = [part for part in truths if difference(truths[part], givens[part]) is not None]
    ran = f"  kvlab ran: {p.runs}"
    if not failed:
        return CheckResult(p.id, "pass", len(truths), f"✓ {head}: your prediction is what kvlab computes.\n"
                                                      f"  kvlab computes {short_repr(raw_truth)}\n{ran}")
    count = f"{len(failed)} of {len(truths)} parts differ" if len(truths) > 1 else "kvlab computes something else"
    lines = [f"✗ {head}: {count}."]
    consistent = {m: value for m, value in wrong.items() if _consistent(value, truths, givens)}
    named = {part: [m for m, value in consistent.items() if difference(value[part], givens[part]) is None]
             for part in failed}
    everywhere = [m for m in consistent if all(m in named[part] for part in failed)]  # said once, below the parts
    for part in failed:
        lines += _lines_for_part(part, (raw_truths[part], raw_givens[part]), (truths[part], givens[part]),
                                 [m for m in named[part] if m not in everywhere or len(failed) == 1])
    if len(failed) > 1:
        lines += [f"  likely:   {m.words(Case())}" for m in everywhere]
    return CheckResult(p.id, "fail", len(truths), "\n".join([*lines, ran]), expected=raw_truth, actual=raw_given)


def log_line_numbers(line: Any) -> tuple[int, int, str]:
    """vLLM's KV line as (tokens, max_model_len, concurrency as printed): ``GPU KV cache size: N tokens, Maximum
    concurrency for M tokens per request: X.XXx``; commas and spaces do not matter."""
    import re

    if not isinstance(line, str):
        raise TypeError(f"predict the line as a string, got {type(line).__name__}")
    found = re.search(r"size:\s*([\d,_ ]+)\s*tokens.*?for\s*([\d,_ ]+)\s*tokens.*?:\s*([\d.]+)\s*x", line, re.S)
    if not found:
        raise ValueError("write the whole line as vLLM prints it, numbers included")
    tokens, length = (int(re.sub(r"[,_ ]", "", g)) for g in found.group(1, 2))
    return tokens, length, found.group(3)
