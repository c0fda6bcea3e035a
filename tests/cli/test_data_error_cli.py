"""The data's standard error through the CLI: JSON keys of trace and eigen, the advisor, the
``at K se`` gate of analyze and compare's difference against its noise."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.report.envelope import validate_report

DATA = "blobs:n=96,dim=5,classes=3,seed=4"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data_error")
    spec = tiny_mlp_spec(d_in=5, classes=3, width=6, depth=1, activation="gelu")
    return write_own_checkpoint(folder / "tiny.safetensors", spec, data_spec=DATA, seed=5)


def _json(capsys, *args):
    run = run_cli(capsys, *args, "--dtype", "float64", "--batch-size", "8", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    return report


def test_trace_reports_its_data_error(tiny, capsys):
    t = _json(capsys, "trace", str(tiny))["results"]["trace"]
    assert t["data_method"] == "batch means over 9 batches" and t["data_batches"] == 9
    assert t["data_samples"] == 72 and t["data_stderr"] > 0
    assert t["combined_stderr"] == pytest.approx((t["stderr"] ** 2 + t["data_stderr"] ** 2) ** 0.5)
    advice = t["data_advice"]
    assert advice["relative_data_stderr"] == pytest.approx(abs(t["data_stderr"] / t["estimate"]))
    assert advice["data_tol"] == t["tol"]
    expected = 72 * (advice["relative_data_stderr"] / t["tol"]) ** 2
    assert advice["samples_needed"] == pytest.approx(expected, abs=1)
    assert (advice["note"] is not None) == (advice["relative_data_stderr"] > 0.1)


def test_one_batch_has_no_data_error(tiny, capsys):
    run = run_cli(capsys, "trace", str(tiny), "--json", "-")  # 72 samples, batches of 256
    t = run.json()["results"]["trace"]
    assert t["data_stderr"] is None and t["data_batches"] == 1 and t["data_advice"] is None


def test_eigen_reports_data_errors_beside_the_eigenvalues(tiny, capsys):
    r = _json(capsys, "eigen", str(tiny), "--top-k", "2")["results"]
    assert len(r["data_stderr"]) == 2 and all(e > 0 for e in r["data_stderr"])
    assert r["data_method"].startswith("batch means of u^T A_b u over 9 batches")
    assert r["data_matvecs"] == 2
    assert len(r["combined_stderr"]) == 2 and r["data_advice"]["data_tol"] == 0.05


def test_no_data_error_saves_its_products_and_leaves_the_eigenvalues(tiny, capsys):
    """``--no-data-error``: no data error, its product per eigenvalue (float64) not taken, the
    eigenvalues and the solver's products as with it."""
    with_error = _json(capsys, "eigen", str(tiny), "--top-k", "2")
    without = _json(capsys, "eigen", str(tiny), "--top-k", "2", "--no-data-error")
    r, q = with_error["results"], without["results"]
    assert q["eigenvalues"] == pytest.approx(r["eigenvalues"], rel=1e-12)
    assert q["matvecs"] == r["matvecs"] and not q.get("data_stderr")
    assert not q.get("data_matvecs")
    assert without["timing"]["matvecs"] == with_error["timing"]["matvecs"] - 2


def test_analyze_gate_at_k_se_and_compare_knows_the_noise(tiny, capsys, tmp_path):
    report = _json(capsys, "analyze", str(tiny))
    h = report["results"]["hessian"]
    se = (h["eigen_residuals"][0] ** 2 + h["eigen_data_stderr"][0] ** 2) ** 0.5
    lam = h["lambda_max"]
    common = ("--dtype", "float64", "--batch-size", "8", "--quiet")
    # lambda_max exceeds lam - se by se: trips at 0.5 se, not at 2 se
    gate = f"hessian.lambda_max > {lam - se}"
    assert (
        run_cli(capsys, "analyze", str(tiny), *common, "--fail-if", gate + " at 0.5 se").code == 1
    )
    assert run_cli(capsys, "analyze", str(tiny), *common, "--fail-if", gate + " at 2 se").code == 0
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report))
    b.write_text(json.dumps(report))
    compared = run_cli(capsys, "compare", str(a), str(b), "--json", "-")
    assert compared.code == 0, compared.err
    rows = compared.json()["results"]["differences"]
    assert {r["quantity"] for r in rows} == {"lambda_max", "trace"}
    assert all(r["verdict"] == "within noise" and r["difference"] == 0 for r in rows)
