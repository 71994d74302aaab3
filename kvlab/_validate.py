"""Small argument checks shared by every module, so messages read the same everywhere.

``checked`` (below) reads the same kind of rule from type hints: a decorated function refuses a wrong type
before its body runs.

kvlab's public functions promise a kvlab error naming the parameter for bad input, never a ``TypeError``
or ``AttributeError`` from deep inside. ``@checked`` reads the function's annotations once and, on each
call, checks the arguments the caller passed: ``int`` (bools refused), ``float`` (finite: NaN and infinity
refused), ``str``, ``bool``, ``Literal[...]``, ``None`` only where ``| None`` says so, kvlab's own classes,
containers (``Sequence``, ``Iterable``, ``Mapping``: the container, not its items) and unions of these.
The checks guard the door, once: kvlab's own code calls the undecorated function (``fn.__wrapped__``, or a
private ``_impl`` a public method checks and calls), so the allocator's hot paths pay no check and no stack
inspection. Each checker is built once per signature, with exact-type fast paths (``type(v) is int``) and
``numbers`` only as the fallback; a list of ints is checked in one C-level pass, not a frame per item. A door
called for every request and step (``Request``, the manager's ``get_computed_blocks``, ``allocate_slots`` and
``free``, the free queue's ``popleft_n``) takes ``@checked(inline=True)``: the checks are written into its
own body, so it costs no wrapper's call.
In kvlab an ``int`` or ``float`` parameter is a count, a size, an index or a share, so it must be >= 0
unless the function names it in ``signed=``. Range rules beyond that (> 0, <= 1, fits the pool) stay
in the function, next to what they protect.
"""

from __future__ import annotations

import ast
import collections.abc as abc
import dataclasses
import functools
import inspect
import math
import numbers
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from kvlab.errors import KvlabValueError, UnknownNameError


def positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an integer >= 1 (bools refused), else raise naming ``name``."""
    if type(value) is int and value >= 1:  # the usual case, without numbers' Python-level isinstance
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise KvlabValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def non_negative_int(name: str, value: object) -> int:
    """Return ``value`` if it is an integer >= 0 (bools refused), else raise naming ``name``."""
    if type(value) is int and value >= 0:  # the usual case, without numbers' Python-level isinstance
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise KvlabValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def non_negative_number(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite real >= 0, else raise naming ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or value < 0
    ):
        raise KvlabValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def positive_number(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite real > 0, else raise naming ``name``."""
    number = non_negative_number(name, value)
    if number == 0:
        raise KvlabValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def fraction_in_unit_interval(name: str, value: object) -> float:
    """Return ``value`` if 0 < value <= 1 (a share such as gpu_memory_utilization)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (0 < float(value) <= 1)
    ):
        raise KvlabValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def one_of(name: str, value: object, allowed: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``allowed``, else raise listing the allowed names."""
    allowed = list(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise UnknownNameError(name, value, allowed)
    return value


# --- checks read from type hints -----------------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])
# The most Python objects (blocks, requests, tokens, repeats) one kvlab call builds: about a GiB on a laptop.
MAX_OBJECTS = 10**7
INT64 = 2**63
Check = Callable[[object], bool]

_CONTAINERS: dict[Any, tuple[type, str]] = {
    abc.Sequence: (abc.Sequence, "a sequence"),
    abc.Iterable: (abc.Iterable, "an iterable"),
    abc.Mapping: (abc.Mapping, "a mapping"),
    abc.Collection: (abc.Collection, "a collection"),
    list: (list, "a list"),
    tuple: (abc.Sequence, "a tuple"),  # or a list: classes turn a list into their tuple
    dict: (dict, "a dict"),
    set: (set, "a set"),
    frozenset: (frozenset, "a frozenset"),
}


def _is_int(value: object) -> bool:
    kind = type(value)
    return kind is int or (kind is not bool and isinstance(value, numbers.Integral))


def _is_real(value: object) -> bool:
    kind = type(value)
    return kind is float or kind is int or (kind is not bool and isinstance(value, numbers.Real))


def _number_check(kind: str, signed: bool) -> tuple[Check, str]:
    low = -INT64 if signed else 0
    if kind == "int":  # every count ends up in a numpy or torch int64 somewhere

        def check_int(v: object) -> bool:
            return (type(v) is int or _is_int(v)) and low <= v < INT64  # type: ignore[operator]

        check_int.fast = f"(type({{v}}) is int and {low} <= {{v}} < {INT64})"  # type: ignore[attr-defined]
        return check_int, "an integer below 2**63" if signed else "an integer >= 0 (below 2**63)"

    def check_real(v: object) -> bool:
        return (type(v) is float or _is_real(v)) and math.isfinite(v) and (signed or v >= 0)  # type: ignore[arg-type, operator]

    return check_real, "a finite number" if signed else "a finite number >= 0"


def _ints_check(signed: bool) -> Check:
    """Every item an int in range, in C-level passes (``map``, ``min``, ``max``) for a list or tuple of plain ints."""
    low = -INT64 if signed else 0
    item_ok = _number_check("int", signed)[0]

    def items_ok(v: Any) -> bool:
        if type(v) in (list, tuple) and (not v or set(map(type, v)) == {int}):
            return not v or (low <= min(v) and max(v) < INT64)
        return all(item_ok(x) for x in v)

    return items_ok


def _checker(annotation: Any, signed: bool) -> tuple[Check, str] | None:
    """A predicate and its description for ``annotation``, or None where kvlab cannot check it cheaply."""
    if annotation is Any or isinstance(annotation, (TypeVar, str, typing.ForwardRef)):
        return None
    if annotation is type(None) or annotation is None:
        return _with_fast(lambda v: v is None, "{v} is None"), "None"
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [_checker(arg, signed) for arg in typing.get_args(annotation)]
        if any(p is None for p in parts):
            return None
        checks = [p[0] for p in parts]  # type: ignore[index]
        text = " or ".join(dict.fromkeys(p[1] for p in parts))  # type: ignore[index]

        def union(v: object) -> bool:
            return any(c(v) for c in checks)

        union.parts = parts  # type: ignore[attr-defined]  # lets a refusal name the bad item of a container
        return union, text
    if origin is typing.Literal:
        allowed = typing.get_args(annotation)
        what = _Names("one of " + ", ".join(repr(a) for a in allowed))
        what.allowed = tuple(str(a) for a in allowed)
        return (lambda v: any(v == a and type(v) is type(a) for a in allowed)), what
    if origin is typing.Annotated:
        return _checker(typing.get_args(annotation)[0], signed)
    base = origin if origin is not None else annotation
    if base is bool:
        return _with_fast(lambda v: isinstance(v, bool), "({v} is True or {v} is False)"), "True or False"
    if base is int:
        return _number_check("int", signed)
    if base is float:
        return _number_check("float", signed)
    if base is str:
        return _with_fast(lambda v: isinstance(v, str), "type({v}) is str"), "a str"
    if base is abc.Hashable:
        return (lambda v: v is not None and isinstance(v, abc.Hashable)), "a hashable value (not None)"
    if base in _CONTAINERS:
        return _container_checker(base, typing.get_args(annotation), signed)
    if base is abc.Callable:
        return callable, "a callable"
    if inspect.isclass(base) and getattr(base, "_is_protocol", False):
        methods = [n for n, v in vars(base).items() if not n.startswith("_") and callable(v)]
        return (lambda v: all(callable(getattr(v, n, None)) for n in methods)), \
            f"a {base.__name__} (with {', '.join(methods)})"
    if inspect.isclass(base):
        owner = "kvlab " if base.__module__.startswith("kvlab") else ""

        def is_instance(v: object) -> bool:
            return isinstance(v, base)

        is_instance.kind = base  # type: ignore[attr-defined]  # _compile inlines the isinstance
        return is_instance, f"a {owner}{base.__name__}"
    return None


def _with_fast(check: Check, template: str) -> Check:
    """``check`` with the inline expression ``_compile`` writes in its place (``{v}``: the value)."""
    check.fast = template  # type: ignore[attr-defined]
    return check


def _container_checker(base: Any, args: tuple[Any, ...], signed: bool) -> tuple[Check, str]:
    """A container and, where it holds its items already (not a one-shot iterator), each item's type."""
    kind, text = _CONTAINERS[base]
    if base in (abc.Mapping, dict) and len(args) == 2:
        keys, values = _checker(args[0], signed), _checker(args[1], signed)
        key_ok = keys[0] if keys else (lambda k: True)
        value_ok = values[0] if values else (lambda v: True)
        what = f"{text} of {keys[1] if keys else 'keys'} to {values[1] if values else 'values'}"
        return (lambda v: isinstance(v, kind) and all(key_ok(k) and value_ok(x) for k, x in v.items())), what
    if base is tuple and args and args[-1] is not Ellipsis:  # a fixed-length tuple
        parts = [_checker(arg, signed) for arg in args]
        checks = [part[0] if part else (lambda x: True) for part in parts]
        what = f"a tuple of {len(args)} ({', '.join(part[1] if part else 'any' for part in parts)})"
        return (lambda v: isinstance(v, abc.Sequence) and not isinstance(v, (str, bytes))
                and len(v) == len(checks) and all(c(x) for c, x in zip(checks, v, strict=True))), what
    item = _checker(args[0], signed) if args else None
    if item is None:
        return (lambda v: isinstance(v, kind) and not isinstance(v, str)), text
    item_ok, item_what = item
    items_ok = _ints_check(signed) if typing.get_origin(args[0]) is None and args[0] is int else None

    def check(v: object) -> bool:
        if not isinstance(v, kind) or isinstance(v, (str, bytes)):
            return False
        if isinstance(v, abc.Iterator):  # a generator: its items cannot be looked at without using them up
            return True
        if items_ok is not None:
            return items_ok(v)
        return all(item_ok(x) for x in v)  # type: ignore[attr-defined]

    check.item = (kind, item_ok, item_what)  # type: ignore[attr-defined]  # lets a refusal name the bad item
    plain = {list: "type({v}) is list", abc.Sequence: "type({v}) in (list, tuple)",
             abc.Iterable: "type({v}) in (list, tuple)", abc.Collection: "type({v}) in (list, tuple)"}.get(kind)
    if items_ok is not None and plain is not None:  # a list (or tuple) of plain ints, inline: C-level calls only
        low = -INT64 if signed else 0
        check.fast = (f"({plain} and len({{v}}) > 0 and set(map(type, {{v}})) == {{{{int}}}} "  # type: ignore[attr-defined]
                      f"and {low} <= min({{v}}) and max({{v}}) < {INT64})")
    return check, f"{text} (each item: {item_what})"


def _resolve(func: Callable[..., Any]) -> dict[str, Any]:
    """The parameters' annotations as objects, read in the function's own module (``functools`` wrappers unwrapped).

    An annotation that does not resolve there (a name only type checkers import) is left unchecked: kvlab's
    modules import at load every class a checked parameter names (no import cycle needs hiding, the layout
    test holds that), so no other module's names are searched.
    """
    namespace = getattr(inspect.unwrap(func), "__globals__", {})
    out: dict[str, Any] = {}
    for name, annotation in getattr(func, "__annotations__", {}).items():
        if name == "return":  # only the arguments are checked
            continue
        resolved = _evaluate(annotation, namespace)
        if resolved is not _UNRESOLVED:
            out[name] = resolved
    return out


_UNRESOLVED = object()


def _evaluate(annotation: Any, namespace: Mapping[str, Any]) -> Any:
    """An annotation as an object, from its module's names; ``_UNRESOLVED`` if it names what the module lacks."""
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, dict(namespace))  # noqa: S307 - the module's own annotation text
    except Exception:  # noqa: BLE001
        return _UNRESOLVED


