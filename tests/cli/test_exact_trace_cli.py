"""``sharp trace --estimator exact`` for every operator and ``sharp diagonal``'s exact routes,
through the CLI on a checkpoint and its data: the numbers against dense float64 matrices
(double backward, per-sample gradients), tr = the sum of the operator's own diagonal, and the
size refusal of the unit-vector route (exit 2, one line naming the stochastic estimators)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import assert_one_line_error, run_cli
from hessian_helpers import double_backward_hessian, jacobian_ggn
from safetensors.torch import load_file

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.io.data.loading import load_dataset
from sharpcli.report.envelope import validate_report

DATA = "blobs:n=40,dim=4,classes=3,seed=4"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A GELU MLP checkpoint (43 parameters), its dense H, G, N and empirical Fisher over the
    train split, its parameter names and the split's size."""
    folder = tmp_path_factory.mktemp("exact")
    spec = tiny_mlp_spec(d_in=4, classes=3, width=5, depth=1, activation="gelu")
    path = write_own_checkpoint(folder / "tiny.safetensors", spec, data_spec=DATA, seed=5)
    model = load_checkpoint(path).model.double().eval()
    x, y = load_dataset(DATA).split("train")
    x = x.double()
    params = list(model.parameters())
    H = double_backward_hessian(model, params, x, y)
    G = jacobian_ggn(model, params, x, y, F.cross_entropy)
    rows = []
    for i in range(x.shape[0]):
        l_i = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(l_i, params)]))
    g = torch.stack(rows)
    dense = {"hessian": H, "ggn": G, "nme": H - G, "ef": g.T @ g / x.shape[0]}
    names = [n for n, _ in model.named_parameters()]
    return path, dense, names, x.shape[0]


def _trace(capsys, path, operator: str, *extra: str) -> dict:
    run = run_cli(
        capsys, "trace", path, "--operator", operator, "--estimator", "exact",
        "--dtype", "float64", "--json", "-", *extra,
    )  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    return report["results"]


def _diagonal(capsys, path, out, operator: str, estimator: str) -> torch.Tensor:
    run = run_cli(
        capsys, "diagonal", path, "--operator", operator, "--estimator", estimator,
        "--dtype", "float64", "--out", out,
    )  # fmt: skip
    assert run.code == 0, run.err
    return load_file(out)


@pytest.mark.parametrize("operator", ["hessian", "ggn", "nme", "ef"])
def test_exact_trace_of_each_operator_is_the_dense_trace(tiny, capsys, operator):
    path, dense, *_ = tiny
    results = _trace(capsys, path, operator)
    t = results["trace"]
    assert (t["estimator"], t["stderr"], t["converged"]) == ("exact", 0.0, True)
    assert t["estimate"] == pytest.approx(float(dense[operator].trace()), abs=1e-10)
    layers = results["by_layer"]
    assert sum(v["estimate"] for v in layers.values()) == pytest.approx(t["estimate"], abs=1e-12)


def test_exact_traces_split_as_h_equals_g_plus_n(tiny, capsys):
    path = tiny[0]
    h, g, n = (_trace(capsys, path, op)["trace"]["estimate"] for op in ("hessian", "ggn", "nme"))
    assert h == pytest.approx(g + n, abs=1e-12)


def test_exact_fisher_trace_is_the_sum_of_the_operators_diagonal(tiny, tmp_path, capsys):
    """The sampled-label Fisher: its exact trace (per-sample norms at its label draws) is the
    sum of the diagonal that its products give (one product per unit vector), and its
    per-sample diagonal is that diagonal; with one draw per sample it is not G's."""
    path, dense, names, n = tiny
    t = _trace(capsys, path, "fisher")["trace"]
    by_products = _diagonal(capsys, path, tmp_path / "e.safetensors", "fisher", "exact")
    per_sample = _diagonal(capsys, path, tmp_path / "p.safetensors", "fisher", "per-sample")
    flat = torch.cat([by_products[n].reshape(-1) for n in names])
    assert t["estimate"] == pytest.approx(float(flat.sum()), abs=1e-10)
    assert all(torch.allclose(per_sample[n], by_products[n], atol=1e-12, rtol=0) for n in names)
    assert abs(t["estimate"] - float(dense["ggn"].trace())) > 1e-6
    assert t["matvecs"] == 0 and t["samples"] == n


def test_exact_square_is_the_squared_frobenius_norm(tiny, capsys):
    path, dense, *_ = tiny
    t = _trace(capsys, path, "ggn", "--square")["trace"]
    assert t["quantity"] == "trace_of_square" and t["matvecs"] == dense["ggn"].shape[0]
    assert t["estimate"] == pytest.approx(float(dense["ggn"].square().sum()), rel=1e-12)


def test_exact_route_of_p_products_is_refused_past_its_limit(tmp_path, capsys):
    """16,003 parameters: the Hessian's and the NME's exact traces (one product per parameter)
    are refused in one line naming the stochastic estimators; the Gauss-Newton and empirical
    Fisher traces (per-sample norms) are not limited."""
    spec = tiny_mlp_spec(d_in=4, classes=3, width=2000, depth=1, activation="gelu")
    path = write_own_checkpoint(tmp_path / "wide.safetensors", spec, data_spec=DATA, seed=5)
    for operator in ("hessian", "nme"):
        run = run_cli(capsys, "trace", path, "--operator", operator, "--estimator", "exact")
        assert_one_line_error(
            run, 2, "16,003 parameters", "10,000", "--estimator hutchpp", "--estimator hutchinson"
        )
    run = run_cli(capsys, "trace", path, "--operator", "ggn", "--estimator", "exact", "--square")
    assert_one_line_error(run, 2, "Tr(ggn^2)", "--estimator hutchpp")
    for operator in ("ggn", "ef"):
        run = run_cli(capsys, "trace", path, "--operator", operator, "--estimator", "exact")
        assert run.code == 0, run.err


def test_exact_diagonal_refusal_names_the_per_sample_route_where_it_exists(tiny, tmp_path, capsys):
    path = tiny[0]
    out = tmp_path / "d.safetensors"
    for operator in ("ggn", "ef", "fisher"):
        run = run_cli(capsys, "diagonal", path, "--operator", operator, "--estimator", "exact",
                      "--max-products", "10", "--out", out)  # fmt: skip
        assert_one_line_error(run, 2, "--max-products", "--estimator per-sample")
    run = run_cli(capsys, "diagonal", path, "--estimator", "exact", "--max-products", "10",
                  "--out", out)  # fmt: skip
    assert_one_line_error(run, 2, "--estimator hutchinson")
    assert "per-sample" not in run.err and not out.exists()
