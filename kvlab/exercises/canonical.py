"""Canonical forms: what the grader compares, so no object returned by a learner can fake agreement.

A learner's result is rebuilt from plain Python values before anything looks at it: numpy
scalars and arrays become Python scalars and lists, a torch tensor becomes a list (or stays a
tensor where the expected value is one), tuples and lists stay what they are. Only exact
built-in types survive; a subclass of ``int`` with an ``__eq__`` that always says yes, a
generator or any object of the learner's own is refused with the reason. No method of the
learner's objects runs while this happens: numpy's and torch's conversions are called
through their own classes, never through the value.

``difference(expected, actual)`` then compares two canonical values with exact types (an
``int`` is not a ``float`` nor a ``bool``; a list and a tuple are both a sequence) and says
where they first part, in words.

Both are bounded: a result of more than ``MAX_VALUES`` values in all (counting every visit, so
``[[0] * 20000] * 20000``, one row repeated, counts 400 million) is refused with that reason
after ``MAX_VALUES`` steps, before anything builds or compares it; ``difference`` walks at most
the expected value, which kvlab keeps small.
"""

from __future__ import annotations

import math
import reprlib
import sys
from fractions import Fraction
from typing import Any

SCALARS = (type(None), bool, int, float, str, bytes, Fraction)
MAX_DEPTH = 40
MAX_VALUES = 100_000  # values in one canonical result; the largest expected value of any exercise holds ~2,600
HASH_BYTES = 16  # bytes this long or longer are shown as a short hex hash, as kvlab's figures show block hashes


class NotComparable(Exception):  # noqa: N818  (a reason, not a fault of kvlab's)
    """The learner's result holds something the grader does not compare; the message says what and why."""


def type_name(value: Any) -> str:
    """The name of a value's type, read without calling anything the value defines."""
    try:
        return type.__getattribute__(type(value), "__qualname__")
    except Exception:  # a metaclass can make even this raise
        return "object"


class _Budget:
    """How many more values ``canonical`` may visit before it refuses the result as too large."""

    def __init__(self, limit: int, path: str) -> None:
        self.left, self.limit, self.path = limit, limit, path

    def spend(self, count: int, *, keep: bool = True) -> None:
        """Count ``count`` values (``keep=False``: only see that they would fit, as their visits count them)."""
        if count > self.left:
            raise NotComparable(f"{self.path} holds more than {self.limit:,} values, far more than any answer here: "
                                "a list repeated ([row] * n), or grown without end?")
        if keep:
            self.left -= count


def _numpy_item(value: Any, path: str, budget: _Budget) -> Any | None:
    """A numpy scalar or array as Python values; None when ``value`` is not numpy's."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    if isinstance(value, numpy.ndarray):
        budget.spend(int(numpy.ndarray.__getattribute__(value, "size")), keep=False)
        return numpy.ndarray.tolist(value)  # the C method, whatever a subclass defines
    if isinstance(value, numpy.generic):
        item = numpy.generic.item(value)
        if type(item) not in SCALARS:
            raise NotComparable(f"{path} is a numpy {type_name(value)}, which has no plain Python value")
        return item
    return None


def _torch_value(value: Any, path: str, keep_tensors: bool, budget: _Budget) -> tuple[bool, Any]:
    """(is a tensor, its canonical form): the tensor itself when expected so, else its values as lists."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return False, None
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise NotComparable(f"{path} is a {type_name(value)}, a subclass of torch.Tensor: return a plain tensor")
    tensor = torch.Tensor.detach(value)
    budget.spend(torch.Tensor.numel(tensor), keep=keep_tensors)
    if keep_tensors:
        return True, torch.Tensor.clone(tensor).cpu()
    return True, torch.Tensor.tolist(tensor)


def canonical(value: Any, *, keep_tensors: bool = False, path: str = "the result", _depth: int = 0,
              _seen: frozenset[int] = frozenset(), _budget: _Budget | None = None) -> Any:
    """``value`` rebuilt from exact built-in types; raises ``NotComparable`` naming the part that is not
    (or saying that it holds more than ``MAX_VALUES`` values)."""
    budget = _Budget(MAX_VALUES, path) if _budget is None else _budget
    budget.spend(1)
    if _depth > MAX_DEPTH:
        raise NotComparable(f"{path} is nested more than {MAX_DEPTH} levels deep")
    kind = type(value)
    if kind in SCALARS:
        return value
    item = _numpy_item(value, path, budget)
    if item is not None:
        return canonical(item, keep_tensors=keep_tensors, path=path, _depth=_depth + 1, _seen=_seen, _budget=budget)
    is_tensor, tensor = _torch_value(value, path, keep_tensors, budget)
    if is_tensor:
        return tensor if keep_tensors else canonical(tensor, path=path, _depth=_depth + 1, _seen=_seen,
                                                     _budget=budget)
    if kind not in (list, tuple, dict, set, frozenset):
        raise NotComparable(f"{path} is a {type_name(value)}, not a plain Python value (int, float, str, bytes, "
                            "bool, None, or a list, tuple, dict or set of them)")
    if id(value) in _seen:
        raise NotComparable(f"{path} contains itself")
    seen = _seen | {id(value)}

    def inner(part: Any, where: str) -> Any:
        return canonical(part, keep_tensors=keep_tensors, path=where, _depth=_depth + 1, _seen=seen, _budget=budget)

    if kind is dict:
        return {inner(k, f"a key of {path}"): inner(v, f"{path}[{k!r}]" if type(k) in SCALARS else path)
                for k, v in dict.items(value)}
    if kind in (set, frozenset):
        return set(inner(v, f"an element of {path}") for v in kind.__iter__(value))
    return kind(inner(v, f"{path}[{i}]") for i, v in enumerate(kind.__iter__(value)))


