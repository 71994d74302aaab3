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


class ConfigFieldError(KvlabValueError):
    """A ``config.json`` field kvlab reads has the wrong type or range; the message names the field as the file does."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"config.json field {field!r} {problem}")


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


class CheckpointError(KvlabValueError):
    """A checkpoint (``config.json``, its weight files or their index) is malformed or disagrees with itself.

    The message names the file and the field or tensor; a library's own error (JSON, safetensors)
    is kept as the cause and quoted.
    """


class RequestFailedError(KvlabError):
    """A request could not go on and finished with ``FINISHED_ERROR``; the message names it and says why.

    Raised for one request, never for a whole engine: the request's blocks are freed and the
    engine keeps serving the others.
    """

    def __init__(self, request_id: str, reason: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r}: {reason}")


class NonFiniteLogitsError(RequestFailedError):
    """A request's logits hold NaN or infinity, so no token can be sampled (a NaN weight, an overflow)."""

    def __init__(self, request_id: str, num_nan: int, num_inf: int, vocab_size: int) -> None:
        self.num_nan, self.num_inf = num_nan, num_inf
        super().__init__(
            request_id,
            f"its logits hold {num_nan} NaN and {num_inf} infinite values out of {vocab_size}: no token can be "
            "sampled. The model produced them (a NaN or huge weight, an overflow in a low-precision dtype); "
            "kvlab finishes the request with an error instead of emitting a meaningless token",
        )


class ReplicaDiedError(KvlabError):
    """A fleet replica process exited or stopped answering within its timeout; the message names it."""

    def __init__(self, replica: int, reason: str) -> None:
        self.replica = replica
        super().__init__(f"replica {replica}: {reason}")


class RankFailedError(KvlabError):
    """A tensor-parallel rank raised, exited or stopped answering; every rank was stopped and the engine with them.

    ``rank`` is the rank that failed first, ``reason`` what it reported (or how it ended); ``reports`` holds
    every rank's report, first failure first, ``tracebacks`` the tracebacks they sent, ``exit_codes`` how each
    process ended.
    """

    def __init__(self, rank: int | None, reason: str, reports: dict[int, str] | None = None,
                 tracebacks: dict[int, str] | None = None, exit_codes: dict[int, int | None] | None = None) -> None:
        self.rank, self.reason = rank, reason
        self.reports = dict(reports or {})
        self.tracebacks, self.exit_codes = dict(tracebacks or {}), dict(exit_codes or {})
        who = "a rank" if rank is None else f"rank {rank}"
        others = "; ".join(f"rank {r}: {_first_line(text)}" for r, text in self.reports.items() if r != rank)
        super().__init__(f"{who} failed: {reason}" + (f" (then {others})" if others else "")
                         + ". Every rank was stopped: build a new engine to go on")


def _first_line(text: str, limit: int = 120) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."
