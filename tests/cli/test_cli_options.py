"""What people type: every option says what it does, choices list their values in ``--help`` and
complete in the shell, flags show no ``<bool>``, list options show their form and an example,
``--tol``/``--max-matvecs`` are named by what they bound (the old names still work), and the
README's table of shared options matches the commands.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import typer
from cli_helpers import assert_one_line_error, run_cli

from sharpcli import catalogue
from sharpcli.cli import choices

ROOT = Path(__file__).resolve().parents[2]
WIDE = "250"  # help rendered wide enough that no value list wraps


def _group():
    from sharpcli.cli.app import app

    return typer.main.get_command(app)


def _commands() -> dict[str, object]:
    """Every command, and the ``sharp`` group itself under ``""``."""
    group = _group()
    return {"": group, **group.commands}


def _params(command):
    return command.get_params(command.make_context("sharp", [], resilient_parsing=True))


def _help(capsys, monkeypatch, name: str) -> str:
    monkeypatch.setenv("COLUMNS", WIDE)
    run = run_cli(capsys, *([name] if name else []), "--help")
    assert run.code == 0, run.err
    return run.out


def _choices(param) -> tuple[str, ...] | None:
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None or not descriptor.is_choice:
        return None
    return tuple(str(c) for c in descriptor.choices)


# ----------------------------------------------------------------------------- help text
def test_every_option_and_argument_has_help():
    missing = [
        f"{name or 'sharp'} {param.opts[0]}"
        for name, command in _commands().items()
        for param in _params(command)
        if not (getattr(param, "help", None) or "").strip()
    ]
    assert missing == []


def test_choices_are_listed_and_no_type_noise(capsys, monkeypatch):
    """Each option with a fixed set of values lists it (``Values: a, b, c.``); flags show no
    ``<bool>``, lists no ``list[str]``, nothing shows click's TEXT/BOOLEAN or a False default."""
    listed = 0
    for name, command in _commands().items():
        text = " ".join(_help(capsys, monkeypatch, name).replace("│", " ").split())
        for noise in ("<bool>", "list[", "BOOLEAN", "TEXT", "[default: False]", "<str>..."):
            assert noise not in text, (name, noise)
        for param in _params(command):
            values = _choices(param)
            if values:
                assert f"Values: {', '.join(values)}." in text, (name, param.opts)
                listed += 1
    assert listed >= 25  # split, dtype, arch in 8 commands; which, method, engine, ...


@pytest.mark.parametrize(
    ("name", "option", "metavar"),
    [
        ("train", "--reg", "NAME[:k=v,...]"),
        ("train", "--optimizer", "NAME[:k=v,...]"),
        ("sweep", "--reg", "NAME[:k=v,...]"),
        ("sweep", "--extra-reg", "NAME[:k=v,...]"),
        ("sweep", "--grid", "NAME=V1,V2,..."),
        ("sweep", "--set", "KEY=VALUE"),
        ("analyze", "--metrics", "NAME,..."),
        ("analyze", "--fail-if", "'KEY OP NUMBER'"),
        ("bound-check", "--check", "NAME,..."),
        ("bound-check", "--sigma", "S,..."),
        ("weight-rescale", "--alpha", "A,..."),
        ("train", "--track", "NAME,..."),
        ("eigen", "--operator", "NAME"),
        ("eigen", "--params", "SCOPE"),
    ],
)
def test_list_and_open_options_show_their_form_and_an_example(name, option, metavar):
    (param,) = [p for p in _params(_group().commands[name]) if option in p.opts]
    assert param.metavar == metavar
    assert "e.g." in param.help or name == "eigen" and option == "--operator"


# ----------------------------------------------------------------------------- the value sets
def _literal(alias) -> set[str]:
    return set(typing.get_args(alias))


