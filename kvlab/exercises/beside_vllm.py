"""vLLM 0.33.0's own code beside kvlab's, where vLLM is installed: its source, and a learner's answer run against it.

kvlab copies no line of vLLM. Where vLLM 0.33.0 is installed (importable in this kernel, or in the
``.venv-vllm`` that ``make test-vllm`` builds beside the repository), ``beside`` shows the function
being taught as vLLM's installed file has it, next to kvlab's, and ``against_vllm`` runs a learner's
answer on an exercise's cases against a reference built on vLLM's own classes. Without vLLM, both
say how to get it and return: a notebook cell that calls them runs either way.

The source is read from the installed file (``ast``, the lines ``inspect.getsource`` returns), not
imported: importing vLLM takes several seconds of CPU and most of its dependencies. Running a
learner's answer does import it, in this kernel when it can, else in ``.venv-vllm``'s Python (the
function travels as the checker sends it, ``transfer.dumps_function``).
"""

from __future__ import annotations

import ast
import dataclasses
import html
import importlib.util
import inspect
import json
import pickle
import random
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab import VLLM_VERSION
from kvlab.errors import KvlabValueError, UnknownNameError
from kvlab.exercises.canonical import canonical, difference, short_repr
from kvlab.exercises.catalogue import get_exercise
from kvlab.exercises.grading import cases_for, copies, format_inputs
from kvlab.exercises.limits import call_with_time_limit
from kvlab.exercises.records import CheckResult

REPOSITORY = Path(__file__).resolve().parents[2]
VENV_WITH_VLLM = REPOSITORY / ".venv-vllm"
HOW_TO_GET_IT = (f"vLLM {VLLM_VERSION} is not installed here. `make test-vllm` builds it beside the workbook, in "
                 f".venv-vllm (vllm=={VLLM_VERSION} without its dependencies, and a few small packages), and this cell "
                 f"then shows vLLM's code; or `pip install vllm=={VLLM_VERSION}` into this environment.")
RUN_LIMIT_S = 600  # the subprocess imports vLLM: seconds of CPU, minutes on a loaded machine


@dataclasses.dataclass(frozen=True)
class VllmInstall:
    """Where vLLM's package folder is, its version, and the Python that can import it (None: this one)."""

    package: Path
    version: str
    python: Path | None


def _version(package: Path) -> str:
    found = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", (package / "_version.py").read_text()
                      ) if (package / "_version.py").exists() else None
    return found.group(1) if found else "unknown"


