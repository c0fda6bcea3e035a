"""The repository stands alone: every citation resolves in docs/references.md, and nothing
points to design notes kept outside the repository.

- docs/references.md defines each key once, as a list item ``- **[KEY]** ...``.
- Every bracketed key (``[NME]``, ``[Hutch++]``, ``[Goodfellow2015]``) in the docstrings and
  comments of the Python files and in the prose of the Markdown pages is defined there. Only
  prose is read: code (outside docstrings and comments), fenced blocks and inline code spans
  are skipped, and Markdown links ``[text](url)``, ``[text][ref]`` and ``[ref]: url`` are not
  citations. Indexing such as ``x[None]`` or ``list[Path]`` is not either (a key follows a
  space or an opening parenthesis, never a name).
- A paper key used bare with a place in the paper ("NME eq. 20", "MAN Fig. 1") is defined.
- No text file names the outside specification or notes files (the words are assembled from
  pieces below so that this file does not match itself).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCES = ROOT / "docs" / "references.md"

PYTHON_DIRS = ("sharpcli", "tests", "benchmarks", "fixtures", "docs")
MARKDOWN = (*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md")
TEXT_SCOPE = ("sharpcli", "tests", "docs", "benchmarks", "fixtures", "README.md", "CHANGELOG.md")
TEXT_SUFFIXES = {".py", ".md", ".json", ".txt", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".csv"}

KEY_SHAPE = r"[A-Z][A-Za-z0-9+\-]+"
DEFINITION = re.compile(rf"^- \*\*\[(?P<key>{KEY_SHAPE})\]\*\*\s+\S")
# A citation: a bracketed key after start, space or punctuation (not after a name, a bracket or a
# backtick: indexing, nested lists, code), and not followed by "(", "[" or ":" (links).
CITATION = re.compile(rf"(?<![\w\]\[`\\])\[(?P<key>{KEY_SHAPE})\](?![(\[:])")
# A bare paper key with a place in the paper: "NME eq. 20", "AD Corollary 1", "MAN Fig. 1".
LOCATORS = r"(?:eqs?\.|Eqs?\.|Figs?\.|Tables?|Theorems?|Thm|Corollary|Alg\.|Algorithm|App\.)"
BARE_CITATION = re.compile(rf"\b(?P<key>[A-Z][A-Z]+)\s+{LOCATORS}\s*[0-9A-Z]")
PAPERS = {"AD", "NME", "NSO", "MAN", "FA"}

_DESIGN_DOC = "SP" + "EC"
_NOTES_DOC = "LESS" + "ONS"
_ARCH_DOC = "ARCHI" + "TECTURE"
_PAPER_FILES = (
    "activation-decay",
    "neglected-hessian-component-nme",
    "noise-stability-optimization",
    "sharpness-can-be-manipulated",
    "flatness-aware-regularization",
)
FORBIDDEN = [
    re.compile(rf"\b{_NOTES_DOC}\b"),
    re.compile(rf"\b(?:{_DESIGN_DOC}|{_NOTES_DOC}|{_ARCH_DOC})\.md\b"),
    re.compile("/work/" + "shared"),
    re.compile(r"\b(?:" + "|".join(_PAPER_FILES) + r")\.t" + "xt"),
]
_DESIGN_WORD = re.compile(rf"\b{_DESIGN_DOC}\b")
# "--data X" or metavar="X": X names an option's value
_PLACEHOLDER = re.compile(r'(?:--[\w-]+[ =]|metavar=")$')


def points_outside(line: str) -> bool:
    """Whether a line names a document kept outside the repository."""
    if any(pattern.search(line) for pattern in FORBIDDEN):
        return True
    return any(
        not _PLACEHOLDER.search(line[: match.start()]) for match in _DESIGN_WORD.finditer(line)
    )


def defined_keys() -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in REFERENCES.read_text(encoding="utf-8").splitlines():
        match = DEFINITION.match(line)
        if match:
            counts[match["key"]] = counts.get(match["key"], 0) + 1
    return counts


def _strip_inline_code(text: str) -> str:
    text = re.sub(r"``.*?``", " ", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", " ", text)


def python_prose(path: Path) -> str:
    """Docstrings (every bare string statement) and comments of a Python file."""
    source = path.read_text(encoding="utf-8")
    parts = [
        node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    parts += [
        tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    return _strip_inline_code("\n".join(parts))


def markdown_prose(text: str) -> str:
    """A Markdown page's text without its fenced blocks and inline code spans."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", " ", text, flags=re.S | re.M)
    return _strip_inline_code(text)