# (command, option, the catalogue's values): each closed set of an option is spelled once, in
# sharpcli.catalogue; the CLI's Literal types and the library modules read it from there
CLOSED_SETS = [
    ("eigen", "--split", catalogue.SPLITS),
    ("eigen", "--dtype", catalogue.DTYPES),
    ("eigen", "--which", catalogue.WHICH),
    ("eigen", "--method", catalogue.METHODS),
    ("eigen", "--engine", catalogue.ENGINES),
    ("eigen", "--arch", catalogue.MODEL_NAMES),
    ("eigen", "--token-reduction", catalogue.TOKEN_REDUCTIONS),
    ("gn-nme", "--ggn-estimator", catalogue.GGN_ESTIMATORS),
    ("train", "--model", catalogue.MODEL_NAMES),
    ("sweep", "--schedule", catalogue.SCHEDULES),
    ("train", "--track-on", catalogue.TRACK_ON),
    ("weight-rescale", "--mode", catalogue.RESCALE_MODES),
    ("bound-check", "--epsilon", catalogue.EPSILON_KINDS),
    ("compare", "--format", catalogue.TABLE_FORMATS),
]
# (command, option, the catalogue's values) of comma lists and open sets checked by the library
LIST_SETS = [
    ("analyze", "--metrics", catalogue.METRICS),
    ("sweep", "--metrics", catalogue.METRICS),
    ("train", "--track", catalogue.TRACKABLE),
    ("train", "--optimizer", catalogue.OPTIMIZERS),  # NAME[:k=v,...]: an open spec
    ("bound-check", "--check", catalogue.CHECKS),
    ("eigen", "--device", catalogue.DEVICES),
]


def _completion(capsys, monkeypatch, words: str) -> list[str]:
    """What bash receives from ``_SHARP_COMPLETE=complete_bash`` for ``words``."""
    monkeypatch.setenv("_SHARP_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", words)
    monkeypatch.setenv("COMP_CWORD", str(len(words.split(" ")) - 1))
    run = run_cli(capsys)
    assert run.code == 0, run.err
    return run.out.split()


@pytest.mark.parametrize(("name", "option", "values"), CLOSED_SETS + LIST_SETS)
def test_options_offer_exactly_the_catalogue_s_values(capsys, monkeypatch, name, option, values):
    """Completion offers the catalogue's values in its order, nothing else; a closed set's
    choices (which --help lists) are the catalogue's."""
    (param,) = [p for p in _params(_group().commands[name]) if option in p.opts]
    if (name, option, values) in CLOSED_SETS:
        assert _choices(param) == values
    assert _completion(capsys, monkeypatch, f"sharp {name} x {option} ") == list(values)


@pytest.mark.parametrize(("name", "option", "values"), CLOSED_SETS + LIST_SETS)
def test_a_value_outside_the_catalogue_s_set_is_refused(capsys, name, option, values):
    """One line, exit 2, naming the option; before any file is read."""
    assert "sideways" not in values
    before = () if name in ("train", "sweep") else ("never-read.safetensors",)
    run = run_cli(capsys, name, *before, option, "sideways", *_REQUIRED.get(name, ()))
    assert_one_line_error(run, 2, option, "sideways")


_REQUIRED = {"sweep": ("--reg", "wd", "--grid", "sigma=0.1")}


def test_the_library_reads_the_catalogue_s_sets():
    """The library modules that accept these values hold the catalogue's tuples, not copies."""
    from sharpcli.analyses import analyze, bounds, rescale, spectrum, tracking
    from sharpcli.curvature.eigen.lanczos import WHICH
    from sharpcli.io.data.dataset import SPLITS
    from sharpcli.losses import TOKEN_REDUCTIONS
    from sharpcli.models.zoo import MODEL_NAMES
    from sharpcli.preflight import DTYPES
    from sharpcli.report import compare
    from sharpcli.training import config

    assert SPLITS is catalogue.SPLITS
    assert tuple(DTYPES) == catalogue.DTYPES
    assert WHICH is catalogue.WHICH
    assert spectrum.METHODS is catalogue.METHODS
    assert spectrum.ENGINES is catalogue.ENGINES
    assert spectrum.GGN_ESTIMATORS is catalogue.GGN_ESTIMATORS
    assert TOKEN_REDUCTIONS is catalogue.TOKEN_REDUCTIONS
    assert MODEL_NAMES is catalogue.MODEL_NAMES
    assert config.OPTIMIZERS is catalogue.OPTIMIZERS
    assert config.SCHEDULES is catalogue.SCHEDULES
    assert rescale.MODES is catalogue.RESCALE_MODES
    assert bounds.EPSILON_KINDS is catalogue.EPSILON_KINDS
    assert bounds.CHECKS is catalogue.CHECKS
    assert compare.FORMATS is catalogue.TABLE_FORMATS
    assert analyze.METRICS is catalogue.METRICS
    assert tracking.TRACKABLE is catalogue.TRACKABLE


