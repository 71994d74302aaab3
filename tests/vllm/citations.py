"""Claims of the form "vLLM does this here" in the workbook's prose, and what the installed vLLM source says of each.

``find_claims`` reads the notebooks (every cell), kvlab's and kernels' Python (docstrings and
comments), ``README.md`` and ``GLOSSARY.md``, and returns each citation it recognises:

* a path ``vllm/...`` (a file or a folder): it must exist in the installed package;
* a path into vLLM's C++ (``csrc/...``), which the wheel does not ship: the text must name the
  revision it was read at (``v0.6.6``) within the same sentence, and is checked against nothing else;
* ``path:line`` / ``path:start-end``: refused outright (cite by symbol; lines move every release);
* an identifier presented as vLLM's: ``vLLM's `X` ``, ``0.33.0's `X` ``, `` `vllm/a.py`'s `X` ``,
  `` `X` in `vllm/a.py` `` (then ``X`` must be defined in that very file), dotted ``A.b`` each part;
* a CLI flag ``--x-y`` beside the word vLLM, an environment variable ``VLLM_X``, a metric ``vllm:x``;
* a log line's format quoted with its ``%s`` beside the word vLLM: 0.33.0 must log exactly that string.

``check`` returns the ones the source contradicts, as ``Claim`` objects naming file and line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import vllm

ROOT = Path(__file__).parents[2]
VLLM_ROOT = Path(vllm.__file__).parent  # .../site-packages/vllm
REVISION = re.compile(r"\bv?0\.\d+\.\d+\b|\bv\d+\.\d+(\.\d+)?\b"  # a release (0.33.0, v0.6.6), or a commit
                      r"|(?<=revision )[0-9a-f]{7,40}\b|(?<=commit )[0-9a-f]{7,40}\b")

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\(\))?"
_PATH = r"vllm/[A-Za-z0-9_/.]*[A-Za-z0-9_/]"
_OWNER = r"(?:\bvLLM(?: 0\.33\.0| V1)?|\b0\.33\.0|V1)'s\s+(?:own\s+|new\s+|real\s+)?"
PATTERNS = {
    "path:line": re.compile(r"\b(" + _PATH + r"\.py):(\d+)(?:-\d+)?"),
    "path": re.compile(r"(?<![A-Za-z0-9_./-])(" + _PATH + r")"),
    "csrc": re.compile(r"(?<![A-Za-z0-9_./-])(csrc/[A-Za-z0-9_/.]+)"),
    "owned": re.compile(_OWNER + r"``?(" + _IDENT + r")`"),
    "in file": re.compile(r"`(" + _IDENT + r")``?(?:\s+(?:does|is|lives|logs|sits|defined))?\s+(?:in|from|of)\s+"
                          r"(?:its\s+)?`*(" + _PATH + r"\.py)"),
    "file's": re.compile(r"`*(" + _PATH + r"\.py)`*'s\s+``?(" + _IDENT + r")`"),
    "said absent": re.compile(r"(?:\b0\.33\.0|\bvLLM(?: 0\.33\.0)?) (?:has no|does not have|no longer has|dropped)"
                              r"\s+(?:the\s+|a\s+|older\s+)*``?(" + _IDENT + r")`"),
    "log": re.compile(r'"([^"]*%[0-9.]*[sdf][^"]*)"'),  # a log line's format, quoted with its %s
    "flag": re.compile(r"`(--[a-z0-9][a-z0-9-]*)"),
    "env": re.compile(r"\b(VLLM_[A-Z0-9_]+)\b"),
    "metric": re.compile(r"\b(vllm:[a-z0-9_]+)"),
}


_ABSENT_BEFORE = re.compile(r"(?:no longer|has no|have no|does not have|dropped|removed|renamed|not in 0\.33\.0)"
                            r"\b[^.;:]{0,60}$")
_ABSENT_AFTER = re.compile(r"^[`\"']*\s+not in\b")


@dataclass(frozen=True)
class Claim:
    source: str  # file, and cell or line
    kind: str
    text: str  # what is claimed: a path, an identifier, a flag
    file: str | None = None  # the vLLM file the identifier is said to be in
    context: str = ""
    absent: bool = False  # the text says 0.33.0 does not have it: then it must be absent


    def __str__(self) -> str:
        where = f" in {self.file}" if self.file else ""
        return f"{self.source}: {self.kind} {self.text!r}{where}  <- {self.context.strip()[:160]!r}"


def documents() -> list[tuple[str, str]]:
    """(where, text) for every cell of every notebook, every kvlab and kernels module, README and GLOSSARY."""
    docs = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            docs.append((f"{nb.name} cell {i}", "".join(cell["source"])))
    for folder in ("kvlab", "kernels"):
        for py in sorted((ROOT / folder).rglob("*.py")):
            # comment markers go, so that a comment's sentence reads on across its lines as a docstring's does
            docs.append((str(py.relative_to(ROOT)), re.sub(r"^[ \t]*#:?[ \t]?", "", py.read_text(), flags=re.M)))
    for md in ("README.md", "GLOSSARY.md"):
        docs.append((md, (ROOT / md).read_text()))
    return docs


def _sentences(text: str) -> list[tuple[int, str]]:
    """(line number, sentence) pieces: a sentence may span lines; the line is where it starts."""
    out, line = [], 1
    for piece in re.split(r"(?<=[.!?])\s+(?=[A-Z`*(])|\n\s*\n|\n\s*[-*|#]", text):
        out.append((line, piece))
        line += piece.count("\n")
    return out


def _older_revision(sentence: str) -> bool:
    """The sentence is about another release (``v0.6.6's attention_kernels.cuh``): checked against nothing."""
    return any(m.group(0).lstrip("v") != "0.33.0" for m in REVISION.finditer(sentence))


def find_claims() -> list[Claim]:
    claims = []
    for where, text in documents():
        for offset, sentence in _sentences(text):
            flat = " ".join(sentence.split())
            src = f"{where} line {offset}" if "cell" not in where else where
            if _older_revision(flat):
                claims += [Claim(src, "csrc", m.group(1), context=flat) for m in PATTERNS["csrc"].finditer(flat)]
                continue
            before = len(claims)
            for m in PATTERNS["path:line"].finditer(flat):
                claims.append(Claim(src, "path:line", m.group(0), context=flat))
            for m in PATTERNS["path"].finditer(flat):
                claims.append(Claim(src, "path", m.group(1).rstrip("."), context=flat))
            for m in PATTERNS["csrc"].finditer(flat):
                claims.append(Claim(src, "csrc", m.group(1), context=flat))
            for m in PATTERNS["owned"].finditer(flat):
                claims.append(Claim(src, "identifier", m.group(1), context=flat))
            for m in PATTERNS["said absent"].finditer(flat):
                claims.append(Claim(src, "identifier", m.group(1), context=flat, absent=True))
            for m in PATTERNS["in file"].finditer(flat):
                claims.append(Claim(src, "identifier", m.group(1), m.group(2), flat))
            for m in PATTERNS["file's"].finditer(flat):
                claims.append(Claim(src, "identifier", m.group(2), m.group(1), flat))
            if re.search(r"\bvLLM\b|vllm/", flat):
                for m in PATTERNS["flag"].finditer(flat):
                    claims.append(Claim(src, "flag", m.group(1), context=flat))
                for m in PATTERNS["log"].finditer(flat):
                    claims.append(Claim(src, "log", m.group(1), context=flat))
            for m in PATTERNS["env"].finditer(flat):
                claims.append(Claim(src, "env", m.group(1), context=flat))
            for m in PATTERNS["metric"].finditer(flat):
                # a template (vllm:kv_block_<metric>_seconds, an f-string's {metric}) is not a name
                if flat[m.end():m.end() + 1] not in ("<", "{"):
                    claims.append(Claim(src, "metric", m.group(1).rstrip("_"), context=flat))
            for i in range(before, len(claims)):  # said to be gone from 0.33.0: then it must be gone
                c = claims[i]
                at = flat.find(c.text)
                if _ABSENT_BEFORE.search(flat[:at]) or _ABSENT_AFTER.search(flat[at + len(c.text):]):
                    claims[i] = Claim(c.source, c.kind, c.text, c.file, c.context, absent=True)
    return claims


# ----------------------------------------------------------------- what the installed source has


@cache
def _source(relative: str | None = None) -> str:
    files = [VLLM_ROOT / relative[len("vllm/"):]] if relative else sorted(VLLM_ROOT.rglob("*.py"))
    return "\n".join(f.read_text(errors="replace") for f in files if f.is_file())


@cache
def _words(relative: str | None = None) -> frozenset[str]:
    return frozenset(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", _source(relative)))


@cache
def _defined(relative: str | None = None) -> frozenset[str]:
    """Names a file defines: functions, classes, fields and attributes, module constants, enum members."""
    text = _source(relative)
    names = set(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", text, re.M))
    names |= set(re.findall(r"^\s*(\w+)\s*(?::[^=\n]+)?=", text, re.M))
    names |= set(re.findall(r"^\s*(\w+)\s*:", text, re.M))
    names |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=", text))
    return frozenset(n for n in names if n)


def unresolved(claim: Claim) -> str | None:
    """Why the installed vLLM contradicts ``claim``, or None when it holds."""
    if claim.absent and claim.kind in ("env", "metric", "flag", "identifier", "path"):
        present = _present(Claim(claim.source, claim.kind, claim.text, claim.file)) is None
        return "said to be absent from 0.33.0, but 0.33.0 has it" if present else None
    return _present(claim)


def _present(claim: Claim) -> str | None:
    if claim.kind == "path:line":
        return "cites a line number: cite the symbol instead"
    if claim.kind == "path":
        target = VLLM_ROOT / claim.text[len("vllm/"):]
        return None if target.exists() or target.with_suffix(".py").exists() else "no such path in 0.33.0"
    if claim.kind == "csrc":
        return None if REVISION.search(claim.context) else "vLLM's C++ is not in 0.33.0's wheel: name the revision"
    if claim.kind == "log":
        return None if f'"{claim.text}"' in _source() else "no log line with that format in 0.33.0"
    if claim.kind == "flag":
        field = claim.text[2:].replace("-", "_")
        known = field in _defined("vllm/engine/arg_utils.py") or claim.text in _source()
        return None if known else "no such CLI flag in 0.33.0's EngineArgs"
    if claim.kind == "env":
        return None if claim.text in _defined("vllm/envs.py") else "no such environment variable in vllm/envs.py"
    if claim.kind == "metric":  # Prometheus' client adds a counter's _total and a histogram's _count/_sum/_bucket
        name = re.sub(r"_(total|count|sum|bucket|created)$", "", claim.text)
        return None if re.search(f'"{name}(_total)?"', _source()) else "no such metric in 0.33.0"
    if claim.text.endswith(".py"):  # a module named by its file: some file of 0.33.0 has that name
        return None if any(VLLM_ROOT.rglob(claim.text)) else "no file of that name in 0.33.0"
    parts = claim.text.removesuffix("()").split(".")
    if claim.file:
        if not (VLLM_ROOT / claim.file[len("vllm/"):]).exists():
            return "no such file in 0.33.0"
        missing = [p for p in parts if p not in _defined(claim.file) and p not in _words(claim.file)]
        return f"{', '.join(missing)} not in {claim.file}" if missing else None
    missing = [p for p in parts if p not in _defined() and not re.search(f"[\"':/]{p}[\"']", _source())]
    return f"{', '.join(missing)} not defined anywhere in 0.33.0" if missing else None
