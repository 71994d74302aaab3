"""kvlab's layers hold: the import contracts in pyproject.toml, checked on the source and in a fresh process.

The rules themselves are data (``[tool.kvlab.layers]``); ``scripts/check_layers.py`` reads every
module's imports with ``ast``. The last tests show the checker can fail: a deliberately wrong
import in a scratch copy of the package is caught.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_layers", ROOT / "scripts" / "check_layers.py")
check_layers = sys.modules["check_layers"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_layers)


def test_every_layer_contract_holds():
    violations = check_layers.check(check_layers.load_contracts())
    assert not violations, "\n".join(map(str, violations))


def test_every_module_is_covered_by_a_layer():
    """A new top-level module or package must be placed in a layer (and so in a contract) on purpose."""
    covered = {p for c in check_layers.load_contracts() for p in c["modules"] if p != "kvlab"}
    covered |= {"kvlab.viz", "kvlab.exercises"}                       # the top layers, checked by the viz rule
    modules = [m for m, _ in check_layers.iter_modules(check_layers.SOURCE_DIRS) if m != "kvlab"]
    stray = [m for m in modules if not any(m == p or m.startswith(p + ".") for p in covered)]
    assert not stray, f"modules in no layer: {stray}"


def _fresh_import(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize(("leaf", "loaded"), [
    ("kvlab.errors", ["kvlab", "kvlab.errors"]),
    ("kvlab.units", ["kvlab", "kvlab._validate", "kvlab.errors", "kvlab.units"]),
])
def test_the_leaves_the_kernels_import_pull_in_nothing_else_of_kvlab(leaf, loaded):
    """The kernels import kvlab.errors and kvlab.units (``cdiv``); kvlab/__init__ must not drag the rest behind."""
    code = f"import sys, {leaf}; print(sorted(m for m in sys.modules if m.startswith('kvlab')))"
    assert _fresh_import(code) == str(loaded)


def test_capacity_core_and_sim_load_without_torch():
    modules = [m for m, _ in check_layers.iter_modules(check_layers.SOURCE_DIRS)
               if m.startswith(("kvlab.capacity", "kvlab.core", "kvlab.sim"))]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + (
        "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    assert _fresh_import(code) == "[]"


def test_the_top_level_names_notebooks_use_load_lazily():
    import kvlab

    assert kvlab.VLLM_VERSION == "0.33.0"
    assert kvlab.kv_bytes_per_token(kvlab.get_model("llama-3-8b"), "bf16") == 128 * kvlab.KiB
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        kvlab.nonsense  # noqa: B018


@pytest.mark.parametrize(("where", "line", "contract"), [
    ("kvlab/core/request.py", "from kvlab.engine import LLMEngine", "core is bookkeeping"),
    ("kvlab/core/sched/scheduler.py", "    from kvlab.engine.model_runner import ModelRunner", "core is bookkeeping"),
    ("kvlab/capacity/budget.py", "import torch", "capacity is arithmetic"),
    ("kernels/grid.py", "from kvlab.core import hashing", "the kernels import nothing"),
    ("kvlab/sim/prefix_sim.py", "from kvlab.engine import LLMEngine", "sim runs on core"),
    ("kvlab/engine/model.py", "from kvlab.viz.engine import EnginePanel", "only notebooks"),
    ("kvlab/units.py", "from kvlab.capacity.models import get_model", "the top level"),
])
def test_a_deliberately_wrong_import_breaks_a_contract(tmp_path, where, line, contract):
    for folder in ("kvlab", "kernels"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / where
    body = target.read_text()
    if line.startswith(" "):                                       # inside a function: add one
        body += f"\n\ndef _sneaky():\n{line}\n"
    else:
        body += f"\n{line}\n"
    target.write_text(body)
    dirs = {"kvlab": tmp_path / "kvlab", "kvlab.kernels": tmp_path / "kernels"}
    violations = check_layers.check(check_layers.load_contracts(), dirs)
    assert violations and all(v.imp.path == target for v in violations), [str(v) for v in violations]
    assert any(contract in v.contract for v in violations), [str(v) for v in violations]


def test_an_import_under_type_checking_or_inside_a_function_is_not_a_load_time_import(tmp_path):
    module = tmp_path / "kvlab" / "capacity" / "lazy.py"
    module.parent.mkdir(parents=True)
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n\n"
                      "def f():\n    import torch\n    return torch\n")
    imports = check_layers.module_imports("kvlab.capacity.lazy", module, set())
    assert [(i.imported, i.at_load) for i in imports] == [("typing", True), ("torch", False)]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the kvlab modules it imports anywhere: at load, inside a function or under TYPE_CHECKING."""
    modules = dict(check_layers.iter_modules(check_layers.SOURCE_DIRS))
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = check_layers._resolve_from(module, node, is_package)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[module] |= {n for n in names if n in modules and n != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back_not_even_under_type_checking():
    """No import cycle anywhere in kvlab or its kernels, counting imports inside functions and under TYPE_CHECKING:
    shared types live in a leaf module, and a dispatcher sits above what it dispatches to (``load_model`` in
    the engine's registry, the FP8 sweep above the kernels' facade). So ``@checked`` resolves every annotation
    in the function's own module."""
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_a_cycle_made_through_type_checking():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]


