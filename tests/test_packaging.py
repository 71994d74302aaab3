"""The package installs as the README says: pyproject and environment.yml agree, kernels map to kvlab.kernels."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _names(requirements):
    return {re.split(r"[<>=;\[ ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    yml = [line.strip()[2:] for line in (ROOT / "environment.yml").read_text().splitlines()
           if line.startswith("      - ") and not line.strip().startswith("- -e")]
    assert sorted(deps) == sorted(yml)


def test_triton_is_declared_for_linux_only():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (triton,) = [d for d in deps if d.startswith("triton")]
    assert "sys_platform == 'linux'" in triton


def test_kernels_folder_is_installed_as_kvlab_kernels_and_not_as_kernels():
    import kvlab.kernels

    assert Path(kvlab.kernels.__file__).resolve().parent == ROOT / "kernels"
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"]["kvlab.kernels"] == "kernels"
    assert "kernels" not in cfg["packages"]


def test_every_kvlab_subpackage_is_listed_for_installation():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"kvlab." + p.parent.relative_to(ROOT / "kvlab").as_posix().replace("/", ".")
             for p in (ROOT / "kvlab").rglob("__init__.py") if p.parent != ROOT / "kvlab"}
    assert found | {"kvlab", "kvlab.kernels"} <= listed


def test_ci_runs_make_test_and_the_readme_shows_both_commands():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
