"""Small argument checks shared by every module, so messages read the same everywhere."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

from kvlab.errors import KvlabValueError, UnknownNameError


def positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an integer >= 1 (bools refused), else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise KvlabValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def non_negative_int(name: str, value: object) -> int:
    """Return ``value`` if it is an integer >= 0 (bools refused), else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise KvlabValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def non_negative_number(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite real >= 0, else raise naming ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or value < 0
    ):
        raise KvlabValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def positive_number(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite real > 0, else raise naming ``name``."""
    number = non_negative_number(name, value)
    if number == 0:
        raise KvlabValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def fraction_in_unit_interval(name: str, value: object) -> float:
    """Return ``value`` if 0 < value <= 1 (a share such as gpu_memory_utilization)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (0 < float(value) <= 1)
    ):
        raise KvlabValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def one_of(name: str, value: object, allowed: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``allowed``, else raise listing the allowed names."""
    allowed = list(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise UnknownNameError(name, value, allowed)
    return value
