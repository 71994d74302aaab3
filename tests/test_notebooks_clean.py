"""Notebooks are committed without outputs, in order, and each one ends with exercises and a self-test."""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_are_numbered_from_01_without_gaps():
    numbers = [int(p.name[:2]) for p in NOTEBOOKS]
    # A number may be missing only while that notebook is being written elsewhere: its README row has no link yet.
    rows = re.findall(r"^\| (\d\d) \| (\[?)", (NOTEBOOKS[0].parents[1] / "README.md").read_text(), re.M)
    planned = {int(n) for n, link in rows if not link}
    gaps = set(range(1, max(numbers) + 1)) - set(numbers)
    assert numbers[0] == 1 and gaps <= planned, [p.name for p in NOTEBOOKS]
    assert {int(n) for n, link in rows if link} <= set(numbers), "a linked README row names a missing notebook"
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", p.name) for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_carries_no_outputs_or_execution_counts(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; run `make strip`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_exercises_and_a_self_test(path):
    nb = json.loads(path.read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    exercises = [c for c in code if c.startswith("# EXERCISE ")]
    assert len(exercises) >= 2, f"{path.name} needs at least two exercise cells"
    assert any("self_test(" in c for c in code), f"{path.name} needs a self-test"
