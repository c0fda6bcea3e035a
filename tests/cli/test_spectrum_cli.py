"""eigen / trace / gn-nme / analyze through the CLI: numbers against dense float64 Hessians,
JSON keys and schema, --fail-if gates, bad options."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli, run_process
from torch.func import functional_call, hessian

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.io.data.loading import load_dataset
from sharpcli.report.envelope import validate_report

DATA = "blobs:n=96,dim=5,classes=3,seed=4"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GELU MLP checkpoint on tiny blobs, and its dense float64 Hessian over the train split."""
    folder = tmp_path_factory.mktemp("spectrum")
    spec = tiny_mlp_spec(d_in=5, classes=3, width=6, depth=1, activation="gelu")
    path = write_own_checkpoint(folder / "tiny.safetensors", spec, data_spec=DATA, seed=5)
    model = load_checkpoint(path).model.double().eval()
    x, y = load_dataset(DATA).split("train")
    x = x.double()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}
    sizes = [p.numel() for p in params.values()]

    def loss(flat):
        chunks = torch.split(flat, sizes)
        ps = {n: c.reshape(params[n].shape) for n, c in zip(names, chunks)}
        return torch.nn.functional.cross_entropy(functional_call(model, ps, (x,)), y)

    flat = torch.cat([p.reshape(-1) for p in params.values()])
    H = hessian(loss)(flat)
    return path, torch.linalg.eigvalsh(H), H


