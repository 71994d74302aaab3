"""Sending a learner's function to the checking process, and reading back only plain data.

A function defined in a notebook cell lives in ``__main__``, which the checking process does
not share, so ``pickle`` cannot send it by name. ``dumps_function`` sends such a function by
value, as cloudpickle does: its code (``marshal``, the same interpreter reads it back), the
globals its code names, its defaults, closure and the source lines of its cell (so
``inspect.getsource`` and ``@triton.jit`` work there too); what it uses is sent the same way,
modules by name and anything importable (kvlab, numpy, a test module) by reference. A class or
an object of a class defined in the notebook cannot be sent: ``NotSendable`` says which.

``loads_plain`` reads what the learner's process sends back with an unpickler that builds only
plain values, tensors and the exercise modules' own result types: no other class is looked up.
"""

from __future__ import annotations

import builtins
import importlib
import io
import linecache
import marshal
import pickle
import types
from collections.abc import Callable
from typing import Any

_PLAIN_GLOBALS = {("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"), ("builtins", "slice"),
                  ("builtins", "getattr"), ("fractions", "Fraction"), ("collections", "OrderedDict"),
                  ("copyreg", "_reconstructor"), ("builtins", "object")}


class NotSendable(Exception):  # noqa: N818  (a reason, not a fault of kvlab's)
    """The learner's function uses something that cannot leave this process; the message names it."""


def _importable(obj: Any) -> bool:
    """True when ``obj`` can be found again by its module and qualified name (pickle's by-reference rule)."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module_name or not qualname or module_name == "__main__" or "<locals>" in qualname:
        return False
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:
        return False
    return found is obj


def _names(code: types.CodeType) -> set[str]:
    """Every global name ``code`` and the code nested in it may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _make_function(code_bytes: bytes, name: str, qualname: str, module: str, cells: int) -> types.FunctionType:
    """The skeleton of a sent function; ``_fill_function`` gives it its globals, defaults and closure."""
    code = marshal.loads(code_bytes)
    closure = tuple(types.CellType() for _ in range(cells)) or None
    fn = types.FunctionType(code, {"__builtins__": builtins, "__name__": module}, name, None, closure)
    fn.__qualname__ = qualname
    fn.__module__ = module
    return fn


def _fill_function(fn: types.FunctionType, state: tuple) -> None:
    globals_, defaults, kwdefaults, cell_values, attributes, filename, lines = state
    fn.__globals__.update(globals_)
    fn.__defaults__, fn.__kwdefaults__ = defaults, kwdefaults
    for cell, value in zip(fn.__closure__ or (), cell_values, strict=True):
        if value is not _EMPTY:
            cell.cell_contents = value
    fn.__dict__.update(attributes)
    if lines and filename not in linecache.cache:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


class _Empty:
    """The contents of a closure cell not yet filled."""

    def __reduce__(self) -> str:
        return "_EMPTY"


_EMPTY = _Empty()


def _identity(value: Any) -> Any:
    return value


class _Pickler(pickle.Pickler):
    """Functions the other process cannot import by value; modules by name; notebook classes refused.

    ``modules`` collects the modules named by reference, so the other process can import them once.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.modules: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType):
            self.modules.add(obj.__name__)
            return importlib.import_module, (obj.__name__,)
        if isinstance(obj, types.FunctionType):
            if _importable(obj):
                self.modules.add(obj.__module__)
                return NotImplemented
            return self._by_value(obj)
        raw = getattr(obj, "fn", None)
        if type(obj).__module__.startswith("triton") and isinstance(raw, types.FunctionType):
            return _identity, (raw,)  # a @triton.jit function travels as the function it wraps
        if isinstance(obj, type):
            if not _importable(obj):
                raise NotSendable(f"the class {obj.__qualname__} is defined in this notebook")
            self.modules.add(obj.__module__)
        if not isinstance(obj, type) and type(obj).__module__ == "__main__":
            raise NotSendable(f"a {type(obj).__qualname__} (a class defined in this notebook)")
        return NotImplemented

    @staticmethod
    def _by_value(fn: types.FunctionType) -> tuple:
        code = fn.__code__
        globals_ = {n: fn.__globals__[n] for n in sorted(_names(code)) if n in fn.__globals__}
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:
                cells.append(_EMPTY)
        lines = linecache.getlines(code.co_filename)
        skeleton = (marshal.dumps(code), fn.__name__, fn.__qualname__, fn.__module__, len(cells))
        state = (globals_, fn.__defaults__, fn.__kwdefaults__, tuple(cells), dict(fn.__dict__), code.co_filename,
                 lines)
        return _make_function, skeleton, state, None, None, _fill_function


def dumps_function(fn: Callable[..., Any]) -> tuple[bytes, list[str]]:
    """``fn`` as bytes the checking process turns back into the same function, and the modules it names;
    ``NotSendable`` if it cannot be sent."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        pickler.dump(fn)
    except NotSendable:
        raise
    except RecursionError:
        raise NotSendable("what it uses is nested too deeply") from None
    except Exception as exc:
        raise NotSendable(f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return buffer.getvalue(), sorted(pickler.modules)


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain values, torch tensors and ``kvlab.exercises.nbXX``'s own result types, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = ((module, name) in _PLAIN_GLOBALS or module == "torch" or module.startswith("torch.")
                   or module.startswith("kvlab.exercises.nb"))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not plain data")
        return super().find_class(module, name)


def loads_plain(data: bytes) -> Any:
    """What the learner's process sent, read back as plain data only."""
    return _PlainUnpickler(io.BytesIO(data)).load()
