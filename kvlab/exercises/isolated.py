"""``check`` in a fresh process, out of the notebook's reach: cases, expected values and verdict there.

Why. A notebook cell can change kvlab (replace ``core.judge``, rebind ``nb01.kv_bytes_per_token``,
patch ``ModelSpec.kv_factor``, clear a case list), and the learner's function can catch any
exception a time limit raises (``except:`` in a retry loop) or return a result that takes
minutes to compare. So the grading happens in other processes:

* the *checker*, started once per kernel (``python -c ...serve()``, its own session), imports
  kvlab as installed and never runs a learner's code; for each check it forks
* a *judge*, which draws the cases and forks
* the *learner's process*, which receives the learner's function (``transfer``) and the
  notebook's changes to kvlab's module data (so the function runs with the values it sees in
  the notebook), calls it on each case and sends back each result as plain data. The judge,
  meanwhile, computes each expected value with kvlab's own code and compares. The learner's
  process never holds an expected value, and the judge kills it (``SIGKILL``: nothing catches
  that) once a case runs past its time limit, or its result takes longer than
  ``COMPARE_LIMIT_S`` to read.

What the learner's function prints comes back and is printed in the notebook. Where no such
process can be had (no ``fork``, as on Windows), or the function uses something that cannot be
sent (a class defined in the notebook), ``check`` runs in the kernel as before and says so.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import io
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from kvlab.exercises.canonical import NotComparable, canonical, type_name
from kvlab.exercises.catalogue import get_exercise
from kvlab.exercises.grading import (
    ReportedError,
    UnreadableResult,
    cases_for,
    copies,
    describe_error,
    grade,
    limit_for,
)
from kvlab.exercises.limits import Outcome
from kvlab.exercises.records import CheckResult
from kvlab.exercises.state import STATE, kvlab_code, module_data
from kvlab.exercises.transfer import loads_plain

START_LIMIT_S = 180.0  # the checker's start: a fresh interpreter importing kvlab (and torch)
SETUP_LIMIT_S = 60.0  # the learner's process: loading the function and the modules it names
COMPARE_LIMIT_S = 5.0  # reading one result once the learner's function returned (canonical is bounded)
MAX_OUTPUT_CHARS = 20_000  # what the learner's function prints, kept for the notebook
_HEADER = struct.Struct("<Q")


# --------------------------------------------------------------------------- messages over pipes


def _send(fd: int, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, count: int, deadline: float | None) -> bytes:
    chunks, left = [], count
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int, deadline: float | None = None, *, plain: bool = False) -> Any:
    """The next message on ``fd``; ``TimeoutError`` past ``deadline``, ``EOFError`` when the writer is gone."""
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    data = _read_exactly(fd, size, None if deadline is None else max(deadline, time.monotonic() + 5.0))
    return loads_plain(data) if plain else pickle.loads(data)


# --------------------------------------------------------------------------- the learner's process


class _Printed(io.TextIOBase):
    """``sys.stdout`` of the learner's process: what it prints goes to the judge, up to a bound."""

    def __init__(self, fd: int) -> None:
        self.fd, self.left = fd, MAX_OUTPUT_CHARS

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self.left > 0 and type(text) is str and text:
            part = text[: self.left]
            self.left -= len(part)
            _send(self.fd, ("out", part if self.left > 0 else part + "\n… (the rest of the output is cut)\n"))
        return len(text) if type(text) is str else 0


def _as_sent(value: Any) -> tuple:
    """A result as plain data (tensors kept as tensors, the judge decides), or why it is not."""
    try:
        if type(value).__module__.startswith("kvlab.exercises.nb") and hasattr(type(value), "__dataclass_fields__"):
            return ("value", value)  # an exercise's own result type, built by its `prepare` wrapper
        return ("value", canonical(value, keep_tensors=True))
    except NotComparable as why:
        return ("not comparable", type_name(value), str(why))