def test_eigen_matches_dense_hessian(tiny, capsys):
    path, evals, _ = tiny
    run = run_cli(
        capsys,
        "eigen",
        path,
        "--top-k",
        "3",
        "--which",
        "both",
        "--dtype",
        "float64",
        "--tol",
        "1e-8",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    got = report["results"]["eigenvalues"]
    want = torch.cat([evals[-3:].flip(0), evals[:3].flip(0)]).tolist()
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert all(report["results"]["converged"])
    assert report["timing"]["matvecs"] > 0 and report["checkpoint"]["sha256"]


def test_timing_reports_startup_and_compute_apart(tiny):
    """``timing.startup_seconds`` runs from the process start to the computation (interpreter,
    CLI, torch and library imports), ``compute_seconds`` is the computation; ``seconds`` (the
    command after option parsing) holds the computation and the imports on its way."""
    path = tiny[0]
    run = run_process("eigen", path, "--top-k", "1", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    timing = report["timing"]
    assert 0 < timing["compute_seconds"] <= timing["seconds"]
    # start-up includes the imports that `seconds` counts before the computation (10 ms: the
    # resolution of the process start time), and torch's import alone takes longer than 0.1 s
    imports = timing["seconds"] - timing["compute_seconds"]
    assert timing["startup_seconds"] >= imports - 0.02
    assert timing["startup_seconds"] > 0.1


def test_trace_exact_ggn_and_hutchpp_within_stderr(tiny, capsys):
    path, _, H = tiny
    run = run_cli(capsys, "trace", path, "--dtype", "float64", "--tol", "0.02", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    t = report["results"]["trace"]
    exact = float(torch.trace(H))
    assert abs(t["estimate"] - exact) <= 4 * t["stderr"] + 1e-9
    layers = report["results"]["by_layer"]
    assert sum(v["estimate"] for v in layers.values()) == pytest.approx(t["estimate"], rel=1e-10)
    sq = run_cli(
        capsys, "trace", path, "--dtype", "float64", "--square", "--tol", "0.02", "--json", "-"
    ).json()
    exact_sq = float((H * H).sum())
    assert (
        abs(sq["results"]["trace"]["estimate"] - exact_sq)
        <= 4 * sq["results"]["trace"]["stderr"] + 1e-9
    )


def test_gn_nme_identity_and_schema(tiny, capsys):
    path, _, H = tiny
    run = run_cli(capsys, "gn-nme", path, "--dtype", "float64", "--tol", "0.05", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    r = report["results"]
    # same probes for H, G and N: the trace estimates satisfy tr(H) = tr(G) + tr(N) per probe
    assert r["hessian"]["trace"]["estimate"] == pytest.approx(
        r["ggn"]["trace"]["estimate"] + r["nme"]["trace"]["estimate"], rel=1e-6
    )
    assert r["ggn"]["lambda_min"] >= -1e-10  # G is PSD
    check = r["ggn_trace_check"]
    assert abs(check["hutchinson"] - check["exact"]) <= 4 * check["hutchinson_stderr"] + 1e-9
    assert abs(check["sampled_label"] - check["exact"]) <= 4 * check["sampled_label_stderr"] + 1e-9
    assert r["hessian"]["lambda_max"] == pytest.approx(
        float(torch.linalg.eigvalsh(H)[-1]), rel=1e-6
    )


def test_analyze_gate_trips_and_passes(tiny, capsys):
    path, evals, _ = tiny
    lam = float(evals[-1])
    tripped = run_cli(
        capsys,
        "analyze",
        path,
        "--dtype",
        "float64",
        "--fail-if",
        f"hessian.lambda_max > {lam / 2}",
        "--json",
        "-",
    )
    assert tripped.code == 1
    report = tripped.json()
    validate_report(report)
    assert report["results"]["hessian"]["lambda_max"] == pytest.approx(lam, rel=1e-6)
    assert report["results"]["gates"][0]["tripped"] is True
    passed = run_cli(
        capsys,
        "analyze",
        path,
        "--dtype",
        "float64",
        "--fail-if",
        f"hessian.lambda_max > {lam * 2}",
        "--fail-if",
        "accuracy < -1",
        "--quiet",
    )
    assert passed.code == 0, passed.err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["eigen", "--top-k", "0"], "--top-k"),
        (["eigen", "--top-k", "30", "--max-matvecs", "20"], "--top-k"),
        (["eigen", "--tol", "0"], "--eig-tol"),  # the former name; errors name the new one
        (["eigen", "--operator", "jacobian"], "--operator"),
        (["eigen", "--params", "nomatch*"], "--params"),
        (["trace", "--estimator", "magic"], "--estimator"),
        (["analyze", "--metrics", "vibes"], "--metrics"),
        (["analyze", "--fail-if", "hessian.lambda_max >> 3"], "--fail-if"),
        (["analyze", "--fail-if", "hessian.nothing > 3"], "--fail-if"),
        (["eigen", "--split", "validation"], "--split"),
        (["eigen", "--dtype", "float16"], "--dtype"),
    ],
)
def test_bad_options_exit_2(tiny, capsys, args, needle):
    path = tiny[0]
    run = run_cli(capsys, args[0], path, *args[1:])
    assert_one_line_error(run, 2, needle)


def test_missing_checkpoint_names_the_file(tmp_path, capsys):
    run = run_cli(capsys, "eigen", tmp_path / "absent.safetensors", "--json", "-")
    assert_one_line_error(run, 2, "absent.safetensors")
    assert run.json()["error"]["type"] == "input"


def test_density_integrates_to_one_and_plots(tiny, capsys, tmp_path):
    path, evals, _ = tiny
    plot = tmp_path / "density.png"
    run = run_cli(
        capsys,
        "density",
        path,
        "--dtype",
        "float64",
        "--steps",
        "40",
        "--probes",
        "2",
        "--plot",
        plot,
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    r = report["results"]
    grid, dens = torch.tensor(r["grid"]), torch.tensor(r["density"])
    assert float(torch.trapezoid(dens, grid)) == pytest.approx(1.0, abs=0.02)
    # the extreme Ritz values bracket the spectrum and reach its ends (Lanczos converges there first)
    assert r["lambda_max"] == pytest.approx(float(evals[-1]), rel=1e-6)
    assert r["lambda_min"] == pytest.approx(float(evals[0]), rel=1e-6, abs=1e-8)
    from png_helpers import png_size

    from sharpcli.report.plots import PIXELS

    assert png_size(plot) == PIXELS


def test_pyhessian_engine_agrees_with_native_within_its_tolerance(tiny, capsys):
    path, evals, _ = tiny
    largest_abs = float(evals.abs().max())
    run = run_cli(
        capsys, "eigen", path, "--engine", "pyhessian", "--dtype", "float64", "--json", "-"
    )
    assert run.code == 0, run.err
    r = run.json()["results"]
    assert r["engine"] == "pyhessian"
    # pyhessian stops on a 1e-3 relative change: its value is within a few times that of the truth
    assert abs(abs(r["eigenvalues"][0]) - largest_abs) <= 5e-3 * largest_abs
    native = run_cli(capsys, "eigen", path, "--dtype", "float64", "--json", "-").json()["results"]
    assert abs(abs(r["eigenvalues"][0]) - abs(native["eigenvalues"][0])) <= 5e-3 * largest_abs
    refused = run_cli(capsys, "eigen", path, "--engine", "pyhessian", "--which", "smallest")
    assert_one_line_error(refused, 2, "--engine")


def test_analyze_keeps_what_its_estimators_note(tiny, capsys):
    """analyze's report carries the notes of the eigen and trace runs it made (once each), and
    prints them under the table: the same notes a separate `eigen` run prints."""
    path, _, _ = tiny
    eigen = run_cli(capsys, "eigen", path, "--json", "-")
    assert eigen.code == 0, eigen.err
    expected = eigen.json()["results"]["notes"]
    assert expected  # float32 products: explicit residuals are noted
    run = run_cli(capsys, "analyze", path, "--metrics", "eigen,trace", "--json", "-")
    assert run.code == 0, run.err
    notes = run.json()["results"]["notes"]
    assert all(note in notes for note in expected) and len(notes) == len(set(notes))
    shown = run_cli(capsys, "analyze", path, "--metrics", "eigen")
    # how the residuals were computed is a detail: stderr, under --verbose only
    assert shown.code == 0 and "note:" not in shown.out + shown.err
    shown = run_cli(capsys, "analyze", path, "--metrics", "eigen", "--verbose")
    assert shown.code == 0 and "note:" not in shown.out
    assert "sharp: note: residuals are explicit" in shown.err


def test_an_added_estimator_is_reached_by_trace_estimator(tiny, capsys):
    """`--estimator NAME` dispatches through the catalogue's registry: an estimator declared and
    added in this process runs, and `--help` lists it, like a built-in."""
    from sharpcli.curvature.trace.estimators import ESTIMATORS
    from sharpcli.curvature.trace.probes import TraceResult
    from sharpcli.registry import declare

    @declare("estimator", "dense-diagonal", "sum of A e_i . e_i over every basis vector")
    def dense_diagonal(request):
        op = request.build()
        AE = op @ torch.eye(op.shape[0], dtype=op.dtype)
        value = float((AE * AE).sum() if request.square else torch.diagonal(AE).sum())
        return TraceResult(value, 0.0, op.shape[0], op.shape[0], "dense-diagonal")

    path, _, H = tiny
    ESTIMATORS.add(dense_diagonal)
    try:
        argv = ["trace", path, "--dtype", "float64", "--estimator", "dense-diagonal"]
        run = run_cli(capsys, *argv, "--json", "-")
        assert run.code == 0, run.err
        t = run.json()["results"]["trace"]
        assert t["estimator"] == "dense-diagonal"
        assert t["estimate"] == pytest.approx(float(torch.trace(H)), rel=1e-10)
        shown = run_cli(capsys, "trace", "--help").out
        assert "dense-diagonal" in " ".join(shown.split())
    finally:
        ESTIMATORS.unregister("dense-diagonal")


def test_trace_of_a_relu_nme_is_zero_within_its_stderr(tmp_path, capsys):
    """tr(N) = 0 exactly for a ReLU MLP (its second derivatives within one layer vanish): the
    sketch stops at N's range, the estimate is 0 within its standard error, no note claims
    the trace exact, and the layers sum to the total (the sketch used to grow past the rank,
    lose orthogonality and report e.g. -1.03 +- 0.015)."""
    spec = tiny_mlp_spec(d_in=5, classes=3, width=6, depth=1, activation="relu")
    path = write_own_checkpoint(tmp_path / "relu.safetensors", spec, data_spec=DATA, seed=5)
    run = run_cli(capsys, "trace", path, "--operator", "nme", "--dtype", "float64", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    t = report["results"]["trace"]
    assert 0 < t["stderr"] <= 1e-12 and abs(t["estimate"]) <= 4 * t["stderr"], t
    assert 0 < t["sketch_size"] < sum(p.numel() for p in load_checkpoint(path).model.parameters())
    notes = " ".join(t["notes"] + report.get("notes", []))
    assert "spans the operator's range" in notes and "exact" not in notes
    layers = report["results"]["by_layer"]
    assert sum(v["estimate"] for v in layers.values()) == pytest.approx(t["estimate"], abs=1e-15)
