"""A time limit on each call of a learner's function in this process, where ``check`` cannot use another.

``check`` runs the learner's function in a process of its own and kills it at the limit
(``isolated.py``); this module serves where that cannot be done (no ``fork``, a function that
cannot be sent) and for a call of the learner's own ``__str__``. It cannot stop code that
catches ``BaseException`` (a bare ``except:``). Why this design: a thread cannot be killed.
Jupyter, Voila and pytest run a cell in the main thread, where a POSIX interval timer
(``SIGALRM``) interrupts Python code between two bytecodes: that is the main path.
``CaseTimeout`` derives from ``BaseException``, so the learner's ``except Exception`` does not
swallow it, and the timer fires again every ``REFIRE_S`` until the call is over; the handler
never raises inside this module, so the grader's own bookkeeping cannot be cut in half. Where
that path is closed (another thread, Windows, a timer someone else armed), the call runs in a
worker thread and, at the limit, the same exception is raised inside it with CPython's
``PyThreadState_SetAsyncExc``. Neither path can stop one long call inside C code (a huge numpy
product): the case still fails as timed out, and the result says whether the call was left
running.
"""

from __future__ import annotations

import ctypes
import dataclasses
import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any

REFIRE_S = 0.2  # after the limit, the timer fires again this often until the call stops
STOP_GRACE_S = 1.0  # thread path: how long to wait for a stopped worker to end


class CaseTimeout(BaseException):  # noqa: N818  (not an error of the learner's code: its time is up)
    """Raised inside the learner's call when the case's time limit is reached."""


@dataclasses.dataclass
class Outcome:
    """What one limited call did: returned ``value``, raised ``error``, or ran out of time."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    still_running: bool = False  # the thread path could not stop it (stuck in C code)


def _call(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> Outcome:
    try:
        return Outcome(value=fn(*args, **kwargs))
    except (Exception, SystemExit) as exc:  # the learner's bug (or exit()), reported rather than raised
        return Outcome(error=exc)


def call_with_time_limit(fn: Callable[..., Any], args: tuple = (), kwargs: Mapping[str, Any] | None = None,
                         seconds: float | None = None) -> Outcome:
    """Call ``fn(*args, **kwargs)`` and stop it after ``seconds`` (None: no limit)."""
    kwargs = {} if kwargs is None else kwargs
    if seconds is None:
        return _call(fn, args, kwargs)
    if _alarm_available():
        return _with_alarm(fn, args, kwargs, seconds)
    return _in_thread(fn, args, kwargs, seconds)


def _alarm_available() -> bool:
    return (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))


def _with_alarm(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any], seconds: float) -> Outcome:
    state = {"armed": True, "fired": False}

    def on_alarm(signum: int, frame: Any) -> None:
        # Raise only in the learner's code: never in this module, whose next step disarms the timer.
        if state["armed"] and frame is not None and frame.f_code.co_filename != __file__:
            state["fired"] = True
            raise CaseTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    outcome = Outcome(timed_out=True)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds, REFIRE_S)
        outcome = _call(fn, args, kwargs)
    except CaseTimeout:
        pass
    finally:
        state["armed"] = False
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
    return Outcome(timed_out=True) if state["fired"] else outcome


def _raise_in(thread: threading.Thread) -> None:
    """Ask CPython to raise ``CaseTimeout`` in ``thread`` at its next bytecode."""
    set_async_exc = getattr(getattr(ctypes, "pythonapi", None), "PyThreadState_SetAsyncExc", None)
    if set_async_exc is not None and thread.ident is not None:
        set_async_exc(ctypes.c_ulong(thread.ident), ctypes.py_object(CaseTimeout))


def _in_thread(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any], seconds: float) -> Outcome:
    box: dict[str, Outcome] = {}

    def target() -> None:
        try:
            box["outcome"] = _call(fn, args, kwargs)
        except CaseTimeout:
            box["outcome"] = Outcome(timed_out=True)

    worker = threading.Thread(target=target, daemon=True, name="kvlab-check-case")
    worker.start()
    worker.join(seconds)
    if not worker.is_alive():
        return box.get("outcome", Outcome(timed_out=True))
    waited = 0.0
    while worker.is_alive() and waited < STOP_GRACE_S:
        _raise_in(worker)
        worker.join(REFIRE_S)
        waited += REFIRE_S
    return Outcome(timed_out=True, still_running=worker.is_alive())
