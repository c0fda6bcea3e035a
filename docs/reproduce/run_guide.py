"""Run the ``sharp`` commands of a user-guide page, in order, and check their exit codes.

The guide pages put runnable commands in fenced ```` ```sh ```` blocks, one ``sharp ...``
command per line (no shell variables, pipes or redirections), or ``python fixtures/NAME.py
ARGS`` for a data file made by one of the repository's fixture scripts (run from the
repository's ``fixtures/`` folder, in the work folder). A trailing comment ``# exit N``
states a documented non-zero exit code (a tripped ``--fail-if`` gate exits 1, bad input 2,
a numerical failure 3); every other command must exit 0. Comment lines and blank lines are
allowed; any other line in an ``sh`` block is an error, so a page cannot show a command
that this runner (and ``tests/docs/test_docs.py``, ``tests/docs/test_reproduce_guide.py``) does not
execute.

Usage (from the repository root)::

    python docs/reproduce/run_guide.py                      # docs/reproduce.md in ./reproduce-run
    python docs/reproduce/run_guide.py docs/ci.md --workdir /tmp/ci-run

Each command runs as ``python -m sharpcli ARGS`` (a fixture line as ``python
REPO/fixtures/NAME.py ARGS``) in the work folder (so checkpoints written by earlier
commands exist for later ones) with ``OMP_NUM_THREADS=1`` unless already set; its output is
printed. The exit status is 0 when every command exited as documented.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^```(\S*)\s*$")
_EXIT_COMMENT = re.compile(r"#\s*exits?\s+(\d+)\b")
_FIXTURE = re.compile(r"^fixtures/[A-Za-z0-9_]+\.py$")
REPOSITORY = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class GuideCommand:
    """One ``sharp`` command of a guide page.

    ``args`` are the arguments after ``sharp`` (after ``python`` for a fixture script:
    ``fixtures/NAME.py`` and its arguments); ``expected_exit`` the documented exit code (0
    unless the line ends with ``# exit N``); ``line`` the 1-based line number in the page;
    ``text`` the line as written; ``program`` is ``sharp`` or ``python``.
    """

    args: tuple[str, ...]
    expected_exit: int
    line: int
    text: str
    program: str = "sharp"

    def option(self, name: str) -> str | None:
        """Value of ``--name VALUE`` (or ``--name=VALUE``) in the command, else None."""
        for i, arg in enumerate(self.args):
            if arg == name and i + 1 < len(self.args):
                return self.args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
        return None


def extract_commands(markdown: str, source: str = "<page>") -> list[GuideCommand]:
    """Every ``sharp`` command in the page's ```` ```sh ```` blocks, in page order.

    Raises ValueError naming ``source`` and the line for a line in an ``sh`` block that is
    neither blank, a comment, nor a single ``sharp`` command, and for an unclosed block.
    """
    commands: list[GuideCommand] = []
    in_sh = False
    in_other = False
    for number, raw in enumerate(markdown.splitlines(), start=1):
        fence = _FENCE.match(raw.strip())
        if fence and not in_sh and not in_other:
            in_sh = fence.group(1) == "sh"
            in_other = not in_sh
            continue
        if fence and (in_sh or in_other) and fence.group(1) == "":
            in_sh = in_other = False
            continue
        if not in_sh:
            continue
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        words = _split(stripped)
        if "$" in stripped or "`" in stripped or any(_is_operator(word) for word in words):
            raise ValueError(f"{source}:{number}: shell syntax in a guide command: {stripped!r}")
        fixture = len(words) >= 2 and words[0] == "python" and _FIXTURE.match(words[1])
        if not words or (words[0] != "sharp" and not fixture):
            raise ValueError(f"{source}:{number}: not a sharp command: {stripped!r}")
        match = _EXIT_COMMENT.search(stripped)
        expected = int(match.group(1)) if match else 0
        program = "python" if fixture else "sharp"
        commands.append(GuideCommand(tuple(words[1:]), expected, number, stripped, program))
    if in_sh or in_other:
        raise ValueError(f"{source}: unclosed code block")
    return commands


def _split(line: str) -> list[str]:
    """Shell words of ``line`` (POSIX quoting, ``#`` comments); unquoted ``| & ; < > ( )``
    runs come out as separate words so that they can be refused."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def _is_operator(word: str) -> bool:
    """True for a word made only of shell operator characters (``|``, ``&&``, ``>``, ...)."""
    return bool(word) and all(ch in "|&;<>()" for ch in word)


@dataclass(frozen=True)
class CommandRun:
    """Outcome of one guide command: exit code, stdout, stderr and wall seconds."""

    command: GuideCommand
    code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def as_documented(self) -> bool:
        """True when the exit code is the documented one."""
        return self.code == self.command.expected_exit


def run_command(command: GuideCommand, workdir: Path, timeout: float = 600.0) -> CommandRun:
    """Run ``python -m sharpcli ARGS`` (or the fixture script) in ``workdir``
    (``OMP_NUM_THREADS=1`` unless set)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("COLUMNS", "100")
    start = time.perf_counter()
    if command.program == "python":
        argv = [sys.executable, str(REPOSITORY / command.args[0]), *command.args[1:]]
    else:
        argv = [sys.executable, "-m", "sharpcli", *command.args]
    proc = subprocess.run(
        argv,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return CommandRun(
        command, proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: run a page's commands in order; 0 when all exit as documented."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_page = Path(__file__).resolve().parent.parent / "reproduce.md"
    parser.add_argument(
        "page", nargs="?", default=str(default_page), help="guide page (default docs/reproduce.md)"
    )
    parser.add_argument("--workdir", default="reproduce-run", help="folder to run in (created)")
    options = parser.parse_args(argv)
    page = Path(options.page)
    workdir = Path(options.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    commands = extract_commands(page.read_text(encoding="utf-8"), source=str(page))
    failures = 0
    total = time.perf_counter()
    for command in commands:
        print(f"$ {command.text}", flush=True)
        result = run_command(command, workdir)
        sys.stdout.write(result.stdout)
        sys.stdout.write(result.stderr)
        status = "ok" if result.as_documented else f"FAILED (expected exit {command.expected_exit})"
        print(f"[exit {result.code}, {result.seconds:.1f} s, {status}]\n", flush=True)
        failures += not result.as_documented
    print(
        f"{len(commands)} commands, {failures} not as documented, {time.perf_counter() - total:.0f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
