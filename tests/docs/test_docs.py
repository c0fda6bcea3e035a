"""The user guide (``docs/``) cannot drift from the code.

- Every ``sharp`` command in a guide page's ```` ```sh ```` blocks parses against the real
  CLI (option names and value types), and every CLI command has a page.
- The command pages' examples run, in page order, in one folder (in-process, slow), and
  every output block shows what the command above it prints (``docs/reproduce/examples.py``
  regenerates them; its check runs here).
- ``docs/reproduce.md`` runs as written: ``tests/docs/test_reproduce_guide.py`` (its own file, so
  that ``pytest --dist loadfile`` runs it beside this one).

The page parser is ``docs/reproduce/run_guide.py``, the same one users and CI run.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import typer
from typer.exceptions import TyperException

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
COMMAND_PAGES = sorted((DOCS / "commands").glob("*.md"))
# Order matters: the quick start writes model.safetensors, which the other pages use.
EXAMPLE_PAGES = [DOCS / "index.md", *COMMAND_PAGES, DOCS / "ci.md", DOCS / "json.md"]
REPRODUCE = DOCS / "reproduce.md"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, DOCS / "reproduce" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


run_guide = _load("run_guide")
examples = _load("examples")


def _commands(page: Path):
    return run_guide.extract_commands(
        page.read_text(encoding="utf-8"), source=str(page.relative_to(ROOT))
    )


def _python_blocks(page: Path) -> list[str]:
    """The page's fenced ``python`` blocks, in order."""
    return re.findall(
        r"^```python\n(.*?)^```$", page.read_text(encoding="utf-8"), flags=re.S | re.M
    )


def _cli_group():
    from sharpcli.cli.app import app

    return typer.main.get_command(app)


def _schema() -> dict:
    import sharpcli

    return json.loads((Path(sharpcli.__file__).parent / "report" / "schema.json").read_text())


# ----------------------------------------------------------------------------- fast checks
def test_page_parser_refuses_what_it_would_not_run():
    text = (
        '```sh\nsharp analyze m.safetensors --fail-if "hessian.lambda_max > 500"  # exit 1\n```\n'
    )
    (command,) = run_guide.extract_commands(text)
    assert command.args == ("analyze", "m.safetensors", "--fail-if", "hessian.lambda_max > 500")
    assert command.expected_exit == 1 and command.line == 2
    assert command.option("--fail-if") == "hessian.lambda_max > 500"
    for bad in (
        "sharp eigen m | head",
        "sharp eigen $CKPT",
        "sharp eigen m > out.txt",
        "python -m sharpcli eigen m",
        "sharp train && sharp eigen m",
        "python fixtures/make_digits_data.py d.npz > log",
        "python ../fixtures/make_digits_data.py d.npz",
        "python tests/conftest.py",
    ):
        with pytest.raises(ValueError):
            run_guide.extract_commands(f"```sh\n{bad}\n```\n")
    # other fenced blocks (text, yaml, json) are never run
    assert run_guide.extract_commands("```yaml\nrun: sharp eigen m | head\n```\n") == []
    # a fixture script of the repository writes a data file for later commands
    (fixture,) = run_guide.extract_commands(
        "```sh\npython fixtures/make_digits_data.py d.npz\n```\n"
    )
    assert fixture.program == "python" and fixture.args == ("fixtures/make_digits_data.py", "d.npz")


def test_every_command_has_a_page_linked_from_the_index():
    names = set(_cli_group().commands)
    assert {page.stem for page in COMMAND_PAGES} == names
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for name in names:
        assert f"commands/{name}.md" in index, name
    for page in ("json.md", "ci.md", "reproduce.md"):
        assert page in index


def test_every_guide_command_parses_against_the_cli():
    group = _cli_group()
    total = 0
    for page in [*EXAMPLE_PAGES, REPRODUCE]:
        commands = _commands(page)
        assert commands, f"{page.name}: no sharp commands"
        for command in commands:
            where = f"{page.name}:{command.line}: {command.text}"
            assert command.expected_exit in (0, 1, 2, 3), where
            if command.program == "python":  # a fixture script that writes a data file
                assert (ROOT / command.args[0]).is_file(), where
                continue
            name, *args = command.args
            assert name in group.commands, where
            try:
                group.commands[name].make_context(name, list(args))
            except TyperException as exc:  # unknown option, bad value type, missing argument
                pytest.fail(f"{where}: {exc}")
            total += 1
    assert total >= 60


# ----------------------------------------------------------------------------- command pages
@pytest.mark.slow
def test_command_page_examples_run_as_documented(tmp_path, monkeypatch):
    """Every example of index, command pages, ci and json, in page order, in one folder;
    exit codes as documented, every report written validates against the schema, and every
    output block is what the command above it prints at 80 columns (else: run
    ``python docs/reproduce/examples.py`` and review the diff)."""
    assert examples.PAGES == EXAMPLE_PAGES
    schema = _schema()

    def check(page, command, code, out, err):
        where = f"{page.name}:{command.line}: {command.text}"
        assert command.program == "sharp", where  # fixture scripts: reproduce.md only
        assert code == command.expected_exit, f"{where}\nexit {code}\n{out[-2000:]}\n{err[-2000:]}"
        target = command.option("--json")
        if target == "-":
            jsonschema.validate(json.loads(out), schema)
        elif target is not None and (tmp_path / target).exists():  # a report or an error object
            jsonschema.validate(json.loads((tmp_path / target).read_text()), schema)

    rewritten = examples.regenerate(tmp_path, on_command=check)
    assert examples.stale(rewritten) == []
    monkeypatch.chdir(tmp_path)
    for page in EXAMPLE_PAGES:
        for block in _python_blocks(page):  # e.g. json.md's "reading a report in a script"
            exec(compile(block, f"{page.name}:python", "exec"), {"__name__": "__docs__"})


def test_output_blocks_follow_their_commands_and_run_times_are_ignored():
    page = (
        "intro\n\n```sh\nsharp eigen m.safetensors\nsharp trace m.safetensors\n```\n\n"
        "```text\nold output\n```\n\n```sh\nsharp train --out m.safetensors\n```\n\nprose\n"
    )
    first, second = examples.examples(page)
    assert [c.args[0] for c in first.commands] == ["eigen", "trace"]
    assert first.output == (8, 9)  # the body of the text block (0-based, end exclusive)
    assert page.splitlines()[8] == "old output"
    assert [c.args[0] for c in second.commands] == ["train"] and second.output is None
    table = [
        "┃ epoch ┃ train loss ┃ seconds ┃",
        "│     1 │    0.64175 │   0.219 │",
        "│ seconds          │          0.073848 │",
        "│ train_loss       │          1.14302 │",
    ]
    other_run = [
        table[0],
        table[1].replace("0.219", "0.301"),
        table[2].replace("73848", "8"),
        table[3].replace("1.14302 │", "1.143024 │"),  # another CPU's rounding; a wider column
    ]
    assert examples.same(table, other_run)
    changed = [table[0], table[1].replace("0.64175", "0.64275"), table[2], table[3]]
    assert not examples.same(table, changed)
    assert not examples.same(["12 matvecs over 1500 samples"], ["9 matvecs over 1500 samples"])
    assert examples.same(["residual 3.11e-07"], ["residual 3.9e-07"])  # both at rounding level
    assert examples.same(["a long line", "wrapped"], ["a long line wrapped"])
    assert not examples.same(["note: x"], ["note: x", "note: y"])
