"""kvlab's own values, protected from the notebook: what the grader computes expected results from.

A learner can change kvlab from a notebook cell (``KV_DTYPE_BYTES["bf16"] = 1``), and the
change lasts until the kernel restarts. The references that ``check`` runs read those same
module globals, so a patch could move the expected values towards a wrong answer. This
module keeps kvlab's own values and puts them back for exactly as long as a reference runs.

Where kvlab's own values come from: a fresh Python process (the checking process of
``isolated.py`` when it runs) imports the same kvlab modules and sends their module-level data
back (pickled), once per kernel and module. A copy taken in this
process could already hold a patch made before ``kvlab.exercises`` was imported; the fresh
process cannot. Guarded are the public module-level *data* (numbers, strings, bytes, paths and
containers or dataclasses of them) of the layers the references read at call time: the top
level, ``capacity``, ``core`` and ``sim``. Functions and classes are not compared: a rebound
function could not be told from a lazily bound one. Where no process can be started, the
values at import of ``kvlab.exercises`` stand in, and ``source`` says so.

Code is compared apart (``kvlab_code``): each public function, class and method of kvlab's by
where it was defined, so ``check`` can name what a notebook replaced (``core.judge``,
``ModelSpec.kv_factor``) next to kvlab as the fresh process has it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from kvlab.exercises.canonical import short_repr

GUARDED = ("kvlab", "kvlab.errors", "kvlab.units", "kvlab.data", "kvlab.machine", "kvlab._validate",
           "kvlab.kv_cache_interface")
GUARDED_PACKAGES = ("kvlab.capacity", "kvlab.core", "kvlab.sim")
#: Values that differ between processes by design, so a fresh process cannot vouch for them.
PER_PROCESS = {("kvlab.core.hashing", "NONE_HASH")}  # random unless PYTHONHASHSEED is set, as in vLLM
CHILD_TIMEOUT_S = 120


def is_data(value, depth=0):
    """True for plain data: scalars, paths, and containers or dataclass instances holding only plain data."""
    if depth > 8:
        return False
    if value is None or type(value) in (bool, int, float, complex, str, bytes) or type(value).__name__ == "Fraction":
        return True
    if isinstance(value, type) or callable(value):
        return False
    if type(value) in (list, tuple, set, frozenset):
        return all(is_data(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(is_data(k, depth + 1) and is_data(v, depth + 1) for k, v in value.items())
    if hasattr(type(value), "__dataclass_fields__"):
        return all(is_data(getattr(value, f), depth + 1) for f in type(value).__dataclass_fields__)
    return "PurePath" in [c.__name__ for c in type(value).__mro__]


def module_data(names: list[str]) -> dict[str, dict[str, Any]]:
    """The public, picklable module data of each named module, imported here (in a fresh process: kvlab's own)."""
    out = {}
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        values = {}
        for key, value in vars(module).items():
            if key.startswith("_") or not is_data(value) or _pickle(value) is None:
                continue
            values[key] = value
        out[name] = values
    return out


_CHILD = """import pickle, sys
from kvlab.exercises.state import module_data
sys.stdout.buffer.write(pickle.dumps(module_data(sys.argv[1:])))
"""


def guarded_modules() -> list[str]:
    """The kvlab modules loaded now whose data is guarded."""
    return sorted(name for name in list(sys.modules) if name in GUARDED or name.startswith(
        tuple(p + "." for p in GUARDED_PACKAGES)) or name in GUARDED_PACKAGES)


def same(a: Any, b: Any, depth: int = 0) -> bool:
    """Equal with exact types, through containers and dataclass fields (NaN equals NaN)."""
    if type(a) is not type(b) or depth > 10:
        return False
    if type(a) is float:
        return a == b or (a != a and b != b)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y, depth + 1) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return a.keys() == b.keys() and all(same(a[k], b[k], depth + 1) for k in a)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name), depth + 1) for f in dataclasses.fields(a))
    return a == b


_MISSING = object()


def _pickle(value: Any) -> bytes | None:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None


