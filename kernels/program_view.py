"""Which elements each program of a Triton launch loaded and stored: the interpreter's per-program view.

``traced_launch(kernel, grid, tensors, scalars, constants)`` runs a ``@triton.jit`` kernel (or the plain
function it wraps) under Triton's interpreter and records, for every program of the grid, the elements
of each tensor argument it read with ``tl.load`` and wrote with ``tl.store`` (masked-off lanes are not
accesses: Triton never touches them). Notebook 05's puzzles show it beside each kernel the learner writes.

How, without patching Triton. Triton-Puzzles got this view by replacing functions inside the
interpreter (``interpreter_builder.create_load`` and friends), which broke with each release. Here
nothing of Triton is replaced. The kernel is rebuilt from its own code with one change to *its*
globals: the name bound to ``triton.language`` (``tl``) points at a stand-in module that forwards every
attribute to ``triton.language`` except ``load`` and ``store``, which first write the addresses they are
given (``pointer.to(tl.int64)``), their mask and the program id into a small int64 tensor of ours
(``tl.store`` through a pointer made from its address), then call the real ``tl.load``/``tl.store``.
That uses only the language, plus two documented properties of ``TRITON_INTERPRET=1``: a kernel runs as
ordinary Python, one program after another, and a CPU tensor's pointer is its own address. Helper
``@triton.jit`` functions the kernel calls are rebuilt the same way, so their loads count too. After the
launch, each address is mapped back to the tensor argument it falls in and to an element index.
Addresses inside no tensor argument are counted as ``outside`` (an out-of-bounds access).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from kvlab.kernels._backend import TRITON_INTERPRETER, backend, require_triton

from kvlab.errors import BackendUnavailableError, KernelInputError
from kvlab.units import format_ranges

require_triton()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

Program = tuple[int, int, int]


def _helpers(fn: types.FunctionType) -> list[str]:
    """Names of the global functions ``fn``'s code calls that are Triton functions themselves."""
    names, stack = set(), [fn.__code__]
    while stack:
        code = stack.pop()
        names |= set(code.co_names)
        stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    found = []
    for name in sorted(names):
        value = fn.__globals__.get(name)
        raw = getattr(value, "fn", value)
        if isinstance(raw, types.FunctionType) and raw is not fn and _uses_triton(raw):
            found.append(name)
    return found


def _uses_triton(fn: types.FunctionType) -> bool:
    """True for a function whose module holds ``triton.language``: a kernel or a helper written in Triton."""
    return any(value is tl for value in fn.__globals__.values())


def rebuild(fn: Callable, language: Any = None, jit: bool = True, _seen: dict | None = None) -> Any:
    """``fn`` (plain or ``@triton.jit``) decorated afresh for this process, its Triton helpers too.

    With ``language``, every global name bound to ``triton.language`` is bound to ``language`` instead
    (the tracing stand-in); ``triton.language`` itself stays reachable under a hidden name, so the
    interpreter still finds the module it runs the kernel with. Helpers stay plain functions in the
    interpreter, where calling one is calling Python (a ``@triton.jit`` one re-patches the language at
    every call), and are decorated for a GPU, where a kernel may call only ``@triton.jit`` functions.
    """
    raw = getattr(fn, "fn", fn)
    if not isinstance(raw, types.FunctionType):
        raise KernelInputError(f"expected a function (plain or @triton.jit), got {type(fn).__name__}")
    seen = {} if _seen is None else _seen
    if raw in seen:
        return seen[raw]
    names = dict(raw.__globals__)
    if language is not None:
        for name, value in raw.__globals__.items():
            if value is tl:
                names[name] = language
        names["__kvlab_triton_language__"] = tl
    copy = types.FunctionType(raw.__code__, names, raw.__name__, raw.__defaults__, raw.__closure__)
    copy.__annotations__ = dict(raw.__annotations__)
    copy.__kwdefaults__ = raw.__kwdefaults__
    copy.__module__, copy.__qualname__ = raw.__module__, raw.__qualname__
    result = triton.jit(copy) if jit else copy
    seen[raw] = result
    for name in _helpers(raw):      # in the interpreter a plain helper is a plain call, without the re-patching
        names[name] = rebuild(raw.__globals__[name], language, backend() != TRITON_INTERPRETER, seen)
    return result