class _Names(str):
    """A description listing names (a ``Literal``): refused with ``UnknownNameError``."""

    allowed: tuple[str, ...] = ()


def _refusal(name: str, check: Check, what: str, value: object) -> KvlabValueError:
    """``describe_refusal``, but inside a container of the right kind, name the first item that is wrong."""
    for part_check, part_what in getattr(check, "parts", ()):  # a union: the container alternative it is
        item = getattr(part_check, "item", None)
        if item is not None and isinstance(value, item[0]) and not isinstance(value, (str, bytes)):
            return _refusal(name, part_check, part_what, value)
    item = getattr(check, "item", None)
    if item is not None and isinstance(value, item[0]) and not isinstance(value, (str, bytes, abc.Iterator)):
        kind, item_ok, item_what = item
        for i, x in enumerate(value):  # type: ignore[attr-defined]
            if not item_ok(x):
                return _refusal(f"{name}[{i}]", item_ok, item_what, x)
    return describe_refusal(name, what, value)


def describe_refusal(name: str, what: str, value: object) -> KvlabValueError:
    """The error every check raises: the parameter, what it accepts and what it got."""
    if isinstance(what, _Names):
        return UnknownNameError(name, value, what.allowed)
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return KvlabValueError(f"{name} must be {what}, got {shown}")


