"""The user guide (``docs/``) cannot drift from the code.

- Every ``sharp`` command in a guide page's ```` ```sh ```` blocks parses against the real
  CLI (option names and value types), and every CLI command has a page.
- The command pages' examples run, in page order, in one folder (in-process, slow).
- ``docs/reproduce.md`` runs as written: ``tests/test_reproduce_guide.py`` (its own file, so
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
from cli_helpers import run_cli
from typer.exceptions import TyperException

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
COMMAND_PAGES = sorted((DOCS / "commands").glob("*.md"))
# Order matters: the quick start writes model.safetensors, which the other pages use.
EXAMPLE_PAGES = [DOCS / "index.md", *COMMAND_PAGES, DOCS / "ci.md", DOCS / "json.md"]
REPRODUCE = DOCS / "reproduce.md"


def _load_runner():
    spec = importlib.util.spec_from_file_location("run_guide", DOCS / "reproduce" / "run_guide.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_guide", module)
    spec.loader.exec_module(module)
    return module


run_guide = _load_runner()


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
def test_command_page_examples_run_as_documented(tmp_path, monkeypatch, capsys):
    """Every example of index, command pages, ci and json, in page order, in one folder;
    exit codes as documented and every report written validates against the schema."""
    monkeypatch.chdir(tmp_path)
    schema = _schema()
    for page in EXAMPLE_PAGES:
        for command in _commands(page):
            where = f"{page.name}:{command.line}: {command.text}"
            assert command.program == "sharp", where  # fixture scripts: reproduce.md only
            run = run_cli(capsys, *command.args)
            assert run.code == command.expected_exit, (
                f"{where}\nexit {run.code}\n{run.out[-2000:]}\n{run.err[-2000:]}"
            )
            target = command.option("--json")
            if target == "-":
                jsonschema.validate(json.loads(run.out), schema)
            elif target is not None and (tmp_path / target).exists():  # a report or an error object
                jsonschema.validate(json.loads((tmp_path / target).read_text()), schema)
        for block in _python_blocks(page):  # e.g. json.md's "reading a report in a script"
            exec(compile(block, f"{page.name}:python", "exec"), {"__name__": "__docs__"})
