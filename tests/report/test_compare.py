"""sharp compare: reports of different commands line up; CSV numbers equal the reports' numbers."""

from __future__ import annotations

import csv
import json

import pytest
from cli_helpers import assert_one_line_error, run_cli, run_in_process

from sharpcli.report.envelope import validate_report


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare")
    paths = {}

    def sharp(*args):
        run = run_in_process(*args)
        assert run.code in (0, 1), run.err
        return run

    data = "blobs:n=160,dim=6,classes=3"
    for reg in ("none", "ad:sigma=0.5"):
        ck = folder / f"{reg.split(':')[0]}.safetensors"
        sharp(
            "train",
            "--epochs",
            "2",
            "--data",
            data,
            "--width",
            "8",
            "--reg",
            reg,
            "--out",
            ck,
            "--json",
            folder / f"train-{reg.split(':')[0]}.json",
            "--quiet",
        )
        sharp(
            "analyze",
            ck,
            "--metrics",
            "eigen,trace,gn-nme",
            "--split",
            "test",
            "--tol",
            "0.1",
            "--json",
            folder / f"analyze-{reg.split(':')[0]}.json",
            "--quiet",
        )
        paths[reg] = ck
    sharp("eigen", paths["none"], "--json", folder / "eigen-none.json", "--quiet")
    sharp(
        "gn-nme",
        paths["none"],
        "--samples",
        "48",
        "--tol",
        "0.2",
        "--json",
        folder / "gn-nme-none.json",
        "--quiet",
    )
    sharp(
        "trace",
        paths["none"],
        "--square",
        "--tol",
        "0.2",
        "--json",
        folder / "square-none.json",
        "--quiet",
    )
    return folder


def test_compare_csv_matches_reports(reports, capsys, tmp_path):
    files = sorted(reports.glob("*.json"))
    out = tmp_path / "table.csv"
    run = run_cli(
        capsys, "compare", *files, "--format", "csv", "--out", out, "--sort", "run", "--json", "-"
    )
    assert run.code == 0, run.err
    validate_report(run.json())
    rows = {r["run"]: r for r in csv.DictReader(open(out))}
    assert set(rows) == {f.stem for f in files}
    for f in files:
        report = json.loads(f.read_text())
        row = rows[f.stem]
        res = report["results"]
        if report["command"] == "train":
            assert float(row["test_accuracy"]) == pytest.approx(
                res["final"]["test_accuracy"], rel=1e-12
            )
            assert row["regularizers"] == " + ".join(report["settings"]["regs"])
        elif report["command"] == "analyze":
            assert float(row["lambda_max"]) == pytest.approx(
                res["hessian"]["lambda_max"], rel=1e-12
            )
            assert float(row["trace"]) == pytest.approx(res["hessian"]["trace"], rel=1e-12)
            assert float(row["nme_share"]) == pytest.approx(res["nme_share"], rel=1e-12)
            assert float(row["test_accuracy"]) == pytest.approx(res["accuracy"], rel=1e-12)
            assert row["regularizers"] == " + ".join(report["checkpoint"]["train"]["regs"])
        elif report["command"] == "gn-nme":
            assert float(row["lambda_max"]) == pytest.approx(
                res["hessian"]["lambda_max"], rel=1e-12
            )
            assert float(row["trace"]) == pytest.approx(
                res["hessian"]["trace"]["estimate"], rel=1e-12
            )
            assert float(row["frobenius_sq"]) == pytest.approx(
                res["hessian"]["frobenius_sq"], rel=1e-12
            )
            assert float(row["nme_share"]) == pytest.approx(res["nme_share"], rel=1e-12)
        elif report["command"] == "trace":  # --square: Tr(H^2)
            assert float(row["frobenius_sq"]) == pytest.approx(res["trace"]["estimate"], rel=1e-12)
            assert row["trace"] == ""
        else:  # eigen of the Hessian
            assert report["command"] == "eigen"
            assert float(row["lambda_max"]) == pytest.approx(res["eigenvalues"][0], rel=1e-12)


