"""Gram-Schmidt skipped where Paige's relation predicts semi-orthogonality.

:func:`sharpcli.curvature.eigen.ritz.semiorthogonal` lets a Lanczos step skip its
Gram-Schmidt pass when no Ritz pair has converged far enough to pull the new vector towards
it. These tests measure the basis itself (``Q^T Q`` in float64) at every step, on operators
whose Ritz values converge within the run, and the eigenvalues against the exact spectrum.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sharpcli.curvature import lanczos
from sharpcli.curvature.eigen.krylov import KrylovBasis
from sharpcli.curvature.eigen.ritz import (
    lanczos_step,
    skip_when_semiorthogonal,
    tridiagonal_matrix,
)
from sharpcli.curvature.operators.hessian import CurvatureOperator, MatrixOperator


def _operator(dtype, dim=600, seed=0):
    """``R diag(d) R^T`` with a few separated top eigenvalues (they converge in ~20 steps)."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.cat([torch.tensor([30.0, 25.0, 21.0]), torch.rand(dim - 3, generator=gen) * 10])
    R, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    A = (R * d.double()) @ R.T
    return MatrixOperator(((A + A.T) / 2).to(dtype)), d.double().sort(descending=True).values


def _run(op, steps, policy):
    """``steps`` Lanczos steps; the worst ``|q_i^T q_k|`` of the basis after each step and the
    steps that ran Gram-Schmidt. ``policy``: ``"paige"``, ``"always"`` or ``"never"``."""
    dim = op.shape[0]
    eps = torch.finfo(op.dtype).eps
    basis = KrylovBasis(dim, op.dtype, "cpu")
    q = torch.randn(dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    basis.append((q / q.norm()).to(op.dtype))
    alphas: list[float] = []
    betas: list[float] = []
    worst, full_steps, scale = [], 0, 0.0
    for j in range(steps):
        coupling = [(j - 1, betas[-1])] if j else []
        skip = {"always": None, "never": lambda a, b, local: True}.get(policy)
        if policy in ("paige", "paige-eps"):
            skip = skip_when_semiorthogonal(
                lambda a: tridiagonal_matrix([*alphas, a], betas), scale, eps
            )
        if policy == "paige-eps":  # the relation with eps ||A|| assumed, not measured
            skip = (lambda test: lambda a, b, local: test(a, b, 0.0))(skip)
        alpha, beta, w, full = lanczos_step(op, basis, coupling, j, skip)
        full_steps += full
        alphas.append(alpha)
        betas.append(beta)
        scale = max(scale, abs(alpha), beta)
        basis.append(w / beta)
        Q = torch.stack([basis[i] for i in range(len(basis))])
        G = Q @ Q.T - torch.eye(len(basis), dtype=torch.float64)
        worst.append(float(G.abs().max()))
    return worst, full_steps, alphas, betas


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_skipped_steps_keep_the_basis_semiorthogonal(dtype):
    op, spectrum = _operator(dtype)
    eps = torch.finfo(dtype).eps
    worst, full_steps, alphas, betas = _run(op, 60, "paige")
    # every pair of basis vectors stays within semi-orthogonality at every step
    assert max(worst) <= eps**0.5, max(worst)
    # most early steps skip Gram-Schmidt; once the top pairs converge, it runs
    assert 5 <= full_steps <= 55, full_steps
    # the Ritz values of the projected matrix are the exact eigenvalues to rounding
    theta = np.linalg.eigvalsh(tridiagonal_matrix(alphas, betas))[::-1]
    np.testing.assert_allclose(theta[:3], spectrum[:3].numpy(), rtol=50 * eps)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_without_any_gram_schmidt_orthogonality_is_lost(dtype):
    """The same run with every Gram-Schmidt pass skipped: the loss the test above guards."""
    op, _ = _operator(dtype)
    worst, full_steps, _, _ = _run(op, 60, "never")
    assert full_steps == 0
    assert max(worst) > 10 * torch.finfo(dtype).eps ** 0.5, max(worst)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lanczos_reports_its_gram_schmidt_steps_and_matches_full_reorthogonalisation(dtype):
    op, spectrum = _operator(dtype)
    eps = torch.finfo(dtype).eps
    result = lanczos(op, 3, tol=1e-3 if dtype == torch.float32 else 1e-9, seed=0)
    assert result.reorthogonalized is not None
    assert result.reorthogonalized < result.krylov_dim
    assert result.to_dict()["reorthogonalized"] == result.reorthogonalized
    got = torch.tensor(result.eigenvalues, dtype=torch.float64)
    assert torch.allclose(got, spectrum[:3], rtol=1e-6 if dtype == torch.float32 else 1e-12)
    always = _run(op, result.krylov_dim, "always")
    theta = np.linalg.eigvalsh(tridiagonal_matrix(always[2], always[3]))[::-1][:3]
    np.testing.assert_allclose(result.eigenvalues, theta, rtol=100 * eps)


class NoisyMatrix(CurvatureOperator):
    """A float64 matrix whose products carry fresh seeded noise of norm ``noise ||A||``: a
    model whose products are much worse than the rounding unit (asymmetric errors)."""

    name = "noisy matrix"

    def __init__(self, A: torch.Tensor, noise: float):
        super().__init__(A.shape[0], torch.float64, "cpu")
        self.A, self.noise = A, noise
        self.size = float(torch.linalg.matrix_norm(A, ord=2))
        self.gen = torch.Generator().manual_seed(7)

    def _matmat(self, V):
        E = torch.randn(V.shape, generator=self.gen, dtype=torch.float64)
        E = E / torch.linalg.vector_norm(E, dim=0, keepdim=True)
        return self.A @ V + self.noise * self.size * E * torch.linalg.vector_norm(V, dim=0)


def test_the_products_measured_error_keeps_noisy_products_semiorthogonal():
    """Products 1e-9 off (far above eps64): the measured local error calls Gram-Schmidt in
    time; Paige's relation with ``eps ||A||`` assumed would let the basis lose orthogonality."""
    op, _ = _operator(torch.float64)
    noisy = NoisyMatrix(op.matrix, 1e-9)
    eps = torch.finfo(torch.float64).eps
    worst, full_steps, _, _ = _run(noisy, 60, "paige")
    assert max(worst) <= eps**0.5, max(worst)
    noisy.gen.manual_seed(7)
    worst_assumed, full_assumed, _, _ = _run(noisy, 60, "paige-eps")
    assert max(worst_assumed) > eps**0.5, max(worst_assumed)
    assert full_steps > full_assumed
