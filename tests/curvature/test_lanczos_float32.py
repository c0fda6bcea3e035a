"""Lanczos, power iteration and SLQ on a float32 operator of dimension 400k with a known spectrum.

A float32 model multiplies in float32; the estimators around the products must not add their
own float32 rounding (dot products and norms over 4e5 entries have ~1e-6 relative error) nor
report residuals smaller than the ones the returned vectors have.
"""

from __future__ import annotations

import pytest
import torch

from sharpcli.curvature import lanczos, power_iteration, spectral_density
from sharpcli.curvature.operators.hessian import CurvatureOperator
from sharpcli.curvature.products.scope import rademacher_like

DIM = 400_000
TOP = (10.0, 9.0, 8.25)  # above a bulk spread uniformly over [0, 7]


class RotatedDiagonal(CurvatureOperator):
    """``A = R diag(d) R`` with the Householder reflection ``R = I - 2 u u^T`` (``|u| = 1``).

    ``R`` is orthogonal and symmetric, so the eigenvalues of ``A`` are exactly the float32
    numbers ``d``; the products are computed in float32, like a float32 model's, and
    :meth:`exact` gives the float64 product of the same matrix for reference.
    """

    name = "rotated diagonal"

    def __init__(self, d: torch.Tensor, u: torch.Tensor):
        super().__init__(d.numel(), torch.float32, "cpu")
        self.d, self.u = d, u

    @staticmethod
    def _reflect(u, X):
        return X - 2 * u[:, None] * (u @ X)[None, :]

    def _matmat(self, V):
        if V.dtype != torch.float32:  # a float32 model cannot multiply anything else
            raise TypeError(f"float32 operator given {V.dtype}")
        return self._reflect(self.u, self.d[:, None] * self._reflect(self.u, V))

    def exact(self, V: torch.Tensor) -> torch.Tensor:
        """``A V`` in float64 (the same float32 ``d`` and ``u``, no product rounding)."""
        u, squeeze = self.u.double(), V.dim() == 1
        V = V.double().reshape(V.shape[0], -1)
        out = self._reflect(u, self.d.double()[:, None] * self._reflect(u, V))
        return out[:, 0] if squeeze else out


@pytest.fixture(scope="module")
def rotated():
    gen = torch.Generator().manual_seed(0)
    bulk = torch.rand(DIM - len(TOP), generator=gen, dtype=torch.float64) * 7.0
    d = torch.cat([torch.tensor(TOP, dtype=torch.float64), bulk])
    d = d[torch.randperm(DIM, generator=gen)].to(torch.float32)
    u = torch.randn(DIM, generator=gen, dtype=torch.float64)
    u = (u / torch.linalg.vector_norm(u)).to(torch.float32)
    u = u / u.double().norm().to(torch.float32)  # unit to float32 rounding: R orthogonal to ~1e-7
    return RotatedDiagonal(d, u), d.double().sort(descending=True).values


def _explicit(op, values, vectors) -> list[float]:
    """``||A v - theta v|| / ||v||`` with the float64 product of the same matrix."""
    V = vectors.double()
    theta = torch.tensor(values, dtype=torch.float64)
    R = op.exact(V) - V * theta
    return (torch.linalg.vector_norm(R, dim=0) / torch.linalg.vector_norm(V, dim=0)).tolist()


