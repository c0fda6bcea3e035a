"""Every JSON file sharp writes validates against the shipped schema (sharpcli/report/schema.json).

Each registered command runs once on tiny data with ``--json PATH`` and its report is validated;
``sweep`` also leaves one train report, one analysis report per run and a divergence record in
its folder, and every one of them is validated too. ``compare`` must then accept the sweep's
analysis reports (before the fix they lacked ``results.gates`` and ``compare`` refused them).
A failed run of each command writes an error document, validated as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run_cli, run_in_process

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.report.envelope import validate_report

DATA = "blobs:n=64"


def _commands(ckpt: str, folder: Path, reports: list[str]) -> dict[str, list[str]]:
    """One quick, successful command line per command."""
    fast = ["--max-matvecs", "6"]
    return {
        "eigen": ["eigen", ckpt, "--top-k", "1", *fast],
        "trace": ["trace", ckpt, *fast],
        "gn-nme": ["gn-nme", ckpt, *fast],
        "density": ["density", ckpt, "--steps", "4", "--probes", "1"],
        "diagonal": ["diagonal", ckpt, "--probes", "4", "--out", str(folder / "diag.st")],
        "sharpness": ["sharpness", ckpt, "--rho", "0.05", "--steps", "3"],
        "landscape": ["landscape", ckpt, "--steps", "3"],
        "analyze": ["analyze", ckpt, "--metrics", "eigen", "--fail-if", "loss > 100"],
        "activation-stats": ["activation-stats", ckpt],
        "weight-rescale": ["weight-rescale", ckpt, "--alpha", "2"],
        "bound-check": ["bound-check", ckpt, "--sigma", "0.1", "--perturbations", "2"],
        "train": ["train", "--data", DATA, "--epochs", "1", "--out", str(folder / "t.st")],
        "sweep": [
            "sweep",
            "--reg",
            "wd",
            "--grid",
            "sigma=0.01,1e30",
            "--data",
            DATA,
            "--epochs",
            "2",
            "--width",
            "8",
            "--metrics",
            "eigen",
            "--analyze-samples",
            "32",
            "--out-dir",
            str(folder / "sweep"),
        ],
        "compare": ["compare", *reports],
    }


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every command's report, written with --json PATH: command -> (exit code, stderr, path)."""
    from sharpcli.cli.app import app

    folder = tmp_path_factory.mktemp("schema")
    ckpt = str(write_own_checkpoint(folder / "own.safetensors", tiny_mlp_spec(), data_spec=DATA))
    written: dict = {}
    order = [c.name for c in app.registered_commands]
    for name in sorted(order, key=lambda n: n == "compare"):  # compare reads the others
        others = [str(p) for _, _, p in written.values() if p.exists()]
        argv = _commands(ckpt, folder, others)[name]
        path = folder / f"{name}.json"
        run = run_in_process(*argv, "--json", str(path), "--quiet")
        written[name] = (run.code, run.err, path)
    return folder, written


def test_every_command_is_covered(reports):
    from sharpcli.cli.app import app

    _, written = reports
    assert set(written) == {c.name for c in app.registered_commands}


@pytest.mark.parametrize(
    "command",
    [
        "eigen",
        "trace",
        "gn-nme",
        "density",
        "diagonal",
        "analyze",
        "activation-stats",
        "weight-rescale",
        "sharpness",
        "landscape",
        "bound-check",
        "train",
        "sweep",
        "compare",
    ],
)
def test_each_commands_report_validates(reports, command):
    _, written = reports
    code, err, path = written[command]
    assert code == 0, err
    report = json.loads(path.read_text())
    validate_report(report)
    assert report["command"] == command


def test_every_json_file_of_a_sweep_validates_and_compare_reads_them(reports, capsys):
    folder, written = reports
    sweep = json.loads(written["sweep"][2].read_text())["results"]
    assert len(sweep["runs"]) == 2 and len(sweep["diverged"]) == 1
    files = sorted((folder / "sweep").glob("*.json"))
    kinds = {path.name.split(".")[-2] for path in files}
    assert kinds == {"train", "analyze", "diverged"}, files
    for path in files:
        validate_report(json.loads(path.read_text()))
    analysed = [str(p) for p in files if p.name.endswith(".analyze.json")]
    assert analysed
    run = run_cli(capsys, "compare", *analysed, "--json", "-")
    assert run.code == 0, run.err
    validate_report(run.json())
    assert len(run.json()["results"]["rows"]) == len(analysed)


@pytest.mark.parametrize(
    "argv",
    [
        ["eigen", "missing.safetensors"],
        ["analyze", "missing.safetensors"],
        ["train", "--epochs", "0"],
        ["sweep", "--reg", "wd", "--grid", "sigma"],
        ["compare", "missing.json"],
    ],
)
def test_error_documents_validate(tmp_path, capsys, argv):
    path = tmp_path / "error.json"
    run = run_cli(capsys, *argv, "--json", str(path))
    assert run.code == 2
    document = json.loads(path.read_text())
    validate_report(document)
    assert set(document) == {"schema", "command", "version", "error"}
