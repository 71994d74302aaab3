"""GLOSSARY.md: every row defined, its Chinese quoted from the source articles, its pointers leading somewhere.

The Chinese forms are checked against the articles themselves when they are on this
machine (``shared/seeds`` beside the repository, or ``$KVLAB_SEEDS``): a form marked
*(trad.)* must occur in the Traditional Chinese article (``002_*``), any other form in
one of the Simplified ones. Every notebook named in the last column is a link to the
section that teaches the term, with the id JupyterLab and the HTML export both give that
section (``tests/_links.py``). Only a notebook still being written (listed in the README's
notebook map, not yet in ``notebooks/``) may be named by its number alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from _links import broken_links, headings, links, resolve, without_links

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "GLOSSARY.md"
TRAD = re.compile(r"\s*\*\(trad\.[^)]*\)\*")
NOTE = re.compile(r"\s*\([ -~]*\)$")  # an English remark in brackets after a form
LINK_TEXT = re.compile(r"(\d\d) §(\d+) \S")  # "05 §8 FP8": notebook 05, section 8, a title
TAUGHT = re.compile(r"(?<!\d)(\d\d) (?:§|·)")


def _rows() -> list[list[str]]:
    rows = []
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|(\s*-+\s*\|)+", line) and "Taught in" not in line:
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


ROWS = _rows()
NO_FORM = "—"  # the articles do not name the term
SENTENCE_END = re.compile(r"[.!?](?=\s+\S|\s*$)")


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


def _planned_notebooks() -> set[str]:
    """Notebook numbers the README's notebook map lists."""
    return set(re.findall(r"^\| (\d\d) \|", (ROOT / "README.md").read_text(encoding="utf-8"), re.M))


def _written_notebooks() -> set[str]:
    """Notebook numbers that exist in notebooks/."""
    return {p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}


def test_every_row_has_four_non_empty_cells():
    assert len(ROWS) >= 30
    bad = [row for row in ROWS if len(row) != 4 or not all(row)]
    assert not bad, bad


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row[0])
def test_every_term_has_a_definition_of_one_or_two_sentences(row):
    english, definition = row[0], row[1]
    assert len(definition.split()) >= 8, f"{english}: a definition says what the term means, not just its name"
    assert definition.endswith("."), f"{english}: end the definition with a full stop"
    assert 1 <= len(SENTENCE_END.findall(definition)) <= 2, f"{english}: one or two sentences"
    assert definition.lower() != english.lower()


def test_the_terms_the_first_notebooks_use_are_defined():
    terms = {row[0].split(" (")[0].strip("`").lower() for row in ROWS}
    for term in ("max_model_len", "lora adapter", "mfu", "headroom", "first-fit", "logits"):
        assert term in terms, term


def test_no_term_is_listed_twice():
    terms = [row[0].lower() for row in ROWS]
    assert len(terms) == len(set(terms)), sorted(t for t in terms if terms.count(t) > 1)


def test_each_term_has_a_chinese_form_and_a_notebook_that_teaches_it():
    for english, _, chinese, taught in ROWS:
        assert chinese == NO_FORM or all(form for form, _ in _forms(chinese)), english
        assert TAUGHT.search(taught), f"{english}: name the notebook as 'NN §' or 'NN ·' in {taught!r}"


@pytest.mark.parametrize("number", sorted({n for row in ROWS for n in TAUGHT.findall(row[3])}))
def test_the_notebooks_it_points_to_exist(number):
    if not list((ROOT / "notebooks").glob(f"{number}_*.ipynb")):
        if number in _planned_notebooks():
            pytest.skip(f"notebook {number} is in the README's map but not in notebooks/ yet")
        pytest.fail(f"the glossary points to notebook {number}, which neither exists nor is planned")


def test_links_lead_to_notebooks_and_their_sections():
    text = GLOSSARY.read_text(encoding="utf-8")
    assert len([t for t, _ in links(text) if ".ipynb#" in t]) >= len(ROWS), "every row links the sections it names"
    broken = broken_links(text, GLOSSARY)
    assert not broken, broken


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row[0])
def test_each_link_names_the_notebook_and_section_it_opens(row):
    for target, text in links(row[3]):
        label = LINK_TEXT.match(text)
        assert label, f"{text!r}: name the section as 'NN §N title'"
        number, section = label.groups()
        notebook, anchor = resolve(target, GLOSSARY)
        assert notebook.name.startswith(f"{number}_") and anchor, f"{text!r} opens {target}"
        heading = headings(notebook).get(anchor)
        assert heading is None or heading.section == section, f"{text!r} opens a part of section {heading.section}"


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row[0])
def test_a_notebook_that_exists_is_named_by_a_link_to_its_section(row):
    for number in TAUGHT.findall(without_links(row[3])):
        assert number in _planned_notebooks() - _written_notebooks(), (
            f"{row[0]}: notebook {number} exists, so link the section that teaches the term")


def test_chinese_forms_are_quoted_from_the_source_articles():
    seeds = _seeds()
    if seeds is None:
        pytest.skip("the source articles (shared/seeds) are not on this machine")
    traditional = "".join(p.read_text(encoding="utf-8") for p in seeds.glob("002_*.txt"))
    simplified = "".join(p.read_text(encoding="utf-8") for p in seeds.glob("00[013]_*.txt"))
    missing = [(row[0], form) for row in ROWS if row[2] != NO_FORM for form, trad in _forms(row[2])
               if form not in (traditional if trad else simplified)]
    assert not missing, f"not found as written in the articles (term, form): {missing}"


def test_the_glossary_is_reachable_from_the_readme():
    assert "(GLOSSARY.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
    # ... and from the opening of every notebook: tests/test_navigation.py
