"""A Ctrl-C at a chosen line: a tracer that raises ``KeyboardInterrupt`` at the k-th line kvlab.core runs in a step.

Lines under the executor are left out (a failure there fails the step's requests, a behaviour of its own), the
line that calls it included (``kvlab.core.sched.loop._execute``, whose ``try`` holds that call), and so are the
undo record's (``kvlab.core.sched.snapshot``), which runs only once the interrupt came.
"""

from __future__ import annotations

import linecache
from pathlib import Path

import kvlab.core

CORE = str(Path(kvlab.core.__file__).parent)


def calls_the_executor(frame) -> bool:
    """True on the line that calls the executor: an interrupt there lands in the executor's ``try``, a failure of
    the executor's own."""
    return "executor.execute_model(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def under_executor_or_snapshot(frame) -> bool:
    """True inside an executor's ``execute_model`` (or the loop's call of it) or the undo record, however deep."""
    while frame is not None:
        if frame.f_code.co_name in ("execute_model", "_execute") or frame.f_code.co_filename.endswith("snapshot.py"):
            return True
        frame = frame.f_back
    return False


class InterruptAtLine:
    """``sys.settrace(InterruptAtLine(k))``: a ``KeyboardInterrupt`` at the ``k``-th line counted (k = 0: never).

    ``lines`` counts the lines seen; ``active`` (True unless set otherwise) says when to count.
    """

    def __init__(self, k: int) -> None:
        self.k, self.lines, self.active = k, 0, True

    def __call__(self, frame, event, arg):
        if not self.active or not frame.f_code.co_filename.startswith(CORE) or under_executor_or_snapshot(frame):
            return None
        return self.line

    def line(self, frame, event, arg):
        if event == "line" and self.active and not calls_the_executor(frame):
            self.lines += 1
            if self.lines == self.k:
                raise KeyboardInterrupt
        return self.line