def _describe(where: str, live: Any, own: Any) -> str:
    if live is _MISSING:
        return f"{where} was deleted"
    if type(live) is dict and type(own) is dict:
        keys = [k for k in {**own, **live} if not same(live.get(k, _MISSING), own.get(k, _MISSING))]
        return "; ".join(_describe(f"{where}[{k!r}]", live.get(k, _MISSING), own.get(k, _MISSING)) if k in own
                         else f"{where}[{k!r}] was added" for k in keys[:3])
    return f"{where} is {short_repr(live)}, kvlab's own value is {short_repr(own)}"


def _replace_contents(target: Any, source: Any) -> None:
    """Make a dict, list or set hold what ``source`` holds, keeping its identity (other modules alias it)."""
    if type(target) is list:
        target[:] = source
    else:
        target.clear()
        target.update(source)


class KvlabState:
    """kvlab's own module data, compared with what the modules hold now."""

    def __init__(self) -> None:
        self.own: dict[str, dict[str, Any]] = {}
        self._pickled: dict[tuple[str, str], bytes] = {}  # a fast first test; equal pickles mean equal values
        self._modules_seen = 0
        self.source = "a fresh Python process"
        #: Where kvlab's own values come from: the checking process when it runs (``isolated``), else a fresh one.
        self.fetch: Callable[[list[str]], dict[str, dict[str, Any]]] | None = None
        self._at_import = self._read_here(guarded_modules())

    @staticmethod
    def _read_here(names: list[str]) -> dict[str, dict[str, Any]]:
        out = {}
        for name in names:
            module = sys.modules.get(name)
            if isinstance(module, ModuleType):
                out[name] = {k: copy.deepcopy(v) for k, v in vars(module).items()
                             if not k.startswith("_") and is_data(v)}
        return out

    def _load(self) -> None:
        """Fetch kvlab's own values for every guarded module loaded now and not fetched yet."""
        if len(sys.modules) == self._modules_seen:
            return
        self._modules_seen = len(sys.modules)
        wanted = [m for m in guarded_modules() if m not in self.own]
        if not wanted:
            return
        fetched = self._fetch(wanted)
        for name in wanted:
            self.own[name] = {k: v for k, v in fetched.get(name, {}).items() if (name, k) not in PER_PROCESS}
            self._pickled.update({(name, k): _pickle(v) for k, v in self.own[name].items()})

    def _fetch(self, wanted: list[str]) -> dict[str, dict[str, Any]]:
        """kvlab's own data of the ``wanted`` modules, from a process that imported them afresh."""
        if self.fetch is not None:
            with contextlib.suppress(Exception):
                return self.fetch(wanted)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            done = subprocess.run([sys.executable, "-c", _CHILD, *wanted], capture_output=True, check=True,
                                  timeout=CHILD_TIMEOUT_S, env=env)
            return pickle.loads(done.stdout)
        except Exception:  # no process, no pickle: fall back on the values seen at import
            self.source = "the values at import of kvlab.exercises (no fresh process could be started)"
            return {m: self._at_import.get(m) or self._read_here([m]).get(m, {}) for m in wanted}

    def changes(self) -> list[tuple[str, str]]:
        """(module, name) of every guarded value that differs from kvlab's own."""
        self._load()
        found = []
        for module_name, values in self.own.items():
            module = sys.modules.get(module_name)
            for name, own in values.items():
                live = vars(module).get(name, _MISSING) if module is not None else own
                if live is not own and _pickle(live) != self._pickled[module_name, name] and not same(live, own):
                    found.append((module_name, name))
        return found

    @staticmethod
    def fingerprint() -> dict[tuple[str, str], bytes | None]:
        """The guarded module data as it is now, pickled: cheap, and needs no fresh process."""
        return {(m, k): _pickle(v) for m in guarded_modules() if isinstance(sys.modules.get(m), ModuleType)
                for k, v in vars(sys.modules[m]).items() if not k.startswith("_") and is_data(v)}

    def changed_since(self, fingerprint: dict[tuple[str, str], bytes | None]) -> list[tuple[str, str]]:
        """(module, name) of the guarded values that changed since ``fingerprint`` was taken."""
        now = self.fingerprint()
        return sorted(key for key in {*fingerprint, *now} if fingerprint.get(key, b"") != now.get(key, b""))

    def describe(self, changes: list[tuple[str, str]]) -> list[str]:
        """One line per change: where, what it holds now, and kvlab's own value."""
        return [_describe(f"{m}.{n}", vars(sys.modules[m]).get(n, _MISSING), self.own[m][n]) for m, n in changes]

    @staticmethod
    def set_value(module_name: str, name: str, value: Any) -> None:
        """Give ``module.name`` a value (in place for a dict, list or set, which other modules alias)."""
        module = sys.modules.get(module_name)
        if module is None:
            return
        live = vars(module).get(name, _MISSING)
        if type(live) is type(value) and type(live) in (dict, list, set):
            _replace_contents(live, value)
        else:
            setattr(module, name, value)

    def live_changes(self) -> list[tuple[str, str, Any]]:
        """(module, name, value now) of every guarded value that differs from kvlab's own."""
        return [(m, n, vars(sys.modules[m]).get(n)) for m, n in self.changes() if n in vars(sys.modules[m])]

    def _put_back(self, changes: list[tuple[str, str]]) -> list[Any]:
        """Give every changed value kvlab's own; return what undoes that."""
        undo = []
        for module_name, name in changes:
            module, own = sys.modules[module_name], copy.deepcopy(self.own[module_name][name])
            live = vars(module).get(name, _MISSING)
            if type(live) is type(own) and type(live) in (dict, list, set):
                undo.append((_replace_contents, live, copy.copy(live)))
                _replace_contents(live, own)
            else:
                undo.append((setattr, module, name, live) if live is not _MISSING else (delattr, module, name))
                setattr(module, name, own)
        return undo

    @contextlib.contextmanager
    def own_values(self) -> Iterator[list[tuple[str, str]]]:
        """Run the body with kvlab's own values in place, then put the notebook's back; yields the changes."""
        changes = self.changes()
        undo = self._put_back(changes)
        try:
            yield changes
        finally:
            for fn, *args in reversed(undo):
                fn(*args)

    def restore(self) -> list[str]:
        """Put kvlab's own values back for good; returns a line per value restored."""
        changes = self.changes()
        lines = self.describe(changes)
        self._put_back(changes)
        return lines


