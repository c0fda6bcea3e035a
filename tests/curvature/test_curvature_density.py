"""Stochastic Lanczos quadrature: quadrature identities against exact spectra, PNG output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import setup_and_reference
from png_helpers import png_size

from sharpcli.curvature import (
    AnalysisData,
    CurvatureEngine,
    MatrixOperator,
    ParamScope,
    spectral_density,
)
from sharpcli.curvature.products.scope import rademacher_like
from sharpcli.errors import UsageError
from sharpcli.report.plots import PIXELS, plot_density


def test_full_krylov_quadrature_reproduces_the_spectrum_moments():
    model, x, y, H, _ = setup_and_reference("gelu")
    op = CurvatureEngine(
        model, AnalysisData(x, y, "cross-entropy", 23), ParamScope.resolve(model)
    ).hessian()
    result = spectral_density(op, probes=2, steps=93, seed=0)
    # the first probe, drawn by the seeded Rademacher helper itself, normalised
    v = rademacher_like(93, torch.Generator().manual_seed(0), torch.float64, "cpu") / 93**0.5
    exact = torch.linalg.eigvalsh(H)
    for nodes, weights in zip(result.nodes, result.weights):
        assert sum(weights) == pytest.approx(1.0, abs=1e-12)
        # with P steps the nodes are the eigenvalues (Gauss quadrature is exact for polynomials
        # of degree < 2P): v^T H v = sum tau theta and v^T H^2 v = sum tau theta^2, |v| = 1
        assert max(nodes) == pytest.approx(float(exact[-1]), rel=1e-8)
        assert min(nodes) == pytest.approx(float(exact[0]), rel=1e-8)
    tau = torch.tensor(result.weights[0], dtype=torch.float64)
    theta = torch.tensor(result.nodes[0], dtype=torch.float64)
    assert float((tau * theta).sum()) == pytest.approx(float(v @ H @ v), rel=1e-10)
    assert float((tau * theta**2).sum()) == pytest.approx(float(v @ H @ H @ v), rel=1e-10)
    assert result.matvecs <= 2 * 93  # a breakdown may end a probe early (invariant subspace)
    # the broadened density integrates to one
    grid, density = np.asarray(result.grid), np.asarray(result.density)
    assert np.trapezoid(density, grid) == pytest.approx(1.0, abs=1e-3)
    # SLQ trace: P * v^T H v averaged over 2 normalised Rademacher probes = Hutchinson with 2 probes
    assert abs(result.trace_estimate - float(H.trace())) < 4 * float((H * H).sum().sqrt())


def test_density_of_a_known_spectrum_and_png(tmp_path):
    A = MatrixOperator(torch.diag(torch.tensor([0.0] * 8 + [5.0] * 2, dtype=torch.float64)))
    result = spectral_density(A, probes=3, steps=10, broadening=0.1, grid_points=501, seed=1)
    grid, density = np.asarray(result.grid), np.asarray(result.density)
    mass_high = np.trapezoid(np.where(grid > 2.5, density, 0.0), grid)
    # quadrature weight at eigenvalue 5 = mean over probes of |v_top|^2 = 2/10 exactly for Rademacher
    assert mass_high == pytest.approx(0.2, abs=1e-3)
    assert result.matvecs == 3 * 2  # two distinct eigenvalues: breakdown after 2 steps
    path = plot_density(result.to_dict(), tmp_path / "density.png", title="test")
    assert png_size(path) == PIXELS


def test_density_arguments():
    A = MatrixOperator(torch.eye(3, dtype=torch.float64))
    with pytest.raises(UsageError):
        spectral_density(A, probes=0)
    single = spectral_density(A, probes=1, steps=5)
    assert single.nodes == [[pytest.approx(1.0)]] and single.sigma > 0


def test_slq_trace_stderr_is_the_spread_of_rademacher_hutchinson_samples():
    """Each probe's quadrature value is z^T H z (z = sqrt(P) v, Rademacher), even with few steps:
    the reported stderr is their spread / sqrt(probes), and over probes it covers tr(H)."""
    model, x, y, H, _ = setup_and_reference("gelu")
    op = CurvatureEngine(
        model, AnalysisData(x, y, "cross-entropy", 23), ParamScope.resolve(model)
    ).hessian()
    result = spectral_density(op, probes=40, steps=6, seed=3)
    per_probe = [
        93 * sum(t * w for t, w in zip(n, ws)) for n, ws in zip(result.nodes, result.weights)
    ]
    assert result.trace_estimate == pytest.approx(float(np.mean(per_probe)), rel=1e-12)
    assert result.trace_stderr == pytest.approx(np.std(per_probe, ddof=1) / 40**0.5, rel=1e-12)
    # Hutchinson's variance for Rademacher probes: 2 (||H||_F^2 - sum_i H_ii^2) per sample
    variance = 2 * float((H * H).sum() - (H.diagonal() ** 2).sum())
    assert result.trace_stderr == pytest.approx((variance / 40) ** 0.5, rel=0.35)
    assert abs(result.trace_estimate - float(H.trace())) < 4 * result.trace_stderr
    assert result.to_dict()["trace_stderr"] == result.trace_stderr
    one = spectral_density(op, probes=1, steps=6, seed=3)
    assert one.trace_stderr is None and one.to_dict()["trace_stderr"] is None
