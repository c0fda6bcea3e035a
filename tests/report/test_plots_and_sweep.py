"""Every plot is a valid PNG of the documented size; sharp sweep completes, resumes, tabulates and plots."""

from __future__ import annotations

import csv
import json

import pytest
from cli_helpers import run_cli
from png_helpers import png_size

from sharpcli.report.envelope import validate_report
from sharpcli.report.plots import PIXELS

DATA = "blobs:n=160,dim=6,classes=3"


def test_train_and_gn_nme_and_compare_plots(tmp_path, capsys):
    ck = tmp_path / "m.safetensors"
    run = run_cli(
        capsys,
        "train",
        "--epochs",
        "2",
        "--data",
        DATA,
        "--width",
        "8",
        "--track",
        "eigen",
        "--track-samples",
        "48",
        "--out",
        ck,
        "--plot",
        tmp_path / "train.png",
        "--json",
        tmp_path / "t.json",
        "--quiet",
    )
    assert run.code == 0, run.err
    assert png_size(tmp_path / "train.png") == PIXELS
    run = run_cli(
        capsys,
        "gn-nme",
        ck,
        "--samples",
        "48",
        "--tol",
        "0.2",
        "--plot",
        tmp_path / "gn.png",
        "--json",
        tmp_path / "g.json",
        "--quiet",
    )
    assert run.code == 0, run.err
    assert png_size(tmp_path / "gn.png") == PIXELS
    run = run_cli(
        capsys, "analyze", ck, "--split", "test", "--json", tmp_path / "a.json", "--quiet"
    )
    assert run.code == 0, run.err
    run = run_cli(
        capsys,
        "compare",
        tmp_path / "a.json",
        tmp_path / "t.json",
        "--plot",
        tmp_path / "cmp.png",
        "--quiet",
    )
    assert run.code == 0, run.err
    assert png_size(tmp_path / "cmp.png") == PIXELS


def test_png_size_rejects_non_png(tmp_path):
    bad = tmp_path / "x.png"
    bad.write_bytes(b"GIF89a....")
    with pytest.raises(ValueError):
        png_size(bad)
    from sharpcli.report.plots import plot_compare_scatter

    good = plot_compare_scatter(
        [{"run": "a", "lambda_max": 1.0, "test_accuracy": 0.5}], tmp_path / "good.png"
    )
    assert png_size(good) == PIXELS
    data = good.read_bytes()
    for broken in (
        data[:-20],
        data[:200] + bytes([data[200] ^ 1]) + data[201:],
    ):  # truncated; one bit flipped
        bad.write_bytes(broken)
        with pytest.raises(ValueError):
            png_size(bad)


def test_sweep_three_values_two_seeds_resumes_after_interruption(tmp_path, capsys):
    args = [
        "sweep",
        "--reg",
        "ad",
        "--grid",
        "sigma=0.01,0.1,0.5",
        "--seeds",
        "0,1",
        "--data",
        DATA,
        "--epochs",
        "2",
        "--width",
        "8",
        "--analyze-samples",
        "40",
        "--out-dir",
        tmp_path / "sw",
    ]
    first = run_cli(capsys, *args, "--max-runs", "2", "--json", "-")
    assert first.code == 0, first.err
    assert (
        first.json()["results"]["completed"] is False and len(first.json()["results"]["runs"]) == 2
    )
    second = run_cli(capsys, *args, "--json", "-")
    assert second.code == 0, second.err
    res = second.json()["results"]
    assert res["completed"] is True and len(res["runs"]) == 6 and len(res["skipped"]) == 2
    assert (
        res["runs"][:2] == first.json()["results"]["runs"]
    )  # resumed runs are read back, not redone
    rows = list(csv.DictReader(open(res["tables"]["runs_csv"])))
    assert len(rows) == 6
    for row, run in zip(rows, res["runs"]):
        report = json.loads((tmp_path / "sw" / f"{run['run']}.analyze.json").read_text())
        assert float(row["lambda_max"]) == pytest.approx(
            report["results"]["hessian"]["lambda_max"], rel=1e-12
        )
    summary = list(csv.DictReader(open(res["tables"]["summary_csv"])))
    assert [float(r["sigma"]) for r in summary] == [0.01, 0.1, 0.5]
    assert all(int(r["seeds"]) == 2 for r in summary)
    assert png_size(res["plot"]) == PIXELS
    # the checkpoint of each run records its swept value
    from sharpcli.io.checkpoints import load_checkpoint

    ck = load_checkpoint(tmp_path / "sw" / f"{res['runs'][-1]['run']}.safetensors")
    assert ck.train_config["regs"] == ["ad:sigma=0.5"] and ck.train_config["seed"] == 1


def test_sweep_records_a_diverging_value_and_goes_on(tmp_path, capsys):
    args = [
        "sweep",
        "--reg",
        "wd",
        "--grid",
        "sigma=0.01,100",
        "--data",
        DATA,
        "--epochs",
        "2",
        "--width",
        "8",
        "--analyze-samples",
        "40",
        "--out-dir",
        tmp_path / "sw",
        "--json",
        "-",
    ]
    run = run_cli(capsys, *args)
    assert run.code == 0, run.err
    res = run.json()["results"]
    small, large = (row["run"] for row in res["runs"])
    assert small.startswith("wd-sigma=0.01-seed0-") and large.startswith("wd-sigma=100.0-seed0-")
    assert res["completed"] is True and res["diverged"] == [large]
    record = json.loads((tmp_path / "sw" / f"{large}.diverged.json").read_text())
    validate_report(record)  # the error document of a failed train run
    assert record["sweep"]["regs"] == ["wd:sigma=100.0"] and record["error"]["exit_code"] == 3
    assert "nan" in record["error"]["message"] or "finite" in record["error"]["message"]
    rows = {r["run"]: r for r in csv.DictReader(open(res["tables"]["runs_csv"]))}
    assert rows[large]["lambda_max"] == "" and float(rows[small]["lambda_max"]) > 0
    assert [int(r["seeds"]) for r in res["summary"]] == [1, 0]
    assert png_size(res["plot"]) == PIXELS
    again = run_cli(capsys, *args).json()["results"]  # resumed: the diverged run is not retrained
    assert again["skipped"] == [small, large] and again["diverged"] == res["diverged"]
