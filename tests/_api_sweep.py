"""The input sweep's machinery: every public callable of kvlab's pure layers, called with wrong inputs.

For each public function, class and public method of ``kvlab.capacity``, ``kvlab.core`` and ``kvlab.sim``
(plus the engine's configuration objects) the sweep builds one call that works (the *baseline*, from the
parameter's default, a value by parameter name, or an override below), then changes one argument at a time
to a wrong value chosen from its annotation: the wrong type, ``None`` where ``None`` is not allowed, NaN and
infinity for numbers, ``-1`` for counts and sizes, an unknown name for names, ``10**15`` for sizes. Each probe
is classified:

- ``ok``: a kvlab error (``KvlabError``) whose message names the parameter the caller used;
- ``unnamed``: a kvlab error that does not name the parameter;
- ``generic``: any other exception (``TypeError``, ``AttributeError``, ``ZeroDivisionError`` ...) leaking out;
- ``silent``: the call returned although the value is wrong for its annotation or its meaning;
- ``hang``: the call ran past ``PROBE_SECONDS`` of CPU time (a size of 10**15 must be refused, not attempted);
- ``accepted``: the call returned and the value is allowed (e.g. ``10**15`` where a size may be large).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import pkgutil
import resource
import signal
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvlab.errors import KvlabError

PROBE_SECONDS = 2.0
LARGE = True
PROBE_EXTRA_MEMORY = 2 << 30  # a probe may map this much more than the process has; beyond it, MemoryError
PACKAGES = ("kvlab.capacity", "kvlab.core", "kvlab.core.sched", "kvlab.sim")
EXTRA_MODULES = ("kvlab.engine.engine_config", "kvlab.engine.kv_transfer_config", "kvlab.units",
                 "kvlab.kv_cache_interface")


class _Timeout(BaseException):
    """Raised by the alarm inside a probe (a BaseException, so the code under test cannot swallow it)."""


@dataclass(frozen=True)
class Target:
    """One public callable: its dotted name, how to get a fresh object to call, and how to build its baseline."""

    name: str
    func: Callable[..., Any]
    params: tuple[inspect.Parameter, ...]
    owner: type | None = None  # the class a method belongs to (its baseline builds the instance)


@dataclass
class Probe:
    target: str
    parameter: str
    value: str
    outcome: str
    detail: str = ""


@dataclass
class SweepResult:
    probes: list[Probe] = field(default_factory=list)
    baselines_failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def count(self, outcome: str) -> int:
        return sum(p.outcome == outcome for p in self.probes)

    def of(self, *outcomes: str) -> list[Probe]:
        return [p for p in self.probes if p.outcome in outcomes]


def public_modules() -> Iterator[types.ModuleType]:
    """Every module of the swept layers (sub-packages' modules included), then the extra modules."""
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__):
            if not info.ispkg:
                yield importlib.import_module(f"{package_name}.{info.name}")
    for name in EXTRA_MODULES:
        yield importlib.import_module(name)


def public_callables(module: types.ModuleType) -> Iterator[tuple[str, Any]]:
    """The functions and classes a module defines and does not mark private."""
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    for name in names:
        obj = getattr(module, name, None)
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj


def signature(func: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(func, eval_str=True)
    except (TypeError, ValueError, NameError):
        try:
            return inspect.signature(func)
        except (TypeError, ValueError):
            return None


def call_with_alarm(thunk: Callable[[], Any], seconds: float = PROBE_SECONDS) -> Any:
    """Run ``thunk``; raise ``_Timeout`` after ``seconds`` of this process's CPU time (SIGPROF, so a busy
    machine does not turn a slow call into a "hang"; the sweep runs in the main thread)."""

    def on_alarm(signum: int, frame: object) -> None:
        raise _Timeout

    previous = signal.signal(signal.SIGPROF, on_alarm)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as fh:
        mapped = int(fh.read().split()[0]) * resource.getpagesize()
    cap = mapped + PROBE_EXTRA_MEMORY
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        return thunk()
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGPROF, previous)