def _learner_process(request: dict, cases: list, fd: int) -> None:
    """Call the learner's function on every case in order; send each outcome as plain data."""
    sys.path[:] = request["path"]
    sys.stdout = sys.stderr = _Printed(fd)
    try:
        function = pickle.loads(request["function"])
        for module_name, name, value in pickle.loads(request["changes"]):
            STATE.set_value(module_name, name, value)  # the notebook's kvlab data, as the function sees it there
        exercise = get_exercise(request["exercise_id"])
        learner = exercise.prepare(function) if exercise.prepare else function
    except BaseException as exc:  # noqa: BLE001  (anything the notebook's objects do when rebuilt)
        _send(fd, ("setup", *describe_error(exc)))
        return
    before = STATE.fingerprint()
    for number, case in enumerate(cases, start=1):
        args, kwargs = copies(case)
        _send(fd, ("start", number))
        try:
            sent = ("value", learner(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001  (the learner's bug, exit() or an interrupt: reported)
            sent = ("error", *describe_error(exc), isinstance(exc, NotImplementedError))
        _send(fd, ("returned", number))
        if sent[0] == "value":
            sent = _as_sent(sent[1])
        # Reading kvlab's data takes a few ms: after the first case and the last, not after each.
        changed = STATE.changed_since(before) if number in (1, len(cases)) else None
        try:
            _send(fd, ("done", number, sent, changed))
        except Exception as exc:  # noqa: BLE001  (a value pickle cannot write)
            _send(fd, ("done", number, ("not comparable", "object", f"it could not be sent: {exc}"), changed))


# --------------------------------------------------------------------------- the judge


class _Learner:
    """The judge's view of the learner's process: outcomes read under the time limits, and what it printed."""

    def __init__(self, pid: int, fd: int, limit: float) -> None:
        self.pid, self.fd, self.limit = pid, fd, limit
        self.printed: list[str] = []
        self.changed: list[tuple[str, str]] = []
        self.setup_error: tuple[str, str] | None = None
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def reap(self) -> None:
        """Wait for the killed process to end (after the reply: its teardown need not delay it)."""
        self.stop()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)

    def outcome(self, number: int, case: Any = None) -> Outcome:
        """Case ``number``'s outcome; past a limit, the process is killed and the case timed out."""
        if self.stopped:
            return Outcome(timed_out=True)
        deadline, phase = time.monotonic() + SETUP_LIMIT_S, "setup"
        while True:
            try:
                message = _receive(self.fd, deadline, plain=True)
            except TimeoutError:
                self.stop()
                if phase == "returned":
                    return Outcome(error=ReportedError(
                        "TimeoutError", f"your function returned, but its result could not be read within "
                        f"{COMPARE_LIMIT_S:g} s"))
                return Outcome(timed_out=True)
            except EOFError:
                self.stop()
                if self.setup_error is not None:
                    kind, text = self.setup_error
                    return Outcome(error=ReportedError(kind, f"{text} (while loading your function in the checking "
                                                       "process)"))
                return Outcome(error=ReportedError("SystemExit", "the process running your function ended"))
            kind = message[0]
            if kind == "out":
                self.printed.append(message[1])
            elif kind == "setup":
                self.setup_error = (message[1], message[2])
            elif kind == "start" and message[1] == number:
                deadline, phase = time.monotonic() + self.limit, "running"
            elif kind == "returned" and message[1] == number:
                deadline, phase = time.monotonic() + COMPARE_LIMIT_S, "returned"
            elif kind == "done" and message[1] == number:
                self.changed = self.changed if message[3] is None else list(message[3])
                return _outcome_of(message[2])


def _outcome_of(sent: tuple) -> Outcome:
    if sent[0] == "value":
        return Outcome(value=sent[1])
    if sent[0] == "error":
        return Outcome(error=ReportedError(sent[1], sent[2], sent[3]))
    return Outcome(error=UnreadableResult(sent[1], sent[2]))


def _changed_note(changed: list[tuple[str, str]]) -> list[str]:
    if not changed:
        return []
    names = ", ".join(f"{m}.{n}" for m, n in changed[:6])
    return [f"  note:     your function changed kvlab's state while check() ran: {names}",
            "            (in the checking process: expected values come from kvlab's own, and this notebook's "
            "kvlab is as it was)."]


def _judge(request_fd: int, reply_fd: int, code: tuple[int, dict[str, str]]) -> None:
    """Fork the learner's process, wait for a request, draw its cases, grade the outcomes, send the result.

    Both processes exist before the request comes (``_spare``), so no fork delays a check. ``code`` is
    kvlab's code as the checker has it (``state.kvlab_code``), with a version: sent when the kernel's is older.
    """
    learner_request_fd, to_learner_fd = os.pipe()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the learner's process: it never sees an expected value
        try:
            for fd in (to_learner_fd, read_fd, request_fd, reply_fd):
                os.close(fd)
            with contextlib.suppress(EOFError):
                _learner_process(*_receive(learner_request_fd), write_fd)  # the judge's (request, cases)
        finally:
            os._exit(0)
    for fd in (learner_request_fd, write_fd):
        os.close(fd)
    try:
        request = _receive(request_fd, plain=True)
    except EOFError:  # the checker ended before this spare was used
        return
    try:
        _judge_request(request, pid, read_fd, to_learner_fd, reply_fd, code)
    except BaseException as exc:  # noqa: BLE001  (the judge must answer, whatever happened)
        with contextlib.suppress(Exception):
            _send(reply_fd, ("broken", request["number"], f"{type(exc).__name__}: {exc}"))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _judge_request(request: dict, pid: int, read_fd: int, to_learner_fd: int, reply_fd: int,
                   code: tuple[int, dict[str, str]]) -> None:
    """Grade one request with the learner's process ``pid``; exactly one reply, then the process is reaped."""
    sys.path[:] = request["path"]
    exercise = get_exercise(request["exercise_id"])
    limit = limit_for(exercise, request["time_limit"])
    cases = cases_for(exercise, request["seed"])
    _send(to_learner_fd, (request, cases))
    learner = _Learner(pid, read_fd, limit)
    reference = exercise.expected_function()

    def expected_for(case: Any) -> Any:
        args, kwargs = copies(case)
        return reference(*args, **kwargs)

    try:
        result = grade(exercise, cases, request["seed"], limit, learner.outcome, expected_for,
                       lambda: _changed_note(learner.changed))
    finally:
        learner.stop()
    news = code if request["code_version"] != code[0] else None
    number, printed = request["number"], "".join(learner.printed)
    if learner.setup_error is not None and result.cases_run <= 1 and result.status != "pass":
        reply: tuple = ("not sendable", number, learner.setup_error[1])
    else:
        reply = ("result", number, result, printed, news)
        try:
            pickle.dumps(reply)
        except Exception:  # noqa: BLE001  (a case or value pickle cannot write: the message is what matters)
            plain = CheckResult(result.exercise_id, result.status, result.cases_run, result.message, seed=result.seed)
            reply = ("result", number, plain, printed, news)
    _send(reply_fd, reply)
    with contextlib.suppress(Exception):
        learner.reap()


def _spare(requests_fd: int, reply_fd: int, code: tuple[int, dict[str, str]]) -> tuple[int, int]:
    """Fork a judge (which forks its learner's process) to wait for the next request: (pid, fd to send it on)."""
    request_fd, send_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(send_fd)
            os.close(requests_fd)
            _judge(request_fd, reply_fd, code)
        finally:
            os._exit(0)
    os.close(request_fd)
    return pid, send_fd


def _retire(spare: tuple[int, int]) -> None:
    """End a spare judge that was never used (it reads EOF) and wait for it."""
    os.close(spare[1])
    with contextlib.suppress(ChildProcessError):
        os.waitpid(spare[0], 0)


def serve() -> None:
    """The checker's loop: one request at a time on stdin, each graded by a spare judge; ends at EOF."""
    requests, reply_fd = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # a stray print (a warning at import) must not land in the replies
    with open(os.devnull, "rb") as devnull:
        os.dup2(devnull.fileno(), 0)
    torch = sys.modules.get("torch")
    if torch is not None:  # the judge and the learner's process run side by side on exercise-sized tensors:
        torch.set_num_threads(1)  # one thread each (two spinning thread pools made a check 80x slower)
    # This process imported kvlab afresh and never runs a learner's code: its module data is kvlab's own.
    # A judge's `STATE.own_values()` reads it here (without this, it started a whole new checker per failing
    # check, ~2 s each, to name a known mistake).
    STATE.fetch = module_data
    STATE.changes()
    gc.freeze()  # what kvlab imported stays out of the collector's way: fewer pages copied in each fork
    code, warm = (0, kvlab_code()), set()
    _send(reply_fd, ("ready", code))
    spare = _spare(requests, reply_fd, code)
    while True:
        try:
            request = _receive(requests, plain=True)
        except EOFError:
            _retire(spare)
            return
        if request["kind"] == "data":
            _send(reply_fd, ("data", request["number"], module_data(request["modules"])))
            continue
        missing = [m for m in request["modules"] if m not in sys.modules]
        if missing or request["exercise_id"] not in warm:  # done once here, for every later judge to inherit
            sys.path[:] = request["path"]
            for module_name in missing:  # kvlab's modules the notebook loaded, a test module, a learner's file
                with contextlib.suppress(Exception):
                    importlib.import_module(module_name)
            with contextlib.suppress(Exception):  # kvlab's door checks compile on first use: once, here
                exercise = get_exercise(request["exercise_id"])
                cases = cases_for(exercise, 0)
                if exercise.prepare is not None:  # a kernel launch: Triton's interpreter rewrites each @jit
                    args, kwargs = copies(cases[0])  # function it meets once per process; here, not per check
                    exercise.prepare(exercise.reference)(*args, **kwargs)
            warm.add(request["exercise_id"])
            STATE.changes()  # kvlab's own values of the modules just imported, read once for every judge
            gc.freeze()
            code = (code[0] + 1, kvlab_code()) if missing else code
            _retire(spare)
            spare = _spare(requests, reply_fd, code)
        (judge, send_fd), spare = spare, None
        _send(send_fd, request)
        os.close(send_fd)
        spare = _spare(requests, reply_fd, code)
        _, status = os.waitpid(judge, 0)
        if status != 0:
            _send(reply_fd, ("broken", request["number"], f"the judging process ended with status {status}"))


# --------------------------------------------------------------------------- the kernel's side


class Unavailable(Exception):  # noqa: N818  (a reason to check in the kernel instead)
    """No checking process could be used for this check; the message says why."""


class Checker:
    """The checker process of this kernel: started on the first check, ended with the kernel."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._own_code: tuple[int, dict[str, str]] = (-1, {})
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._number = 0  # of the last request: each reply names the request it answers

    @staticmethod
    def supported() -> bool:
        return hasattr(os, "fork") and hasattr(select, "select") and sys.platform != "win32"

    def _start(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        # The checker forks every judge: torch must ask NVML, not CUDA, whether there is a GPU (CUDA does
        # not survive a fork), so the judges and learners' processes can each start CUDA of their own.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTORCH_NVML_BASED_CUDA_CHECK="1")
        process = subprocess.Popen(
            [sys.executable, "-c", "from kvlab.exercises.isolated import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True, close_fds=True)
        try:
            kind, own_code = _receive(process.stdout.fileno(), time.monotonic() + START_LIMIT_S)
        except BaseException:
            self._kill(process)
            raise
        assert kind == "ready"
        self._process, self._own_code = process, own_code
        return process

    @staticmethod
    def _kill(process: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            process.wait(5)
        for stream in (process.stdin, process.stdout):
            with contextlib.suppress(Exception):
                stream.close()

    def close(self) -> None:
        """End the checker and anything it forked (at kernel exit, or after a broken exchange)."""
        if self._process is not None:
            self._kill(self._process)
            self._process = None

    @property
    def own_code(self) -> dict[str, str]:
        """kvlab's functions, classes and methods as the fresh process has them (``state.kvlab_code``)."""
        return self._own_code[1]

    def own_data(self, modules: list[str]) -> dict[str, dict[str, Any]]:
        """kvlab's own module data of ``modules``, as the checker imported them (``KvlabState.fetch``)."""
        if not self.supported() or self._broken is not None:
            raise Unavailable("no checking process")
        return self._exchange({"kind": "data", "modules": modules}, START_LIMIT_S)[2]

    def _exchange(self, request: dict, backstop_s: float) -> tuple:
        with self._lock:
            try:
                process = self._start()
            except Exception as exc:  # noqa: BLE001
                self._broken = f"the checking process could not start ({type(exc).__name__}: {exc})"
                raise Unavailable(self._broken) from None
            self._number += 1
            deadline = time.monotonic() + backstop_s
            try:
                _send(process.stdin.fileno(), {**request, "number": self._number})
                while True:  # a late word about an earlier request (a judge that died after replying) is skipped
                    reply = _receive(process.stdout.fileno(), deadline)
                    if reply[1] == self._number:
                        return reply
            except BaseException:  # a time-out, a dead checker or the learner's Stop: start afresh next time
                self.close()
                raise

    def check(self, request: dict, backstop_s: float) -> tuple[CheckResult, str]:
        """Send one check; its result and what the learner's function printed. ``Unavailable`` if none."""
        if not self.supported():
            raise Unavailable("this system cannot fork a process")
        if self._broken is not None:
            raise Unavailable(self._broken)
        loaded = [m for m in sys.modules if m.startswith("kvlab.")]  # so the checker has kvlab's own of each
        modules = sorted({*request["modules"], *loaded})
        reply = self._exchange({"kind": "check", **request, "modules": modules, "code_version": self._own_code[0]},
                               backstop_s)
        if reply[0] == "result":
            if reply[4] is not None:
                self._own_code = reply[4]
            return reply[2], reply[3]
        raise Unavailable(reply[2] if reply[0] == "not sendable" else f"the checking process failed: {reply[2]}")


CHECKER = Checker()
atexit.register(CHECKER.close)
STATE.fetch = CHECKER.own_data