def test_named_sets_are_the_catalogue_s_registries():
    """--reg, --operator, --activation and --estimator offer the catalogue's names (no copy):
    an extension registered in this process is completed, and listed in --help, at once."""
    from sharpcli.registry import Entry

    assert choices.completer(catalogue.ESTIMATORS)("hutch") == ["hutchpp", "hutchinson"]
    assert choices.metavar(catalogue.REGULARIZERS, params=True) == "NAME[:k=v,...]"
    assert choices.metavar(catalogue.ACTIVATIONS, params=True) == "NAME[:beta=B]"
    assert choices.metavar(catalogue.OPERATORS) == "NAME"
    complete = choices.completer(catalogue.OPERATORS)
    assert complete("") == ["hessian", "ggn", "nme", "ef", "fisher"]
    info = {"symbol": "2G", "psd": True}
    catalogue.OPERATORS.register(
        "ggn-twice", lambda p: 2 * p.ggn(), entry=Entry("ggn-twice", "2 G", info=info)
    )
    try:
        assert complete("ggn") == ["ggn", "ggn-twice"]
    finally:
        catalogue.OPERATORS.unregister("ggn-twice")
    assert complete("ggn") == ["ggn"]


def test_a_value_outside_the_set_is_one_line_naming_the_option_and_the_values(capsys):
    run = run_cli(capsys, "eigen", "never-read.safetensors", "--which", "sideways")
    assert_one_line_error(run, 2, "--which", "'sideways' is not one of", "'largest'", "'both'")
    assert "Value error" not in run.err
    run = run_cli(capsys, "train", "--optimizer", "lion", "--json", "-")
    assert run.code == 2 and run.json()["error"]["source"] == "--optimizer"


# ----------------------------------------------------------------------------- completion
def test_list_completion_continues_a_comma_list():
    complete = choices.list_completer(catalogue.METRICS)
    assert complete("") == list(catalogue.METRICS)
    assert complete("eigen,tr") == ["eigen,trace"]
    assert complete("eigen,") == [f"eigen,{m}" for m in catalogue.METRICS if m != "eigen"]
    assert choices.completer(catalogue.OPERATORS)("g") == ["ggn"]


@pytest.mark.parametrize(
    ("words", "offered"),
    [
        ("sharp eigen m.safetensors --which ", ["largest", "smallest", "both"]),
        ("sharp eigen m.safetensors --operator n", ["nme"]),
        ("sharp analyze m.safetensors --metrics eigen,gn", ["eigen,gn-nme"]),
        ("sharp train --reg hess", ["hessian-trace"]),
        ("sharp compare r.json --format m", ["markdown"]),
        ("sharp eigen m.safetensors --eig-", ["--eig-tol", "--eig-max-matvecs"]),
        ("sharp gn-", ["gn-nme"]),
    ],
)
def test_shell_completion_offers_commands_options_and_values(capsys, monkeypatch, words, offered):
    """What bash receives from ``_SHARP_COMPLETE=complete_bash`` (the script that
    ``sharp --install-completion`` installs sets it)."""
    monkeypatch.setenv("_SHARP_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", words)
    monkeypatch.setenv("COMP_CWORD", str(len(words.split(" ")) - 1))
    run = run_cli(capsys)
    assert run.code == 0, run.err
    assert run.out.split() == offered


def test_show_completion_prints_the_script(capsys, monkeypatch):
    # typer finds the shell by walking the parent processes (shellingham), which fails where no
    # shell started the test (a CI runner, a background job): name the shell as a login would.
    import typer.completion

    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    run = run_cli(capsys, "--show-completion")
    assert run.code == 0, run.err
    assert "_SHARP_COMPLETE=complete_bash" in run.out and "complete " in run.out


