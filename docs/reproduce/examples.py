"""Regenerate the example output blocks of the user guide from real runs, or check them.

In the guide pages (:data:`PAGES`) a fenced ```` ```text ```` block that directly follows a
```` ```sh ```` block (blank lines between at most) shows what that block's commands print at
80 columns: their stdout, then their stderr (notes), as a terminal shows them. This script
runs every command of the pages in page order in one work folder (the quick start of
``index.md`` writes the ``model.safetensors`` the other pages use), in-process, with
``COLUMNS=80`` and ``OMP_NUM_THREADS=1``, and writes each such block from the run, so the
pages show exactly what the exact command above them prints.

Usage (from the repository root)::

    python docs/reproduce/examples.py            # rewrite the stale blocks
    python docs/reproduce/examples.py --check    # exit 1 naming the stale blocks

``tests/docs/test_docs.py`` runs the check on every test run (with the pages' exit codes and
report schemas), so a page whose output no longer matches the tool fails the suite.
The check compares what a run shows, not its bytes (:func:`same`): the words and numbers in
order (so a number one digit longer, which widens a column or moves a line break, is the same
page), numbers equal to 4 significant digits or both below 1e-6 (float rounding differs from
one CPU to another), run times (``seconds``) and checkpoint hashes (``sha256``) left out. A
count (``12 matvecs``), a label, a note or a fourth digit that changed makes the page stale.
The rewrite records the latest run exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run_guide import REPOSITORY, GuideCommand, extract_commands  # noqa: E402

DOCS = REPOSITORY / "docs"
# Order matters: the quick start writes model.safetensors, which the other pages use.
PAGES = [DOCS / "index.md", *sorted((DOCS / "commands").glob("*.md")), DOCS / "ci.md"]
PAGES.append(DOCS / "json.md")
COLUMNS = 80
_FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass
class Example:
    """An ``sh`` block's commands and the ``text`` block after it (0-based line range of its
    body, end exclusive), if any."""

    commands: list[GuideCommand]
    output: tuple[int, int] | None


def examples(markdown: str, source: str = "<page>") -> list[Example]:
    """The page's ``sh`` blocks, in order, with the output block that follows each."""
    lines = markdown.splitlines()
    commands = extract_commands(markdown, source=source)
    found: list[Example] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i].strip())
        if not fence or not fence.group(1):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if fence.group(1) == "sh":
            mine = [c for c in commands if i + 1 < c.line <= end]
            output = None
            k = end + 1
            while k < len(lines) and not lines[k].strip():
                k += 1
            if k < len(lines) and lines[k].strip() == "```text":
                close = next(j for j in range(k + 1, len(lines)) if lines[j].strip() == "```")
                output = (k + 1, close)
            found.append(Example(mine, output))
        i = end + 1
    return found


def run_in_process(args: tuple[str, ...]) -> tuple[int, str, str]:
    """``sharp ARGS`` in this process: (exit code, stdout, stderr)."""
    from sharpcli.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def shown(out: str, err: str) -> list[str]:
    """What a terminal shows: stdout, then stderr; trailing spaces dropped."""
    return [line.rstrip() for line in (out + err).splitlines()]


_SECONDS_HEADER = re.compile(r"^(seconds|\w+_seconds|sha256)$")
_NUMBER = re.compile(r"^[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?$")
_TOKEN = re.compile(r"[\s│┃┏┓┗┛┡┩└┘┌┐━─┳┻╇╈┼┣┫╋┠┨]+")


def normalise(lines: list[str]) -> list[str]:
    """``lines`` with run times and hashes masked: the cells of table columns headed
    ``seconds`` (or ``*_seconds``) and the values of key-value rows named so or ``sha256``."""
    masked = []
    columns: set[int] = set()
    for line in lines:
        cells = re.split(r"[│┃]", line)
        if len(cells) > 2:
            names = [c.strip() for c in cells]
            if line.lstrip().startswith("┃"):
                columns = {i for i, n in enumerate(names) if _SECONDS_HEADER.match(n)}
            elif _SECONDS_HEADER.match(names[1]):
                cells = cells[:2] + ["#"] + cells[3:]
            else:
                cells = ["#" if i in columns else c for i, c in enumerate(cells)]
            line = "|".join(c.strip() for c in cells)
        masked.append(line)
    return masked