def _bounded(made: tuple[Check, str], limit: int) -> tuple[Check, str]:
    check, what = made
    return (lambda v: check(v) and (v is None or v <= limit)), f"{what} and <= {limit:,}"


def _rules_for(fn: Callable[..., Any], signed: tuple[str, ...], skip_first: bool,
               at_most: Mapping[str, int] | None = None,
               skip: tuple[str, ...] = ()) -> list[tuple[str, int, Check, str]]:
    """(name, position, predicate, description) for each parameter ``@checked`` can check."""
    hints = _resolve(fn)
    rules = []
    for position, (name, param) in enumerate(inspect.signature(fn).parameters.items()):
        if (skip_first and position == 0) or name not in hints or name in skip:
            continue
        made = _checker(hints[name], name in signed)
        if made is not None and at_most and name in at_most:
            made = _bounded(made, at_most[name])
        if made is not None:
            index = position if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD) else 1 << 30
            rules.append((name, index, *made))
    return rules


def _fast(check: Check, value: str, namespace: dict[str, Any], prefix: str = "_") -> str | None:
    """An inline Python expression that is True only where ``check`` is (the common exact types), or None.

    A union inlines the alternatives that have such an expression; the others are left to ``check`` itself.
    """
    template = getattr(check, "fast", None)
    if template is not None:
        return template.format(v=value)
    kind = getattr(check, "kind", None)
    if kind is not None:
        name = f"{prefix}k{len(namespace)}"  # "_": never a parameter's name (see _with_own_signature)
        namespace[name] = kind
        return f"isinstance({value}, {name})"
    inline = [_fast(part, value, namespace, prefix) for part, _ in getattr(check, "parts", ())]
    inline = [expression for expression in inline if expression]
    return "(" + " or ".join(inline) + ")" if inline else None


_MISSING = object()


def _compile(plan: list[tuple[str, int, Check, str]]) -> Callable[[tuple[Any, ...], dict[str, Any]], None]:
    """One function checking every argument of a call, built once per signature: exact types inline, the full
    predicate only where the inline test fails (a numpy int, a subclass), the refusal only where that fails too."""
    lines = ["def check_arguments(args, kwargs):", "    n = len(args)"]
    namespace: dict[str, Any] = {"_MISSING": _MISSING}
    for i, (name, index, check, what) in enumerate(plan):
        namespace[f"c{i}"] = check
        namespace[f"fail{i}"] = functools.partial(_refusal, name, check, what)
        if index < 1 << 30:
            lines.append(f"    v = args[{index}] if n > {index} else kwargs.get({name!r}, _MISSING)")
        else:
            lines.append(f"    v = kwargs.get({name!r}, _MISSING)")
        inline = _fast(check, "v", namespace)
        test = f"({inline} or c{i}(v))" if inline else f"c{i}(v)"
        lines.append(f"    if v is not _MISSING and not {test}:")
        lines.append(f"        raise fail{i}(v)")
    exec(compile("\n".join(lines), "<checked arguments>", "exec"), namespace)  # noqa: S102 - from the annotations
    return namespace["check_arguments"]  # type: ignore[no-any-return]