# ----------------------------------------------------------------------------- one meaning per name
# command -> (what --tol and --max-matvecs meant there, their names by meaning)
RENAMED = {
    "eigen": ("--eig-tol", "--eig-max-matvecs"),
    "weight-rescale": ("--eig-tol", "--eig-max-matvecs"),
    "bound-check": ("--eig-tol", "--eig-max-matvecs"),
    "trace": ("--trace-tol", "--trace-max-matvecs"),
    "gn-nme": ("--trace-tol", "--trace-max-matvecs"),
    "analyze": ("--trace-tol", "--trace-max-matvecs"),
}


def test_tol_and_max_matvecs_are_named_by_meaning_with_the_old_names_as_aliases(
    capsys, monkeypatch
):
    for name, command in _commands().items():
        for param in _params(command):
            first = next((o for o in param.opts if o.startswith("--")), None)
            assert first not in ("--tol", "--max-matvecs"), (name, param.opts)
    for name, (tol, budget) in RENAMED.items():
        command = _group().commands[name]
        text = _help(capsys, monkeypatch, name)
        for new, old, value in ((tol, "--tol", "0.25"), (budget, "--max-matvecs", "7")):
            (param,) = [p for p in _params(command) if new in p.opts]
            assert param.opts == [new, old], (name, param.opts)
            # help lists the current name; the text names the former one (a narrow names column)
            assert new in text and old not in text.replace(f"{old}: former", "")
            assert f"{old}: former name" in param.help
            by_new = command.make_context(name, ["m.safetensors", new, value]).params
            by_old = command.make_context(name, ["m.safetensors", old, value]).params
            assert by_new[param.name] == by_old[param.name] == float(value)


@pytest.mark.parametrize(
    ("name", "args", "flag"),
    [
        ("eigen", ("--tol", "0"), "--eig-tol"),
        ("eigen", ("--max-matvecs", "0"), "--eig-max-matvecs"),
        ("trace", ("--tol", "0"), "--trace-tol"),
        ("trace", ("--max-matvecs", "1"), "--trace-max-matvecs"),
        ("gn-nme", ("--tol", "-1"), "--trace-tol"),
        ("analyze", ("--tol", "0"), "--trace-tol"),
        ("weight-rescale", ("--tol", "0"), "--eig-tol"),
        ("bound-check", ("--tol", "0"), "--eig-tol"),
    ],
)
def test_errors_name_the_option_by_its_new_name(capsys, name, args, flag):
    run = run_cli(capsys, name, "never-read.safetensors", *args)
    assert_one_line_error(run, 2, f"sharp {name}: error: {flag}")


def test_report_settings_keep_their_keys(capsys, tmp_path):
    from fixtures.make_checkpoint_fixtures import write_own_checkpoint

    ckpt = write_own_checkpoint(tmp_path / "own.safetensors")
    run = run_cli(
        capsys, "eigen", ckpt, "--eig-tol", "0.01", "--eig-max-matvecs", "9", "--json", "-"
    )
    assert run.code == 0, run.err
    settings = run.json()["settings"]
    assert (settings["tol"], settings["max_matvecs"]) == (0.01, 9)
    run = run_cli(
        capsys, "trace", ckpt, "--trace-tol", "0.5", "--trace-max-matvecs", "12", "--json", "-"
    )
    assert run.code == 0, run.err
    settings = run.json()["settings"]
    assert (settings["tol"], settings["max_matvecs"]) == (0.5, 12)


