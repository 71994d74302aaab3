"""Every figure of the source articles is computed by kvlab and asserted in a notebook: the table says where.

``data/source_figures.json`` lists each figure with the kvlab code that computes it and the notebook
cell that asserts it. These tests hold the table to its word: the code exists, the cell exists, the
cell really asserts what the row quotes, and nothing is left "missing".
"""

import ast
import importlib
import json
import re
from functools import cache
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
TABLE = json.loads((ROOT / "data" / "source_figures.json").read_text(encoding="utf-8"))
FIGURES = TABLE["figures"]
STATUSES = {"reproduced", "corrected"}


def squash(text: str) -> str:
    """``text`` without whitespace, so that a quoted assert survives re-wrapping."""
    return re.sub(r"\s+", "", text)


@cache
def cells(notebook: str) -> dict[str, str]:
    nb = nbformat.read(ROOT / notebook, as_version=4)
    return {cell["id"]: cell.source for cell in nb.cells if cell.cell_type == "code"}


def assert_statements(source: str) -> list[str]:
    """The source of every ``assert`` statement in a cell."""
    tree = ast.parse(source)
    return [ast.get_source_segment(source, node) for node in ast.walk(tree) if isinstance(node, ast.Assert)]


def test_every_row_is_complete_and_ids_are_unique():
    required = {"id", "article", "source", "kvlab", "notebook", "cell", "assert", "status"}
    for row in FIGURES:
        assert required <= row.keys(), (row.get("id"), required - row.keys())
        assert row["article"] in TABLE["articles"], row["id"]
        assert row["id"].startswith(row["article"] + "."), row["id"]
        assert row["kvlab"] and row["source"].strip() and row["assert"].strip(), row["id"]
    ids = [row["id"] for row in FIGURES + TABLE["pending"]]
    assert len(ids) == len(set(ids))


def test_nothing_is_missing_and_every_correction_says_why():
    assert {row["status"] for row in FIGURES} <= STATUSES
    for row in FIGURES:
        if row["status"] == "corrected":
            assert len(row.get("reason", "")) > 40, f"{row['id']}: a correction needs its reason"
        else:
            assert "reason" not in row, f"{row['id']}: a reproduced figure has a note, not a reason"
    for row in TABLE["pending"]:
        assert row["owner"] and len(row["reason"]) > 40 and (ROOT / row["notebook"]).exists(), row["id"]


def test_every_article_has_rows():
    assert {row["article"] for row in FIGURES} == set(TABLE["articles"])


@pytest.mark.parametrize("name", sorted({name for row in FIGURES for name in row["kvlab"]}))
def test_the_kvlab_code_named_exists(name):
    module, _, attribute = name.partition(":")
    target = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)


@pytest.mark.parametrize("row", FIGURES, ids=[row["id"] for row in FIGURES])
def test_the_cell_asserts_what_the_row_quotes(row):
    code = cells(row["notebook"])
    assert row["cell"] in code, f"{row['id']}: no code cell {row['cell']} in {row['notebook']}"
    source = code[row["cell"]]
    statements = [squash(s) for s in assert_statements(source)]
    assert any(squash(row["assert"]) in s for s in statements), (
        f"{row['id']}: no assert in {row['notebook']} {row['cell']} contains {row['assert']!r}")
    if "data" in row:
        assert squash(row["data"]) in squash(source), f"{row['id']}: {row['data']!r} not in {row['cell']}"


def test_a_row_whose_assert_is_gone_fails():
    row = FIGURES[0]
    disarmed = re.sub(r"^(\s*)assert ", r"\1_ = ", cells(row["notebook"])[row["cell"]], flags=re.M)
    statements = [squash(s) for s in assert_statements(disarmed)]
    assert not any(squash(row["assert"]) in s for s in statements)
