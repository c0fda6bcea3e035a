"""Lanczos and power iteration against torch.linalg.eigvalsh of exact float64 matrices."""

from __future__ import annotations

import pytest
import torch
from conftest import setup_and_reference

from sharpcli.curvature import (
    AnalysisData,
    CurvatureEngine,
    MatrixOperator,
    ParamScope,
    lanczos,
    power_iteration,
    ritz_residuals,
)
from sharpcli.errors import UsageError


def _operators(kind="gelu"):
    model, x, y, H, G = setup_and_reference(kind)
    cp = CurvatureEngine(model, AnalysisData(x, y, "cross-entropy", 23), ParamScope.resolve(model))
    return {"hessian": (cp.hessian(), H), "ggn": (cp.ggn(), G), "nme": (cp.nme(), H - G)}


@pytest.fixture(scope="module")
def operators():
    return _operators()


@pytest.fixture(scope="module")
def all_operators():
    """Tiny GELU MLP, ReLU MLP and CNN with BatchNorm in eval mode (the issue's three references)."""
    return {kind: _operators(kind) for kind in ("gelu", "relu", "cnn")}


@pytest.mark.parametrize("kind", ["gelu", "relu", "cnn"])
@pytest.mark.parametrize("name", ["hessian", "ggn", "nme"])
@pytest.mark.parametrize("which", ["largest", "smallest", "both"])
def test_lanczos_matches_eigvalsh(all_operators, kind, name, which):
    op, dense = all_operators[kind][name]
    exact = torch.linalg.eigvalsh(dense).flip(0)  # descending
    scale = exact.abs().max()
    # eigenvalues counted with multiplicity (the CNN's G has rank <= 23 * 2 < P, a null
    # space of dimension > 30: its smallest three are 0, 0, 0)
    top, bottom = exact[:3], exact[-3:]
    expected = {"largest": top, "smallest": bottom, "both": torch.cat([top, bottom])}[which]
    result = lanczos(op, 3, which, tol=1e-8, seed=1, return_eigenvectors=True)
    got = torch.tensor(result.eigenvalues, dtype=torch.float64)
    assert torch.all(got[:-1] >= got[1:])  # descending
    assert (got - expected).abs().max() <= 1e-6 * scale
    assert all(result.converged) and result.matvecs <= op.shape[0]
    # the residuals from the Lanczos relation are honest: they match ||A u - lambda u||
    explicit = ritz_residuals(MatrixOperator(dense), result.eigenvalues, result.eigenvectors)
    for estimate, actual in zip(result.residuals, explicit):
        assert abs(estimate - actual) <= 1e-12 * float(scale) + 1e-6 * actual
        assert actual <= 1e-8 * max(abs(v) for v in result.eigenvalues) + 1e-12 * float(scale)
    orth = result.eigenvectors.T @ result.eigenvectors
    assert torch.allclose(orth, torch.eye(orth.shape[0], dtype=orth.dtype), atol=1e-8)


def test_default_tolerance_flags_and_budget(operators):
    op, dense = operators["hessian"]
    lam_max = float(torch.linalg.eigvalsh(dense)[-1])
    result = lanczos(op, 1, tol=1e-3, seed=0)
    assert result.converged == [True] and result.residuals[0] <= 1e-3 * abs(result.eigenvalues[0])
    assert abs(result.eigenvalues[0] - lam_max) <= 1e-5 * lam_max  # error ~ residual^2 / gap
    assert result.matvecs < 40 and result.krylov_dim == result.matvecs
    starved = lanczos(op, 3, "smallest", tol=1e-10, max_matvecs=6, seed=0)
    assert starved.matvecs == 6 and not all(starved.converged)
    assert any("budget" in note for note in starved.notes)
    again = lanczos(op, 1, tol=1e-3, seed=0)
    assert again.eigenvalues == result.eigenvalues  # seeded start: identical runs


def test_tiny_problems_are_exact_with_multiplicities():
    torch.manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(7, 7, dtype=torch.float64))
    spectrum = torch.tensor([3.0, 3.0, 3.0, 1.0, 0.0, 0.0, -2.0], dtype=torch.float64)
    A = MatrixOperator(Q @ torch.diag(spectrum) @ Q.T)
    top = lanczos(A, 3, "largest")
    assert top.eigenvalues == pytest.approx([3.0, 3.0, 3.0], abs=1e-12)
    assert top.breakdown is not None and top.matvecs == 7
    everything = lanczos(A, 10, "both")  # k larger than P: all P eigenvalues, once each
    assert everything.eigenvalues == pytest.approx(spectrum.tolist(), abs=1e-12)
    assert all(everything.converged)
    one = lanczos(MatrixOperator(torch.tensor([[2.5]], dtype=torch.float64)), 2, "both")
    assert one.eigenvalues == [2.5] and one.residuals == [0.0]


def test_power_iteration_finds_largest_magnitude_with_residuals(operators):
    op, dense = operators["nme"]  # N is indefinite: its largest |eigenvalue| is negative here
    exact = torch.linalg.eigvalsh(dense)
    biggest = exact[exact.abs().argmax()]
    result = power_iteration(op, 1, tol=1e-6, max_matvecs=300, seed=0, return_eigenvectors=True)
    assert result.which == "largest-magnitude"
    assert abs(result.eigenvalues[0] - float(biggest)) <= 1e-3 * abs(float(biggest))
    explicit = ritz_residuals(MatrixOperator(dense), result.eigenvalues, result.eigenvectors)
    assert result.residuals[0] == pytest.approx(explicit[0], rel=1e-8, abs=1e-14)
    assert result.converged[0] == (result.residuals[0] <= 1e-6 * abs(result.eigenvalues[0]))


def test_power_iteration_deflation_on_a_known_spectrum():
    diag = torch.tensor([10.0, 6.0, 3.0, 1.0, 0.5], dtype=torch.float64)
    result = power_iteration(
        MatrixOperator(torch.diag(diag)), 2, tol=1e-10, max_matvecs=500, seed=2
    )
    assert result.eigenvalues == pytest.approx([10.0, 6.0], rel=1e-8)
    # the relative-change rule stops with eigenvalue error ~1e-10 but residual ~sqrt of it:
    # the converged flag is the residual criterion and says so
    assert all(1e-7 < r < 1e-3 for r in result.residuals) and result.converged == [False, False]
    loose = power_iteration(MatrixOperator(torch.diag(diag)), 2, tol=1e-3, max_matvecs=500, seed=2)
    assert loose.converged == [
        r <= 1e-3 * abs(v) for r, v in zip(loose.residuals, loose.eigenvalues)
    ]
    assert result.method == "power" and result.matvecs > loose.matvecs


def test_bad_arguments_are_usage_errors(operators):
    op, _ = operators["hessian"]
    with pytest.raises(UsageError) as info:
        lanczos(op, 1, "middle")
    assert info.value.source == "which"
    with pytest.raises(UsageError) as info:
        lanczos(op, 0)
    assert info.value.source == "top_k"
    with pytest.raises(UsageError):
        power_iteration(op, 1, tol=0.0)