def _code_signature(value: Any) -> str | None:
    """Where a function, method or class of kvlab's was defined; None for data (compared apart)."""
    if isinstance(value, (staticmethod, classmethod)):
        inner = _code_signature(value.__func__)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, property):
        return "property(" + ", ".join(str(_code_signature(f)) for f in (value.fget, value.fset, value.fdel)) + ")"
    if isinstance(value, ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    code = getattr(value, "__code__", None)
    if inspect.isfunction(value) and code is not None:
        return f"{value.__module__}.{value.__qualname__} at {code.co_filename}:{code.co_firstlineno}"
    if callable(value):
        return f"{type(value).__qualname__} {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return None


def kvlab_code() -> dict[str, str]:
    """Every public function, class and method of the kvlab modules loaded now, by dotted name."""
    found = {}
    for module_name in [m for m in list(sys.modules) if m == "kvlab" or m.startswith("kvlab.")]:
        module = sys.modules.get(module_name)
        if not isinstance(module, ModuleType):
            continue
        for name, value in list(vars(module).items()):
            if name.startswith("_"):
                continue
            signature = _code_signature(value)
            if signature is not None:
                found[f"{module_name}.{name}"] = signature
            if isinstance(value, type) and value.__module__ == module_name:
                for attribute, member in list(vars(value).items()):
                    member_signature = None if attribute.startswith("_") else _code_signature(member)
                    if member_signature is not None:
                        found[f"{module_name}.{name}.{attribute}"] = member_signature
    return found


def code_changes(own: dict[str, str]) -> list[str]:
    """Dotted names of kvlab's functions, classes and methods that differ here from ``own`` (kvlab as installed)."""
    here = kvlab_code()
    loaded = {m for m in sys.modules if m == "kvlab" or m.startswith("kvlab.")}
    return sorted(name for name, signature in own.items()
                  if here.get(name, signature if _module_of(name, loaded) is None else None) != signature)


def _module_of(name: str, loaded: set[str]) -> str | None:
    """The loaded module a dotted name lives in (None when that module is not loaded here)."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:end]) in loaded:
            return ".".join(parts[:end])
    return None


STATE = KvlabState()  # created at import of kvlab.exercises, after every notebook's module has loaded kvlab


def restore_kvlab_state() -> list[str]:
    """Undo every change a notebook made to kvlab's module data (what ``check`` reports); lists what it undid."""
    return STATE.restore()