def prose_files() -> list[tuple[Path, str]]:
    out = []
    for folder in PYTHON_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out.append((path, python_prose(path)))
    out += [
        (path, markdown_prose(path.read_text(encoding="utf-8")))
        for path in MARKDOWN
        if path.exists()
    ]
    return out


def text_files() -> list[Path]:
    out = []
    for name in TEXT_SCOPE:
        base = ROOT / name
        candidates = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in candidates:
            if (
                path.is_file()
                and path.suffix in TEXT_SUFFIXES
                and "__pycache__" not in path.parts
                and not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
            ):
                out.append(path)
    return out


# ----------------------------------------------------------------------------- the parsers
def test_citation_pattern_skips_links_code_and_indexing():
    text = markdown_prose(
        "See [NME] eq. 2 and ([Hutch++]); [A link](x.md), [Ref][1], [Ref]: u, `x [Key]`,\n"
        "```\nA [NOPE]\n```\nlist[Path] and x[None]; [Goodfellow2015]. [N] is too short.\n"
    )
    assert [m["key"] for m in CITATION.finditer(text)] == ["NME", "Hutch++", "Goodfellow2015"]
    bare = "NME eq. 20, AD Corollary 1, MAN Fig. 1, the README section 2"
    assert [m["key"] for m in BARE_CITATION.finditer(bare)] == ["NME", "AD", "MAN"]


def test_outside_pointers_are_told_from_placeholders_and_names():
    assert points_outside(f"see {_DESIGN_DOC} section 7")
    assert points_outside(f"({_DESIGN_DOC} \u00a73) and more")
    assert points_outside(f'{_NOTES_DOC} "reference code"')
    assert points_outside(f"{_ARCH_DOC}.md")
    assert not points_outside(f"sharp train [--data {_DESIGN_DOC}] [--epochs E]")
    assert not points_outside(
        f"{_DESIGN_DOC}S = {{}}; {_DESIGN_DOC}IAL_VALUES; MODEL_{_DESIGN_DOC}"
    )
    assert not points_outside("docs/architecture.md, a data spec, lessons learned")


# ----------------------------------------------------------------------------- the checks
def test_references_define_each_key_once():
    counts = defined_keys()
    assert counts, f"no '- **[KEY]** ...' entries in {REFERENCES}"
    assert not {k: n for k, n in counts.items() if n > 1}, "keys defined more than once"
    assert PAPERS <= set(counts), f"paper keys missing: {sorted(PAPERS - set(counts))}"


def test_every_cited_key_is_defined():
    keys = set(defined_keys())
    missing = []
    for path, prose in prose_files():
        for pattern in (CITATION, BARE_CITATION):
            for match in pattern.finditer(prose):
                if match["key"] not in keys:
                    missing.append(f"{path.relative_to(ROOT)}: [{match['key']}]")
    assert not missing, "citation keys not defined in docs/references.md:\n" + "\n".join(
        sorted(set(missing))
    )


@pytest.mark.parametrize("page", ["index.md", "architecture.md"])
def test_references_are_linked(page):
    assert "](references.md)" in (ROOT / "docs" / page).read_text(encoding="utf-8")


def test_no_pointer_to_files_outside_the_repository():
    hits = []
    for path in text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if points_outside(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not hits, "pointers to files outside the repository:\n" + "\n".join(hits)
