"""Exercises that check themselves, one ``nbXX`` module per notebook, and self-test questions.

In a notebook: ``from kvlab.exercises import check, hint, show_solution, self_test``.
"""

import importlib
import pkgutil

from kvlab.exercises.core import (
    DEFAULT_TIME_LIMIT_S,
    EXERCISES,
    QUESTIONS,
    Case,
    CheckResult,
    Exercise,
    Mistake,
    Question,
    SelfTest,
    ask,
    check,
    describe,
    get_exercise,
    hint,
    list_exercises,
    self_test,
    show_solution,
    solution,
)
from kvlab.exercises.predictions import PREDICTIONS, Prediction, get_prediction, list_predictions, predict
from kvlab.exercises.state import restore_kvlab_state

# Each notebook's exercises live in kvlab/exercises/nbXX.py and register themselves on import.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("nb")):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = [
    "DEFAULT_TIME_LIMIT_S",
    "EXERCISES",
    "QUESTIONS",
    "Case",
    "CheckResult",
    "Exercise",
    "Mistake",
    "PREDICTIONS",
    "Prediction",
    "Question",
    "SelfTest",
    "ask",
    "check",
    "describe",
    "get_exercise",
    "get_prediction",
    "hint",
    "list_exercises",
    "list_predictions",
    "predict",
    "restore_kvlab_state",
    "self_test",
    "show_solution",
    "solution",
]