# ----------------------------------------------------------------------------- README
def _readme_table() -> tuple[list[list[str]], list[list[str]]]:
    """README's table of shared options: per column the commands, per row the cells."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("| option |")
    lines = []
    for line in text[start:].splitlines():
        if not line.startswith("|"):
            break
        lines.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, _, *rows = lines
    columns = [re.findall(r"`([a-z-]+)`", cell) for cell in header[1:]]
    return columns, rows


def test_readme_states_which_commands_take_the_shared_options():
    """Each row: ``yes`` means every command of the column has each option, ``no`` none has
    it, ``--other`` that each has ``--other`` instead; every command is in one column."""
    from sharpcli.cli.flags import _flags

    columns, rows = _readme_table()
    commands = _group().commands
    assert sorted(n for column in columns for n in column) == sorted(commands)
    flags = {name: set(_flags(command).values()) for name, command in commands.items()}
    for first, *cells in rows:
        options = re.findall(r"`(--[a-z-]+)`", first)
        assert options, first
        for column, cell in zip(columns, cells, strict=True):
            other = re.findall(r"`(--[a-z-]+)`", cell)
            for name in column:
                for option in options:
                    assert (option in flags[name]) == (cell == "yes"), (name, option, cell)
                assert cell in ("yes", "no") or other and set(other) <= flags[name], (name, cell)
    shared = {option for row in rows for option in re.findall(r"`(--[a-z-]+)`", row[0])}
    assert {"--split", "--samples", "--device", "--seed", "--data", "--json"} <= shared


def test_sweep_device_reaches_every_run(capsys, tmp_path):
    """``sweep --device`` is the runs' device (an unknown one is refused naming it), and the
    sweep report's environment names it."""
    common = ["sweep", "--reg", "wd", "--grid", "sigma=0.1", "--data", "blobs:n=64"]
    common += ["--width", "4", "--epochs", "1", "--analyze-samples", "8", "--metrics", "trace"]
    run = run_cli(capsys, *common, "--out-dir", tmp_path / "a", "--device", "nope")
    assert_one_line_error(run, 2, "sharp sweep: error: --device", "'nope'")
    run = run_cli(capsys, *common, "--out-dir", tmp_path / "b", "--device", "cpu", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    assert report["settings"]["train"]["device"] == report["environment"]["device"] == "cpu"


@pytest.mark.parametrize(
    "command, expected",
    [
        ("eigen", "raise --eig-tol or --eig-max-matvecs 5"),
        ("trace", "raise --trace-tol or --trace-max-matvecs 5"),
        ("analyze", "raise --trace-tol or --trace-max-matvecs 5"),
    ],
)
def test_notes_spell_library_parameters_as_the_running_commands_flags(command, expected):
    """A note such as Lanczos' "raise `tol`" reaches the user in the running command's spelling
    (the same parameter is --eig-tol in eigen and --trace-tol in trace)."""
    import typer.main

    from sharpcli.cli.app import app
    from sharpcli.cli.flags import spell_flags

    group = typer.main.get_command(app)
    context = type(group.make_context("sharp", [command, "--help"], resilient_parsing=True))
    with context(
        group.commands[command], parent=context(group, info_name="sharp"), info_name=command
    ):
        assert spell_flags("raise `tol` or `max_matvecs=5`") == expected


def test_help_at_80_columns_cuts_nothing(capsys, monkeypatch):
    """At 80 columns every option's current name is shown whole (second names live in the help
    text, lazyhelp.first_long_names_only, where each is named) and no word of a help text is cut
    with an ellipsis (no word wider than the help column)."""
    monkeypatch.setenv("COLUMNS", "80")
    for name, command in _commands().items():
        run = run_cli(capsys, *([name] if name else []), "--help")
        assert run.code == 0, run.err
        assert max(len(line) for line in run.out.splitlines()) <= 80, name
        names_column = [  # first cell of an option row, after the required marker "*"
            cells[0].rstrip(",")
            for line in run.out.splitlines()
            if (cells := [c for c in line[1:].split() if c != "*"]) and cells[0].startswith("--")
        ]
        for param in _params(command):
            first = next((o for o in param.opts if o.startswith("--")), None)
            if first is not None and not getattr(param, "hidden", False):
                assert first in names_column, (name, first)
        assert not any(n.endswith("…") for n in names_column), (name, names_column)
        assert "…" not in run.out, (name, [ln for ln in run.out.splitlines() if "…" in ln])
        for param in _params(command):
            for other in [o for o in param.opts if o.startswith("--")][1:]:
                assert other in (param.help or ""), (name, param.opts)  # named in the help text
