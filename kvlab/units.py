"""Binary units (KiB = 1024 B, GiB = 1024**3 B), a formatter and ``cdiv``, so every notebook counts alike."""

from __future__ import annotations

from kvlab._validate import checked, positive_int

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


@checked(signed=("a",))
def cdiv(a: int, b: int) -> int:
    """Ceiling division, as vLLM's ``cdiv``: the blocks needed for ``a`` tokens in blocks of ``b``."""
    return -(-a // positive_int("b", b))