def test_the_manager_hands_blocks_back_in_one_type_as_vllm_does():
    """``get_computed_blocks`` / ``allocate_slots`` are annotated as vLLM 0.33.0's: a ``KVCacheBlocks``, never a list.

    vLLM's ``kv_cache_manager.py`` returns ``tuple[KVCacheBlocks, int, int]`` and ``KVCacheBlocks | None``
    whatever the number of KV cache groups; a ``list | KVCacheBlocks`` by group count is gone.
    """
    import typing

    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.kv_cache_utils import KVCacheBlocks
    from kvlab.core.request import Request

    returns = {name: typing.get_type_hints(getattr(KVCacheManager, name))["return"]
               for name in ("get_computed_blocks", "allocate_slots")}
    assert returns == {"get_computed_blocks": tuple[KVCacheBlocks, int, int],
                       "allocate_slots": KVCacheBlocks | None}
    manager = KVCacheManager(num_blocks=4, block_size=4)
    request = Request("r", [1, 2, 3])
    hits, _, _ = manager.get_computed_blocks(request)
    assert type(hits) is KVCacheBlocks and type(manager.allocate_slots(request, 3, 0, hits)) is KVCacheBlocks


#: The classes of vLLM 0.33.0's ``vllm/v1/kv_cache_interface.py`` a spec hierarchy is made of
#: (``tests/vllm/test_hybrid_planning.py`` checks each is still a class there).
VLLM_SPEC_CLASSES = (
    "KVCacheSpec", "AttentionSpec", "FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec",
    "SlidingWindowMLASpec", "ChunkedLocalAttentionSpec", "MambaSpec", "EncoderOnlyAttentionSpec",
    "CrossAttentionSpec", "SinkFullAttentionSpec", "UniformTypeKVCacheSpecs", "KVCacheTensor", "KVCacheGroupSpec",
    "KVCacheConfig",
)


def _class_homes() -> dict[str, list[str]]:
    """Class name -> the modules that define a class of that name (anywhere in the module: nested ones too)."""
    homes: dict[str, list[str]] = {}
    for module, path in check_layers.iter_modules(check_layers.SOURCE_DIRS):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                homes.setdefault(node.name, []).append(module)
    return homes


def test_one_spec_hierarchy_in_one_home():
    """Each of vLLM's spec classes kvlab has is defined once, in kvlab.kv_cache_interface (planning, the manager
    and the engine's tensors share it): no second ``FullAttentionSpec`` beside the first."""
    homes = _class_homes()
    kvlab_has = {name: homes[name] for name in VLLM_SPEC_CLASSES if name in homes}
    assert {name: where for name, where in kvlab_has.items() if where != ["kvlab.kv_cache_interface"]} == {}
    assert {"KVCacheSpec", "AttentionSpec", "FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec"} <= set(
        kvlab_has)