def _checked_function(fn: F, signed: tuple[str, ...], at_most: Mapping[str, int] | None = None,
                      skip: tuple[str, ...] = ()) -> F:
    fast = _with_own_signature(fn, signed, at_most, skip)
    if fast is not None:
        return fast
    check_arguments: Callable[[tuple[Any, ...], dict[str, Any]], None] | None = None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal check_arguments
        if check_arguments is None:  # resolved at the first call, when every name the annotations use exists
            check_arguments = _compile(_rules_for(fn, signed, skip_first=False, at_most=at_most, skip=skip))
        check_arguments(args, kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _with_own_signature(fn: F, signed: tuple[str, ...], at_most: Mapping[str, int] | None,
                        skip: tuple[str, ...]) -> F | None:
    """The checking wrapper as one function with ``fn``'s own parameters: the checks inline, no ``*args`` to unpack.

    Its first call resolves the annotations (every name they use exists by then), writes the checks and swaps
    its own code for them. None where the signature has ``*args``, ``**kwargs`` or positional-only parameters.
    """
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        return None
    namespace: dict[str, Any] = {"_fn": fn, "_MISSING": _MISSING}
    if any(p.name.startswith("_") for p in params):  # could shadow the names the wrapper's code uses
        return None
    heads, passes = [], []
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not any(h == "*" for h in heads) and \
                all(q.kind is not q.KEYWORD_ONLY for q in params[:i]):
            heads.append("*")
        if p.default is p.empty:
            heads.append(p.name)
        else:
            namespace[f"_d{i}"] = p.default
            heads.append(f"{p.name}=_d{i}")
        passes.append(p.name if p.kind is p.POSITIONAL_OR_KEYWORD else f"{p.name}={p.name}")
    head, call = ", ".join(heads), ", ".join(passes)
    defaults = {p.name: f"_d{i}" for i, p in enumerate(params) if p.default is not p.empty}

    def build(body: list[str]) -> Any:
        code: dict[str, Any] = {}
        source = "\n".join([f"def {fn.__name__}({head}):", *body])
        exec(compile(source, f"<checked {fn.__qualname__}>", "exec"), namespace, code)  # noqa: S102
        return code[fn.__name__].__code__

    def first_call() -> None:  # the checks, now that the annotations resolve
        body = []
        for name, _, check, what in _rules_for(fn, signed, skip_first=False, at_most=at_most, skip=skip):
            i = len(namespace)
            namespace[f"_c{i}"], namespace[f"_f{i}"] = check, functools.partial(_refusal, name, check, what)
            inline = _fast(check, name, namespace)
            test = f"({inline} or _c{i}({name}))" if inline else f"_c{i}({name})"
            guard = f"{name} is not {defaults[name]} and " if name in defaults else ""  # a default is trusted
            body += [f"    if {guard}not {test}:", f"        raise _f{i}({name})"]
        wrapper.__code__ = build([*body, f"    return _fn({call})"])

    namespace["_first_call"] = first_call
    wrapper: Any = types.FunctionType(build(["    _first_call()", f"    return _checking({call})"]), namespace,
                                      fn.__name__, None)
    wrapper.__defaults__ = tuple(p.default for p in params if p.default is not p.empty
                                 and p.kind is p.POSITIONAL_OR_KEYWORD) or None
    wrapper.__kwdefaults__ = {p.name: p.default for p in params
                              if p.default is not p.empty and p.kind is p.KEYWORD_ONLY} or None
    namespace["_checking"] = wrapper
    functools.update_wrapper(wrapper, fn)
    return wrapper  # type: ignore[no-any-return]


def _inlined(fn: F, signed: tuple[str, ...], at_most: Mapping[str, int] | None, skip: tuple[str, ...]) -> F | None:
    """``fn`` with its argument checks written at the top of its own body: the door costs no call of its own.

    For the allocator's doors, called once per step per request. At the first call (when the annotations
    resolve) ``fn``'s own source is compiled again with the checks in front, at ``fn``'s file and lines (a
    traceback shows the real line); the checkers live in ``fn``'s module under names that start with
    ``_checked_``. None where that cannot be done (no source, a closure such as ``super()``'s, ``*args``):
    ``@checked`` then writes a wrapper as usual. ``__wrapped__`` is ``fn``, unchecked, as with a wrapper.
    """
    params = list(inspect.signature(fn).parameters.values())
    code = getattr(fn, "__code__", None)
    if code is None or code.co_freevars or any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                                               for p in params):
        return None
    try:
        lines, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef) or tree.body[0].name != fn.__name__:
        return None
    module, prefix = fn.__globals__, "_checked_" + fn.__qualname__.replace(".", "_") + "_"
    heads = []
    for p in params:  # the first call's parameters (the defaults are fn's own: "None" here is never read)
        if p.kind is p.KEYWORD_ONLY and "*" not in heads:
            heads.append("*")
        heads.append(p.name if p.default is p.empty else f"{p.name}=None")
    call = ", ".join(p.name if p.kind is p.POSITIONAL_OR_KEYWORD else f"{p.name}={p.name}" for p in params)
    defaults = {p.name: f"{prefix}d{i}" for i, p in enumerate(params) if p.default is not p.empty}
    module.update({defaults[p.name]: p.default for p in params if p.name in defaults})

    def with_checks(checks: list[str]) -> types.CodeType:
        """``fn``'s code with ``checks`` in front of its body (after its docstring), at its own lines."""
        fused = ast.parse(textwrap.dedent("".join(lines)))
        ast.increment_lineno(fused, first - 1)
        func = fused.body[0]
        func.decorator_list = []  # type: ignore[attr-defined]
        prologue = ast.parse("\n".join(checks)).body
        for node in (n for statement in prologue for n in ast.walk(statement)):
            if "lineno" in node._attributes:
                node.lineno = node.end_lineno = func.lineno  # type: ignore[attr-defined]
                node.col_offset = node.end_col_offset = 0  # type: ignore[attr-defined]
        body = func.body  # type: ignore[attr-defined]
        docstring = int(bool(body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str))
        body[docstring:docstring] = prologue
        compiled = compile(fused, code.co_filename, "exec", dont_inherit=True)
        made = next(c for c in compiled.co_consts if isinstance(c, types.CodeType) and c.co_name == fn.__name__)
        assert not made.co_freevars, f"{fn.__qualname__}: a fused door must not need a closure"
        return made.replace(co_qualname=code.co_qualname)

    def first_call(*args: Any, **kwargs: Any) -> Any:
        namespace: dict[str, Any] = {}
        checks = []
        for name, _, check, what in _rules_for(fn, signed, skip_first=False, at_most=at_most, skip=skip):
            i = len(namespace)
            namespace[f"{prefix}c{i}"] = check
            namespace[f"{prefix}f{i}"] = functools.partial(_refusal, name, check, what)
            inline = _fast(check, name, namespace, prefix)
            test = f"({inline} or {prefix}c{i}({name}))" if inline else f"{prefix}c{i}({name})"
            guard = f"{name} is not {defaults[name]} and " if name in defaults else ""  # a default is trusted
            checks.append(f"if {guard}not {test}:\n    raise {prefix}f{i}({name})")
        module.update(namespace)
        door.__code__ = with_checks(checks)
        return door(*args, **kwargs)

    with_checks([])  # fails here, at import, if the source cannot be compiled alone
    module[prefix + "first_call"] = first_call
    stub = compile(f"def {fn.__name__}({', '.join(heads)}):\n    return {prefix}first_call({call})\n",
                   code.co_filename, "exec")
    door: Any = types.FunctionType(next(c for c in stub.co_consts if isinstance(c, types.CodeType)), module,
                                   fn.__name__, fn.__defaults__)
    door.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(door, fn)
    return door  # type: ignore[no-any-return]


