"""The pyhessian 0.1 engine: parity with the native engine and exact spectra, refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import setup_and_reference

from sharpcli.curvature import AnalysisData
from sharpcli.errors import UsageError
from sharpcli.parity import pyhessian_density, pyhessian_eigenvalues, pyhessian_trace


def test_pyhessian_top_eigenvalue_agrees_with_exact_largest_magnitude():
    model, x, y, H, _ = setup_and_reference("gelu")
    exact = torch.linalg.eigvalsh(H)
    largest_magnitude = float(exact[exact.abs().argmax()])
    one_batch = pyhessian_eigenvalues(
        model, AnalysisData(x, y, "cross-entropy", 23), top_k=1, seed=0
    )
    assert one_batch.engine == "pyhessian" and one_batch.method == "power"
    # its relative-change rule (1e-3) stops early: within a few percent of |lambda|_max
    assert abs(one_batch.eigenvalues[0] - largest_magnitude) <= 0.05 * abs(largest_magnitude)
    assert one_batch.residuals[0] is not None and one_batch.matvecs >= 2
    tight = pyhessian_eigenvalues(
        model, AnalysisData(x, y, "cross-entropy", 23), tol=1e-9, max_matvecs=2000, seed=0
    )
    assert abs(tight.eigenvalues[0] - largest_magnitude) <= 1e-5 * abs(largest_magnitude)
    # dataloader mode (several batches, weighted by size) follows the same iterates
    loader = pyhessian_eigenvalues(model, AnalysisData(x, y, "cross-entropy", 10), top_k=1, seed=0)
    assert loader.eigenvalues[0] == pytest.approx(one_batch.eigenvalues[0], rel=1e-9)
    assert model.training is False and all(p.grad is None for p in model.parameters())


def test_pyhessian_trace_with_its_samples_standard_error():
    model, x, y, H, _ = setup_and_reference("gelu")
    data = AnalysisData(x, y, "cross-entropy", 10)
    early = pyhessian_trace(model, data, tol=1e-12, max_matvecs=200, seed=0)
    # its stop rule divides by the signed running mean: a negative first sample stops it at once
    assert early.samples == 2 and early.converged
    result = pyhessian_trace(model, data, max_matvecs=200, seed=0, run_all=True)
    assert result.engine == "pyhessian" and result.samples == 200 == result.matvecs
    assert result.by_layer == {} and result.stderr is not None
    assert abs(result.estimate - float(H.trace())) <= 4 * result.stderr


def test_pyhessian_refusals():
    model, x, y, _, _ = setup_and_reference("gelu")
    data = AnalysisData(x, y, "cross-entropy", 23)
    with pytest.raises(UsageError) as info:
        pyhessian_eigenvalues(model, data, params="last")
    assert info.value.source == "params"
    with pytest.raises(UsageError, match="torch.eig") as info:
        pyhessian_density(model, data)
    assert info.value.source == "engine"


def test_missing_pyhessian_says_how_to_install_it(monkeypatch):
    """PyHessian is an optional extra: without it --engine pyhessian is a usage error."""
    import sys

    model, x, y, _, _ = setup_and_reference("gelu")
    monkeypatch.setitem(sys.modules, "pyhessian.hessian", None)  # import fails
    with pytest.raises(UsageError, match=r"sharpcli\[pyhessian\]") as info:
        pyhessian_trace(model, AnalysisData(x, y, "cross-entropy", 16), max_matvecs=2)
    assert info.value.source == "engine"
