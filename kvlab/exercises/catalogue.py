"""The catalogue of exercises and self-test questions, filled at import of each ``nbXX`` module."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.exercises.records import Exercise, Question

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