class _Recorder:
    """Collects what the stand-in ``tl.load``/``tl.store`` report: one int64 tensor per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.Tensor, int]] = []   # (kind, [3 + 2n] pid, addresses, mask, n)

    def record(self, kind: str, pointer: Any, mask: Any) -> None:
        shape = [int(s) for s in pointer.shape]
        n = 1
        for s in shape:
            n *= s
        buffer = torch.empty(3 + 2 * n, dtype=torch.int64)
        self.calls.append((kind, buffer, n))
        base = tl.full([], buffer.data_ptr(), tl.int64).to(tl.pointer_type(tl.int64))
        for axis in range(3):
            tl.store(base + axis, tl.program_id(axis).to(tl.int64))
        on = tl.full(shape, 1, tl.int64)
        if mask is not None:
            on = tl.where(mask, on, 0)                                   # broadcast to the pointer's shape
        if shape:
            index = tl.reshape(tl.arange(0, n), shape)
            tl.store(base + 3 + index, pointer.to(tl.int64))
            tl.store(base + 3 + n + index, on)
        else:
            tl.store(base + 3, pointer.to(tl.int64))
            tl.store(base + 3 + n, on)

    def language(self) -> types.ModuleType:
        """The stand-in for ``triton.language``: itself everywhere but ``load`` and ``store``."""
        module = types.ModuleType("triton_language_traced")
        module.__getattr__ = lambda name: getattr(tl, name)               # type: ignore[method-assign]

        def load(pointer, mask=None, other=None, *args, **kwargs):
            self.record("load", pointer, mask)
            return tl.load(pointer, mask, other, *args, **kwargs)

        def store(pointer, value, mask=None, *args, **kwargs):
            self.record("store", pointer, mask)
            return tl.store(pointer, value, mask, *args, **kwargs)

        module.load, module.store = load, store
        return module


@dataclasses.dataclass
class ProgramTrace:
    """What every program of one launch touched: ``accesses[program][(kind, tensor)]`` = sorted flat indices."""

    grid: Program
    shapes: dict[str, tuple[int, ...]]
    accesses: dict[Program, dict[tuple[str, str], torch.Tensor]]   # in the order first touched
    outside: dict[Program, int]                      # in-mask lanes whose address is in no tensor argument

    def programs(self) -> list[Program]:
        """Every program of the grid, in launch order (the interpreter's: axis 0 outermost)."""
        return [(x, y, z) for x in range(self.grid[0]) for y in range(self.grid[1]) for z in range(self.grid[2])]

    def flat(self, program: Sequence[int], kind: str, tensor: str) -> torch.Tensor:
        """Flat indices of ``tensor``'s elements that ``program`` loaded (``kind="load"``) or stored."""
        if kind not in ("load", "store"):
            raise KernelInputError(f"kind must be 'load' or 'store', got {kind!r}")
        if tensor not in self.shapes:
            raise KernelInputError(f"tensor must be one of {sorted(self.shapes)}, got {tensor!r}")
        empty = torch.empty(0, dtype=torch.int64)
        return self.accesses.get(_program(program), {}).get((kind, tensor), empty)

    def touched(self, program: Sequence[int], kind: str, tensor: str) -> set[tuple[int, ...]]:
        """The same as index tuples of ``tensor``'s shape."""
        flat = self.flat(program, kind, tensor)
        return set(_unravel(flat.tolist(), self.shapes[tensor]))

    def busy(self) -> list[Program]:
        """The programs that touched anything (the others exited at once)."""
        return [p for p in self.programs() if self.accesses.get(p) or self.outside.get(p)]

    def picture(self, program: Sequence[int], tensor: str, rows: int, cols: int | None = None,
                names: Sequence[str] | None = None) -> str:
        """A map of ``tensor`` as ``program`` touched it: axis ``rows`` down, axis ``cols`` across.

        ``█`` marks a (row, column) where the program loaded or stored at least one element, ``·``
        one it left alone; the other axes are folded and said in words ("dim 0-15"). With ``cols``
        None the one axis ``rows`` is drawn across a single line. ``names`` name the axes.
        """
        shape = self.shapes[tensor]
        names = list(names) if names is not None else [f"axis {a}" for a in range(len(shape))]
        seen = self.touched(program, "load", tensor) | self.touched(program, "store", tensor)
        kinds = [k for k in ("load", "store") if self.touched(program, k, tensor)]
        head = (f"{_shown(tensor)}[{', '.join(names)}] "
                f"{' and '.join('loaded' if k == 'load' else 'stored' for k in kinds)}"
                f" by program {self.name(program)}")
        if not seen:
            return f"{_shown(tensor)}: untouched by program {self.name(program)}"
        folded = [a for a in range(len(shape)) if a not in (rows, cols)]
        if folded:
            head += " (" + ", ".join(f"{names[a]} {format_ranges(sorted({t[a] for t in seen}))}" for a in folded) + ")"
        if cols is None:
            hit = {t[rows] for t in seen}
            return head + f"\n  {names[rows]} 0..{shape[rows] - 1}: " + "".join(
                "█" if r in hit else "·" for r in range(shape[rows]))
        hit = {(t[rows], t[cols]) for t in seen}
        width = len(str(shape[rows] - 1))
        lines = [head, " " * (len(names[rows]) + width + 4) + f"{names[cols]} 0..{shape[cols] - 1}"]
        for r in range(shape[rows]):
            cells = "".join("█" if (r, c) in hit else "·" for c in range(shape[cols]))
            lines.append(f"  {names[rows]} {r:>{width}} {cells}")
        return "\n".join(lines)

    def summary(self, program: Sequence[int], kind: str, tensor: str, outer: int, inner: int | None = None,
                names: Sequence[str] | None = None) -> str:
        """What ``program`` loaded (or stored) of ``tensor`` in words: ``block 7 slot 0-3; block 2 slot 0-1``,
        grouped by axis ``outer`` in the order the program first touched each group."""
        flat = self.flat(program, kind, tensor)
        if not len(flat):
            return "nothing"
        names = list(names) if names is not None else [f"axis {a}" for a in range(len(self.shapes[tensor]))]
        groups: dict[int, set[int]] = {}                  # in the order the program first touched them
        for t in _unravel(flat.tolist(), self.shapes[tensor]):
            groups.setdefault(t[outer], set()).add(t[inner] if inner is not None else 0)
        if inner is None:
            return f"{names[outer]} {format_ranges(sorted(groups))}"
        runs: list[tuple[list[int], set[int]]] = []        # neighbours with the same inner indices: one run
        for o, i in groups.items():
            if runs and runs[-1][0][-1] == o - 1 and runs[-1][1] == i:
                runs[-1][0].append(o)
            else:
                runs.append(([o], i))
        return "; ".join(f"{names[outer]} {format_ranges(o)} {names[inner]} {format_ranges(sorted(i))}"
                         for o, i in runs)

    def name(self, program: Sequence[int]) -> tuple[int, ...]:
        """A program's id with the grid's unused trailing axes left out: ``(3,)`` for a 1-D grid."""
        return _program(program)[:_axes(self.grid)]


def _unravel(flat: list[int], shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Flat indices as index tuples of a contiguous ``shape`` (``torch.unravel_index`` imports sympy: seconds)."""
    out = []
    for i in flat:
        index = []
        for size in reversed(shape):
            i, r = divmod(i, size)
            index.append(r)
        out.append(tuple(reversed(index)))
    return out


def _shown(tensor: str) -> str:
    """A pointer argument's name as a reader says it: ``key_cache`` for ``key_cache_ptr``."""
    return tensor.removesuffix("_ptr")


def _axes(grid: Sequence[int]) -> int:
    """How many grid axes to name: trailing axes of size 1 are left out."""
    used = [i for i, g in enumerate(grid) if g > 1]
    return max(used) + 1 if used else 1


def _program(program: Sequence[int]) -> Program:
    p = tuple(int(i) for i in program) + (0,) * (3 - len(program))
    return p[0], p[1], p[2]


def traced_launch(kernel: Callable, grid: Sequence[int], tensors: Mapping[str, torch.Tensor],
                  scalars: Mapping[str, Any] | None = None, constants: Mapping[str, Any] | None = None) -> ProgramTrace:
    """Launch ``kernel[grid](**tensors, **scalars, **constants)`` under the interpreter and trace every program.

    ``tensors`` are the pointer arguments, contiguous CPU tensors (written in place, as by any launch);
    ``scalars`` and ``constants`` the other arguments. Needs ``TRITON_INTERPRET`` (the interpreter backend).
    """
    if backend() != TRITON_INTERPRETER:
        raise BackendUnavailableError("the per-program view runs the kernel in Triton's interpreter, and this "
                                      f"process compiles kernels natively ({backend()}); set "
                                      "KVLAB_KERNEL_BACKEND=interpreter to see it")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise KernelInputError(f"tensors[{name!r}] must be a contiguous CPU tensor")
    recorder = _Recorder()
    traced = rebuild(kernel, recorder.language())
    grid3 = _program(tuple(grid) + (1,) * (3 - len(grid)))
    traced[tuple(grid)](**tensors, **dict(scalars or {}), **dict(constants or {}))
    spans = [(name, t.data_ptr(), t.numel(), t.element_size()) for name, t in tensors.items()]
    accesses: dict[Program, dict[tuple[str, str], list[torch.Tensor]]] = {}
    outside: dict[Program, int] = {}
    for kind, buffer, n in recorder.calls:
        program = _program(buffer[:3].tolist())
        addresses, on = buffer[3:3 + n], buffer[3 + n:].bool()
        addresses = addresses[on]
        placed = torch.zeros_like(addresses, dtype=torch.bool)
        for name, start, numel, size in spans:
            inside = (addresses >= start) & (addresses < start + numel * size)
            if bool(inside.any()):
                found = accesses.setdefault(program, {}).setdefault((kind, name), [])
                found.append((addresses[inside] - start) // size)
                placed |= inside
        missed = int((~placed).sum())
        if missed:
            outside[program] = outside.get(program, 0) + missed
    merged = {p: {key: _first_seen(torch.cat(parts)) for key, parts in found.items()} for p, found in accesses.items()}
    return ProgramTrace(grid3, {name: tuple(t.shape) for name, t in tensors.items()}, merged, outside)


def _first_seen(flat: torch.Tensor) -> torch.Tensor:
    """The distinct values of ``flat`` in the order they first occur (the order a program touched them)."""
    return torch.tensor(list(dict.fromkeys(flat.tolist())), dtype=torch.int64)


def signature_names(kernel: Callable) -> list[str]:
    """The kernel's parameter names, in order (what a launch passes by keyword)."""
    return list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