def test_lanczos_float32_operator_is_accurate_and_reports_true_residuals(rotated):
    op, spectrum = rotated
    tol = 1e-5
    result = lanczos(
        op, 3, "largest", tol=tol, seed=0, return_eigenvectors=True, explicit_residuals=True
    )
    exact = spectrum[:3]
    got = torch.tensor(result.eigenvalues, dtype=torch.float64)
    error = ((got - exact).abs() / exact).max().item()
    # float32 products perturb the matrix by ~eps32 ||A|| ~ 1e-6: eigenvalues stay well inside tol
    assert error <= 1e-6, error
    explicit = _explicit(op, result.eigenvalues, result.eigenvectors)
    for reported, actual, value, ok in zip(
        result.residuals, explicit, result.eigenvalues, result.converged
    ):
        # the reported residual is no smaller than the one the returned vector has
        assert reported >= actual / 2, (reported, actual)
        assert ok == (reported <= tol * abs(value) or reported <= 100 * 2**-23 * max(TOP))
        if ok:
            assert actual <= 2 * tol * abs(value)
    assert result.matvecs == result.krylov_dim + 3  # one extra product per explicit residual
    # without the explicit check the Ritz estimate is still near the truth (float64 recurrence)
    estimate = lanczos(op, 3, "largest", tol=tol, seed=0, explicit_residuals=False)
    assert estimate.eigenvalues == pytest.approx(result.eigenvalues, rel=1e-12)


def test_power_iteration_float32_operator(rotated):
    op, spectrum = rotated
    result = power_iteration(op, 1, tol=1e-9, max_matvecs=150, seed=0, return_eigenvectors=True)
    explicit = _explicit(op, result.eigenvalues, result.eigenvectors)
    # Rayleigh quotient error ~ residual^2 / gap; the residual is what it says
    assert abs(result.eigenvalues[0] - spectrum[0].item()) <= 1e-6 * spectrum[0].item()
    assert result.residuals[0] >= explicit[0] / 2 and result.residuals[0] <= 2 * explicit[0]


def test_slq_float32_operator_moments(rotated):
    op, _ = rotated
    result = spectral_density(op, probes=1, steps=30, seed=3)
    theta = torch.tensor(result.nodes[0], dtype=torch.float64)
    tau = torch.tensor(result.weights[0], dtype=torch.float64)
    # the probe, as drawn by the seeded Rademacher helper, normalised
    v = rademacher_like(DIM, torch.Generator().manual_seed(3), torch.float64, "cpu") / DIM**0.5
    Av = op.exact(v)
    # Gauss quadrature reproduces v^T A v and v^T A^2 v (float32 products: ~1e-7 relative)
    assert float((tau * theta).sum()) == pytest.approx(float(v @ Av), rel=5e-7)
    assert float((tau * theta**2).sum()) == pytest.approx(float(Av @ Av), rel=5e-7)


class NoisyDiagonal(CurvatureOperator):
    """``diag(d) V`` in float32 plus fresh seeded noise of norm ~``noise * max|d|`` per product:
    an operator whose products are worse than the Krylov recurrence can see."""

    name = "noisy diagonal"

    def __init__(self, d: torch.Tensor, noise: float):
        super().__init__(d.numel(), torch.float32, "cpu")
        self.d, self.noise = d, noise
        self.gen = torch.Generator().manual_seed(5)

    def _matmat(self, V):
        E = torch.randn(V.shape, generator=self.gen, dtype=torch.float32) / V.shape[0] ** 0.5
        return self.d[:, None] * V + self.noise * self.d.abs().max() * E


def test_explicit_residuals_withdraw_a_convergence_the_estimate_claims():
    d = torch.cat([torch.tensor([10.0, 9.0]), torch.linspace(0.0, 7.0, 2998)])
    tol = 1e-5
    estimate = lanczos(NoisyDiagonal(d, 1e-4), 2, tol=tol, seed=0, explicit_residuals=False)
    assert all(estimate.converged)  # the Ritz estimate cannot see the products' errors
    result = lanczos(NoisyDiagonal(d, 1e-4), 2, tol=tol, seed=0)  # float32: explicit by default
    assert result.matvecs == result.krylov_dim + 2
    assert result.eigenvalues == pytest.approx([10.0, 9.0], rel=1e-4)
    # explicit residuals ~ noise * max|d| = 1e-3, far above tol |lambda| and 100 eps32 ||A||
    assert all(5e-4 < r < 5e-3 for r in result.residuals), result.residuals
    assert result.converged == [False, False]
    assert any("not by the explicit residual" in note for note in result.notes)
