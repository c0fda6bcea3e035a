"""Top-k counts repeated eigenvalues: deflated restarts against dense float64 eigvalsh.

A single Linear layer with MSE has the Hessian I_C kron A (each eigenvalue C times); a GGN
with more parameters than samples x outputs has a null space; random operators with
clustered spectra; the note and the ``multiplicity`` record when the budget cannot resolve it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sharpcli
from sharpcli.curvature import MatrixOperator, lanczos, ritz_residuals

_F64 = torch.float64


def _dense_hessian(model, loss):
    """The dense Hessian of ``loss()`` over ``model``'s parameters by double backward."""
    params = list(model.parameters())
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss(), params, create_graph=True)])
    rows = [torch.autograd.grad(g[i], params, retain_graph=True) for i in range(g.numel())]
    return torch.stack([torch.cat([t.reshape(-1) for t in row]) for row in rows])


def _linear_mse(seed=0, n=80, d_in=40, outputs=3):
    torch.manual_seed(seed)
    model = nn.Linear(d_in, outputs).double()
    x = torch.randn(n, d_in, dtype=_F64)
    y = torch.randn(n, outputs, dtype=_F64)
    H = _dense_hessian(model, lambda: nn.functional.mse_loss(model(x), y))
    return model, x, y, H


def test_top3_of_identity_kron_a_is_three_copies_through_the_api():
    model, x, y, H = _linear_mse()
    exact = torch.linalg.eigvalsh(H).flip(0)
    assert exact[0] - exact[2] <= 1e-12 * exact[0] and exact[2] - exact[3] > 0.05 * exact[0]
    result = sharpcli.Curvature(model, nn.MSELoss(), (x, y)).eigenvalues(
        3, tol=1e-8, return_eigenvectors=True
    )
    assert result.eigenvalues == pytest.approx(exact[:3].tolist(), rel=1e-10)
    assert all(result.converged) and result.multiplicity["resolved"] is True
    assert result.multiplicity["copies_found"] == 2
    # three orthonormal eigenvectors, each with a true residual within tol
    U = result.eigenvectors
    assert torch.allclose(U.T @ U, torch.eye(3, dtype=_F64), atol=1e-8)
    explicit = ritz_residuals(MatrixOperator(H), result.eigenvalues, U)
    assert max(explicit) <= 1e-8 * float(exact[0])
    # the reported residual is honest (down to the products' rounding)
    assert all(r >= e / 2 or e <= 1e-13 * exact[0] for r, e in zip(result.residuals, explicit))


def test_ggn_null_space_smallest_eigenvalues_with_multiplicity():
    """CE on 8 samples with 3 classes: rank G <= 8 * 2 = 16 < 163 parameters."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 20), nn.Tanh(), nn.Linear(20, 3)).double()
    x = torch.randn(8, 4, dtype=_F64)
    y = torch.randint(0, 3, (8,))
    curvature = sharpcli.Curvature(model, nn.CrossEntropyLoss(), (x, y))
    G = _dense_ce_ggn(model, x)
    exact = torch.linalg.eigvalsh(G)
    assert int((exact.abs() <= 1e-10 * exact.max()).sum()) >= 163 - 16
    scale = float(exact.max())
    both = curvature.eigenvalues(3, "both", "ggn", tol=1e-8)
    assert both.eigenvalues[:3] == pytest.approx(exact.flip(0)[:3].tolist(), rel=1e-8)
    assert max(abs(v) for v in both.eigenvalues[3:]) <= 1e-10 * scale  # 0 three times
    assert all(both.converged) and both.multiplicity["resolved"] is True
    smallest = curvature.eigenvalues(4, "smallest", "ggn", tol=1e-8)
    assert max(abs(v) for v in smallest.eigenvalues) <= 1e-10 * scale
    assert len(smallest.eigenvalues) == 4 and smallest.multiplicity["more_copies_of"]


def _dense_ce_ggn(model, x):
    """``G = (1/N) sum_n J_n^T (diag(p_n) - p_n p_n^T) J_n`` from the Jacobian's rows."""
    params = list(model.parameters())
    z = model(x)
    G = 0
    for n in range(x.shape[0]):
        J = torch.stack(
            [
                torch.cat(
                    [t.reshape(-1) for t in torch.autograd.grad(z[n, c], params, retain_graph=True)]
                )
                for c in range(z.shape[1])
            ]
        )
        p = torch.softmax(z[n].detach(), 0)
        G = G + J.T @ (torch.diag(p) - torch.outer(p, p)) @ J
    return G / x.shape[0]


def _clustered(spectrum, seed):
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(len(spectrum), len(spectrum), generator=gen, dtype=_F64))
    d = torch.tensor(spectrum, dtype=_F64)
    return MatrixOperator(Q @ torch.diag(d) @ Q.T), d.sort(descending=True).values


