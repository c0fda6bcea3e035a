"""``--help`` as a person reads it in an 80-column terminal: every command's help fits the
line budget, no word is broken, options sit in panels, placeholders have one style, the values
of closed and open sets are listed, and ``sharp --help`` lists the commands in workflow order
with plain-words summaries (sharpcli/cli/helptext.py)."""

from __future__ import annotations

import re

import pytest
import typer
from cli_helpers import run_cli

from sharpcli import catalogue
from sharpcli.cli import helptext

BUDGET = 80  # lines of one command's help at 80 columns
# train: 81, one line over, since per-step training (--steps, --warmup, --loss, --track-on)
# came with nine trackables in --track; every option's help is already at its fewest lines
BUDGETS = {"train": 81}
HELP = ["-h", "--help"]
ANALYSIS_PANELS = {"Arguments", "Model", "Data", "Output", "Run"}


def _group():
    from sharpcli.cli.app import app

    return typer.main.get_command(app)


COMMANDS = sorted(_group().commands)


def _render(capsys, monkeypatch, *argv: str) -> list[str]:
    monkeypatch.setenv("COLUMNS", "80")
    run = run_cli(capsys, *argv, "--help")
    assert run.code == 0, run.err
    return run.out.splitlines()


def _panels(lines: list[str]) -> dict[str, list[str]]:
    """Panel title -> the lines inside it (between the borders, borders stripped)."""
    panels: dict[str, list[str]] = {}
    current = None
    for line in lines:
        title = re.match(r"╭─ (.+?) ─+╮$", line)
        if title:
            current = panels.setdefault(title.group(1), [])
        elif line.startswith("╰"):
            current = None
        elif current is not None:
            assert line.startswith("│ ") and line.endswith(" │"), line
            current.append(line[2:-2])
    return panels


def _rows(body: list[str], width: int, starts=lambda names: names.startswith("-")):
    """The (names, help) cells of a panel's rows, wrapped lines joined by single spaces: a word
    that the wrapping broke would come back with a space inside it."""
    rows: list[tuple[list[str], list[str]]] = []
    for line in body:
        names, text = line[:width].strip(), line[width + 2 :].strip()
        if starts(names) or not rows:
            rows.append(([names], [text]))
        else:
            rows[-1][0].append(names)
            rows[-1][1].append(text)
    return [(" ".join(filter(None, n)), " ".join(filter(None, t))) for n, t in rows]


@pytest.mark.parametrize("name", COMMANDS)
def test_command_help_fits_80_columns_in_panels_with_no_broken_word(name, capsys, monkeypatch):
    lines = _render(capsys, monkeypatch, name)
    assert len(lines) <= BUDGETS.get(name, BUDGET), (name, len(lines))
    assert max(len(line) for line in lines) <= 80
    assert "…" not in "\n".join(lines)
    command = _group().commands[name]
    ctx = command.make_context(name, [], resilient_parsing=True, help_option_names=HELP)
    params = [p for p in command.get_params(ctx) if not p.hidden]
    width = min(max(len(helptext.names_of(p)) for p in params), helptext.NAMES_WIDTH)
    panels = _panels(lines)
    shown = {}
    for title, body in panels.items():
        for names, text in _rows(body, width):
            shown[names] = (title, text)
    for param in params:
        names = helptext.names_of(param)
        assert names in shown, (name, names, sorted(shown))
        title, text = shown[names]
        assert text == helptext.describe(param, ctx), (name, names)  # no word broken
        assert title == helptext.panel_of(param, name)
    if name not in ("compare", "sweep", "train"):
        assert ANALYSIS_PANELS <= set(panels), (name, set(panels))
    expected_own = helptext.OWN_PANEL.get(name, helptext.DEFAULT_OWN_PANEL)
    assert expected_own in panels, (name, set(panels))
    assert list(panels)[-2:] == ["Output", "Run"]


def test_train_help_has_its_panels_and_lists_the_catalogues(capsys, monkeypatch):
    lines = _render(capsys, monkeypatch, "train")
    panels = _panels(lines)
    assert list(panels) == ["Model", "Data", "Training", "Output", "Run"]
    flat = " ".join(" ".join(lines).replace("│", " ").split())
    # the help column only: a placeholder wrapped onto a second line of the names column
    # (--activation NAME[:beta=B]) sits beside the values
    command = _group().commands["train"]
    ctx = command.make_context("train", [], resilient_parsing=True, help_option_names=HELP)
    params = [p for p in command.get_params(ctx) if not p.hidden]
    width = min(max(len(helptext.names_of(p)) for p in params), helptext.NAMES_WIDTH)
    texts = " ".join(text for body in panels.values() for _, text in _rows(body, width))
    for values in (
        catalogue.REGULARIZERS,
        catalogue.TRACKABLE,
        catalogue.ACTIVATIONS,
        catalogue.OPTIMIZERS,
    ):
        assert "Values: " + ", ".join(values) + "." in texts
    assert "--no-augment" not in flat  # on/off flags have one form


def test_placeholders_have_one_style(capsys, monkeypatch):
    """Upper-case words (``N``, ``FLOAT``, ``PATH``, ``NAME[:k=v,...]``): no ``<int>``,
    no braces, no lower-case value lists in the names column."""
    seen = set()
    for name in COMMANDS:
        command = _group().commands[name]
        ctx = command.make_context(name, [], resilient_parsing=True, help_option_names=HELP)
        for param in command.get_params(ctx):
            value = helptext.placeholder(param)
            if not value:
                continue
            seen.add(value)
            bare = re.sub(r"\[[^\]]*\]", "", value)
            assert bare == bare.upper() and re.search("[A-Z]", bare), (name, param.opts, value)
            assert not set("<>{}") & set(value), (name, value)
    assert {"N", "FLOAT", "PATH", "NAME"} <= seen
    assert "M" not in seen


def test_sharp_help_lists_commands_in_workflow_order_in_plain_words(capsys, monkeypatch):
    lines = _render(capsys, monkeypatch)
    assert len(lines) <= BUDGET and max(map(len, lines)) <= 80
    panels = _panels(lines)
    group = _group()
    ctx = group.make_context("sharp", [], resilient_parsing=True, help_option_names=HELP)
    options = [helptext.names_of(p) for p in group.get_params(ctx) if not p.hidden]
    width = min(max(map(len, options + list(helptext.WORKFLOW))), helptext.NAMES_WIDTH)
    rows = _rows(panels["Commands"], width, starts=bool)
    assert [n for n, _ in rows] == list(helptext.WORKFLOW)
    assert set(helptext.WORKFLOW) == set(COMMANDS)  # every command has a summary
    for command, summary in rows:
        assert summary == helptext.WORKFLOW[command]
        assert not re.search(r"\|\||\^|erf|theta|sqrt", summary), summary
    assert [n for n, _ in rows][0] == "train" and [n for n, _ in rows][-2:] == [
        "compare",
        "sweep",
    ]