_KINDS = {type(None): "None", bool: "a bool", int: "an int", float: "a float", str: "a str", bytes: "bytes",
          Fraction: "a Fraction", list: "a list", tuple: "a tuple", dict: "a dict", set: "a set"}


def describe_type(value: Any) -> str:
    """'an int', 'a list', ... for a canonical value."""
    return _KINDS.get(type(value), f"a {type_name(value)}")


def _same_number(expected: float, actual: float) -> bool:
    if math.isnan(expected) or math.isnan(actual):
        return math.isnan(expected) and math.isnan(actual)
    return math.isclose(expected, actual, rel_tol=1e-9, abs_tol=1e-12)


def difference(expected: Any, actual: Any, path: str = "the result") -> str | None:
    """None when two canonical values agree; otherwise where and how they first differ, in words
    ('' when the whole result is simply another value of the right type).

    Types are exact: an int where an int is expected (a float or a bool is not one), a float
    or an int where a float is expected (equal to 1 part in 10^9), a list or a tuple where a
    sequence is expected.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{path} is {describe_type(actual)}, expected a tensor"
        if actual.shape != expected.shape:
            return f"{path} has shape {list(actual.shape)}, expected {list(expected.shape)}"
        return None if torch.equal(actual, expected) else f"{path} holds other values"
    if type(expected) is float:
        if type(actual) not in (float, int):
            return f"{path} is {describe_type(actual)}, expected a float"
        return None if _same_number(expected, actual) else _unequal(expected, actual, path)
    if type(expected) in (list, tuple):
        return _sequence_difference(expected, actual, path)
    if type(expected) is dict:
        return _dict_difference(expected, actual, path)
    expected_kind = set if type(expected) is frozenset else type(expected)
    if type(actual) is not expected_kind and not (expected_kind is set and type(actual) is frozenset):
        hint = "; return int(...)" if expected_kind is int and type(actual) in (float, Fraction) else ""
        return f"{path} is {describe_type(actual)} ({short_repr(actual)}), expected {describe_type(expected)}{hint}"
    return None if actual == expected else _unequal(expected, actual, path)


def _unequal(expected: Any, actual: Any, path: str) -> str:
    """'' for the whole result (the message shows both already), else where inside it the values part."""
    return "" if path == "the result" else f"{path} is {short_repr(actual)}, expected {short_repr(expected)}"


def _sequence_difference(expected: list | tuple, actual: Any, path: str) -> str | None:
    if type(actual) not in (list, tuple):
        return f"{path} is {describe_type(actual)}, expected a sequence ({describe_type(expected)})"
    if len(actual) != len(expected):
        return f"{path} has {len(actual)} items, expected {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        found = difference(e, a, f"{path}[{i}]")
        if found:
            return found
    return None


def _dict_difference(expected: dict, actual: Any, path: str) -> str | None:
    if type(actual) is not dict:
        return f"{path} is {describe_type(actual)}, expected a dict"
    missing = [k for k in expected if k not in actual]
    extra = [k for k in actual if k not in expected]
    if missing or extra:
        return f"{path} lacks the keys {short_repr(missing)} and has the extra keys {short_repr(extra)}"
    for key, e in expected.items():
        found = difference(e, actual[key], f"{path}[{key!r}]")
        if found:
            return found
    return None


# --------------------------------------------------------------------------- short reprs


class _ShortRepr(reprlib.Repr):
    """reprlib, with long byte strings (block hashes) shown as the first 8 hex digits of the hash."""

    def repr_bytes(self, value: bytes, level: int) -> str:
        if len(value) >= HASH_BYTES:
            return f"<hash {value[:4].hex()}…>"
        text = repr(value)
        return text if len(text) <= self.maxstring else text[: self.maxstring - 3] + "..."


_short = _ShortRepr()
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 12
_short.maxstring = _short.maxother = 160
_short.maxlevel = 4


def short_repr(value: Any) -> str:
    """A repr small enough to read in a failure message; hashes as short hex."""
    try:
        return _short.repr(value)
    except Exception:
        return f"<a {type_name(value)}>"
