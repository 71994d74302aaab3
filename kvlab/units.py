"""Binary units (KiB = 1024 B, GiB = 1024**3 B), a formatter and ``cdiv``, so every notebook counts alike."""

from __future__ import annotations

import numbers

from kvlab._validate import checked, positive_int
from kvlab.errors import KvlabValueError

KiB = 1024
MiB = 1024**2
GiB = 1024**3


@checked(signed=("num_bytes",), at_most={"digits": 20})
def format_bytes(num_bytes: float, digits: int = 3) -> str:
    """``format_bytes(327680) == '320 KiB'``: the largest binary unit that keeps the value >= 1."""
    value = float(num_bytes)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(value) >= size:
            return f"{value / size:.{digits}f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{value:g} B"


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as vLLM's ``cdiv``: the blocks needed for ``a`` tokens in blocks of ``b``.

    Checked inline, not with ``@checked``: the allocator calls it on every step.
    """
    if type(a) is not int and (isinstance(a, bool) or not isinstance(a, numbers.Integral)):
        raise KvlabValueError(f"a must be an integer, got {a!r}")
    if type(b) is not int or b < 1:
        b = positive_int("b", b)
    return -(-a // b)


@checked
def format_ranges(values: list[int]) -> str:
    """Sorted integers as runs: ``[0, 1, 2, 5]`` as ``0-2, 5`` (which programs, blocks or rows were touched)."""
    out, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)