def _checked_class(cls: type, signed: tuple[str, ...], at_most: Mapping[str, int] | None = None,
                   skip: tuple[str, ...] = (), inline: bool = False) -> type:
    if dataclasses.is_dataclass(cls) and hasattr(cls, "__post_init__"):
        post_init = cls.__post_init__  # the generated __init__ calls it once the fields are set

        def check_then_post_init(self: Any) -> None:
            check_fields(self, signed=signed, skip=skip)
            post_init(self)

        cls.__post_init__ = check_then_post_init  # type: ignore[attr-defined]
    elif dataclasses.is_dataclass(cls):
        init = cls.__init__

        @functools.wraps(init)
        def init_then_check(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            check_fields(self, signed=signed, skip=skip)

        cls.__init__ = init_then_check  # type: ignore[method-assign]
    else:
        init = cls.__init__
        fused = _inlined(init, signed, at_most, skip) if inline else None
        cls.__init__ = fused or _checked_function(init, signed, at_most, skip)  # type: ignore[method-assign]
    return cls


def checked(func: Any = None, *, signed: tuple[str, ...] = (), at_most: Mapping[str, int] | None = None,
            skip: tuple[str, ...] = (), inline: bool = False) -> Any:
    """Check each argument against its annotation before the call (a class: its constructor's arguments).

    ``skip`` leaves a parameter to the body (one whose range the body checks with a better message).
    ``at_most`` caps sizes that kvlab would build in memory (``MAX_OBJECTS``), so 10**15 blocks is refused
    at once instead of filling the laptop. On a dataclass the fields are checked once built (``check_fields``).
    ``inline`` writes the checks into the function's own body instead of a wrapper around it (``_inlined``):
    for the doors called once per request and step, where a wrapper's call would cost as much as the work.
    """

    def decorate(obj: Any) -> Any:
        if inspect.isclass(obj):
            return _checked_class(obj, signed, at_most, skip, inline)
        if inline:
            fused = _inlined(obj, signed, at_most, skip)
            if fused is not None:
                return fused
        return _checked_function(obj, signed, at_most, skip)

    return decorate(func) if func is not None else decorate


_FIELD_RULES: dict[tuple[type, tuple[str, ...], tuple[str, ...]], list[tuple[str, Check, str]]] = {}


def _field_rules(klass: type, signed: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[tuple[str, Check, str]]:
    hints: dict[str, Any] = {}
    for base in reversed(klass.__mro__):
        if dataclasses.is_dataclass(base):
            namespace = vars(sys.modules[base.__module__])
            for name, annotation in vars(base).get("__annotations__", {}).items():
                resolved = _evaluate(annotation, namespace)
                if resolved is not _UNRESOLVED:
                    hints[name] = resolved
    rules = []
    for f in dataclasses.fields(klass):
        if f.name in hints and f.name not in skip:
            made = _checker(hints[f.name], f.name in signed)
            if made is not None:
                rules.append((f.name, *made))
    return rules


def check_fields(obj: object, *, signed: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> None:
    """``@checked`` for a dataclass: every field against its annotation (the rules are built once per class)."""
    key = (type(obj), signed, skip)
    rules = _FIELD_RULES.get(key)
    if rules is None:
        rules = _FIELD_RULES[key] = _field_rules(type(obj), signed, skip)
    for name, check, what in rules:
        value = getattr(obj, name)
        if not check(value):
            raise _refusal(name, check, what, value)