def find_vllm(venv: Path | None = None) -> VllmInstall | None:
    """vLLM as installed: importable by this Python (found without importing it), else in ``venv``
    (default: the repository's ``.venv-vllm``); None where neither has it."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin and spec.origin.endswith("__init__.py"):  # a package, not a folder of tests
        package = Path(spec.origin).parent
        return VllmInstall(package, _version(package), None)
    venv = VENV_WITH_VLLM if venv is None else venv
    for package in sorted(venv.glob("lib/python*/site-packages/vllm")):
        python = venv / "bin" / "python"
        if (package / "__init__.py").exists() and python.exists():
            return VllmInstall(package, _version(package), python)
    return None


def source_in_file(path: Path, qualname: str) -> str:
    """The source of ``qualname`` ("BlockPool.free_blocks") in the Python file ``path``, decorators included,
    dedented: what ``inspect.getsource`` gives for it, read without importing the file."""
    text = path.read_text(encoding="utf-8")
    scope: Any = ast.parse(text)
    for part in qualname.split("."):
        found = [n for n in scope.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == part]
        if not found:
            raise UnknownNameError("qualname", qualname, [n.name for n in scope.body if hasattr(n, "name")])
        scope = found[-1]
    first = min([scope.lineno, *(d.lineno for d in scope.decorator_list)])
    return textwrap.dedent("".join(text.splitlines(keepends=True)[first - 1:scope.end_lineno]))


def vllm_source(name: str, install: VllmInstall | None = None) -> str:
    """The installed source of ``name``, written ``"vllm/v1/core/block_pool.py:BlockPool.free_blocks"``."""
    install = install or find_vllm()
    if install is None:
        raise KvlabValueError(HOW_TO_GET_IT)
    path, sep, qualname = name.partition(":")
    if not sep or not path.startswith("vllm/"):
        raise KvlabValueError(f"name must read 'vllm/<file>.py:<qualified name>', got {name!r}")
    return source_in_file(install.package.parent / path, qualname)


def _code(title: str, body: str) -> str:
    return (f'<div style="min-width:0"><div style="font:600 13px sans-serif;margin:2px 0 4px">{title}</div>'
            '<pre style="overflow:auto;max-height:460px;margin:0;padding:6px 8px;font-size:12px;line-height:1.35;'
            f'background:#f8fafc;border:1px solid #e2e8f0;border-radius:4px">{html.escape(body)}</pre></div>')


@dataclasses.dataclass(frozen=True)
class Beside:
    """kvlab's source and vLLM's, side by side in JupyterLab (one after the other as text); vLLM's may be absent."""

    kvlab_name: str
    kvlab_source: str
    vllm_name: str
    vllm_source: str | None
    note: str

    def _repr_html_(self) -> str:
        right = (_code(f"vLLM {VLLM_VERSION}: <code>{html.escape(self.vllm_name)}</code>", self.vllm_source)
                 if self.vllm_source is not None else
                 '<div style="min-width:0;font:13px sans-serif;padding:8px;border:1px dashed #94a3b8;'
                 f'border-radius:4px">{_markdown_code(html.escape(self.note))}</div>')
        note = (f'<div style="font:12px sans-serif;color:#475569;margin-top:4px">'
                f"{_markdown_code(html.escape(self.note))}</div>" if self.vllm_source is not None and self.note else "")
        left = _code(f"kvlab: <code>{html.escape(self.kvlab_name)}</code>", self.kvlab_source)
        return ('<div class="kvlab-beside" style="display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);'
                f'gap:10px;max-width:100%">{left}{right}</div>{note}')

    def __repr__(self) -> str:
        vllm = (f"# vLLM {VLLM_VERSION}: {self.vllm_name}\n{self.vllm_source}" if self.vllm_source is not None
                else f"# vLLM {VLLM_VERSION}: {self.vllm_name}: {self.note}")
        return f"# kvlab: {self.kvlab_name}\n{self.kvlab_source}\n{vllm}" + (
            f"\n# {self.note}" if self.vllm_source is not None and self.note else "")


