"""The project's documents are in the project: every citation resolves.

A reader who meets `docs/behaviour.md §4.3` in a docstring, a sub-reason in a result or
`invariant 3` in a fuzz report must find it in this repository. So, over every text file of
the repository (README, docs/, the package, tests, benchmarks, diagrams):

* every mention of a ``.md`` file, and every relative link in a Markdown file, names a file
  that exists here (a link's ``#fragment`` a heading of its target);
* every ``§`` reference names a numbered section that exists in the document it cites: the
  document named right before it (``docs/behaviour.md §3.2``; later references joined to it
  by commas, "and" or "rule N" cite the same one) or, for a bare ``§3.2``, the Markdown file
  it is written in, or else the last document its file named before it;
* nothing cites the reference documents the project was once written against, which are not
  in it;
* the README points at each document, and the CLI's help and the rendered diagrams cite
  nothing outside the repository either.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from toolloop_fsm.cli import build_parser
from toolloop_fsm.diagrams import declaration
from toolloop_fsm.diagrams import render

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: Folders and top-level files whose text is checked; recorded provider streams are copied
#: byte for byte from elsewhere and cite nothing, so only their provenance file is read.
_CHECKED = (
    "README.md",
    "pyproject.toml",
    ".ci",
    "docs",
    "toolloop_fsm",
    "tests",
    "benchmarks",
    "diagrams",
)
_CAPTURES = ROOT / "tests" / "data" / "wire"

#: Citations of documents that are not in this repository. Each pattern is written so that
#: it does not match its own text (a bracketed letter), so this file is checked too.
_FOREIGN = re.compile(
    r"\bS[P]EC\b|\bD[E]SIGN\b|\bS[T]YLE\.md\b|\bW[I]RE-FORMATS\b|\.\./s[h]ared\b|/work/s[h]ared\b"
)
_MD_MENTION = re.compile(r"(?<![\w.~/-])((?:\.{1,2}/|[\w-]+/)*[\w.-]*\w\.md)\b(?!\w)")
_URL = re.compile(r"\b(?:https?|file)://\S+")
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
_SECTION_REF = re.compile(r"§\s*(\d+(?:\.\d+)*)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_NUMBERED = re.compile(r"(\d+(?:\.\d+)*)\.?\s")
#: What may stand between a document and its § reference, or between two references that cite
#: the same document: spaces, punctuation, "and"/"or", and "rule N" / "steps N–M".
_GLUE = re.compile(
    r"(?:[\s,;/&`*()\]–-]|\band\b|\bor\b|\b(?:rules?|steps?)\s+\d+(?:\s*[–-]\s*\d+)?)*"
)


# --------------------------------------------------------------------------- the files
@cache
def _listed() -> tuple[Path, ...]:
    """The repository's files: tracked and new (not ignored) ones when this is a git checkout,
    else every file under the checked folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return tuple(p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts)
    return tuple(ROOT / name for name in out.decode().split("\0") if name)


def _existing() -> frozenset[Path]:
    return frozenset(p for p in _listed() if p.exists())


def _checked_files() -> list[Path]:
    files = []
    for path in sorted(_existing()):
        relative = path.relative_to(ROOT)
        if relative.parts[0] not in _CHECKED:
            continue
        if path.parent == _CAPTURES and path.suffix != ".md":
            continue
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not text
        files.append(path)
    return files


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _where(path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(ROOT)}:{_line(text, offset)}"


# --------------------------------------------------------------------------- documents
def _slug(heading: str) -> str:
    """A heading's anchor as GitHub renders it."""
    plain = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", plain).replace(" ", "-")


@cache
def _sections(document: Path) -> tuple[str, ...]:
    """The section numbers of a Markdown document's headings, in order."""
    numbers = []
    for match in _HEADING.finditer(_text(document)):
        numbered = _NUMBERED.match(match.group(2) + " ")
        if numbered is not None:
            numbers.append(numbered.group(1))
    return tuple(numbers)


@cache
def _anchors(document: Path) -> frozenset[str]:
    return frozenset(_slug(m.group(2)) for m in _HEADING.finditer(_text(document)))


def _resolve(mention: str, written_in: Path) -> Path | None:
    """The repository file a mention names: relative to the file it is written in, to the
    repository's root, or — a bare file name — the one file of that name."""
    existing = _existing()
    for base in (written_in.parent, ROOT):
        candidate = (base / mention).resolve()
        if candidate in existing:
            return candidate
    if "/" not in mention:
        named = [p for p in existing if p.name == mention]
        if len(named) == 1:
            return named[0]
    return None


def _mentions(text: str) -> Iterator[re.Match[str]]:
    """Every ``.md`` file named in ``text``, web addresses left out."""
    blanked = _URL.sub(lambda m: " " * len(m.group(0)), text)
    return _MD_MENTION.finditer(blanked)


# --------------------------------------------------------------------------- § references
def _section_references(text: str, path: Path) -> Iterator[tuple[int, str, Path | None]]:
    """Each § reference in ``text`` (the content of ``path``): where it is, the section, and
    the document it cites."""
    named = [(m.end(), _resolve(m.group(1), path)) for m in _mentions(text)]
    home = path if path.suffix == ".md" else None
    previous: tuple[int, Path | None] | None = None  # the reference before: end, document
    for match in _SECTION_REF.finditer(text):
        start = match.start()
        before = [item for item in named if item[0] <= start]
        mention = before[-1] if before else None
        if mention is not None and _GLUE.fullmatch(text[mention[0] : start]):
            document = mention[1]  # "docs/behaviour.md §3.2"
        elif (
            previous is not None
            and (mention is None or mention[0] <= previous[0])
            and _GLUE.fullmatch(text[previous[0] : start])
        ):
            document = previous[1]  # "…§3.2 and §4.1": the same document
        elif home is not None:
            document = home  # a bare reference inside a document cites that document
        else:
            document = mention[1] if mention is not None else None
        yield start, match.group(1), document
        previous = (match.end(), document)


