"""Check kvlab's import contracts (``[tool.kvlab.layers]`` in pyproject.toml) by reading every module's imports.

    python scripts/check_layers.py            # prints each broken rule and exits 1, else says all hold

Each contract names the packages it covers and what they may not import: ``forbidden`` (anywhere
in the module, even inside a function), ``forbidden_at_load`` (at module level, where importing
the module runs it; imports inside functions and under ``if TYPE_CHECKING:`` are fine), or
``only`` (kvlab modules outside this list are forbidden). ``allow`` lists the exceptions a
contract makes on purpose, as ``"importer -> imported"``. The imports are read from the source
with ``ast``, so a module need not be importable (no torch, no GPU) to be checked.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: where each top-level package's source lives (pyproject's package-dir: kvlab.kernels is kernels/)
SOURCE_DIRS = {"kvlab": ROOT / "kvlab", "kvlab.kernels": ROOT / "kernels"}


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement: who imports what, where (file and line), and whether it runs at module load."""

    importer: str
    imported: str
    path: Path
    line: int
    at_load: bool


@dataclasses.dataclass(frozen=True)
class Violation:
    contract: str
    imp: Import

    def __str__(self) -> str:
        where = self.imp.path.relative_to(ROOT) if self.imp.path.is_relative_to(ROOT) else self.imp.path
        when = "at module load" if self.imp.at_load else "inside a function"
        return f"{where}:{self.imp.line}: {self.imp.importer} imports {self.imp.imported} ({when}): {self.contract}"


def iter_modules(source_dirs: dict[str, Path]) -> Iterator[tuple[str, Path]]:
    """``(module name, file)`` for every ``.py`` file of the packages (kvlab.kernels from kernels/)."""
    for package, folder in source_dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join([package, *parts]), path


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve_from(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def module_imports(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import in ``path``; ``from pkg import name`` counts as importing ``pkg.name`` when that is a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(nodes: Iterable[ast.stmt], at_load: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend(Import(module, a.name, path, node.lineno, at_load) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_from(module, node, is_package)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.append(Import(module, full if full in known else base, path, node.lineno, at_load))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, False)
            elif isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse, at_load)  # the body only runs for type checkers
            elif isinstance(node, ast.ClassDef | ast.If | ast.For | ast.While | ast.With | ast.Try):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []) or [], at_load)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, at_load)

    visit(tree.body, True)
    return found


def _within(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def load_contracts(pyproject: Path = ROOT / "pyproject.toml") -> list[dict]:
    return tomllib.loads(pyproject.read_text())["tool"]["kvlab"]["layers"]["contract"]


def check(contracts: list[dict], source_dirs: dict[str, Path] = SOURCE_DIRS) -> list[Violation]:
    """The imports that break a contract, in file order."""
    modules = dict(iter_modules(source_dirs))
    known = set(modules)
    violations = []
    for module, path in modules.items():
        for imp in module_imports(module, path, known):
            for c in contracts:
                if not _within(module, c["modules"]) or _within(module, c.get("except", [])):
                    continue
                if f"{module} -> {imp.imported}" in c.get("allow", []):
                    continue
                broken = (
                    _within(imp.imported, c.get("forbidden", []))
                    or (imp.at_load and _within(imp.imported, c.get("forbidden_at_load", [])))
                    or ("only" in c and imp.imported.startswith("kvlab")
                        and not _within(imp.imported, [*c["only"], *c["modules"]]))
                )
                if broken:
                    violations.append(Violation(c["name"], imp))
    return violations


def main() -> int:
    violations = check(load_contracts())
    for v in violations:
        print(v)
    if violations:
        print(f"{len(violations)} import(s) break kvlab's layer contracts ([tool.kvlab.layers] in pyproject.toml)")
        return 1
    print(f"kvlab's {len(load_contracts())} layer contracts hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