def _markdown_code(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def beside(kvlab_object: Any, vllm_name: str, venv: Path | None = None) -> Beside:
    """kvlab's ``kvlab_object`` beside vLLM's ``vllm_name`` (``"vllm/v1/core/block_pool.py:BlockPool.free_blocks"``),
    as installed; without vLLM, kvlab's alone and how to get vLLM's."""
    module = getattr(kvlab_object, "__module__", "")
    if not module.startswith("kvlab"):
        raise KvlabValueError(f"kvlab_object must be a kvlab function or class, got {short_repr(kvlab_object)}")
    ours = textwrap.dedent(inspect.getsource(kvlab_object))
    name = f"{module}.{kvlab_object.__qualname__}"
    install = find_vllm(venv)
    if install is None:
        return Beside(name, ours, vllm_name, None, HOW_TO_GET_IT)
    note = "" if install.version == VLLM_VERSION else (
        f"The installed vLLM is {install.version}; kvlab follows {VLLM_VERSION}, which may differ.")
    return Beside(name, ours, vllm_name, vllm_source(vllm_name, install), note)


# --------------------------------------------------------------------------- answers run against vLLM


def _vllm_free_queue_order(queue: list[int], table: list[int], cached: set[int]) -> list[int]:
    """03.free_queue_order on vLLM's own BlockPool (its block 0 is the null block, so ids are shifted by one)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    size = max([*queue, *table], default=0) + 1
    pool = BlockPool(size + 1, enable_caching=True, hash_block_size=16)
    everything = pool.get_new_blocks(size)  # the null block is taken at start-up: ids 1 .. size, in order
    block = {b.block_id - 1: b for b in everything}
    pool.free_blocks([block[i] for i in queue])  # the queue was empty: it now reads as `queue`
    for i in table:
        if i in cached:
            block[i].set_block_hash(make_block_hash_with_group_id(f"hash of {i}".encode(), 0))
    pool.free_blocks(reversed([block[i] for i in table]))  # KVCacheManager.free's order: tail first
    return [b.block_id - 1 for b in pool.free_block_queue.get_all_free_blocks()]


REFERENCES_ON_VLLM: dict[str, tuple[Callable[..., Any], str]] = {
    "03.free_queue_order": (_vllm_free_queue_order, "vllm/v1/core/block_pool.py:BlockPool.free_blocks"),
}


def run_against_vllm(exercise_id: str, function: Callable[..., Any], seed: int, num_random: int) -> dict[str, Any]:
    """Run ``function`` and the vLLM-built reference on the exercise's cases (here; vLLM must import)."""
    reference, _ = REFERENCES_ON_VLLM[exercise_id]
    exercise = get_exercise(exercise_id)
    cases = cases_for(exercise, seed)[:len(exercise.edge_cases) + num_random]
    for number, case in enumerate(cases, start=1):
        wanted = canonical(reference(*copies(case)[0], **copies(case)[1]))
        outcome = call_with_time_limit(function, *copies(case), seconds=10.0)
        if outcome.error is not None or outcome.timed_out:
            got = "no answer within 10 s" if outcome.timed_out else f"{type(outcome.error).__name__}: {outcome.error}"
            return {"cases": number, "failed": True, "inputs": format_inputs(case, exercise.signature),
                    "vllm": short_repr(wanted), "got": got}
        try:
            where = difference(wanted, canonical(outcome.value))
        except Exception as why:  # what the learner returned cannot be compared
            where = str(why)
        if where is not None:
            return {"cases": number, "failed": True, "inputs": format_inputs(case, exercise.signature),
                    "vllm": short_repr(wanted), "got": short_repr(outcome.value), "where": where}
    return {"cases": len(cases), "failed": False}


def _in_subprocess(install: VllmInstall, exercise_id: str, function: Callable[..., Any], seed: int,
                   num_random: int) -> dict[str, Any]:
    from kvlab.exercises.transfer import dumps_function

    sent, modules = dumps_function(function)
    request = pickle.dumps({"exercise_id": exercise_id, "function": sent, "modules": modules, "seed": seed,
                            "num_random": num_random, "path": [p for p in sys.path if isinstance(p, str)]})
    done = subprocess.run([str(install.python), "-m", "kvlab.exercises.beside_vllm"], input=request,
                          capture_output=True, timeout=RUN_LIMIT_S, cwd=str(REPOSITORY))
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode(errors="replace")[-800:])
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def against_vllm(exercise_id: str, function: Callable[..., Any], *, seed: int | None = None,
                 num_random: int = 20, venv: Path | None = None) -> CheckResult:
    """Run ``function``, an answer to ``exercise_id``, on the exercise's cases against a reference built on vLLM
    0.33.0's own classes; "not attempted" for the stub as shipped; without vLLM, how to get it."""
    if exercise_id not in REFERENCES_ON_VLLM:
        raise UnknownNameError("exercise_id", exercise_id, REFERENCES_ON_VLLM)
    from kvlab.exercises.core import _only_raises_not_implemented

    where = REFERENCES_ON_VLLM[exercise_id][1]
    if _only_raises_not_implemented(function):
        return CheckResult(exercise_id, "not attempted", 0, f"… {exercise_id}: write your answer above first; this "
                                                            f"cell then runs it against vLLM's own {where}.")
    install = find_vllm(venv)
    if install is None:
        return CheckResult(exercise_id, "not attempted", 0, f"… {exercise_id} against vLLM: {HOW_TO_GET_IT}")
    seed = random.randrange(2**31) if seed is None else seed
    found = (run_against_vllm(exercise_id, function, seed, num_random) if install.python is None
             else _in_subprocess(install, exercise_id, function, seed, num_random))
    ran = f"vLLM {install.version}'s own {where.split(':')[1]} ({where.split(':')[0]})"
    if not found["failed"]:
        return CheckResult(exercise_id, "pass", found["cases"], f"✓ {exercise_id}: your answer agrees with {ran} "
                                                                f"on all {found['cases']} cases (seed={seed}).")
    lines = [f"✗ {exercise_id}: your answer differs from {ran} on case {found['cases']} (seed={seed}).",
             f"  inputs:   {found['inputs']}", f"  vLLM:     {found['vllm']}", f"  got:      {found['got']}"]
    lines += [f"  where:    {found['where']}"] if found.get("where") else []
    return CheckResult(exercise_id, "fail", found["cases"], "\n".join(lines))


def _main() -> None:
    """The subprocess's side: read a request from stdin, run it here (vLLM imports), print the result as JSON."""
    request = pickle.loads(sys.stdin.buffer.read())
    sys.path[:0] = [p for p in request["path"] if p not in sys.path]
    for module in request["modules"]:
        importlib.import_module(module)
    function = pickle.loads(request["function"])
    found = run_against_vllm(request["exercise_id"], function, request["seed"], request["num_random"])
    print(json.dumps(found))


if __name__ == "__main__":
    _main()