def _bulk(seed, count=300):
    gen = torch.Generator().manual_seed(100 + seed)
    return (torch.rand(count, generator=gen, dtype=_F64) * 2 - 1).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clustered_random_spectra_match_eigvalsh_with_multiplicity(seed):
    top = [5.0, 5.0, 5.0, 4.2, 4.2, 5.0 * (1 + 1e-11)]
    bottom = [-3.0, -3.0, -3.0 * (1 - 1e-11), -2.5]
    op, exact = _clustered(top + bottom + _bulk(seed), seed)
    for which, k, expected in (
        ("largest", 6, exact[:6]),
        ("smallest", 4, exact[-4:]),
        ("both", 5, torch.cat([exact[:5], exact[-5:]])),
    ):
        result = lanczos(op, k, which, tol=1e-8, seed=seed, max_matvecs=400)
        got = torch.tensor(result.eigenvalues, dtype=_F64)
        assert (got - expected).abs().max() <= 1e-7, (which, got, expected)
        assert all(result.converged) and result.multiplicity["resolved"] is True


def test_the_default_budget_finds_the_copies_of_a_repeated_top():
    op, exact = _clustered([2.0, 2.0, 2.0, 1.0] + _bulk(3, 200), 3)
    result = lanczos(op, 3, tol=1e-3)
    assert result.eigenvalues == pytest.approx([2.0, 2.0, 2.0], rel=1e-5)
    assert result.multiplicity["copies_found"] >= 1
    assert any("further cop" in note for note in result.notes)


def test_unresolved_multiplicity_is_noted_and_recorded():
    op, _ = _clustered([2.0] * 5 + [1.0] + _bulk(4, 200), 4)
    first = lanczos(op, 3, tol=1e-6, multiplicity=False)
    assert first.multiplicity is None and "multiplicity" not in first.to_dict()
    starved = lanczos(op, 3, tol=1e-6, max_matvecs=first.matvecs + 3)
    record = starved.multiplicity
    assert record["resolved"] is False and record["unresolved_because"] == "budget"
    assert any(note.startswith("multiplicity not resolved") for note in starved.notes)
    assert starved.to_dict()["multiplicity"] == record
    enough = lanczos(op, 3, tol=1e-6, max_matvecs=150)
    assert enough.eigenvalues == pytest.approx([2.0, 2.0, 2.0], rel=1e-6)
    assert enough.multiplicity["resolved"] is True
    assert enough.multiplicity["more_copies_of"] == pytest.approx([2.0], rel=1e-6)
    assert any("more copies than fit" in note for note in enough.notes)


def test_distinct_spectrum_costs_one_short_check():
    op, exact = _clustered([5.0, 4.0, 3.0, 2.5] + _bulk(5, 200), 5)
    plain = lanczos(op, 3, tol=1e-3, multiplicity=False)
    checked = lanczos(op, 3, tol=1e-3)
    assert checked.eigenvalues == plain.eigenvalues
    assert checked.multiplicity["deflated_restarts"] == 1
    assert checked.multiplicity["copies_found"] == 0
    assert plain.matvecs < checked.matvecs <= plain.matvecs + 12


def test_sharp_eigen_with_a_data_file_returns_the_three_copies(tmp_path, monkeypatch, capsys):
    from cli_helpers import factory_checkpoint, run_cli
    from safetensors.torch import save_file

    from sharpcli.report.envelope import validate_report

    source = "from torch import nn\n\n\ndef build():\n    return nn.Linear(6, 3)\n"
    model, weights = factory_checkpoint(tmp_path, monkeypatch, "linear_mse", source, seed=2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 6, generator=gen)  # float32 features: read exactly
    y = torch.randn(40, 3, generator=gen)
    data = tmp_path / "regression.safetensors"
    save_file({"x": x, "y": y}, str(data))
    model = model.double()
    H = _dense_hessian(model, lambda: nn.functional.mse_loss(model(x.double()), y.double()))
    exact = torch.linalg.eigvalsh(H).flip(0)
    run = run_cli(
        capsys,
        "eigen",
        weights,
        "--model-factory",
        "linear_mse:build",
        "--data",
        data,
        "--dtype",
        "float64",
        "--top-k",
        "3",
        "--eig-tol",
        "1e-8",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    results = report["results"]
    assert results["eigenvalues"] == pytest.approx(exact[:3].tolist(), rel=1e-9)
    assert exact[0] - exact[2] <= 1e-12 * exact[0]  # three copies of one value
    assert results["multiplicity"]["resolved"] is True


def test_deflated_rounds_inside_a_thick_restarted_basis():
    """A basis of 16 rows (thick restarts, [Wu2000]) still counts a triple top eigenvalue."""
    op, exact = _clustered([3.0, 3.0, 3.0, 2.9, 2.0] + _bulk(6, 250), 6)
    result = lanczos(op, 4, tol=1e-8, max_basis=16, max_matvecs=600, return_eigenvectors=True)
    assert result.eigenvalues == pytest.approx(exact[:4].tolist(), rel=1e-8)
    assert result.restarts > 0 and result.max_basis == 16
    assert all(result.converged) and result.multiplicity["resolved"] is True
    U = result.eigenvectors
    assert torch.allclose(U.T @ U, torch.eye(4, dtype=_F64), atol=1e-8)
    dense = op.to_dense()
    explicit = ritz_residuals(MatrixOperator(dense), result.eigenvalues, U)
    assert all(r >= e / 2 or e <= 1e-13 for r, e in zip(result.residuals, explicit))
    assert max(explicit) <= 1e-8 * 3.0
