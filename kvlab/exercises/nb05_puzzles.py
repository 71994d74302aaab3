"""Notebook 05's kernel puzzles: the paged attention kernel built one Triton kernel at a time.

Each puzzle, in the manner of Triton-Puzzles, gives a kernel's signature and its grid, a torch
specification (``spec``), and named batches (edge cases) that probe one hard path each. The learner
writes the whole ``@triton.jit`` kernel; ``check`` launches it on every batch (``prepare``: a
kernel launch) and compares what it stored with the specification. A wrong answer's message names
the batch, says which outputs are off and, under Triton's interpreter, what the program that owns
them loaded and stored beside what a correct kernel's program touches
(``kvlab.kernels.program_view``); ``show_programs`` draws that per-program view for any kernel.

The puzzles, in the order the notebook gives them (05.online_softmax, in ``nb05.py``, is the fourth):

1. ``05.write_kv``       write K and V by slot (``reshape_and_cache``)
2. ``05.one_block``      one query against one KV block
3. ``05.through_table``  one query across a block table
5. ``05.causal_tiles``   a query block over key tiles: causal mask, sliding window, the -inf guard
6. ``05.gqa``            GQA packing, and the grid of query blocks (``find_seq_idx``)
7. ``05.split_kv``       split-KV: each program writes its range's unnormalised partial
8. ``05.reduce_splits``  the merge of the partials

Every tensor is float32 and tiny: the interpreter runs one program at a time and cannot do bf16.
Importing this module imports no triton (``kvlab.exercises`` imports it with every notebook's);
``tl`` and ``find_seq_idx`` are bound on first use, as in ``nb05``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import linecache
import math
import random
import textwrap
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvlab.errors import BackendUnavailableError, UnknownNameError
from kvlab.exercises.core import Case, Exercise, Mistake, Note, get_exercise, register
from kvlab.exercises.records import LazyCases
from kvlab.units import cdiv, format_ranges

#: ``triton.language`` and kvlab's ``find_seq_idx`` and ``online_softmax_update``, bound by ``_kernels()``.
tl: Any = None
find_seq_idx: Any = None
online_softmax_update: Any = None

#: A wrong answer is one whose output differs from the specification by more than this, relative.
TOLERANCE = 5e-3
#: Elements of poison before and after every tensor a puzzle kernel gets, so that an access just past
#: an edge (a slot of -1, a row past the table) lands in memory of ours: NaN, or -1 for integers.
FENCE = 1024


def _kernels() -> Any:
    """Set up kvlab.kernels (and so Triton) on first use; bind the names the references use."""
    global tl, find_seq_idx, online_softmax_update
    kernels = importlib.import_module("kvlab.kernels")
    if tl is None and kernels.backend() != kernels.TORCH_REFERENCE:
        tl = importlib.import_module("triton.language")
        find_seq_idx = importlib.import_module("kvlab.kernels.attention").find_seq_idx
        nb05 = importlib.import_module("kvlab.exercises.nb05")
        nb05._kernels()
        online_softmax_update = nb05.online_softmax_update
    return kernels


# ----------------------------------------------------------------- the harness: one case is one launch


@dataclasses.dataclass(frozen=True)
class Launch:
    """One puzzle case: the grid and every argument of the kernel, and the batch's name.

    ``tensors`` are the pointer arguments (contiguous, on the CPU; outputs start as NaN), passed by
    the names of the puzzle's signature; ``scalars`` and ``constants`` the rest. ``axes`` names each
    tensor's axes for the messages; ``outputs`` are the tensors graded. Its repr is what a failure
    shows: the batch and the sizes, not the numbers.
    """

    batch: str
    summary: str
    grid: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    scalars: dict[str, Any]
    constants: dict[str, Any]
    outputs: tuple[str, ...]
    axes: dict[str, tuple[str, ...]]

    def __repr__(self) -> str:
        return f"{self.batch!r} batch: {self.summary}; grid {self.grid}"


@dataclasses.dataclass(frozen=True)
class KernelResult:
    """What a puzzle kernel stored: the graded output tensors, and (on a wrong answer) what its programs did."""

    tensors: dict[str, torch.Tensor]
    axes: dict[str, tuple[str, ...]]
    programs: str = ""            # the per-program comparison with a correct kernel, when the answer is wrong
    outside: tuple[str, ...] = ()  # writes that landed past a tensor's edges, in words

    def __repr__(self) -> str:
        parts = []
        for name, t in self.tensors.items():
            nan = int(torch.isnan(t).sum()) if t.is_floating_point() else 0
            parts.append(f"{_shown(name)}{list(t.shape)}" + (f" with {nan} NaN" if nan else ""))
        return ", ".join(parts)


def _fenced(t: torch.Tensor, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``t`` on ``device`` inside a larger buffer whose edges hold poison (NaN, or -1): (view, buffer)."""
    poison = float("nan") if t.is_floating_point() else -1
    buffer = torch.full((t.numel() + 2 * FENCE,), poison, dtype=t.dtype, device=device)
    view = buffer[FENCE:FENCE + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buffer


def _run(kernel: Any, launch: Launch, device: str) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """Launch ``kernel`` (decorated) on fenced copies of the case's tensors: the outputs, back on the CPU,
    and the writes that landed in a fence, in words."""
    fenced = {name: _fenced(t, device) for name, t in launch.tensors.items()}
    with warnings.catch_warnings():           # a wrong kernel's nan/inf is the finding, not a numpy warning
        warnings.simplefilter("ignore", RuntimeWarning)
        kernel[launch.grid](**{name: view for name, (view, _) in fenced.items()}, **launch.scalars,
                            **launch.constants)
    outside = []
    for name, (view, buffer) in fenced.items():
        buffer = buffer.cpu()
        for where, fence in (("before", buffer[:FENCE]), ("after", buffer[FENCE + view.numel():])):
            changed = int((~torch.isnan(fence)).sum()) if view.is_floating_point() else int((fence != -1).sum())
            if changed:
                outside.append(f"{changed} elements {where} {_shown(name)}")
    return {name: fenced[name][0].cpu() for name in launch.outputs}, tuple(outside)


def _is_stub(fn: Any) -> bool:
    try:
        return "NotImplementedError" in inspect.getsource(getattr(fn, "fn", fn))
    except (OSError, TypeError):
        return False


def _wrong(expected: torch.Tensor, actual: torch.Tensor, axes: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (the axes but a trailing ``dim``): whether it is off, and its relative error."""
    e, a = expected.double(), actual.double()
    same_special = (torch.isnan(e) & torch.isnan(a)) | (torch.isinf(e) & (e == a))
    diff = torch.where(same_special, torch.zeros_like(e), (a - e).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    size = torch.where(torch.isfinite(e), e.abs(), torch.zeros_like(e))
    if axes and axes[-1] == "dim":
        diff, size = diff.norm(dim=-1), size.norm(dim=-1)
    error = diff / size.clamp(min=1.0 if not axes or axes[-1] != "dim" else 1e-6)
    return error > TOLERANCE, error


def _positions(mask: torch.Tensor, names: Sequence[str]) -> str:
    """Where ``mask`` holds, by its first index: ``token 0-3 head 0-1; token 7 head 1``."""
    if len(names) > 1 and names[-1] == "dim":
        names = names[:-1]
    groups: dict[int, set[tuple[int, ...]]] = {}
    for t in mask.nonzero().tolist():
        groups.setdefault(t[0], set()).add(tuple(t[1:]))
    runs: list[tuple[list[int], set[tuple[int, ...]]]] = []      # consecutive first indices with the same rest
    for first, rest in sorted(groups.items()):
        if runs and runs[-1][0][-1] == first - 1 and runs[-1][1] == rest:
            runs[-1][0].append(first)
        else:
            runs.append(([first], rest))
    words = []
    for firsts, rest in runs[:4]:
        inner = [f"{names[k + 1]} {format_ranges(sorted({r[k] for r in rest}))}" for k in range(len(names) - 1)]
        words.append(" ".join([f"{names[0]} {format_ranges(firsts)}", *inner]))
    return "; ".join(words) + (f"; and {len(runs) - 4} more" if len(runs) > 4 else "")


def _compare(expected: Any, actual: Any) -> bool | str:
    """True when every graded output matches the specification; else where it does not, in words."""
    if not isinstance(actual, KernelResult) or set(actual.tensors) != set(expected.tensors):
        return False
    lines = [f"your kernel wrote {', '.join(actual.outside)}: outside the tensor, where no store belongs"
             ] if actual.outside != expected.outside else []
    for name, want in expected.tensors.items():
        got = actual.tensors[name]
        if got.shape != want.shape:
            return f"{_shown(name)} has shape {list(got.shape)}, the specification's {list(want.shape)}"
        names = expected.axes[name]
        off, error = _wrong(want, got.to(want.dtype), names)
        if bool(off.any()):
            worst = tuple(int(i) for i in (error == error.max()).nonzero()[0])
            kept = [n for n in names if n != "dim"] if len(names) > 1 else names
            how = "NaN or inf" if not math.isfinite(float(error.max())) else f"relative error {float(error.max()):.2g}"
            lines.append(f"{_shown(name)}[{', '.join(kept)}] is off at {_positions(off, names)} (worst: "
                         f"{', '.join(f'{n} {i}' for n, i in zip(kept, worst, strict=False))}, {how})")
    if not lines:
        return True
    if actual.programs:
        lines.append(actual.programs)
    return "\n            ".join(lines)


def _program_notes(fn: Any, reference: Callable, launch: Launch, spec: dict[str, torch.Tensor],
                   outputs: dict[str, torch.Tensor]) -> str:
    """For a wrong answer, under the interpreter: what the program owning the first wrong output touched,
    against what a correct kernel's program touches (both traced on fresh copies of the case)."""
    mine, right = _traced(fn, launch), _traced(reference, launch)
    owner = None
    for name in launch.outputs:
        off, _ = _wrong(spec[name], outputs[name].to(spec[name].dtype), launch.axes[name])
        if not bool(off.any()):
            continue
        first = tuple(int(i) for i in off.nonzero()[0])
        owner = next((p for p in right.busy() + mine.busy() for trace in (right, mine)
                      if any(t[:len(first)] == first for t in trace.touched(p, "store", name))), None)
        if owner is not None:
            break
    if owner is None:
        owner = next((p for p in mine.busy() if mine.outside.get(p)), None)
    if owner is None:
        return ""
    lines = [f"program {right.name(owner)}, yours against a correct kernel's:"]
    for kind in ("load", "store"):
        for name in launch.tensors:
            if mine.touched(owner, kind, name) != right.touched(owner, kind, name):
                axes = launch.axes[name]
                inner = 1 if len(axes) > 1 and axes[1] != "dim" else None
                what = f"  {'loads' if kind == 'load' else 'stores'} {_shown(name)}"
                lines.append(f"{what}  yours:   {mine.summary(owner, kind, name, 0, inner, axes)}")
                lines.append(f"{' ' * len(what)}  correct: {right.summary(owner, kind, name, 0, inner, axes)}")
    if mine.outside.get(owner):
        lines.append(f"  and {mine.outside[owner]} of its loads and stores fell outside every tensor it was given")
    if len(lines) == 1:
        lines.append("  the same elements, loaded and stored: the arithmetic on them differs")
    return "\n            ".join(lines)


def _traced(fn: Any, launch: Launch) -> Any:
    """``fn``'s launch on fenced copies of the case's tensors, every program's loads and stores recorded."""
    view = importlib.import_module("kvlab.kernels.program_view")
    tensors = {name: _fenced(t, "cpu")[0] for name, t in launch.tensors.items()}
    with warnings.catch_warnings():           # a wrong kernel's nan/inf is the finding, not a numpy warning
        warnings.simplefilter("ignore", RuntimeWarning)
        return view.traced_launch(fn, launch.grid, tensors, launch.scalars, launch.constants)


def _shown(tensor: str) -> str:
    """A pointer argument's name as a reader says it: ``key_cache`` for ``key_cache_ptr``."""
    return tensor.removesuffix("_ptr")


def _interpreting() -> bool:
    kernels = _kernels()
    return kernels.backend() == kernels.TRITON_INTERPRETER


def in_launch(exercise_id: str, fn: Any) -> Callable[[Launch], KernelResult]:
    """``prepare`` of a puzzle: ``fn`` (the learner's kernel, plain or ``@triton.jit``) as ``launch -> result``.

    For a learner's kernel, each result is also compared with the specification here, after the
    launch: the first wrong one gets the per-program comparison (``_program_notes``), and the cases
    after it are not launched at all, since the checker stops at the first wrong case and never
    reads them (it reaches the same verdict with the same comparison).
    """
    compiled: list = []
    failed: list[str] = []

    def run(launch: Launch) -> KernelResult:
        if _is_stub(fn):
            raise NotImplementedError("still the stub")
        kernels = _kernels()
        if kernels.backend() == kernels.TORCH_REFERENCE:
            raise BackendUnavailableError("the puzzles run your kernel with Triton, which is not installed here "
                                          "(Linux only); the rest of the notebook still runs")
        if failed:
            raise RuntimeError(f"not run: the {failed[0]!r} batch before it was already wrong")
        if not compiled:
            compiled.append(importlib.import_module("kvlab.kernels.program_view").rebuild(fn))
        outputs, outside = _run(compiled[0], launch, kernels.default_device())
        result = KernelResult(outputs, launch.axes, "", outside)
        if getattr(getattr(fn, "fn", fn), "__module__", None) != __name__:        # a learner's kernel
            exercise = get_exercise(exercise_id)
            if _compare(exercise.spec(launch), result) is not True:
                failed.append(launch.batch)
                if _interpreting():
                    spec = exercise.spec(launch).tensors
                    notes = _program_notes(fn, exercise.reference, launch, spec, outputs)
                    result = dataclasses.replace(result, programs=notes)
        return result

    return run


def _variant(fn: Callable, original: str, mutated: str) -> Callable:
    """``fn`` with one piece of its source replaced: a known mistake, one change from the reference."""
    source = textwrap.dedent(inspect.getsource(fn))
    if source.count(original) != 1:
        raise AssertionError(f"{fn.__name__}: {original!r} occurs {source.count(original)} times")
    source = source.replace(original, mutated)
    filename = f"<kvlab mistake {fn.__name__}: {mutated.strip()[:40]}>"
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)     # Triton reads a kernel's source
    namespace: dict[str, Any] = {}
    exec(compile(source, filename, "exec"), fn.__globals__, namespace)  # noqa: S102  (kvlab's own source)
    made = namespace[fn.__name__]
    made.__module__ = __name__
    return made


def _mistake(fn: Callable, original: str, mutated: str, says: str) -> Mistake:
    return Mistake(_variant(fn, original, mutated), says)


def _puzzle(exercise_id: str, **fields: Any) -> Exercise:
    """Register a puzzle: a kernel launch for ``prepare``, the shared comparison, a few random batches."""
    return register(Exercise(id=exercise_id, prepare=functools.partial(in_launch, exercise_id), compare=_compare,
                             num_random=fields.pop("num_random", 2), **fields))


def _result(launch: Launch, tensors: dict[str, torch.Tensor]) -> KernelResult:
    return KernelResult({name: tensors[name] for name in launch.outputs}, launch.axes)


# ----------------------------------------------------------------- what each program touched


@dataclasses.dataclass
class ProgramsView:
    """``show_programs``'s answer: the trace of one launch, drawn program by program."""

    title: str
    trace: Any                      # kvlab.kernels.program_view.ProgramTrace
    launch: Launch
    pictures: list[tuple[str, int, int | None]]
    programs: list[tuple[int, int, int]]

    def lines(self, program: Sequence[int]) -> list[str]:
        """One program's loads and stores, in words."""
        out = []
        for kind in ("load", "store"):
            for name in self.launch.tensors:
                if self.trace.touched(program, kind, name):
                    axes = self.launch.axes[name]
                    inner = 1 if len(axes) > 1 and axes[1] != "dim" else None
                    verb = "loads " if kind == "load" else "stores"
                    out.append(f"  {verb} {_shown(name)}: {self.trace.summary(program, kind, name, 0, inner, axes)}")
        return out

    def __repr__(self) -> str:
        busy = self.trace.busy()
        idle = len(self.trace.programs()) - len(busy)
        text = [self.title, f"grid {self.launch.grid}: {len(busy)} programs touch memory"
                            + (f", {idle} exit at once" if idle else "")]
        for program in busy:
            text.append(f"program {self.trace.name(program)}")
            text += self.lines(program)
        for program in self.programs:
            text.append("")
            for tensor, rows, cols in self.pictures:
                text.append(self.trace.picture(program, tensor, rows, cols, self.launch.axes[tensor]))
        return "\n".join(text)


#: Per puzzle: the tensors drawn by ``show_programs`` (tensor, axis down, axis across).
_PICTURES: dict[str, list[tuple[str, int, int | None]]] = {}


def show_programs(exercise_id: str, kernel: Any = None, case: int = 0, draw: int = 1) -> ProgramsView:
    """Run a puzzle's kernel on one of its batches under Triton's interpreter, tracing every program.

    ``kernel`` is yours (plain or ``@triton.jit``); while it is missing or still the stub, the
    reference runs, so you see what a correct kernel's programs touch. ``case`` picks the edge case
    (0: the first); the first ``draw`` busy programs are also drawn as maps of the tensors they read.
    """
    exercise = get_exercise(exercise_id)
    if exercise_id not in _PICTURES:
        raise UnknownNameError("exercise_id", exercise_id, sorted(_PICTURES))
    _kernels()
    theirs = kernel is None or _is_stub(kernel)
    fn = exercise.reference if theirs else kernel
    launch = exercise.edge_cases[case].kwargs["launch"]
    trace = _traced(fn, launch)
    who = "a correct kernel (yours is still the stub)" if theirs and kernel is not None else \
        "a correct kernel" if theirs else "your kernel"
    title = f"{exercise_id}, {launch!r}: what each program of {who} touched"
    return ProgramsView(title, trace, launch, _PICTURES[exercise_id], trace.busy()[:draw])


def show_spec(exercise_id: str) -> Note:
    """A puzzle's specification in torch: what ``check`` compares everything your kernel stores with."""
    spec = get_exercise(exercise_id).spec
    if spec is None:
        raise UnknownNameError("exercise_id", exercise_id, sorted(_PICTURES))
    source = textwrap.dedent(inspect.getsource(spec))
    return Note(f"The specification of `{exercise_id}` (torch), which `check` compares your kernel's outputs "
                f"with:\n\n```python\n{source}```")


# ----------------------------------------------------------------- shared shapes and batches

HEAD = 16          # head_size: the smallest tl.dot dimension, and plenty to tell answers apart


def _batch(seq_lens: Sequence[int], query_lens: Sequence[int], *, num_kv_heads: int = 1, group: int = 1,
           block_size: int = 4, table: str = "scattered", seed: int = 0) -> Any:
    """A paged batch on the CPU whose spare blocks and slots past each sequence hold NaN (``make_batch``)."""
    batches = importlib.import_module("kvlab.kernels.batches")
    return batches.make_batch(seq_lens, query_lens, num_kv_heads=num_kv_heads, group=group, head_size=HEAD,
                              block_size=block_size, table=table, seed=seed, device="cpu")


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


ATTENTION_AXES = {"query": ("token", "head", "dim"), "key_cache": ("block", "slot", "head", "dim"),
                  "value_cache": ("block", "slot", "head", "dim"), "out": ("token", "head", "dim"),
                  "block_table": ("seq", "column"), "seq_lens": ("seq",), "query_start_loc": ("seq",),
                  "block_ids": ("seq",)}


def _random_lens(rng: random.Random, longest: int, num_seqs: int) -> list[int]:
    return [rng.randint(1, longest) for _ in range(num_seqs)]


# ----------------------------------------------------------------- puzzle 1: 05.write_kv


def write_kv(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
             NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Reference: program t copies token t's K and V, [NUM_KV_HEADS, HEAD_SIZE] each, into its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:                                                   # padding: this token owns no slot
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, NUM_KV_HEADS)[:, None]                    # [NUM_KV_HEADS, 1]
    dims = tl.arange(0, HEAD_SIZE)[None, :]                        # [1, HEAD_SIZE]
    src = (token * NUM_KV_HEADS + heads) * HEAD_SIZE + dims        # key[token, head, dim]
    dst = ((block * BLOCK_SIZE + offset) * NUM_KV_HEADS + heads) * HEAD_SIZE + dims   # cache[block, offset, head, dim]
    tl.store(key_cache_ptr + dst, tl.load(key_ptr + src))
    tl.store(value_cache_ptr + dst, tl.load(value_ptr + src))


def _write_case(batch: str, probes: str, slots: Sequence[int], *, num_kv_heads: int = 2, num_blocks: int = 6,
                block_size: int = 4, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(len(slots), num_kv_heads, HEAD, generator=g)               # [num_tokens, Hkv, D]
    value = torch.randn(len(slots), num_kv_heads, HEAD, generator=g)
    cache = torch.full((num_blocks, block_size, num_kv_heads, HEAD), float("nan"))   # unwritten slots stay NaN
    summary = (f"{len(slots)} tokens to slots {list(slots)}, {num_kv_heads} KV heads, blocks of {block_size}, "
               f"{num_blocks} blocks")
    launch = Launch(batch, summary, (len(slots),),
                    {"key_ptr": key, "value_ptr": value, "key_cache_ptr": cache, "value_cache_ptr": cache.clone(),
                     "slot_mapping_ptr": torch.tensor(slots, dtype=torch.int32)},
                    {}, {"NUM_KV_HEADS": num_kv_heads, "HEAD_SIZE": HEAD, "BLOCK_SIZE": block_size},
                    ("key_cache_ptr", "value_cache_ptr"),
                    {"key_ptr": ("token", "head", "dim"), "value_ptr": ("token", "head", "dim"),
                     "key_cache_ptr": ("block", "slot", "head", "dim"),
                     "value_cache_ptr": ("block", "slot", "head", "dim"), "slot_mapping_ptr": ("token",)})
    return Case(kwargs={"launch": launch}, probes=f"{batch}: {probes}")


def _write_spec(launch: Launch) -> KernelResult:
    """Row ``slot`` of the caches seen as [num_blocks * block_size, num_kv_heads, head_size] gets the token's K, V."""
    t = launch.tensors
    slots = t["slot_mapping_ptr"].long()
    keep = slots >= 0
    out = {}
    for src, name in (("key_ptr", "key_cache_ptr"), ("value_ptr", "value_cache_ptr")):
        cache = t[name].clone()
        cache.view(-1, *cache.shape[2:])[slots[keep]] = t[src][keep]     # slot s is row s of [blocks * BS, H, D]
        out[name] = cache
    return _result(launch, out)


def _random_write(rng: random.Random) -> Case:
    heads, block_size = rng.choice([1, 2, 4]), rng.choice([2, 4, 8])
    num_blocks = rng.randint(2, 6)
    tokens = rng.randint(1, min(8, num_blocks * block_size))
    slots = rng.sample(range(num_blocks * block_size), tokens)
    slots = [s if rng.random() > 0.2 else -1 for s in slots]
    return _write_case("random tokens", "a random batch, some tokens padding", slots, num_kv_heads=heads,
                       num_blocks=num_blocks, block_size=block_size, seed=rng.randrange(2**31))


_PICTURES["05.write_kv"] = [("key_cache_ptr", 0, 1)]
_puzzle(
    "05.write_kv",
    title="Puzzle 1: write K and V by slot",
    task=(
        "Write `reshape_and_cache` as a Triton kernel. The grid has one program per token; program t copies "
        "token t's K and V, `key[t]` and `value[t]` (each [NUM_KV_HEADS, HEAD_SIZE]), into slot "
        "`slot_mapping[t]` of the caches [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE]: block "
        "`slot // BLOCK_SIZE`, offset `slot % BLOCK_SIZE`. A slot of -1 is a padding token: write nothing. "
        "Every tensor is contiguous, so an element's address is its flat index added to the tensor's pointer."
    ),
    signature=("def write_kv(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, "
               "NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr):"),
    reference=write_kv,
    spec=_write_spec,
    edge_cases=LazyCases(lambda: [
        _write_case("one decode token", "one token to slot 9: block 2, offset 1", [9]),
        _write_case("prefill across a block edge", "six tokens to slots 13-18: the last three start block 4",
                    [13, 14, 15, 16, 17, 18], seed=1),
        _write_case("padding slot -1", "the middle token is padding (slot -1): its program must write nothing",
                    [5, -1, 22], seed=2),
        _write_case("one KV head", "MQA: one KV head per token, slots out of order", [7, 2, 20], num_kv_heads=1,
                    seed=3),
    ]),
    random_case=_random_write,
    mistakes=[
        _mistake(write_kv, "    if slot < 0:                                                   # padding: this "
                 "token owns no slot\n        return\n", "",
                 "a slot of -1 marks a padding token: return before writing (slot < 0)"),
        _mistake(write_kv, "dst = ((block * BLOCK_SIZE + offset) * NUM_KV_HEADS + heads)",
                 "dst = ((block * NUM_KV_HEADS + heads) * BLOCK_SIZE + offset)",
                 "the cache is [num_blocks, block_size, num_kv_heads, head_size]: a slot holds every head, so the "
                 "offset comes before the head in the address"),
    ],
    hints=[
        "tl.program_id(0) is the token; tl.load(slot_mapping_ptr + token) is its slot (a scalar).",
        "A padding token leaves at once: Triton allows `if slot < 0:` and a bare `return` on a scalar.",
        "Build a [NUM_KV_HEADS, HEAD_SIZE] block of offsets from tl.arange(0, NUM_KV_HEADS)[:, None] and "
        "tl.arange(0, HEAD_SIZE)[None, :]; the source row is token, the destination row is the slot.",
        "In the cache, element [block, offset, head, dim] sits at ((block * BLOCK_SIZE + offset) * NUM_KV_HEADS "
        "+ head) * HEAD_SIZE + dim.",
    ],
)


# ----------------------------------------------------------------- puzzle 2: 05.one_block


def one_block(query_ptr, key_cache_ptr, value_cache_ptr, block_ids_ptr, seq_lens_ptr, out_ptr, scale,
              NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Reference: program (seq, head) attends its sequence's one query to the keys of its one KV block."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.load(block_ids_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    slots = tl.arange(0, BLOCK_SIZE)
    dims = tl.arange(0, HEAD_SIZE)
    valid = slots < seq_len                                                     # [BLOCK_SIZE]
    q = tl.load(query_ptr + (seq * NUM_KV_HEADS + head) * HEAD_SIZE + dims)     # [HEAD_SIZE]
    kv = ((block * BLOCK_SIZE + slots[:, None]) * NUM_KV_HEADS + head) * HEAD_SIZE + dims[None, :]
    k = tl.load(key_cache_ptr + kv, mask=valid[:, None], other=0.0)           # [BLOCK_SIZE, HEAD_SIZE]
    v = tl.load(value_cache_ptr + kv, mask=valid[:, None], other=0.0)
    scores = tl.sum(q[None, :] * k, axis=1) * scale                            # [BLOCK_SIZE]: one row, no tl.dot
    scores = tl.where(valid, scores, float("-inf"))
    p = tl.exp(scores - tl.max(scores, axis=0))
    out = tl.sum(p[:, None] * v, axis=0) / tl.sum(p, axis=0)                    # [HEAD_SIZE]
    tl.store(out_ptr + (seq * NUM_KV_HEADS + head) * HEAD_SIZE + dims, out)


def _decode_tensors(b: Any) -> dict[str, torch.Tensor]:
    return {"query_ptr": b.query, "key_cache_ptr": b.key_cache, "value_cache_ptr": b.value_cache,
            "out_ptr": _nan_like(b.query)}


def _one_block_case(batch: str, probes: str, seq_lens: Sequence[int], *, num_kv_heads: int = 2,
                    block_size: int = 8, loud: float = 1.0, seed: int = 0) -> Case:
    b = _batch(seq_lens, [1] * len(seq_lens), num_kv_heads=num_kv_heads, block_size=block_size, seed=seed)
    b.query *= loud
    tensors = {**_decode_tensors(b), "block_ids_ptr": b.block_table[:, 0].contiguous(), "seq_lens_ptr": b.seq_lens}
    tensors = {k: tensors[k] for k in ("query_ptr", "key_cache_ptr", "value_cache_ptr", "block_ids_ptr",
                                       "seq_lens_ptr", "out_ptr")}
    summary = (f"seq_lens {list(seq_lens)} in blocks {b.block_table[:, 0].tolist()} of {block_size}, "
               f"{num_kv_heads} heads" + (f", queries x{loud:g}" if loud != 1.0 else ""))
    launch = Launch(batch, summary, (len(seq_lens), num_kv_heads), tensors, {"scale": HEAD**-0.5},
                    {"NUM_KV_HEADS": num_kv_heads, "HEAD_SIZE": HEAD, "BLOCK_SIZE": block_size}, ("out_ptr",),
                    _pointer_axes(tensors))
    return Case(kwargs={"launch": launch}, probes=f"{batch}: {probes}")


def _pointer_axes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """Axis names of each pointer argument (``key_cache_ptr``: block, slot, head, dim)."""
    names = {}
    for name, t in tensors.items():
        plain = name.removesuffix("_ptr").removeprefix("split_")
        names[name] = {"acc": ("token", "head", "split", "dim"), "max": ("token", "head", "split"),
                       "sum": ("token", "head", "split")}.get(plain) or ATTENTION_AXES.get(plain) or tuple(
                           f"axis {a}" for a in range(t.dim()))
    return names


def _decode_spec(launch: Launch) -> KernelResult:
    """Each sequence's one query attends to all its keys, read through its blocks: ``paged_attention_ref`` (§2)."""
    t = launch.tensors
    table = t["block_table_ptr"] if "block_table_ptr" in t else t["block_ids_ptr"][:, None]   # puzzle 2: one block
    starts = torch.arange(len(t["seq_lens_ptr"]) + 1, dtype=torch.int32)                       # one query per sequence
    out = _kernels().paged_attention_ref(t["query_ptr"], t["key_cache_ptr"], t["value_cache_ptr"], table,
                                         t["seq_lens_ptr"], starts)
    return _result(launch, {"out_ptr": out})


def _random_one_block(rng: random.Random) -> Case:
    block_size = rng.choice([4, 8, 16])
    lens = _random_lens(rng, block_size, rng.randint(1, 2))
    return _one_block_case("random blocks", "random sequences of one block each", lens, num_kv_heads=1,
                           block_size=block_size, loud=rng.choice([1.0, 1.0, 100.0]),
                           seed=rng.randrange(2**31))


_PICTURES["05.one_block"] = [("key_cache_ptr", 0, 1)]
_puzzle(
    "05.one_block",
    title="Puzzle 2: one query against one KV block",
    task=(
        "Each sequence holds at most BLOCK_SIZE tokens, all in one physical KV block, `block_ids[seq]`, and "
        "decodes one query token. Program (seq, head) attends that query, `query[seq, head]` [HEAD_SIZE], to "
        "the first `seq_lens[seq]` slots of its block in head `head` of the caches [num_blocks, BLOCK_SIZE, "
        "NUM_KV_HEADS, HEAD_SIZE], and stores softmax(q k^T * scale) v in `out[seq, head]`. One query head per "
        "KV head. The slots past a sequence's length hold NaN."
    ),
    signature=("def one_block(query_ptr, key_cache_ptr, value_cache_ptr, block_ids_ptr, seq_lens_ptr, out_ptr, "
               "scale, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr):"),
    reference=one_block,
    spec=_decode_spec,
    edge_cases=LazyCases(lambda: [
        _one_block_case("full block", "two sequences of 8 keys, each filling its block", [8, 8]),
        _one_block_case("one key", "a sequence of one token attends to itself only: the weight is 1", [1, 5],
                        num_kv_heads=1, seed=1),
        _one_block_case("block partly filled", "5 of 8 slots hold keys; slots 5-7 hold NaN and must weigh nothing",
                        [5, 3], num_kv_heads=1, seed=2),
        _one_block_case("loud scores", "queries 100x larger: exp(score) overflows unless the maximum is subtracted",
                        [8, 6], num_kv_heads=1, loud=100.0, seed=3),
    ]),
    random_case=_random_one_block,
    mistakes=[
        _mistake(one_block, "    scores = tl.where(valid, scores, float(\"-inf\"))\n", "",
                 "a slot past the sequence's length loads as 0.0, which still weighs exp(0 - max): mask its score "
                 "to -inf"),
        _mistake(one_block, "p = tl.exp(scores - tl.max(scores, axis=0))", "p = tl.exp(scores)",
                 "exp(score) overflows float32 for scores of about 89 and more: subtract the row's maximum first"),
    ],
    hints=[
        "tl.program_id(0) is the sequence, tl.program_id(1) the head; tl.load gives the block id and the length.",
        "A [BLOCK_SIZE, HEAD_SIZE] tile of offsets: slots along the rows, dims along the columns. Load K and V "
        "with mask=slots < seq_len (broadcast over dims) and other=0.0.",
        "One query row is too small for tl.dot (every side must be 16 or more): tl.sum(q[None, :] * k, axis=1) "
        "gives the BLOCK_SIZE scores.",
        "tl.where(valid, scores, float('-inf')), subtract tl.max(scores, axis=0) before tl.exp, and divide the "
        "weighted sum of V by the sum of the weights.",
    ],
)


# ----------------------------------------------------------------- puzzle 3: 05.through_table


def through_table(query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, scale, max_blocks,
                NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                MAX_KEYS: tl.constexpr):
    """Reference: program (seq, head) attends one query to every key of its sequence, found through the table."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    pos = tl.arange(0, MAX_KEYS)                                                # [MAX_KEYS] logical positions
    valid = pos < seq_len
    physical = tl.load(block_table_ptr + seq * max_blocks + pos // BLOCK_SIZE, mask=valid, other=0)
    dims = tl.arange(0, HEAD_SIZE)
    q = tl.load(query_ptr + (seq * NUM_KV_HEADS + head) * HEAD_SIZE + dims)
    slot = physical * BLOCK_SIZE + pos % BLOCK_SIZE                             # [MAX_KEYS]
    kv = (slot[:, None] * NUM_KV_HEADS + head) * HEAD_SIZE + dims[None, :]
    k = tl.load(key_cache_ptr + kv, mask=valid[:, None], other=0.0)           # [MAX_KEYS, HEAD_SIZE]
    v = tl.load(value_cache_ptr + kv, mask=valid[:, None], other=0.0)
    scores = tl.where(valid, tl.sum(q[None, :] * k, axis=1) * scale, float("-inf"))
    p = tl.exp(scores - tl.max(scores, axis=0))
    out = tl.sum(p[:, None] * v, axis=0) / tl.sum(p, axis=0)
    tl.store(out_ptr + (seq * NUM_KV_HEADS + head) * HEAD_SIZE + dims, out)


def _table_case(batch: str, probes: str, seq_lens: Sequence[int], *, num_kv_heads: int = 2, block_size: int = 4,
                table: str = "scattered", seed: int = 0) -> Case:
    b = _batch(seq_lens, [1] * len(seq_lens), num_kv_heads=num_kv_heads, block_size=block_size, table=table,
               seed=seed)
    tensors = {**_decode_tensors(b), "block_table_ptr": b.block_table, "seq_lens_ptr": b.seq_lens}
    tensors = {k: tensors[k] for k in ("query_ptr", "key_cache_ptr", "value_cache_ptr", "block_table_ptr",
                                       "seq_lens_ptr", "out_ptr")}
    summary = (f"seq_lens {list(seq_lens)}, blocks of {block_size}, block_table {b.block_table.tolist()}, "
               f"{num_kv_heads} heads")
    max_keys = max(16, 1 << (max(seq_lens) - 1).bit_length())
    launch = Launch(batch, summary, (len(seq_lens), num_kv_heads), tensors,
                    {"scale": HEAD**-0.5, "max_blocks": b.block_table.shape[1]},
                    {"NUM_KV_HEADS": num_kv_heads, "HEAD_SIZE": HEAD, "BLOCK_SIZE": block_size, "MAX_KEYS": max_keys},
                    ("out_ptr",), _pointer_axes(tensors))
    return Case(kwargs={"launch": launch}, probes=f"{batch}: {probes}")


def _random_table(rng: random.Random) -> Case:
    return _table_case("random table", "random decodes through scattered blocks",
                       _random_lens(rng, 30, rng.randint(1, 2)), num_kv_heads=1,
                       block_size=rng.choice([2, 4, 8]), table=rng.choice(["scattered", "overlong"]),
                       seed=rng.randrange(2**31))


_PICTURES["05.through_table"] = [("key_cache_ptr", 0, 1), ("block_table_ptr", 0, 1)]
_puzzle(
    "05.through_table",
    title="Puzzle 3: one query across a block table",
    task=(
        "Now a sequence's keys fill several KV blocks, listed in order in its row of `block_table` "
        "[num_seqs, max_blocks] (the row may be longer than needed; unused entries point at blocks of NaN). "
        "Program (seq, head) reads all `seq_lens[seq]` keys at once, as one vector of MAX_KEYS positions "
        "(a power of two >= the longest sequence): position p lives in physical block "
        "`block_table[seq, p // BLOCK_SIZE]` at offset `p % BLOCK_SIZE`. Attend the query to them as in puzzle 2."
    ),
    signature=("def through_table(query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, "
               "scale, max_blocks, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, "
               "BLOCK_SIZE: tl.constexpr, MAX_KEYS: tl.constexpr):"),
    reference=through_table,
    spec=_decode_spec,
    edge_cases=LazyCases(lambda: [
        _table_case("blocks out of order", "keys in physical blocks listed out of order: logical block != physical",
                    [12, 9]),
        _table_case("last block partial", "21 keys in blocks of 4: the sixth block holds one key, then NaN",
                    [21, 6], num_kv_heads=1, seed=1),
        _table_case("one token", "a one-token sequence beside a long one", [1, 30], num_kv_heads=1, seed=2),
        _table_case("table longer than sequence", "two extra table columns point at NaN blocks", [10, 7],
                    num_kv_heads=1, table="overlong", seed=3),
    ]),
    random_case=_random_table,
    mistakes=[
        _mistake(through_table,
                 "physical = tl.load(block_table_ptr + seq * max_blocks + pos // BLOCK_SIZE, mask=valid, other=0)",
                 "physical = pos // BLOCK_SIZE",
                 "logical block p // BLOCK_SIZE is not where the keys are: look it up in the sequence's row of "
                 "block_table"),
        _mistake(through_table, "tl.load(block_table_ptr + seq * max_blocks + pos", "tl.load(block_table_ptr + pos",
                 "block_table is [num_seqs, max_blocks]: sequence seq's row starts at seq * max_blocks"),
    ],
    hints=[
        "Positions pos = tl.arange(0, MAX_KEYS); the ones past seq_len are masked everywhere.",
        "Load the physical block of every position at once: block_table_ptr + seq * max_blocks + pos // "
        "BLOCK_SIZE, masked like the positions.",
        "The slot of position p is physical * BLOCK_SIZE + p % BLOCK_SIZE; from there it is puzzle 2.",
    ],
)


# ----------------------------------------------------------------- puzzle 5: 05.causal_tiles


def causal_tiles(query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
                 out_ptr, scale, max_blocks,
                 NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
                 TILE_N: tl.constexpr, WINDOW: tl.constexpr):
    """Reference: program (seq, q_block, head) attends BLOCK_Q query tokens to their keys, tile by tile."""
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return                                                       # this sequence has fewer query blocks
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)                 # [BLOCK_Q] index in the sequence's query
    row_ok = rows < q_len
    q_pos = seq_len - q_len + rows                                   # [BLOCK_Q] position in the sequence
    dims = tl.arange(0, HEAD_SIZE)
    q_offsets = ((q_start + rows[:, None]) * NUM_HEADS + head) * HEAD_SIZE + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_ok[:, None], other=0.0)                   # [BLOCK_Q, HEAD_SIZE]
    q_first = seq_len - q_len + q_block * BLOCK_Q
    kv_len = tl.minimum(seq_len, q_first + BLOCK_Q)                  # causal: no key after the last query
    first_key = 0
    if WINDOW > 0:
        first_key = tl.maximum(q_first - WINDOW + 1, 0)              # nothing before the first query's window
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_SIZE], dtype=tl.float32)
    for tile in range(first_key // TILE_N, tl.cdiv(kv_len, TILE_N)):
        keys = tile * TILE_N + tl.arange(0, TILE_N)                  # [TILE_N] positions
        key_ok = keys < kv_len
        physical = tl.load(block_table_ptr + seq * max_blocks + keys // BLOCK_SIZE, mask=key_ok, other=0)
        kv = ((physical * BLOCK_SIZE + keys % BLOCK_SIZE)[:, None] * NUM_HEADS + head) * HEAD_SIZE + dims[None, :]
        k = tl.load(key_cache_ptr + kv, mask=key_ok[:, None], other=0.0)                 # [TILE_N, HEAD_SIZE]
        v = tl.load(value_cache_ptr + kv, mask=key_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale                      # [BLOCK_Q, TILE_N]
        visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (q_pos[:, None] - keys[None, :] < WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, scores, v)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]              # l = 0 only on rows past the query
    tl.store(out_ptr + q_offsets, out, mask=row_ok[:, None])


def _varlen_tensors(b: Any) -> dict[str, torch.Tensor]:
    return {"query_ptr": b.query, "key_cache_ptr": b.key_cache, "value_cache_ptr": b.value_cache,
            "block_table_ptr": b.block_table, "seq_lens_ptr": b.seq_lens, "query_start_loc_ptr": b.query_start_loc,
            "out_ptr": _nan_like(b.query)}


def _causal_case(batch: str, probes: str, seq_lens: Sequence[int], query_lens: Sequence[int], *,
                 window: int = 0, num_heads: int = 1, block_size: int = 4, seed: int = 0) -> Case:
    b = _batch(seq_lens, query_lens, num_kv_heads=num_heads, block_size=block_size, seed=seed)
    tensors = _varlen_tensors(b)
    summary = (f"seq_lens {list(seq_lens)}, query_lens {list(query_lens)}, blocks of {block_size}, "
               f"{num_heads} head{'s' * (num_heads > 1)}" + (f", window {window}" if window else ""))
    grid = (len(seq_lens), cdiv(max(query_lens), 16), num_heads)
    launch = Launch(batch, summary, grid, tensors, {"scale": HEAD**-0.5, "max_blocks": b.block_table.shape[1]},
                    {"NUM_HEADS": num_heads, "HEAD_SIZE": HEAD, "BLOCK_SIZE": block_size, "BLOCK_Q": 16,
                     "TILE_N": 16, "WINDOW": window}, ("out_ptr",), _pointer_axes(tensors))
    return Case(kwargs={"launch": launch}, probes=f"{batch}: {probes}")


def _varlen_spec(launch: Launch) -> KernelResult:
    """Every query token attends to its sequence's keys up to its own position (and within the window, if any):
    ``paged_attention_ref`` (§2)."""
    t = launch.tensors
    out = _kernels().paged_attention_ref(t["query_ptr"], t["key_cache_ptr"], t["value_cache_ptr"], t["block_table_ptr"],
                                         t["seq_lens_ptr"], t["query_start_loc_ptr"],
                                         sliding_window=launch.constants.get("WINDOW") or None)
    return _result(launch, {"out_ptr": out})


def _random_causal(rng: random.Random) -> Case:
    seq_lens = _random_lens(rng, 36, rng.randint(1, 2))
    query_lens = [rng.choice([1, min(s, 16), rng.randint(1, s)]) for s in seq_lens]
    return _causal_case("random chunks", "random prompts, chunks and decodes", seq_lens, query_lens,
                        window=rng.choice([0, 0, rng.randint(1, 20)]), num_heads=1,
                        block_size=rng.choice([4, 8, 32]), seed=rng.randrange(2**31))


_PICTURES["05.causal_tiles"] = [("key_cache_ptr", 0, 1), ("out_ptr", 0, 1)]
_puzzle(
    "05.causal_tiles",
    title="Puzzle 5: a query block over key tiles, causal, with a sliding window",
    task=(
        "Prefill and decode together: sequence i's query tokens are `query[query_start_loc[i]:query_start_loc[i+1]]`, "
        "its last tokens (a chunk after a cached context starts at position seq_len - query_len). Program "
        "(seq, q_block, head) takes the BLOCK_Q = 16 query tokens q_block * 16 .. of its sequence (and returns if "
        "the sequence has fewer) and walks its keys in tiles of TILE_N positions through the block table, folding "
        "each tile in with your `online_softmax_update` of puzzle 4 (or `kvlab.kernels.attention`'s). The query at "
        "position q sees the keys at positions <= q, and with WINDOW W > 0 only q - W + 1 .. q. One query head per "
        "KV head; NUM_HEADS of each."
    ),
    signature=("def causal_tiles(query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, "
               "query_start_loc_ptr, out_ptr, scale, max_blocks, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, "
               "BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, WINDOW: tl.constexpr):"),
    reference=causal_tiles,
    spec=_varlen_spec,
    edge_cases=LazyCases(lambda: [
        _causal_case("prompt from position 0", "a 20-token prompt (two query blocks) and a 5-token one: each query "
                     "sees its own position and the ones before", [20, 5], [20, 5]),
        _causal_case("chunk after a cached prefix", "12 queries after 28 cached keys: positions start at 28",
                     [40, 3], [12, 1], num_heads=2, seed=1),
        _causal_case("last tile partial", "37 keys: the third tile holds 5 keys, then slots of NaN", [37, 9], [3, 9],
                     seed=2),
        _causal_case("window inside a block", "window of 6, its edge inside a block of 4: the last queries of a "
                     "query block see nothing of its first tile (m stays -inf there)", [30, 9], [30, 9], window=6,
                     seed=3),
        _causal_case("block spans tiles", "blocks of 32 keys, tiles of 16: two tiles read one block", [45, 2], [7, 2],
                     block_size=32, seed=4),
    ]),
    random_case=_random_causal,
    mistakes=[
        _mistake(causal_tiles, "(keys[None, :] <= q_pos[:, None])", "(keys[None, :] < q_pos[:, None])",
                 "a query sees its own key too: keys at positions <= its position"),
        _mistake(causal_tiles, "(q_pos[:, None] - keys[None, :] < WINDOW)",
                 "(q_pos[:, None] - keys[None, :] <= WINDOW)",
                 "a window of W keys holds q - W + 1 .. q: q - key < W, not <= W"),
        _mistake(causal_tiles, "tl.store(out_ptr + q_offsets, out, mask=row_ok[:, None])",
                 "tl.store(out_ptr + q_offsets, out)",
                 "rows past the sequence's query are another sequence's tokens (or past the tensor): store with the "
                 "row mask"),
    ],
    hints=[
        "The query block's rows are q_block * BLOCK_Q + tl.arange(0, BLOCK_Q); rows >= query_len are padding: "
        "mask their loads and their store. Position of a row: seq_len - query_len + row.",
        "Keys run up to the block's last query, min(seq_len, first query position + BLOCK_Q); loop tile over "
        "range(0, tl.cdiv(that, TILE_N)) and look each position up in the block table as in puzzle 3.",
        "Scores of a tile: tl.dot(q, tl.trans(k)) * scale, [BLOCK_Q, TILE_N]; -inf where the key is past the "
        "row's position, past the keys, on a padding row, or (WINDOW > 0) WINDOW or more positions back.",
        "With a window, the first tile may be hidden from the block's last rows: m stays -inf there, and your "
        "update's guard keeps -inf - (-inf) out. Divide acc by l where l > 0.",
    ],
)


# ----------------------------------------------------------------- puzzle 6: 05.gqa


def gqa(query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
        scale, max_blocks, num_seqs,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr):
    """Reference: program (b, kv_head) serves BLOCK_Q tokens x the GROUP query heads of its KV head, BLOCK_M rows."""
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)           # the sequence's query blocks start there
    if q_block * BLOCK_Q >= q_len:
        return                                                       # the grid is an upper bound
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP                        # [BLOCK_M] row r: token r // GROUP ...
    q_head = kv_head * GROUP + rows % GROUP                          # ... and query head kv_head * GROUP + r % GROUP
    row_ok = (q_idx < q_len) & (rows < BLOCK_Q * GROUP)
    q_pos = seq_len - q_len + q_idx
    dims = tl.arange(0, HEAD_SIZE)
    q_offsets = ((q_start + q_idx)[:, None] * NUM_KV_HEADS * GROUP + q_head[:, None]) * HEAD_SIZE + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_ok[:, None], other=0.0)                   # [BLOCK_M, HEAD_SIZE]
    kv_len = tl.minimum(seq_len, seq_len - q_len + (q_block + 1) * BLOCK_Q)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)
    for tile in range(0, tl.cdiv(kv_len, TILE_N)):
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = keys < kv_len
        physical = tl.load(block_table_ptr + seq * max_blocks + keys // BLOCK_SIZE, mask=key_ok, other=0)
        kv = ((physical * BLOCK_SIZE + keys % BLOCK_SIZE)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_SIZE \
            + dims[None, :]
        k = tl.load(key_cache_ptr + kv, mask=key_ok[:, None], other=0.0)   # one K tile serves all BLOCK_M rows
        v = tl.load(value_cache_ptr + kv, mask=key_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, scores, v)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_offsets, out, mask=row_ok[:, None])


def _gqa_case(batch: str, probes: str, seq_lens: Sequence[int], query_lens: Sequence[int], *, num_kv_heads: int = 2,
              group: int = 2, block_size: int = 4, seed: int = 0) -> Case:
    b = _batch(seq_lens, query_lens, num_kv_heads=num_kv_heads, group=group, block_size=block_size, seed=seed)
    tensors = _varlen_tensors(b)
    block_q = 1 << ((16 // group).bit_length() - 1)      # the largest power of two with BLOCK_Q * GROUP <= 16
    summary = (f"seq_lens {list(seq_lens)}, query_lens {list(query_lens)}, {num_kv_heads} KV heads x group {group}, "
               f"BLOCK_Q {block_q}")
    grid = (sum(query_lens) // block_q + len(seq_lens), num_kv_heads)
    launch = Launch(batch, summary, grid, tensors,
                    {"scale": HEAD**-0.5, "max_blocks": b.block_table.shape[1], "num_seqs": len(seq_lens)},
                    {"NUM_KV_HEADS": num_kv_heads, "GROUP": group, "HEAD_SIZE": HEAD, "BLOCK_SIZE": block_size,
                     "BLOCK_Q": block_q, "BLOCK_M": 16, "TILE_N": 16}, ("out_ptr",), _pointer_axes(tensors))
    return Case(kwargs={"launch": launch}, probes=f"{batch}: {probes}")


def _random_gqa(rng: random.Random) -> Case:
    seq_lens = _random_lens(rng, 24, rng.randint(1, 2))
    query_lens = [rng.choice([1, min(s, 8), rng.randint(1, s)]) for s in seq_lens]
    return _gqa_case("random GQA batch", "random chunks and decodes, random group", seq_lens, query_lens,
                     num_kv_heads=1, group=rng.choice([1, 2, 3, 4]), seed=rng.randrange(2**31))


_PICTURES["05.gqa"] = [("key_cache_ptr", 0, 1), ("out_ptr", 0, 1)]
_puzzle(
    "05.gqa",
    title="Puzzle 6: GQA packing, and the grid of query blocks",
    task=(
        "Now GROUP query heads share each KV head (query head h reads KV head h // GROUP), and the grid is the "
        "real kernel's: axis 0 runs over query blocks of all sequences, num_tokens // BLOCK_Q + num_seqs of them, "
        "and axis 1 over KV heads. Find your sequence with `find_seq_idx(query_start_loc_ptr, program_id(0), "
        "num_seqs, BLOCK_Q)` (from `kvlab.kernels.attention`: sequence i's query blocks start at "
        "query_start_loc[i] // BLOCK_Q + i); return if your query block is past its query. A program packs "
        "BLOCK_Q tokens x GROUP heads into BLOCK_M = 16 rows, row r being token r // GROUP and query head "
        "kv_head * GROUP + r % GROUP, so each K and V tile is loaded once for all of them. Causal, no window."
    ),
    signature=("def gqa(query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr, "
               "out_ptr, scale, max_blocks, num_seqs, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, "
               "HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, "
               "TILE_N: tl.constexpr):"),
    reference=gqa,
    spec=_varlen_spec,
    edge_cases=LazyCases(lambda: [
        _gqa_case("group 2", "2 query heads per KV head: 8 tokens x 2 heads fill 16 rows", [12, 5], [12, 5]),
        _gqa_case("chunk and decodes", "an 8-token chunk after 20 cached keys beside two decodes: the grid's spare "
                  "query blocks exit at once", [28, 17, 6], [8, 1, 1], num_kv_heads=1, group=4, seed=1),
        _gqa_case("GQA group 3", "3 query heads per KV head: 4 tokens x 3 heads fill 12 of 16 rows", [21, 6], [5, 2],
                  num_kv_heads=1, group=3, seed=2),
        _gqa_case("MQA (one KV head)", "8 query heads share one KV head: 2 tokens per program", [13, 4], [5, 4],
                  num_kv_heads=1, group=8, seed=3),
    ]),
    random_case=_random_gqa,
    mistakes=[
        _mistake(gqa, "q_head = kv_head * GROUP + rows % GROUP", "q_head = kv_head + rows % GROUP * NUM_KV_HEADS",
                 "query head h reads KV head h // GROUP (consecutive heads share one), not h % num_kv_heads"),
        _mistake(gqa, "q_block = q_block_global - (q_start // BLOCK_Q + seq)", "q_block = q_block_global - seq",
                 "sequence i's query blocks start at query_start_loc[i] // BLOCK_Q + i, not at i"),
    ],
    hints=[
        "seq = find_seq_idx(query_start_loc_ptr, tl.program_id(0), num_seqs, BLOCK_Q); your query block within "
        "the sequence is program_id(0) - (query_start_loc[seq] // BLOCK_Q + seq).",
        "rows = tl.arange(0, BLOCK_M): the token of row r is q_block * BLOCK_Q + r // GROUP, its query head "
        "kv_head * GROUP + r % GROUP; rows >= BLOCK_Q * GROUP are padding.",
        "The query of row r is at ((q_start + token) * NUM_KV_HEADS * GROUP + head) * HEAD_SIZE; K and V are "
        "read at KV head kv_head, once per tile for all the rows. The rest is puzzle 5 without the window.",
    ],
)


# ----------------------------------------------------------------- puzzle 7: 05.split_kv


def split_kv(query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, split_max_ptr, split_sum_ptr,
             split_acc_ptr, scale, max_blocks,
             NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Reference: program (seq, kv_head, split) folds its range of key tiles into an unnormalised partial."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP                                            # decode: one token, GROUP query heads
    q_head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_SIZE)
    q = tl.load(query_ptr + (seq * NUM_KV_HEADS * GROUP + q_head[:, None]) * HEAD_SIZE + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)       # may be <= tile_lo: an empty split
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = keys < seq_len
        physical = tl.load(block_table_ptr + seq * max_blocks + keys // BLOCK_SIZE, mask=key_ok, other=0)
        kv = ((physical * BLOCK_SIZE + keys % BLOCK_SIZE)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_SIZE \
            + dims[None, :]
        k = tl.load(key_cache_ptr + kv, mask=key_ok[:, None], other=0.0)
        v = tl.load(value_cache_ptr + kv, mask=key_ok[:, None], other=0.0)
        scores = tl.where(row_ok[:, None] & key_ok[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, scores, v)
    row = (seq * NUM_KV_HEADS * GROUP + q_head) * NUM_SPLITS + split                # [seq, q_head, split]
    tl.store(split_max_ptr + row, m_i, mask=row_ok)                  # -inf, 0 and 0 for an empty split
    tl.store(split_sum_ptr + row, l_i, mask=row_ok)
    tl.store(split_acc_ptr + row[:, None] * HEAD_SIZE + dims[None, :], acc, mask=row_ok[:, None])


def _partials(b: Any, num_splits: int, tile_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification of split-KV: every decode's (m, l, acc) over each split's range of key tiles."""
    reference = importlib.import_module("kvlab.kernels.reference")
    num_seqs, num_q_heads = b.query.shape[0], b.query.shape[1]
    group = num_q_heads // b.key_cache.shape[2]
    m = torch.full((num_seqs, num_q_heads, num_splits), float("-inf"))
    l_sum = torch.zeros(num_seqs, num_q_heads, num_splits)
    acc = torch.zeros(num_seqs, num_q_heads, num_splits, HEAD)
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        k = reference.gather_kv(b.key_cache, b.block_table[i], seq_len).repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = reference.gather_kv(b.value_cache, b.block_table[i], seq_len).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", b.query[i], k) * HEAD**-0.5                                # [Hq, n]
        per = cdiv(cdiv(seq_len, tile_n), num_splits)
        for s in range(num_splits):
            keys = slice(s * per * tile_n, min((s + 1) * per * tile_n, seq_len))
            if keys.start >= keys.stop:
                continue                                                    # an empty split: -inf, 0, 0
            part = scores[:, keys]
            m[i, :, s] = part.max(dim=1).values
            weights = torch.exp(part - m[i, :, s, None])                        # [Hq, keys]
            l_sum[i, :, s] = weights.sum(dim=1)
            acc[i, :, s] = torch.einsum("hn,nhd->hd", weights, v[keys])
    return m, l_sum, acc


def _split_case(batch: str, probes: str, seq_lens: Sequence[int], *, num_splits: int = 3, num_kv_heads: int = 1,
                group: int = 2, seed: int = 0) -> Case:
    b = _batch(seq_lens, [1] * len(seq_lens), num_kv_heads=num_kv_heads, group=group, block_size=8, seed=seed)
    shape = (len(seq_lens), num_kv_heads * group, num_splits)
    tensors = {"query_ptr": b.query, "key_cache_ptr": b.key_cache, "value_cache_ptr": b.value_cache,
               "block_table_ptr": b.block_table, "seq_lens_ptr": b.seq_lens,
               "split_max_ptr": torch.full(shape, float("nan")), "split_sum_ptr": torch.full(shape, float("nan")),
               "split_acc_ptr": torch.full((*shape, HEAD), float("nan"))}
    tiles = [cdiv(n, 16) for n in seq_lens]
    summary = (f"seq_lens {list(seq_lens)} ({'/'.join(map(str, tiles))} tiles of 16), {num_splits} splits, "
               f"{num_kv_heads} KV heads x group {group}")
    launch = Launch(batch, summary, (len(seq_lens), num_kv_heads, num_splits), tensors,
                    {"scale": HEAD**-0.5, "max_blocks": b.block_table.shape[1]},
                    {"NUM_KV_HEADS": num_kv_heads, "GROUP": group, "HEAD_SIZE": HEAD, "BLOCK_SIZE": 8, "BLOCK_M": 16,
                     "TILE_N": 16, "NUM_SPLITS": num_splits}, ("split_max_ptr", "split_sum_ptr", "split_acc_ptr"),
                    _pointer_axes(tensors))
    return Case(kwargs={"launch": launch}, probes=f"{batch}: {probes}")


def _split_spec(launch: Launch) -> KernelResult:
    """Each split's unnormalised (m, l, acc) over its range of key tiles (``_partials``, above)."""
    t = launch.tensors
    b = importlib.import_module("kvlab.kernels.checks").PagedTensors(
        t["query_ptr"], t["key_cache_ptr"], t["value_cache_ptr"], t["block_table_ptr"], t["seq_lens_ptr"],
        torch.arange(len(t["seq_lens_ptr"]) + 1, dtype=torch.int32))
    m, l_sum, acc = _partials(b, launch.constants["NUM_SPLITS"], launch.constants["TILE_N"])
    return _result(launch, {"split_max_ptr": m, "split_sum_ptr": l_sum, "split_acc_ptr": acc})


def _random_split(rng: random.Random) -> Case:
    return _split_case("random splits", "random decodes cut into random splits",
                       _random_lens(rng, 50, rng.randint(1, 2)),
                       num_splits=rng.randint(1, 3), num_kv_heads=1, group=rng.choice([1, 2, 4]),
                       seed=rng.randrange(2**31))


_PICTURES["05.split_kv"] = [("key_cache_ptr", 0, 1), ("split_acc_ptr", 1, 2)]
_puzzle(
    "05.split_kv",
    title="Puzzle 7: split-KV, one range of key tiles per program",
    task=(
        "A decode batch (one query token per sequence) with GROUP query heads per KV head, and the keys cut "
        "across NUM_SPLITS programs. Program (seq, kv_head, split) packs the GROUP query heads of its KV head into "
        "BLOCK_M = 16 rows, counts its sequence's key tiles, num_tiles = cdiv(seq_len, TILE_N), takes tiles "
        "[split * per, min((split + 1) * per, num_tiles)) with per = cdiv(num_tiles, NUM_SPLITS), and folds them "
        "in with the online softmax. It stores its rows' *unnormalised* partial, m, l and acc (natural exp, as "
        "your update computes them), at [seq, query head, split] of split_max, split_sum [num_seqs, num_q_heads, "
        "NUM_SPLITS] and split_acc [..., HEAD_SIZE]. A split with no tile stores m = -inf, l = 0, acc = 0."
    ),
    signature=("def split_kv(query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, split_max_ptr, "
               "split_sum_ptr, split_acc_ptr, scale, max_blocks, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, "
               "HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, "
               "NUM_SPLITS: tl.constexpr):"),
    reference=split_kv,
    spec=_split_spec,
    edge_cases=LazyCases(lambda: [
        _split_case("one split", "NUM_SPLITS = 1: one program walks all 3 tiles", [40, 9], num_splits=1),
        _split_case("4 tiles in 3 splits", "cdiv(4, 3) = 2 tiles per split: 2, 2 and none (m = -inf, l = 0)",
                    [60, 20], seed=1),
        _split_case("short sequence", "a 9-key sequence has one tile: the other splits are empty", [9, 33],
                    num_splits=2, seed=2),
        _split_case("group 4, two KV heads", "4 query heads of 2 KV heads in 16 rows, 2 splits", [40],
                    num_splits=2, num_kv_heads=2, group=4, seed=3),
    ]),
    random_case=_random_split,
    mistakes=[
        _mistake(split_kv, "tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)",
                 "tiles_per_split = num_tiles // NUM_SPLITS",
                 "num_tiles // NUM_SPLITS rounds down, so the last tiles belong to no split: take cdiv"),
        _mistake(split_kv, "tl.store(split_acc_ptr + row[:, None] * HEAD_SIZE + dims[None, :], acc,",
                 "tl.store(split_acc_ptr + row[:, None] * HEAD_SIZE + dims[None, :], acc / l_i[:, None],",
                 "a partial stays unnormalised: the merge rescales acc and l by the same weight and divides last"),
    ],
    hints=[
        "Rows are the GROUP query heads of kv_head (kv_head * GROUP + r); rows >= GROUP are padding.",
        "tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), NUM_SPLITS); this split's tiles run from "
        "split * tiles_per_split to the smaller of the next split's start and the number of tiles.",
        "Loop over that range as in puzzle 5 (a decode sees every key of its sequence), then store m_i, l_i and "
        "acc as they are; an empty range leaves them at -inf, 0 and 0, which is what the merge expects.",
    ],
)


# ----------------------------------------------------------------- puzzle 8: 05.reduce_splits


def reduce_splits(split_max_ptr, split_sum_ptr, split_acc_ptr, out_ptr,
                  NUM_Q_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  SPLITS_PAD: tl.constexpr):
    """Reference: program (token, head) merges the split partials with their log-sum-exp weights."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    ok = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_SIZE)
    row = (token * NUM_Q_HEADS + head) * NUM_SPLITS + splits                    # [SPLITS_PAD]
    m = tl.load(split_max_ptr + row, mask=ok, other=float("-inf"))            # a padding lane weighs nothing
    l_s = tl.load(split_sum_ptr + row, mask=ok, other=0.0)
    acc = tl.load(split_acc_ptr + row[:, None] * HEAD_SIZE + dims[None, :], mask=ok[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    weight = tl.exp(m - m_all)                                                  # 0 for an empty split
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    tl.store(out_ptr + (token * NUM_Q_HEADS + head) * HEAD_SIZE + dims, out)


def _reduce_case(batch: str, probes: str, seq_lens: Sequence[int], *, num_splits: int = 3, num_q_heads: int = 2,
                 late_max: bool = False, far_below: bool = False, seed: int = 0) -> Case:
    b = _batch(seq_lens, [1] * len(seq_lens), num_kv_heads=1, group=num_q_heads, block_size=8, seed=seed)
    if late_max or far_below:
        for i, n in enumerate(seq_lens):
            for j in range(n - 4 if late_max else 0, n):              # the last keys point along the query ...
                block, slot = b.block_table[i, j // 8], j % 8
                b.key_cache[block, slot, 0] = (-60.0 if far_below else 4.0) * b.query[i].mean(dim=0)  # ... or far away
    m, l_sum, acc = _partials(b, num_splits, 16)
    tensors = {"split_max_ptr": m, "split_sum_ptr": l_sum, "split_acc_ptr": acc, "out_ptr": _nan_like(b.query)}
    summary = (f"{len(seq_lens)} decodes of {list(seq_lens)} keys, {num_splits} splits, {num_q_heads} heads; "
               f"m from {float(m[torch.isfinite(m)].min()):.3g} to {float(m.max()):.3g}")
    launch = Launch(batch, summary, (len(seq_lens), num_q_heads), tensors, {},
                    {"NUM_Q_HEADS": num_q_heads, "HEAD_SIZE": HEAD, "NUM_SPLITS": num_splits,
                     "SPLITS_PAD": 1 << (num_splits - 1).bit_length()}, ("out_ptr",), _pointer_axes(tensors))
    return Case(kwargs={"launch": launch}, probes=f"{batch}: {probes}")


def _reduce_spec(launch: Launch) -> KernelResult:
    """out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, with M the largest m of the row."""
    t = launch.tensors
    m = t["split_max_ptr"]
    weight = torch.exp(m - m.amax(dim=-1, keepdim=True))                            # [tokens, heads, splits]
    out = (t["split_acc_ptr"] * weight[..., None]).sum(dim=2) / (t["split_sum_ptr"] * weight).sum(dim=2)[..., None]
    return _result(launch, {"out_ptr": out})


def _random_reduce(rng: random.Random) -> Case:
    return _reduce_case("random partials", "random decodes cut into random splits", _random_lens(rng, 70, 1),
                        num_splits=rng.randint(1, 5), num_q_heads=rng.choice([1, 2, 4]), late_max=rng.random() < 0.5,
                        seed=rng.randrange(2**31))


_PICTURES["05.reduce_splits"] = [("split_acc_ptr", 2, 3), ("out_ptr", 0, 1)]
_puzzle(
    "05.reduce_splits",
    title="Puzzle 8: merge the splits",
    task=(
        "The second kernel of split-KV. Program (token, head) reads the NUM_SPLITS partials of its row, m, l and "
        "acc as puzzle 7 stored them, and writes the attention output: with M the largest m, "
        "out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s. An empty split has m = -inf and weighs "
        "nothing. Load the splits as one vector of SPLITS_PAD lanes (a power of two >= NUM_SPLITS) and mask "
        "the lanes past NUM_SPLITS: what they load (`other=`) must weigh nothing either."
    ),
    signature=("def reduce_splits(split_max_ptr, split_sum_ptr, split_acc_ptr, out_ptr, NUM_Q_HEADS: tl.constexpr, "
               "HEAD_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):"),
    reference=reduce_splits,
    spec=_reduce_spec,
    edge_cases=LazyCases(lambda: [
        _reduce_case("one split", "NUM_SPLITS = 1: the merge only divides acc by l", [40, 9], num_splits=1),
        _reduce_case("3 splits, one empty", "cdiv(4 tiles, 3) leaves the third split empty (m = -inf); SPLITS_PAD "
                     "4 adds a masked lane", [60, 30], seed=1),
        _reduce_case("the maximum in the last split", "the last keys score highest: the first splits' sums must "
                     "shrink by exp(m_s - M)", [64, 50], num_splits=4, late_max=True, seed=2),
        _reduce_case("scores far below zero", "every score near -100: exp(m_s - M) is fine, exp(m_s - 0) "
                     "underflows to 0", [40, 20], far_below=True, seed=3),
    ]),
    random_case=_random_reduce,
    mistakes=[
        _mistake(reduce_splits, "/ tl.sum(l_s * weight, axis=0)", "/ tl.sum(l_s, axis=0)",
                 "the splits' sums need the same weights as their values: sum_s exp(m_s - M) l_s"),
        _mistake(reduce_splits, 'mask=ok, other=float("-inf"))', "mask=ok, other=0.0)",
                 "a masked lane loads other=0.0 as its m, which can be the largest: load -inf so it weighs nothing"),
    ],
    hints=[
        "splits = tl.arange(0, SPLITS_PAD); the row of split s is (token * NUM_Q_HEADS + head) * NUM_SPLITS + s. "
        "Load m, l and acc with the mask splits < NUM_SPLITS.",
        "tl.max(m, axis=0) is the scalar M; weights exp(m - M) are 1 for the best split and 0 for an empty one.",
        "A masked lane must weigh nothing: m loads as float('-inf'), l and acc as 0.",
    ],
)


# ----------------------------------------------------------------- puzzle 6 on check_kernel's bench


def kernel_bench(kernel: Any, batches: Sequence[str] | None = None) -> Any:
    """Your ``05.gqa`` kernel as ``paged_attention``, on ``check_kernel``'s packaged batches that it serves.

    Puzzle 6's kernel is the whole paged kernel but for windows, split-KV and FP8, so the bench of
    **Break it yourself** runs it on every packaged batch without those (``batches`` names a subset)
    and reports, batch by batch, what passed and where the worst error is.
    """
    if kernel is None or _is_stub(kernel):
        return Note("Your `05.gqa` kernel is still the stub: once it passes its check, this runs it on "
                    "`check_kernel`'s packaged batches.")
    kernels = _kernels()
    compiled = importlib.import_module("kvlab.kernels.program_view").rebuild(kernel)

    def paged_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *, out=None,
                        **_: Any) -> torch.Tensor:
        num_tokens, num_q_heads, head_size = query.shape
        num_kv_heads, num_seqs = key_cache.shape[2], len(seq_lens)
        group = num_q_heads // num_kv_heads
        block_q = 1 << ((16 // group).bit_length() - 1)
        out = torch.empty_like(query) if out is None else out
        compiled[(num_tokens // block_q + num_seqs, num_kv_heads)](
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, head_size**-0.5,
            block_table.shape[1], num_seqs, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_SIZE=head_size,
            BLOCK_SIZE=key_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=16, TILE_N=16)
        return out

    paged_attention.__qualname__ = "your 05.gqa kernel"
    served = [b for b in kernels.PACKAGED_BATCHES if b.sliding_window is None and b.fp8_scales is None
              and b.num_kv_splits == 1 and (batches is None or b.name in batches)]
    return kernels.check_kernel(paged_attention, served, seed=0)
