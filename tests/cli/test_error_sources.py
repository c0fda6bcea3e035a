"""The library speaks in parameters, the CLI in flags (docs/architecture.md, "Contracts between
layers").

A library caller's error names the library parameter (``err.source == "top_k"``) and refers to
parameters in messages as `name` or `name=value`; the CLI spells both as the running command's
flags (:mod:`sharpcli.cli.flags`), derived from the click commands: a library parameter has the
name of the CLI parameter that sets it, so no table maps names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from torch import nn

from sharpcli.errors import InputError, OutputPathError, SharpError, UsageError

ROOT = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double().eval()


def _identity_operator():
    from sharpcli.curvature.operators.hessian import MatrixOperator

    return MatrixOperator(torch.eye(4, dtype=torch.float64))


def _raise(call):
    with pytest.raises(SharpError) as info:
        call()
    return info.value


# ------------------------------------------------------------------ library callers get parameters


def test_power_iteration_names_its_parameters():
    from sharpcli.curvature import power_iteration

    op = _identity_operator()
    assert _raise(lambda: power_iteration(op, top_k=0)).source == "top_k"
    assert _raise(lambda: power_iteration(op, tol=0.0)).source == "tol"
    assert _raise(lambda: power_iteration(op, max_matvecs=0)).source == "max_matvecs"


def test_density_and_trace_name_their_parameters():
    from sharpcli.curvature import hutchpp, spectral_density

    op = _identity_operator()
    assert _raise(lambda: spectral_density(op, probes=0)).source == "probes"
    assert _raise(lambda: spectral_density(op, steps=0)).source == "steps"
    assert _raise(lambda: spectral_density(op, broadening=-1.0)).source == "broadening"
    assert _raise(lambda: hutchpp(op, max_matvecs=1)).source == "max_matvecs"


def _curvature_errors():
    from sharpcli.curvature import ParamScope, power_iteration, spectral_density
    from sharpcli.curvature.operators.registry import operator_spec

    return [
        lambda: power_iteration(_identity_operator(), top_k=0),
        lambda: spectral_density(_identity_operator(), probes=1, broadening=-1.0),
        lambda: ParamScope.resolve(_tiny_model(), "nothing.*"),
        lambda: ParamScope.resolve(nn.Linear(2, 2).requires_grad_(False)),
        lambda: operator_spec("no-such-operator"),
    ]


def _analyses_errors():
    from sharpcli.analyses.analyze import parse_metrics
    from sharpcli.analyses.bounds import BoundCheckConfig
    from sharpcli.analyses.rescale_plan import plan_rescale
    from sharpcli.analyses.spectrum import METHODS, check_choice
    from sharpcli.analyses.tracking import check_tracked

    example = torch.zeros(2, 4, dtype=torch.float64)
    return [
        lambda: parse_metrics("eigen,bogus"),
        lambda: check_tracked(["bogus"]),
        lambda: check_choice("bogus", METHODS, "method"),
        lambda: BoundCheckConfig(sigma=[]).validate(),
        lambda: BoundCheckConfig(epsilon="max").validate(),
        lambda: plan_rescale(_tiny_model(), example, mode="global", layer="0"),
        lambda: plan_rescale(_tiny_model(), example, mode="layer", layer="nope"),
    ]


def _io_errors():
    from sharpcli.io.checkpoints import factory_from_string
    from sharpcli.io.data.formats import data_format
    from sharpcli.io.data.loading import load_dataset, parse_data_spec, subset

    x, y = torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64)
    return [
        lambda: load_dataset("blobs:q=1"),
        lambda: load_dataset("blobs:n=x"),
        lambda: parse_data_spec("blobs", label_column="label"),
        lambda: subset(x, y, 10, seed=0),
        lambda: data_format("no-such-format"),
        lambda: factory_from_string("no_colon_here"),
        lambda: load_dataset("blobs:n=64").split("validation"),
    ]


def _models_errors():
    from sharpcli.models import build_model, default_model_args
    from sharpcli.models.activations import make_activation
    from sharpcli.models.outputs import select_output
    from sharpcli.models.zoo import final_linear

    return [
        lambda: build_model({"name": "no-such-model", "args": {}}),
        lambda: default_model_args("cnn", (16,), 2),
        lambda: default_model_args("mlp", (4,), 2, width=0),
        lambda: make_activation("no-such-activation"),
        lambda: select_output((torch.zeros(2, 3), torch.zeros(2, 4)), "5"),
        lambda: final_linear(nn.Sequential(nn.ReLU())),
    ]


def _training_errors():
    from sharpcli.regularizers.registry import parse_reg, validate_combination

    return [
        lambda: parse_reg("no-such-regularizer"),
        lambda: parse_reg("sam:rho=x"),
        lambda: validate_combination([parse_reg("wd"), parse_reg("wd")]),
    ]


def _session_and_report_errors():
    import pandas as pd

    from sharpcli.preflight import resolve_dtype
    from sharpcli.report.compare import render
    from sharpcli.report.gate import parse_gate
    from sharpcli.session import build_session

    return [
        lambda: resolve_dtype("float16"),
        lambda: build_session("never-read.safetensors", split="validation"),
        lambda: parse_gate("not a condition"),
        lambda: render(pd.DataFrame({"a": [1]}), "xml"),
    ]


LAYERS = {
    "curvature": _curvature_errors,
    "analyses": _analyses_errors,
    "io": _io_errors,
    "models": _models_errors,
    "training": _training_errors,
    "session-report": _session_and_report_errors,
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_library_errors_name_parameters_not_flags(layer):
    for index, call in enumerate(LAYERS[layer]()):
        err = _raise(call)
        where = (layer, index, err.source, err.message)
        assert isinstance(err, UsageError) and not err.source_is_path, where
        assert err.source.isidentifier(), where  # a parameter name, not "--flag"
        assert not FLAG.search(err.message), where


def test_an_unwritable_output_names_its_path():
    from sharpcli.atomic import check_writable

    err = _raise(lambda: check_writable(ROOT))
    assert isinstance(err, OutputPathError) and err.source_is_path and err.source == str(ROOT)


# ------------------------------------------------------------------ no flags below cli/, statically

# Files that other work is changing now; they still name flags and the CLI passes those through.
# Remove an entry when its file switches to parameter names.
NOT_YET_CONVERTED: set[str] = set()
# String constants below cli/ that rightly hold a flag, with the reason.
FLAGS_ALLOWED = {
    # the docs' table of --operator values, rendered for the command reference
    ("sharpcli/catalogue/curvature.py", "| `--operator` | symbol | what it is | PSD |"),
    # the index generator is a command of its own (python -m sharpcli.catalogue.generate):
    # its --check flag, and the generated file's docstring naming `sharp --help`
    ("sharpcli/catalogue/generate.py", "--check"),
    # reads --device from argv to pick the process-group backend before the app parses it
    ("sharpcli/distributed.py", "--device"),
    ("sharpcli/distributed.py", "--device="),
    # report notes (results.scope.notes in the JSON report), not errors
    (
        "sharpcli/curvature/products/scope.py",
        " values, requires_grad=False in the model) because --params ",
    ),
    ("sharpcli/curvature/products/scope.py", "; name them with --params to include them"),
}


def _docstring_ids(tree) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_no_flags_in_library_strings():
    """Below cli/, no string (docstrings aside) spells a flag: sources, messages and the option
    names handed to helpers are parameter names; cli/flags.py spells them once."""
    found = []
    from sharpcli.catalogue import generate

    allowed = FLAGS_ALLOWED | {("sharpcli/catalogue/generate.py", generate.HEADER)}
    for path in sorted((ROOT / "sharpcli").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("sharpcli/cli/") or relative in NOT_YET_CONVERTED:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = _docstring_ids(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and FLAG.search(node.value)
                and (relative, node.value) not in allowed
            ):
                found.append(f"{relative}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)


# ------------------------------------------------------------------ the CLI spells them as flags


@pytest.fixture(scope="module")
def commands():
    import typer.main

    from sharpcli.cli.app import app

    return typer.main.get_command(app).commands


def test_spelling_follows_the_running_command(commands):
    from sharpcli.cli.flags import FlagSpelling

    everything = list(commands.values())
    eigen = FlagSpelling(commands["eigen"], everything)
    assert eigen.flag("top_k") == "--top-k" and eigen.flag("max_matvecs") == "--eig-max-matvecs"
    assert eigen.flag("params") == "--params" and eigen.flag("arch_args") == "--arch-args"
    assert eigen.flag("model") == "--model"  # no --model here: the app's (train's) spelling
    assert eigen.flag("no_such_parameter") is None
    assert FlagSpelling(commands["bound-check"], everything).flag("sigma") == "--sigma"
    assert FlagSpelling(commands["density"], everything).flag("broadening") == "--broadening"
    assert FlagSpelling(commands["train"], everything).flag("model_args") == "--model-args"
    assert FlagSpelling(commands["compare"], everything).flag("fmt") == "--format"
    assert eigen.text("lower `top_k`, use `engine=native`, keep `unknown`") == (
        "lower --top-k, use --engine native, keep `unknown`"
    )


# The library's `tol` and `max_matvecs` bound an eigensolver in some commands and a trace
# estimate in others; each command spells them by that meaning (the running command's own
# spelling is looked up first).
BY_MEANING = {
    "tol": {"--eig-tol", "--trace-tol"},
    "max_matvecs": {"--eig-max-matvecs", "--trace-max-matvecs"},
}


def test_each_cli_parameter_has_one_flag_or_is_spelled_by_meaning(commands):
    """Each CLI parameter name has one flag across the commands (so the app-wide fallback is
    unambiguous), except the names spelled by meaning (BY_MEANING)."""
    from sharpcli.cli.flags import FlagSpelling, _flags

    spellings: dict[str, set[str]] = {}
    for command in commands.values():
        for name, flag in _flags(command).items():
            spellings.setdefault(name, set()).add(flag)
    assert {n: f for n, f in spellings.items() if len(f) > 1} == BY_MEANING
    everything = list(commands.values())
    for name, (tol, budget) in {
        "eigen": ("--eig-tol", "--eig-max-matvecs"),
        "weight-rescale": ("--eig-tol", "--eig-max-matvecs"),
        "bound-check": ("--eig-tol", "--eig-max-matvecs"),
        "trace": ("--trace-tol", "--trace-max-matvecs"),
        "gn-nme": ("--trace-tol", "--trace-max-matvecs"),
        "analyze": ("--trace-tol", "--trace-max-matvecs"),
    }.items():
        spelling = FlagSpelling(commands[name], everything)
        assert (spelling.flag("tol"), spelling.flag("max_matvecs")) == (tol, budget), name


def test_library_parameters_are_cli_parameters(commands):
    """One name per concept: every parameter a library error names (the layers' errors above,
    and the checks below) is the CLI parameter of the command that sets it, whose flag the
    error is then spelled with; no table maps a library name to another."""
    from sharpcli.analyses.bounds import BoundCheckConfig
    from sharpcli.analyses.noise_stability import noise_stability_check
    from sharpcli.analyses.rescale import check_alphas
    from sharpcli.cli.flags import FlagSpelling
    from sharpcli.curvature import lanczos, power_iteration, spectral_density
    from sharpcli.io.data.loading import load_dataset
    from sharpcli.models.outputs import select_output
    from sharpcli.report.gate import parse_gate

    op = _identity_operator()
    expected = [
        ("eigen", lambda: lanczos(op, top_k=0), "--top-k"),
        ("eigen", lambda: power_iteration(op, max_matvecs=0), "--eig-max-matvecs"),
        ("density", lambda: spectral_density(op, steps=0), "--steps"),
        ("density", lambda: spectral_density(op, broadening=-1.0), "--broadening"),
        ("bound-check", lambda: BoundCheckConfig(sigma=[]).validate(), "--sigma"),
        ("bound-check", lambda: BoundCheckConfig(check=("x",)).validate(), "--check"),
        ("bound-check", lambda: BoundCheckConfig(epsilon="max").validate(), "--epsilon"),
        ("bound-check", lambda: BoundCheckConfig(mc_samples=1).validate(), "--mc-samples"),
        ("bound-check", lambda: BoundCheckConfig(noise_pairs=1).validate(), "--noise-pairs"),
        ("bound-check", lambda: noise_stability_check(None, None, [], None), "--sigma"),
        (
            "bound-check",
            lambda: noise_stability_check(None, None, [0.1], None, noise_pairs=1),
            "--noise-pairs",
        ),
        ("weight-rescale", lambda: check_alphas([]), "--alpha"),
        ("analyze", lambda: parse_gate("not a condition"), "--fail-if"),
        ("eigen", lambda: select_output((torch.zeros(1), torch.zeros(1)), "5"), "--output"),
        ("eigen", lambda: load_dataset("blobs:n=x"), "--data"),
        ("train", lambda: load_dataset("blobs:n=x"), "--data"),
    ]
    everything = list(commands.values())
    for command, call, flag in expected:
        err = _raise(call)
        assert FlagSpelling(commands[command], everything).flag(err.source) == flag, (
            command,
            err.source,
        )
    for layer in LAYERS.values():
        for call in layer():
            source = _raise(call).source
            assert FlagSpelling(None, everything).flag(source) is not None, source


def test_paths_stay_paths(commands, monkeypatch):
    """An input file or an unwritable output called like a parameter is not read as one."""
    from sharpcli.cli import flags

    monkeypatch.setattr(flags, "_running_commands", lambda name, root: (commands["eigen"], []))
    assert flags.to_cli_error(InputError("no such file", source="model")).source == "model"
    assert flags.to_cli_error(OutputPathError("is a directory", source="params")).source == "params"
    err = flags.to_cli_error(UsageError("pass `params=GLOB`", source="params"))
    assert (err.source, err.message, str(err)) == ("--params", "pass --params GLOB", err.message)


def test_the_cli_reports_flags(capsys, tmp_path):
    from fixtures.make_checkpoint_fixtures import write_own_checkpoint

    checkpoint = write_own_checkpoint(tmp_path / "own.safetensors")
    run = run_cli(capsys, "eigen", checkpoint, "--method", "power", "--which", "both")
    assert run.err.strip() == (
        "sharp eigen: error: --which: power iteration finds the largest |eigenvalue|s only; "
        "use --method lanczos"
    )
    # the former name --max-matvecs sets it; the message names the option by its meaning
    run = run_cli(capsys, "eigen", checkpoint, "--top-k", "3", "--max-matvecs", "2", "--json", "-")
    error = run.json()["error"]
    assert error["source"] == "--top-k" and error["message"].startswith("--top-k 3 asks for 3")
    assert error["message"].endswith("lower --top-k or raise --eig-max-matvecs")