# --- what is wrong for an annotation -------------------------------------------------------------------------

_NOT_A_THING = object()


def _flatten(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        out: list[Any] = []
        for arg in typing.get_args(annotation):
            out.extend(_flatten(arg))
        return out
    return [annotation]


def _base(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    return origin if origin is not None else annotation


def wrong_values(annotation: Any, rules: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """Values wrong for ``annotation`` (and for the parameter's meaning), each with whether it MUST be refused.

    ``rules`` may say a parameter allows negatives (``signed``), large values (``large_ok``) or free text.
    """
    if annotation is inspect.Parameter.empty or annotation is Any or isinstance(annotation, str):
        return []  # a string: the annotation names what only type checkers import
    kinds = _flatten(annotation)
    bases = {_base(k) for k in kinds}
    allows_none = type(None) in bases
    out: list[tuple[str, Any, bool]] = []
    if not allows_none:
        out.append(("None", None, True))
    only_numbers = bases <= {int, float, type(None)} and bases & {int, float}
    if only_numbers:
        out.append(("'7' (a string)", "7", True))
        out.append(("[] (a list)", [], True))
        if int in bases and float not in bases:
            out.append(("2.5", 2.5, True))
        if float in bases:
            out.append(("nan", math.nan, True))
            out.append(("inf", math.inf, not rules.get("inf_ok", False)))
        if not rules.get("signed", False):
            out.append(("-1", -1, True))
        if int in bases and LARGE and not rules.get("large_ok", False):
            out.append(("10**15", 10**15, False))  # refused or finished fast; never a hang
    elif bases == {str} or bases == {str, type(None)}:
        out.append(("7 (an int)", 7, True))
        if not rules.get("free_text", False):
            out.append(("'bogus'", "bogus", True))
    elif bases == {bool}:
        out.append(("'yes' (a string)", "yes", True))
        out.append(("2", 2, True))
    else:
        classes = [b for b in bases if inspect.isclass(b) and b not in (type(None), str, int, float)]
        named = [b for b in classes if dataclasses.is_dataclass(b) or b.__module__.startswith("kvlab")]
        if named:
            out.append(("7 (an int)", 7, True))
            if str in bases and not rules.get("free_text", False):
                out.append(("'bogus' (an unknown name)", "bogus", True))
    return out


def classify(target: Target, parameter: str, thunk: Callable[[], Any], must_refuse: bool,
             also_named: tuple[str, ...] = ()) -> tuple[str, str]:
    """Run one probe and say what happened (see the module docstring)."""
    try:
        call_with_alarm(thunk)
    except _Timeout:
        return "hang", f"ran past {PROBE_SECONDS} s"
    except KvlabError as exc:
        message = str(exc)
        names = (parameter, *also_named)
        if any(n in message for n in names):
            return "ok", ""
        return "unnamed", f"{type(exc).__name__}: {message[:160]}"
    except Exception as exc:  # noqa: BLE001 - the point is to catch what leaks
        return "generic", f"{type(exc).__name__}: {str(exc)[:160]}"
    return ("silent" if must_refuse else "accepted"), ""


# --- baselines: one call of each public callable that works ---------------------------------------------------

def _samples() -> dict[str, Callable[[], Any]]:
    """A working value for a required parameter, by name (fresh objects each time: calls may change them)."""
    from kvlab.capacity.hardware import get_gpu, get_host, get_link
    from kvlab.capacity.models import get_model
    from kvlab.capacity.playbook import Deployment, Workload
    from kvlab.core.block_pool import BlockPool
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.request import Request
    from kvlab.core.sched.output import GenerationRequest

    def manager() -> KVCacheManager:
        return KVCacheManager(num_blocks=16, block_size=4)

    return {
        "model": lambda: get_model("llama-3-8b"),
        "gpu": lambda: get_gpu("H100-SXM-80GB"),
        "host": lambda: get_host("DGX-H100"),
        "link": lambda: get_link("PCIe 5.0 x16"),
        "deployment": lambda: Deployment("llama-3-8b", "H100-SXM-80GB", max_model_len=8192),
        "workload": lambda: Workload(mean_prompt_tokens=1000, mean_output_tokens=200),
        "pool": lambda: BlockPool(8),
        "kv_cache_manager": manager,
        "manager": manager,
        "request": lambda: Request("r0", list(range(10))),
        "num_blocks": lambda: 8,
        "block_size": lambda: 4,
        "tokens": lambda: 100,
        "num_tokens": lambda: 10,
        "max_model_len": lambda: 8192,
        "concurrency": lambda: 4,
        "available_bytes": lambda: 1 << 30,
        "bytes_per_block": lambda: 1 << 20,
        "gpu_memory_gib": lambda: 80.0,
        "kv_dtype": lambda: "bf16",
        "weights_dtype": lambda: "bf16",
        "name": lambda: "llama-3-8b",
        "request_id": lambda: "r0",
        "prompt_token_ids": lambda: list(range(10)),
        "n": lambda: 4,
        "seed": lambda: 0,
        "prompt_len": lambda: 8,
        "output_len": lambda: 4,
        "num_elements": lambda: 128,
        "reserved": lambda: 200,
        "num_params": lambda: 8e9,
        "max_concurrency": lambda: 12.0,
        "num_usable_blocks": lambda: 100,
        "hit_rate": lambda: 0.5,
        "workload_shares_prefixes": lambda: True,
        "hash_fn_name": lambda: "sha256",
        "bits": lambda: 16,
        "num_gpu_blocks": lambda: 64,
        "tp": lambda: 8,
        "num_seqs": lambda: 64,
        "generation_request": lambda: GenerationRequest("g0", list(range(10))),
    }


FREE_TEXT = {
    "name", "request_id", "note", "description", "title", "text", "command", "full_name", "path", "identifier",
    "label", "lora_name", "lora_path", "cache_salt", "hash_seed", "parent_id", "memory_label", "architecture",
    "band", "verdict", "flag", "key_prefix", "prompt", "source", "where", "id_prefix", "engine_id", "key",
}
SIGNED = {"seed", "offset_seconds", "delta"}


def _rules(target: str, parameter: str, overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rules: dict[str, Any] = {"free_text": parameter in FREE_TEXT, "signed": parameter in SIGNED}
    rules.update(overrides.get(f"{target}:{parameter}", {}))
    return rules


def targets(skip: dict[str, str]) -> Iterator[Target]:
    """Every public function, class (its constructor) and public method of the swept modules."""
    seen: set[int] = set()
    for module in public_modules():
        for name, obj in public_callables(module):
            if id(obj) in seen or name in skip:
                continue
            seen.add(id(obj))
            sig = signature(obj)
            if sig is None:
                continue
            yield Target(name, obj, tuple(sig.parameters.values()))
            if not inspect.isclass(obj) or issubclass(obj, BaseException) or getattr(obj, "_is_protocol", False):
                continue
            for attr, member in vars(obj).items():
                if attr.startswith("_") or f"{name}.{attr}" in skip:
                    continue
                func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if not inspect.isfunction(func):
                    continue
                msig = signature(func)
                if msig is None:
                    continue
                params = tuple(msig.parameters.values())
                if not isinstance(member, staticmethod):
                    params = params[1:]  # self or cls
                yield Target(f"{name}.{attr}", func, params, owner=obj)


def _baseline_kwargs(target: Target, samples: dict[str, Callable[[], Any]],
                     overrides: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, Any]:
    given = overrides[target.name]() if target.name in overrides else {}
    kwargs: dict[str, Any] = {}
    if any(p.kind is p.VAR_KEYWORD for p in target.params):
        named = {p.name for p in target.params}
        kwargs.update({k: v for k, v in given.items() if k not in named})  # what **kwargs passes on
    for p in target.params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in given:
            kwargs[p.name] = given[p.name]
        elif p.default is not p.empty:
            continue
        elif p.name in samples:
            kwargs[p.name] = samples[p.name]()
        else:
            raise LookupError(f"no sample value for required parameter {p.name!r}")
    return kwargs


def _caller(target: Target, instances: Callable[[], Any] | None) -> Callable[..., Any]:
    if target.owner is None:
        return target.func
    member = vars(target.owner)[target.name.rsplit(".", 1)[1]]
    if isinstance(member, staticmethod):
        return target.func
    if isinstance(member, classmethod):
        return getattr(target.owner, member.__func__.__name__)
    assert instances is not None
    return lambda **kw: getattr(instances(), target.func.__name__)(**kw)


@dataclass(frozen=True)
class Prepared:
    """A target whose baseline call works: how to call it and how to build its working arguments afresh."""

    target: Target
    call: Callable[..., Any]
    make_kwargs: Callable[[], dict[str, Any]]

    def probe(self, parameter: str, value: Any) -> Callable[[], Any]:
        """A thunk calling the target with the baseline, ``parameter`` changed to ``value``."""
        def thunk() -> Any:
            kwargs = self.make_kwargs()
            kwargs[parameter] = value
            return self.call(**kwargs)
        return thunk


def prepare(overrides: dict[str, Callable[[], dict[str, Any]]], skip: dict[str, str],
            failed: dict[str, str] | None = None) -> list[Prepared]:
    """Every target whose baseline call works; the others go to ``failed`` with the reason."""
    import torch  # noqa: F401 - imported once up front, so no alarm lands inside its import

    failed = {} if failed is None else failed
    samples = _samples()
    class_kwargs: dict[str, Callable[[], dict[str, Any]]] = {}
    out: list[Prepared] = []
    for target in targets(skip):
        instances = None
        if target.owner is not None:
            owner_name = target.name.rsplit(".", 1)[0]
            if owner_name not in class_kwargs:
                failed.setdefault(target.name, "its class has no baseline")
                continue
            make = class_kwargs[owner_name]
            owner = target.owner

            def instances(owner: Any = owner, make: Callable[[], dict[str, Any]] = make) -> Any:
                return owner(**make())
        call = _caller(target, instances)

        def make_kwargs(target: Target = target) -> dict[str, Any]:
            return _baseline_kwargs(target, samples, overrides)
        try:
            call_with_alarm(lambda call=call, make_kwargs=make_kwargs: call(**make_kwargs()))
        except (Exception, _Timeout) as exc:  # noqa: BLE001
            failed[target.name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        if inspect.isclass(target.func):
            class_kwargs[target.name] = make_kwargs
        out.append(Prepared(target, call, make_kwargs))
    return out


def probed_parameters(prepared: Prepared) -> list[inspect.Parameter]:
    """The parameters a probe may change: named ones the baseline can be built around."""
    return [p for p in prepared.target.params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def run_sweep(overrides: dict[str, Callable[[], dict[str, Any]]], rules: dict[str, dict[str, Any]],
              skip: dict[str, str], also_named: dict[str, tuple[str, ...]]) -> SweepResult:
    """Build every target's baseline, then probe each parameter with each wrong value."""
    result = SweepResult(skipped=dict(skip))
    for prepared in prepare(overrides, skip, result.baselines_failed):
        target = prepared.target
        for p in probed_parameters(prepared):
            for label, value, must in wrong_values(p.annotation, _rules(target.name, p.name, rules)):
                outcome, detail = classify(target, p.name, prepared.probe(p.name, value), must,
                                           also_named.get(f"{target.name}:{p.name}", ()))
                result.probes.append(Probe(target.name, p.name, label, outcome, detail))
    return result


# --- config.json contents: every field of every real config, through every reader ---------------------------

def config_readers() -> dict[str, Callable[[dict[str, Any]], Any]]:
    """Every public function that reads a ``config.json`` dict, by name (the engine's through its registry)."""
    from kvlab.capacity.models import ModelSpec, count_parameters, get_model, parameter_parts
    from kvlab.engine.registry import model_config_from_dict

    spec = get_model("llama-3-8b")
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init and f.name != "config"}
    return {
        "ModelSpec.from_hf_config": ModelSpec.from_hf_config,
        "ModelSpec.from_hf_config(text_config)": lambda cfg: ModelSpec.from_hf_config(
            {"model_type": "wrapper", "text_config": cfg}),
        "count_parameters": count_parameters,
        "parameter_parts": parameter_parts,
        "ModelSpec(config=...)": lambda cfg: ModelSpec(**fields, config=cfg),
        "model_config_from_dict": model_config_from_dict,
    }


def config_wrong_values(real: Any, nullable: bool, token_ids: bool) -> list[tuple[str, Any, bool]]:
    """Wrong values for a field whose real value is ``real``: the wrong type, None, NaN, negative, huge."""
    out: list[tuple[str, Any, bool]] = [("None", None, not nullable), ("nan", math.nan, True)]
    if isinstance(real, bool):
        out += [("'yes'", "yes", True), ("2", 2, True)]
    elif isinstance(real, (int, float)):
        out += [("'7' (a string)", "7", True), ("[7] (a list)", [7], not token_ids), ("-1", -1, True),
                ("10**15", 10**15, isinstance(real, int))]
    elif isinstance(real, str):
        out += [("7 (an int)", 7, True), ("['x'] (a list)", ["x"], True)]
    elif isinstance(real, (dict, list)):
        out += [("'x' (a string)", "x", True), ("7 (an int)", 7, True)]
    return out


def _config_paths(config: dict[str, Any]) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in config.items():
        yield (key,), value
        if isinstance(value, dict):
            for sub, inner in value.items():
                yield (key, sub), inner


def _with(config: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    if len(path) == 1:
        return {**config, path[0]: value}
    return {**config, path[0]: {**config[path[0]], path[1]: value}}


def run_config_sweep(configs: dict[str, dict[str, Any]]) -> SweepResult:
    """Probe each field of each config with each wrong value through each reader whose baseline call works.

    A field kvlab reads (``kvlab.capacity.config_fields``) must be refused by a kvlab error naming it; a field
    it never reads may be accepted; neither may leak a generic error or hang.
    """
    from kvlab.capacity.config_fields import CONFIG_FIELDS, NESTED_FIELDS

    result = SweepResult()
    for reader, read in config_readers().items():
        for name, config in configs.items():
            try:
                call_with_alarm(lambda read=read, config=config: read(config))
            except Exception as exc:  # noqa: BLE001 - a reader that does not serve this model is not probed
                result.skipped[f"{reader} @ {name}"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                continue
            for path, real in _config_paths(config):
                schema = CONFIG_FIELDS if len(path) == 1 else NESTED_FIELDS.get(path[0], {})
                field = schema.get(path[-1])
                for label, value, wrong in config_wrong_values(real, field is None or field.nullable,
                                                               field is not None and field.kind == "token_ids"):
                    wrong = wrong and field is not None
                    probe = functools.partial(lambda r, c: r(c), read, _with(config, path, value))
                    outcome, detail = _classify_config(probe, path[-1], wrong)
                    result.probes.append(Probe(f"{reader} @ {name}", ".".join(path), label, outcome, detail))
    return result


def _classify_config(thunk: Callable[[], Any], field_name: str, wrong: bool) -> tuple[str, str]:
    try:
        call_with_alarm(thunk)
    except _Timeout:
        return "hang", f"ran past {PROBE_SECONDS} s"
    except KvlabError as exc:
        if not wrong or field_name in str(exc):
            return "ok", ""
        return "unnamed", f"{type(exc).__name__}: {str(exc)[:160]}"
    except Exception as exc:  # noqa: BLE001 - the point is to catch what leaks
        return "generic", f"{type(exc).__name__}: {str(exc)[:160]}"
    return ("silent" if wrong else "accepted"), ""
