"""``--hvp finite-difference`` of eigen, trace and density: equal to ``--hvp exact`` within the
error bound the report states (results.hvp), refusals as one-line errors (exit 2)."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from sharpcli.io.checkpoints import save_checkpoint
    from sharpcli.models import build_model, default_model_args

    spec = {
        "name": "mlp",
        "args": default_model_args("mlp", (8,), 3, width=8, depth=2, activation="gelu"),
    }
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("fd") / "model.safetensors"
    save_checkpoint(path, build_model(spec), spec, data_spec="blobs:n=60,dim=8,classes=3,seed=3")
    return str(path)


def _both(capsys, *argv: str) -> tuple[dict, dict]:
    """The results of ``argv`` with ``--hvp exact`` and with ``--hvp finite-difference``."""
    out = []
    for hvp in ("exact", "finite-difference"):
        run = run_cli(capsys, *argv, "--hvp", hvp, "--batch-size", "16", "--json", "-", "--quiet")
        assert run.code == 0, run.err
        out.append(run.json()["results"])
    return out[0], out[1]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_eigen_agrees_with_exact_within_the_stated_bound(capsys, checkpoint, dtype):
    exact, fd = _both(
        capsys, "eigen", checkpoint, "--top-k", "2", "--which", "both", "--dtype", dtype
    )
    assert "hvp" not in exact
    record = fd["hvp"]
    assert record["method"] == "finite-difference" and record["sharded"] is False
    beta = record["error_bound"]
    assert beta <= (1e-2 if dtype == "float32" else 1e-7) * max(map(abs, exact["eigenvalues"]))
    # a Ritz value is within its residual of an eigenvalue of its operator; the two
    # operators' eigenvalues are within beta (Weyl)
    for a, b, ra, rb in zip(
        exact["eigenvalues"], fd["eigenvalues"], exact["residuals"], fd["residuals"]
    ):
        assert abs(a - b) <= beta + ra + rb, (a, b, beta, ra, rb)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_trace_agrees_with_exact_within_the_stated_bound(capsys, checkpoint, dtype):
    settings = ("--estimator", "hutchinson", "--trace-tol", "1e-9", "--trace-max-matvecs", "12")
    exact, fd = _both(capsys, "trace", checkpoint, "--dtype", dtype, *settings)
    assert exact["trace"]["samples"] == fd["trace"]["samples"]  # the same Rademacher probes
    # each probe's v^T D v is within beta ||v||^2 = beta P of v^T H v
    numel = exact["scope"]["numel"]
    gap = abs(exact["trace"]["estimate"] - fd["trace"]["estimate"])
    assert gap <= fd["hvp"]["error_bound"] * numel, (gap, fd["hvp"])
    assert fd["hvp"]["gradients"] == 2 * 12 + fd["hvp"]["calibration_gradients"]


def test_density_agrees_with_exact_within_the_stated_bound(capsys, checkpoint):
    settings = ("--probes", "2", "--steps", "8", "--grid-points", "64", "--dtype", "float64")
    exact, fd = _both(capsys, "density", checkpoint, *settings)
    # SLQ's trace estimate is the mean of the probes' v^T A v (Rademacher: ||v||^2 = P)
    numel = exact["scope"]["numel"]
    gap = abs(exact["trace_estimate"] - fd["trace_estimate"])
    assert gap <= fd["hvp"]["error_bound"] * numel
    scale = max(abs(exact["lambda_max"]), abs(exact["lambda_min"]))
    for key in ("lambda_max", "lambda_min"):
        assert abs(exact[key] - fd[key]) <= 1e-6 * scale, key


@pytest.mark.parametrize(
    "argv, words",
    [
        (["eigen", "--operator", "ggn", "--hvp", "finite-difference"], "--hvp"),
        (["trace", "--operator", "nme", "--hvp", "finite-difference"], "--hvp"),
        (["trace", "--estimator", "gn-split", "--hvp", "finite-difference"], "gn-split"),
        (["eigen", "--engine", "pyhessian", "--hvp", "finite-difference"], "--engine pyhessian"),
        (["eigen", "--blocks", "layers", "--hvp", "finite-difference"], "--blocks"),
        (["density", "--hvp", "fsdp"], "torchrun"),
        (["eigen", "--hvp", "fsdp", "--operator", "nme"], "--hvp"),
        (["eigen", "--hvp", "central"], "--hvp"),
    ],
)
def test_refusals_are_one_line_errors(capsys, checkpoint, argv, words):
    run = run_cli(capsys, argv[0], checkpoint, *argv[1:])
    assert_one_line_error(run, 2, words)


def test_a_model_without_a_double_backward_is_measured(tmp_path, monkeypatch, capsys):
    """``@once_differentiable`` (as a fused kernel): refused for ``--hvp exact`` by the
    self-check, measured by ``--hvp finite-difference`` to within beta of the Hessian of its
    twin built from torch's own operations."""
    import numpy as np
    from test_second_derivative_check import ONCE_MODULE, _data, _module

    from sharpcli import Curvature

    (tmp_path / "oncemodel.py").write_text(ONCE_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.save(_module().state_dict(), tmp_path / "once.pt")
    x, y = _data(40)
    np.savez(tmp_path / "data.npz", x=x.numpy(), y=y.numpy())
    argv = ["eigen", "once.pt", "--model-factory", "oncemodel:make", "--data", "data.npz"]
    argv += ["--dtype", "float64", "--eig-tol", "1e-8"]
    assert_one_line_error(run_cli(capsys, *argv, "--quiet"), 2, "second derivatives wrongly")
    run = run_cli(capsys, *argv, "--hvp", "finite-difference", "--json", "-", "--quiet")
    assert run.code == 0, run.err
    results = run.json()["results"]
    twin = _module(custom=False).double()
    exact = Curvature(twin, "cross-entropy", (x.double(), y)).eigenvalues(top_k=1, tol=1e-10)
    gap = abs(results["eigenvalues"][0] - exact.eigenvalues[0])
    assert gap <= results["hvp"]["error_bound"] + results["residuals"][0] + exact.residuals[0]