def test_compare_columns_sort_and_markdown(reports, capsys):
    files = sorted(reports.glob("analyze-*.json"))
    run = run_cli(
        capsys,
        "compare",
        *files,
        "--columns",
        "regularizers,lambda_max,results.hessian.trace_stderr",
        "--sort",
        "-lambda_max",
        "--format",
        "markdown",
    )
    assert run.code == 0, run.err
    lines = run.out.strip().splitlines()
    assert lines[0] == "| run | regularizers | lambda_max | results.hessian.trace_stderr |"
    values = [float(l.split("|")[3]) for l in lines[2:]]
    assert values == sorted(values, reverse=True) and len(values) == 2


def test_compare_training_settings_of_analyses_and_unknown_columns(reports, capsys):
    files = sorted(reports.glob("analyze-*.json")) + sorted(reports.glob("train-*.json"))
    run = run_cli(
        capsys,
        "compare",
        *files,
        "--columns",
        "checkpoint.train.lr,checkpoint.train.epochs,settings.lr",
        "--format",
        "json",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    rows = run.json()["results"]["rows"]
    assert [r["checkpoint.train.lr"] for r in rows] == [0.05] * 4
    assert [r["checkpoint.train.epochs"] for r in rows] == [2] * 4
    assert [r["settings.lr"] is None for r in rows] == [
        True,
        True,
        False,
        False,
    ]  # analyses have no lr setting
    assert_one_line_error(
        run_cli(capsys, "compare", *files, "--columns", "lamda_max"), 2, "--columns", "lamda_max"
    )


def test_compare_rejects_bad_reports(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert_one_line_error(run_cli(capsys, "compare", bad), 2, "bad.json")
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"schema": "sharpcli.report/9", "results": {}}))
    assert_one_line_error(run_cli(capsys, "compare", future), 2, "future.json", "not supported")


def test_rows_of_same_named_reports_in_different_folders_are_told_apart(reports, tmp_path, capsys):
    from sharpcli.report.compare import run_names

    for run in ("seed0", "seed1"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "report.json").write_text((reports / "eigen-none.json").read_text())
    out = run_cli(
        capsys,
        "compare",
        tmp_path / "seed0" / "report.json",
        tmp_path / "seed1" / "report.json",
        reports / "train-none.json",
        "--format",
        "json",
    )
    assert out.code == 0, out.err
    assert [row["run"] for row in json.loads(out.out)] == [
        "seed0/report",
        "seed1/report",
        "train-none",
    ]
    assert run_names(["x/a/r.json", "y/a/r.json", "r2.json"])[:2] == ["x/a/r", "y/a/r"]


def test_default_scatter_axes_fall_back_to_sharpness_for_runs_without_accuracy():
    from sharpcli.report.plots import scatter_axes

    analyses = [{"run": "a", "lambda_max": 2.0, "trace": 10.0}, {"run": "b", "lambda_max": 3.0}]
    assert scatter_axes(analyses, None, None) == ("lambda_max", "trace")
    trained = [{"run": "a", "lambda_max": 2.0, "test_accuracy": 0.9, "trace": 1.0}]
    assert scatter_axes(trained, None, None) == ("lambda_max", "test_accuracy")
    only_train_acc = [{"run": "a", "trace": 2.0, "train_accuracy": 0.8}]
    assert scatter_axes(only_train_acc, None, None) == ("trace", "train_accuracy")
    assert scatter_axes(analyses, "trace", "lambda_max") == ("trace", "lambda_max")


def test_compare_default_plot_works_on_reports_without_accuracy(reports, capsys, tmp_path):
    """Before: ``no run has both lambda_max and test_accuracy`` (exit 2) on analysis reports
    run on the training split; now the default scatter is another sharpness measure."""
    png = tmp_path / "scatter.png"
    files = [reports / "eigen-none.json", reports / "gn-nme-none.json"]
    run = run_cli(capsys, "compare", *files, "--plot", png, "--json", tmp_path / "c.json")
    assert run.code == 0, run.err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