# =========================================================================== the tests
def test_nothing_cites_a_document_that_is_not_in_the_repository() -> None:
    found = [
        f"{_where(path, text, m.start())}: {text[m.start() : m.end() + 30].splitlines()[0]!r}"
        for path in _checked_files()
        for text in (_text(path),)
        for m in _FOREIGN.finditer(text)
    ]
    assert found == [], "cited documents that are not in the repository:\n" + "\n".join(found)


def test_every_markdown_file_mentioned_exists_in_the_repository() -> None:
    missing = [
        f"{_where(path, text, m.start())}: {m.group(1)}"
        for path in _checked_files()
        for text in (_text(path),)
        for m in _mentions(text)
        if _resolve(m.group(1), path) is None
    ]
    assert missing == [], "Markdown files mentioned but not in the repository:\n" + "\n".join(
        missing
    )


def test_every_relative_link_in_a_markdown_file_resolves() -> None:
    broken = []
    for path in _checked_files():
        if path.suffix != ".md":
            continue
        text = _text(path)
        for m in _MD_LINK.finditer(text):
            target, _, fragment = m.group(1).partition("#")
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            resolved = _resolve(target, path) if target else path
            if resolved is None:
                broken.append(f"{_where(path, text, m.start())}: {m.group(1)} (no such file)")
            elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
                broken.append(f"{_where(path, text, m.start())}: {m.group(1)} (no such heading)")
    assert broken == [], "broken links:\n" + "\n".join(broken)


def test_every_section_reference_names_a_section_of_the_document_it_cites() -> None:
    unresolved = []
    for path in _checked_files():
        text = _text(path)
        for offset, section, document in _section_references(text, path):
            where = _where(path, text, offset)
            if document is None:
                unresolved.append(f"{where}: §{section} names no document in the repository")
            elif document.suffix != ".md":
                unresolved.append(f"{where}: §{section} cites {document.name}, not a document")
            elif section not in _sections(document):
                unresolved.append(
                    f"{where}: §{section} is not a section of {document.relative_to(ROOT)}"
                )
    assert unresolved == [], "unresolved § references:\n" + "\n".join(unresolved)


@pytest.mark.parametrize("document", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_each_document_numbers_its_sections_once(document: Path) -> None:
    numbers = _sections(document)
    assert numbers, f"{document.name} has no numbered sections to cite"
    repeated = sorted({n for n in numbers if numbers.count(n) > 1})
    assert repeated == [], f"{document.name} numbers these sections twice: {repeated}"


def test_the_readme_points_at_every_document() -> None:
    readme = _text(ROOT / "README.md")
    documents = sorted(p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md"))
    assert {"docs/behaviour.md", "docs/design.md", "docs/invariants.md"} <= set(documents)
    assert [d for d in documents if d not in readme] == []


def test_the_cli_help_and_the_rendered_diagrams_cite_nothing_outside_the_repository() -> None:
    parser = build_parser()
    texts = [parser.format_help()]
    subparsers: dict[str, Any] = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr, assignment]
    texts += [sub.format_help() for sub in subparsers.values()]
    texts += [
        render(declaration(machine), fmt).decode("utf-8")
        for machine in ("inner", "outer")
        for fmt in ("mermaid", "dot")
    ]
    assert [m.group(0) for text in texts for m in _FOREIGN.finditer(text)] == []


# --------------------------------------------------------------------------- the checks' checks
def test_each_reference_is_attributed_to_the_document_it_cites() -> None:
    # An explicit citation, references joined to it, a bare reference after it, another
    # document, and a section that does not exist. (Written with escapes, so that this file's
    # own scan does not read the sample as citations.)
    sign = "\u00a7"
    text = (
        f"see docs/behaviour.md {sign}2.4 and {sign}4.3 rule 2, {sign}6.1; later {sign}2.5.\n"
        f"and `docs/invariants.md` ({sign}9), then docs/behaviour.md {sign}99.\n"
    )
    behaviour, invariants = DOCS / "behaviour.md", DOCS / "invariants.md"
    found = [(s, d) for _o, s, d in _section_references(text, ROOT / "tests" / "probe.py")]
    assert found == [
        ("2.4", behaviour),
        ("4.3", behaviour),
        ("6.1", behaviour),
        ("2.5", behaviour),
        ("9", invariants),
        ("99", behaviour),
    ]
    assert "4.3" in _sections(behaviour) and "9" in _sections(invariants)
    assert "99" not in _sections(behaviour)
    # inside a document, a bare reference cites that document
    inside = [(s, d) for _o, s, d in _section_references(f"as in {sign}3.5", behaviour)]
    assert inside == [("3.5", behaviour)]


def test_the_foreign_citation_pattern_finds_what_it_must() -> None:
    # (pieced together, so that this file's own scan does not read them as citations)
    cited = [
        "SP" + "EC \u00a72.2",
        "D" + "ESIGN" + ".md",
        "S" + "TYLE" + ".md",
        "W" + "IRE-FORMATS \u00a74",
        "../sh" + "ared/x",
        "D" + "ESIGN invariant 9",
    ]
    assert [bool(_FOREIGN.search(text)) for text in cited] == [True] * len(cited)
    # an identifier that merely starts with the word is not a citation
    assert _FOREIGN.search("SP" + "EC_GUARD_ORDER") is None