def environment() -> contextlib.AbstractContextManager:
    """``COLUMNS=80`` and ``OMP_NUM_THREADS=1`` while the pages run."""

    @contextlib.contextmanager
    def scope():
        saved = {k: os.environ.get(k) for k in ("COLUMNS", "OMP_NUM_THREADS")}
        os.environ["COLUMNS"] = str(COLUMNS)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    return scope()


Callback = Callable[[Path, GuideCommand, int, str, str], None]


def regenerate(workdir: Path, pages=None, on_command: Callback | None = None) -> dict[Path, str]:
    """Run every command of ``pages`` in order in ``workdir``; each page's text with its output
    blocks rewritten from the runs. ``on_command(page, command, code, out, err)`` sees each run
    (a test checks exit codes and reports there)."""
    pages = PAGES if pages is None else pages
    rewritten = {}
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with environment():
            for page in pages:
                text = page.read_text(encoding="utf-8")
                lines = text.splitlines()
                for example in reversed(_run_page(page, text, on_command)):
                    start, end = example[0]
                    lines[start:end] = example[1]
                rewritten[page] = "\n".join(lines) + ("\n" if text.endswith("\n") else "")
    finally:
        os.chdir(cwd)
    return rewritten


def _run_page(page: Path, text: str, on_command: Callback | None):
    blocks = []
    for example in examples(text, source=str(page.relative_to(REPOSITORY))):
        produced: list[str] = []
        for command in example.commands:
            if command.program != "sharp":
                raise ValueError(f"{page.name}:{command.line}: only sharp commands here")
            code, out, err = run_in_process(command.args)
            if on_command is not None:
                on_command(page, command, code, out, err)
            produced += shown(out, err)
        if example.output is not None:
            blocks.append((example.output, produced))
    return blocks


def tokens(lines: list[str]) -> list[str]:
    """The words and numbers of ``lines`` (:func:`normalise` d) in order, without table
    borders, padding or line breaks."""
    return [t for t in _TOKEN.split(" ".join(normalise(lines)).replace("|", " ")) if t]


def _close(a: str, b: str) -> bool:
    if a == b:
        return True
    x, y = a.strip(",;()[]"), b.strip(",;()[]")
    if not (_NUMBER.match(x) and _NUMBER.match(y)) or x.isdigit() or y.isdigit():
        return False
    u, v = float(x), float(y)
    return abs(u - v) <= max(1e-6, 5e-4 * max(abs(u), abs(v)))


def same(old: list[str], new: list[str]) -> bool:
    """Whether two output blocks show the same thing (module docstring)."""
    a, b = tokens(old), tokens(new)
    return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))


def stale(rewritten: dict[Path, str]) -> list[str]:
    """``page:line`` of every output block that differs from its run (run times aside)."""
    found = []
    for page, new in rewritten.items():
        old = page.read_text(encoding="utf-8")
        for a, b in zip(examples(old), examples(new)):
            if a.output is None:
                continue
            old_lines = old.splitlines()[a.output[0] : a.output[1]]
            new_lines = new.splitlines()[b.output[0] : b.output[1]]
            if not same(old_lines, new_lines):
                found.append(f"{page.relative_to(REPOSITORY)}:{a.output[0]}")
    return found


def main(argv: list[str] | None = None) -> int:
    """Rewrite the pages' output blocks, or with ``--check`` report the stale ones (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale blocks")
    parser.add_argument("--workdir", type=Path, help="work folder (default: a temporary one)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        rewritten = regenerate(workdir)
    outdated = stale(rewritten)
    if args.check:
        for where in outdated:
            print(f"stale example output: {where} (run python docs/reproduce/examples.py)")
        return 1 if outdated else 0
    for page, text in rewritten.items():
        if page.read_text(encoding="utf-8") != text:
            page.write_text(text, encoding="utf-8")
            print(f"rewrote {page.relative_to(REPOSITORY)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
