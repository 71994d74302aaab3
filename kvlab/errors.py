"""The exceptions kvlab raises.

Every error a learner can trigger is one of these, so a notebook can catch
``KvlabError`` and a test can say exactly which mistake it expects. Errors caused
by bad input also subclass ``ValueError``, the convention Python code already
catches.
"""

from __future__ import annotations

from collections.abc import Iterable


class KvlabError(Exception):
    """Base class of every exception kvlab raises on purpose."""


class KvlabValueError(KvlabError, ValueError):
    """An argument is outside what the function accepts; the message names it."""


class UnknownNameError(KvlabValueError):
    """A name (model preset, dtype, hash function, ...) is not one kvlab knows."""

    def __init__(self, parameter: str, value: object, known: Iterable[str]) -> None:
        self.parameter = parameter
        self.value = value
        self.known = sorted(known)
        super().__init__(
            f"{parameter}={value!r} is not known; choose one of: {', '.join(self.known)}"
        )


class MissingConfigKeyError(KvlabValueError):
    """A model config lacks a field kvlab needs to size its KV cache."""

    def __init__(self, key: str, where: str = "config") -> None:
        self.key = key
        super().__init__(f"{where} is missing the required key {key!r}")


class OutOfBlocksError(KvlabValueError):
    """The block pool has fewer free blocks than were asked for (nothing was taken)."""


class BlockStateError(KvlabValueError):
    """A block operation does not fit the block's state: double free, foreign block, null block."""


class RequestStateError(KvlabValueError):
    """A request operation does not fit the request's state: unknown, freed or finished."""


class KernelInputError(KvlabValueError):
    """Tensors handed to a kernel disagree in shape, dtype or range (checked before launch)."""


class BackendUnavailableError(KvlabError, ImportError):
    """An optional backend (Triton, a GPU) is not installed or not present here."""


class RequestTooLongError(KvlabValueError):
    """A request needs more KV blocks (or tokens) than the engine can ever give it; it was not admitted."""
