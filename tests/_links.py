"""Links in the workbook's Markdown, and the ids its headings get in JupyterLab and in ``make html``.

JupyterLab gives a heading the id ``textContent.replace(/ /g, "-")`` (``createHeaderId`` in
``@jupyterlab/rendermime``). nbconvert, which ``make html`` runs, gives it the same text with
spaces turned into dashes, then percent-encodes what a URL fragment may not hold (anything
outside ASCII, for one). A link aims at a section only where both ids are the same string, so
that it opens the section in JupyterLab, in the static copy and in any browser alike.

The Markdown is rendered by nbconvert's own renderer, so code spans, emphasis and escapes
count exactly as they do on the page, not as a regular expression guesses.
"""

from __future__ import annotations

import functools
import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from nbconvert.filters.markdown_mistune import markdown2html_mistune

HEADING = re.compile(r'<h([1-6])\b[^>]*\bid="([^"]*)"[^>]*>(.*?)</h\1>', re.S)
ANCHOR = re.compile(r'<a\b([^>]*)\bhref="([^"]*)"[^>]*>(.*?)</a>', re.S)
TAG = re.compile(r"<[^>]+>")
EXTERNAL = re.compile(r"[a-z][a-z0-9+.-]*:")


@dataclass(frozen=True)
class Heading:
    id: str  # JupyterLab's id
    exported_id: str  # the HTML export's id
    level: int
    section: str | None  # number of the numbered ``##`` section it opens or sits in ("8"), if any


def markdown_cells(notebook: Path) -> list[str]:
    """The sources of a notebook's Markdown cells, in order."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def _text(fragment: str) -> str:
    return html.unescape(TAG.sub("", fragment))


@functools.cache
def headings(notebook: Path) -> dict[str, Heading]:
    """Every heading of a notebook, by its JupyterLab id."""
    found: dict[str, Heading] = {}
    section = None
    for source in markdown_cells(notebook):
        for level, exported, inner in HEADING.findall(markdown2html_mistune(source)):
            text = _text(inner).removesuffix("¶")  # nbconvert appends a pilcrow link to each heading
            if int(level) <= 2:
                number = re.match(r"(\d+)\. ", text)
                section = number.group(1) if number else None
            lab_id = text.replace(" ", "-")
            found[lab_id] = Heading(lab_id, html.unescape(exported), int(level), section)
    return found


def links(markdown: str) -> list[tuple[str, str]]:
    """``(target, text)`` of every link in ``markdown`` as the page renders it, the headings' own ¶ links left out."""
    return [(unquote(html.unescape(href)), _text(text))
            for attributes, href, text in ANCHOR.findall(markdown2html_mistune(markdown))
            if 'class="anchor-link"' not in attributes]


def local_links(markdown: str) -> list[tuple[str, str]]:
    """The links of ``markdown`` that lead to files of the workbook (no ``https:``, no ``mailto:``)."""
    return [(target, text) for target, text in links(markdown) if not EXTERNAL.match(target)]


def without_links(markdown: str) -> str:
    """The rendered text of ``markdown`` with every link taken out."""
    return _text(ANCHOR.sub("", markdown2html_mistune(markdown)))


def resolve(target: str, source: Path) -> tuple[Path, str]:
    """The file a relative link in ``source`` opens, and its anchor (empty if none)."""
    path, _, anchor = target.partition("#")
    return ((source.parent / path).resolve() if path else source.resolve()), anchor


def broken_links(markdown: str, source: Path) -> list[str]:
    """Every relative link in ``markdown`` (written in file ``source``) that leads nowhere, and why."""
    broken = []
    for target, _ in local_links(markdown):
        file, anchor = resolve(target, source)
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix != ".ipynb":
            broken.append(f"{target}: only a notebook's sections are linked to")
        elif anchor and anchor not in headings(file):
            broken.append(f"{target}: no such section in {file.name} (have {sorted(headings(file))})")
        elif anchor and headings(file)[anchor].exported_id != anchor:
            broken.append(f"{target}: the HTML export names this section {headings(file)[anchor].exported_id!r}; "
                          "link a section whose title is plain ASCII")
    return broken
