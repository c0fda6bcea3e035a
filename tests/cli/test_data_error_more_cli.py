"""The data's error of Tr(A^2), the G/N split, the density's trace and the blocks through the
CLI: their JSON keys (declared in the schema, whose types a wrong value breaks), the table
rows, and the products they add to the report's count."""

from __future__ import annotations

import pytest
from cli_helpers import run_cli

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.report.envelope import validate_report

DATA = "blobs:n=96,dim=5,classes=3,seed=4"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data_error_more")
    spec = tiny_mlp_spec(d_in=5, classes=3, width=6, depth=1, activation="gelu")
    return write_own_checkpoint(folder / "tiny.safetensors", spec, data_spec=DATA, seed=5)


def _report(capsys, *args):
    run = run_cli(capsys, *args, "--dtype", "float64", "--batch-size", "8", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    return report


def _refused(report, set_value) -> None:
    """A string where the schema declares a number is refused."""
    set_value(report, "large")
    with pytest.raises(Exception, match="large"):
        validate_report(report)


def test_square_trace_and_its_blocks_report_a_first_order_data_error(tiny, capsys):
    report = _report(
        capsys, "trace", str(tiny), "--square", "--trace-max-matvecs", "40", "--blocks", "modules"
    )
    r = report["results"]
    t = r["trace"]
    assert t["data_method"] == "batch means of 2 (A v)^T A_b v over 9 batches (first order)"
    assert t["data_stderr"] > 0 and t["data_matvecs"] == 8
    assert all(b["data_stderr"] > 0 and b["data_matvecs"] == 8 for b in r["blocks"])
    assert r["blocks_sum"]["data_stderr"] > 0
    blocks_products = sum(b["matvecs"] + b["data_matvecs"] for b in r["blocks"])
    assert report["timing"]["matvecs"] == t["matvecs"] + t["data_matvecs"] + blocks_products
    _refused(report, lambda rep, v: rep["results"]["trace"].__setitem__("data_stderr", v))
    _refused(report, lambda rep, v: rep["results"]["blocks_sum"].__setitem__("data_stderr", v))
    table = run_cli(
        capsys,
        "trace",
        str(tiny),
        "--square",
        "--trace-max-matvecs",
        "40",
        "--batch-size",
        "8",
        "--blocks",
        "modules",
    )
    assert "data matvecs" in table.out and "data stderr" in table.out


def test_gn_nme_reports_the_traces_and_squares_data_errors(tiny, capsys):
    report = _report(capsys, "gn-nme", str(tiny), "--trace-max-matvecs", "40")
    r = report["results"]
    for name in ("hessian", "ggn", "nme"):
        assert r[name]["trace"]["data_stderr"] > 0
        assert r[name]["frobenius_sq_data_stderr"] > 0
    assert r["data_matvecs"] == 8 and report["timing"]["matvecs"] == r["matvecs"] + 8
    _refused(
        report, lambda rep, v: rep["results"]["nme"].__setitem__("frobenius_sq_data_stderr", v)
    )
    table = run_cli(capsys, "gn-nme", str(tiny), "--trace-max-matvecs", "40", "--batch-size", "8")
    assert "± data" in table.out and "Tr(A^2) ± data" in table.out


def test_density_reports_its_trace_data_error(tiny, capsys):
    report = _report(capsys, "density", str(tiny), "--probes", "2", "--steps", "6")
    r = report["results"]
    assert r["trace_data_stderr"] > 0 and r["trace_data_method"] == "batch means over 9 batches"
    _refused(report, lambda rep, v: rep["results"].__setitem__("trace_data_stderr", v))


def test_eigen_blocks_report_their_data_errors(tiny, capsys):
    report = _report(capsys, "eigen", str(tiny), "--blocks", "modules")
    rows = report["results"]["blocks"]
    assert all(len(b["data_stderr"]) == 1 and b["data_matvecs"] == 1 for b in rows)
    assert all(b["data_method"].startswith("batch means of u^T A_b u") for b in rows)
    _refused(report, lambda rep, v: rep["results"].__setitem__("data_stderr", [v]))
