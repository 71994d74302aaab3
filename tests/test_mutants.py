"""The mutation suite's catalogue still applies to the source, and its scratch copy is what a run imports.

``make test-mutants`` (``scripts/mutation.py``) is not part of ``make test``: it runs the suite once per
mutant. These checks are cheap and run in ``make test``: every mutant's anchor occurs exactly once in its
file (a refactor that moves one fails here, and the anchor gets refreshed), the kernel mutants are
``kvlab.kernels.mutants``' own, and a process started the way the runner starts it imports kvlab from
the scratch copy, never from the editable install.
"""

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from kvlab.kernels import mutants as kernel_mutants

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("mutation", ROOT / "scripts" / "mutation.py")
mutation = sys.modules["mutation"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutation)
catalogue = sys.modules["mutation_catalogue"]

MUTANTS = catalogue.all_mutants()
LAYERS = {"capacity", "core", "sim", "kernels", "engine", "distributed", "fleet", "exercises", "viz"}


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_exactly_once_to_the_current_source_and_still_parses(mutant):
    source = (ROOT / mutant.path).read_text()
    mutated = catalogue.apply(mutant, source)          # raises StaleMutantError unless exactly one match
    assert mutated != source
    compile(mutated, mutant.path, "exec")


def test_the_catalogue_has_at_least_25_mutants_with_unique_names_over_every_layer():
    names = [m.name for m in MUTANTS]
    assert len(names) >= 25 and len(set(names)) == len(names)
    assert {m.layer for m in MUTANTS} == LAYERS
    for m in MUTANTS:
        assert m.bug and all((ROOT / t).is_file() for t in m.tests), m.name
        assert all(any((ROOT / "notebooks").glob(f"{n}_*.ipynb")) for n in m.notebooks), m.name


def test_the_kernel_mutants_are_kvlab_kernels_mutants_own_each_with_hints():
    read = {m.name: m for m in catalogue.kernel_mutants()}
    assert set(read) == set(kernel_mutants.MUTANTS) == set(catalogue.KERNEL_HINTS)
    for name, m in kernel_mutants.MUTANTS.items():
        assert (read[name].path, read[name].original, read[name].mutated) == \
            (f"kernels/{m.module}.py", m.original, m.mutated)
        assert catalogue.apply(read[name], (ROOT / read[name].path).read_text()) == m.source()


def test_a_stale_mutant_is_refused_with_its_name_file_and_count():
    mutant = catalogue.Mutant("demo", "core", "kvlab/units.py", "x = 1", "x = 2", "demo")
    for text, count in (("y = 0\n", 0), ("x = 1\nx = 1\n", 2)):
        stale = rf"'demo' is stale: .* occurs {count} times in kvlab/units.py"
        with pytest.raises(catalogue.StaleMutantError, match=stale):
            catalogue.apply(mutant, text)


def test_the_scratch_layout_is_the_installed_layout():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert cfg == {"kvlab": "kvlab", "kvlab.kernels": "kernels"}
    assert mutation.scratch_path("kernels/attention.py") == "kvlab/kernels/attention.py"
    assert mutation.scratch_path("kvlab/core/block_pool.py") == "kvlab/core/block_pool.py"


def _imports_in(scratch, tmp_path):
    """Start Python as the runner does (scratch first on PYTHONPATH, cwd inside it); where kvlab comes from."""
    log = tmp_path / "imports.log"
    env = {**os.environ, "PYTHONPATH": str(scratch), "KVLAB_MUTATION_SCRATCH": str(scratch),
           "KVLAB_MUTATION_LOG": str(log)}
    code = "import importlib.util, kvlab.errors; print(importlib.util.find_spec('kvlab.kernels').origin)"
    done = subprocess.run([sys.executable, "-c", code], cwd=scratch, env=env, capture_output=True, text=True)
    return done, log.read_text() if log.exists() else ""


def test_a_scratch_copy_first_on_pythonpath_beats_the_editable_install_in_every_process(tmp_path):
    snapshot = {p: c for p, c in mutation.package_files().items() if p.endswith(".py")}
    scratch = mutation.Scratch(tmp_path, "copy", snapshot, ROOT / "kernels")
    done, log = _imports_in(scratch.root, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(scratch.root / "kvlab" / "kernels" / "__init__.py")
    assert " OK kvlab " in log and " OK kvlab.kernels " in log and "FAIL" not in log


def test_a_process_that_would_import_kvlab_from_elsewhere_is_stopped_and_logged(tmp_path):
    empty = tmp_path / "scratch"
    empty.mkdir()
    for helper in mutation.SITE_DIR.glob("*.py"):
        (empty / helper.name).write_text(helper.read_text())
    done, log = _imports_in(empty, tmp_path)            # no kvlab here: only the editable install has one
    assert done.returncode != 0 and "not from the scratch copy" in done.stderr
    assert log.startswith(f"{log.split()[0]} FAIL kvlab {ROOT / 'kvlab' / '__init__.py'}")
