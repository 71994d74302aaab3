"""GLOSSARY.md: every row complete, its Chinese quoted from the source articles, its pointers leading somewhere.

The Chinese forms are checked against the articles themselves when they are on this
machine (``shared/seeds`` beside the repository, or ``$KVLAB_SEEDS``): a form marked
*(trad.)* must occur in the Traditional Chinese article (``002_*``), any other form in
one of the Simplified ones. Notebooks named in the last column must exist; one that is
still being written (listed in the README's notebook map, not yet in ``notebooks/``)
is skipped with its number, so the check tightens by itself as the notebooks land.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "GLOSSARY.md"
TRAD = re.compile(r"\s*\*\(trad\.[^)]*\)\*")
NOTE = re.compile(r"\s*\([ -~]*\)$")  # an English remark in brackets after a form
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#([^)\s]+))?\)")
TAUGHT = re.compile(r"(?<!\d)(\d\d) (?:§|·)")


def _rows() -> list[list[str]]:
    rows = []
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|(\s*-+\s*\|)+", line) and "Taught in" not in line:
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


ROWS = _rows()


def _forms(cell: str) -> list[tuple[str, bool]]:
    """(form, is Traditional) for each ``·``-separated form of a Chinese cell."""
    forms = []
    for part in cell.split(" · "):
        trad = bool(TRAD.search(part))
        forms.append((NOTE.sub("", TRAD.sub("", part)).strip(), trad))
    return forms


def _seeds() -> Path | None:
    candidates = [os.environ.get("KVLAB_SEEDS")] + [str(p / "shared" / "seeds") for p in ROOT.parents[:2]]
    return next((Path(c) for c in candidates if c and list(Path(c).glob("00[0-3]_*.txt"))), None)


def _anchor(heading: str) -> str:
    """The id JupyterLab and nbconvert give a Markdown heading: its text, spaces turned into dashes."""
    text = re.sub(r"[`*_]", "", heading.lstrip("#").strip())
    return text.replace(" ", "-")


def _planned_notebooks() -> set[str]:
    """Notebook numbers the README's notebook map lists."""
    return set(re.findall(r"^\| (\d\d) \|", (ROOT / "README.md").read_text(encoding="utf-8"), re.M))


def test_every_row_has_three_non_empty_cells():
    assert len(ROWS) >= 30
    bad = [row for row in ROWS if len(row) != 3 or not all(row)]
    assert not bad, bad


def test_no_term_is_listed_twice():
    terms = [row[0].lower() for row in ROWS]
    assert len(terms) == len(set(terms)), sorted(t for t in terms if terms.count(t) > 1)


def test_each_term_has_a_chinese_form_and_a_notebook_that_teaches_it():
    for english, chinese, taught in ROWS:
        assert all(form for form, _ in _forms(chinese)), english
        assert TAUGHT.search(taught), f"{english}: name the notebook as 'NN §' or 'NN ·' in {taught!r}"


@pytest.mark.parametrize("number", sorted({n for row in ROWS for n in TAUGHT.findall(row[2])}))
def test_the_notebooks_it_points_to_exist(number):
    if not list((ROOT / "notebooks").glob(f"{number}_*.ipynb")):
        if number in _planned_notebooks():
            pytest.skip(f"notebook {number} is in the README's map but not in notebooks/ yet")
        pytest.fail(f"the glossary points to notebook {number}, which neither exists nor is planned")


def test_links_lead_to_notebooks_and_their_sections():
    links = [m.groups() for row in ROWS for m in LINK.finditer(row[2])]
    assert links, "at least the rows taught in notebook 01 link to their section"
    for target, anchor in links:
        path = ROOT / target
        assert path.exists(), target
        if anchor:
            nb = json.loads(path.read_text(encoding="utf-8"))
            headings = {_anchor(line) for c in nb["cells"] if c["cell_type"] == "markdown"
                        for line in "".join(c["source"]).splitlines() if line.startswith("#")}
            assert anchor in headings, f"{target}#{anchor}: no such section (have {sorted(headings)})"


def test_chinese_forms_are_quoted_from_the_source_articles():
    seeds = _seeds()
    if seeds is None:
        pytest.skip("the source articles (shared/seeds) are not on this machine")
    traditional = "".join(p.read_text(encoding="utf-8") for p in seeds.glob("002_*.txt"))
    simplified = "".join(p.read_text(encoding="utf-8") for p in seeds.glob("00[013]_*.txt"))
    missing = [(row[0], form) for row in ROWS for form, trad in _forms(row[1])
               if form not in (traditional if trad else simplified)]
    assert not missing, f"not found as written in the articles (term, form): {missing}"


def test_the_glossary_is_reachable_from_the_readme_and_notebook_01():
    assert "(GLOSSARY.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
    first = sorted((ROOT / "notebooks").glob("01_*.ipynb"))[0]
    opening = "".join(json.loads(first.read_text(encoding="utf-8"))["cells"][0]["source"])
    assert "(../GLOSSARY.md)" in opening
