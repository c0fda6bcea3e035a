"""Trace estimators against exact float64 traces of tiny models (seeded, within 4 standard errors)."""

from __future__ import annotations

import pytest
import torch
from conftest import setup_and_reference

from sharpcli.curvature import (
    AnalysisData,
    CurvatureEngine,
    MatrixOperator,
    ParamScope,
    exact_ggn_trace,
    frobenius_sq,
    gn_split_trace,
    hutchinson,
    hutchpp,
    sampled_label_ggn_trace,
)


def _setup(kind="gelu", loss="cross-entropy", batch_size=8):
    model, x, y, H, G = setup_and_reference(kind, loss)
    data = AnalysisData(x, y, loss, batch_size)
    scope = ParamScope.resolve(model)
    return model, data, scope, H, G


def _block_traces(A, scope, square=False):
    M = A @ A if square else A
    return {name: float(M[sl, sl].trace()) for name, sl in scope.blocks().items()}


def _assert_layers_within_stderr(result, dense, scope):
    """Per-layer estimates match the dense diagonal blocks' traces within 4.5 of their standard errors."""
    for name, value in _block_traces(dense, scope).items():
        layer = result.by_layer[name]
        assert abs(layer["estimate"] - value) <= 4.5 * layer["stderr"] + 1e-10


@pytest.mark.parametrize(
    "kind,loss", [("gelu", "cross-entropy"), ("cnn", "cross-entropy"), ("gelu", "mse")]
)
def test_exact_ggn_trace_and_layers(kind, loss):
    model, data, scope, _, G = _setup(kind, loss, batch_size=10)
    result = exact_ggn_trace(model, data, scope)
    assert result.estimate == pytest.approx(float(G.trace()), rel=1e-8, abs=1e-12)
    assert result.stderr == 0.0 and result.estimator == "exact"
    expected = _block_traces(G, scope)
    assert list(result.by_layer) == list(expected)
    for name, value in expected.items():
        assert result.by_layer[name]["estimate"] == pytest.approx(value, rel=1e-8, abs=1e-12)


@pytest.mark.parametrize("estimator", [hutchinson, hutchpp])
@pytest.mark.parametrize("operator", ["hessian", "ggn"])
def test_stochastic_traces_within_four_standard_errors(estimator, operator):
    model, data, scope, H, G = _setup()
    cp = CurvatureEngine(model, data, scope)
    op, dense = (cp.hessian(), H) if operator == "hessian" else (cp.ggn(), G)
    result = estimator(op, tol=3e-2, max_matvecs=300, seed=11, block_size=16)
    exact = float(dense.trace())
    assert abs(result.estimate - exact) <= 4 * result.stderr + 1e-10 * abs(exact)
    assert result.matvecs == op.matvecs <= 300
    if result.converged:
        assert result.stderr <= 3e-2 * abs(result.estimate)
    # per-layer traces sum to the total and match the dense diagonal blocks
    assert sum(v["estimate"] for v in result.by_layer.values()) == pytest.approx(
        result.estimate, abs=1e-12
    )
    _assert_layers_within_stderr(result, dense, scope)


def test_hutchpp_needs_fewer_matvecs_than_hutchinson_at_equal_tolerance():
    model, data, scope, _, G = _setup(batch_size=23)
    op = CurvatureEngine(model, data, scope).ggn()
    plain = hutchinson(op, tol=2e-2, max_matvecs=4000, seed=0, block_size=32)
    sketched = hutchpp(op, tol=2e-2, max_matvecs=4000, seed=0, block_size=32)
    assert plain.converged and sketched.converged
    assert sketched.matvecs <= plain.matvecs / 2
    assert abs(sketched.estimate - float(G.trace())) <= 4 * sketched.stderr


@pytest.mark.parametrize(
    "kind,loss",
    [
        ("gelu", "cross-entropy"),
        ("relu", "cross-entropy"),
        ("cnn", "cross-entropy"),
        ("gelu", "mse"),
    ],
)
def test_gn_split_trace_within_four_standard_errors_of_the_hessian_trace(kind, loss):
    model, data, scope, H, G = _setup(kind, loss, batch_size=10)
    result = gn_split_trace(CurvatureEngine(model, data, scope), tol=2e-2, max_matvecs=400, seed=5)
    exact = float(H.trace())
    assert result.estimator == "gn-split" and result.stderr > 0
    assert abs(result.estimate - exact) <= 4 * result.stderr + 1e-10 * abs(exact)
    assert sum(v["estimate"] for v in result.by_layer.values()) == pytest.approx(
        result.estimate, rel=1e-10
    )
    _assert_layers_within_stderr(result, H, scope)


def test_gn_split_beats_hutchinson_when_the_gauss_newton_part_dominates():
    # a well-fit GELU net: dl/dz is small, so N = H - G is small against H (NME eq. 2)
    model, data, scope, H, G = _setup(batch_size=23)
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data.x), data.y).backward()
        opt.step()
    from conftest import dense_reference

    H, G, _ = dense_reference(model, data.x, data.y, "cross-entropy")
    N = H - G
    assert float((N * N).sum()) < 0.05 * float((H * H).sum())
    cp = CurvatureEngine(model, data, scope)
    split = gn_split_trace(cp, tol=1e-2, max_matvecs=4000, seed=0, block_size=16)
    plain = hutchinson(cp.hessian(), tol=1e-2, max_matvecs=4000, seed=0, block_size=16)
    assert split.converged and plain.converged
    assert split.matvecs <= plain.matvecs / 4
    assert abs(split.estimate - float(H.trace())) <= 4 * split.stderr


def test_hutchinson_hand_counts():
    diagonal = MatrixOperator(torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)))
    exact = hutchinson(diagonal, tol=1e-3, max_matvecs=40, block_size=4, min_samples=10)
    # g^T D g = tr(D) for every Rademacher g: zero variance; a pilot of min_samples probes
    # sizes the main sample at its least (min_samples), whose mean is reported
    assert (
        exact.estimate == 10.0 and exact.stderr == 0.0 and exact.matvecs == 20 and exact.converged
    )
    assert exact.samples == 10  # the pilot's 10 products count in matvecs only
    A = torch.tensor([[2.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    capped = hutchinson(MatrixOperator(A), tol=1e-6, max_matvecs=20, block_size=8)
    # g^T A g = 1 + 2 g1 g2 in {-1, 3}: never reaches 1e-6; the pilot (10) plans more than the
    # 10 products left, so the main sample is the rest of the budget
    assert not capped.converged and capped.matvecs == 20 and capped.samples == 10
    assert any(capped.estimate == pytest.approx(-1 + 4 * k / 10) for k in range(11))
    fixed = hutchinson(MatrixOperator(A), tol=1e-6, max_matvecs=19, block_size=8)
    # a budget below two samples of min_samples: one fixed sample, no pilot
    assert fixed.matvecs == fixed.samples == 19
    assert any(fixed.estimate == pytest.approx(-1 + 4 * k / 19) for k in range(20))
    full = hutchpp(MatrixOperator(A), tol=1e-6, max_matvecs=30, initial_sketch=2)
    assert (
        full.estimate == pytest.approx(1.0, abs=1e-14)
        and full.stderr <= 1e-14  # the exact part's rounding only
        and full.sketch_size == 2
        and any("exact up to rounding" in note for note in full.notes)
    )


def test_frobenius_sq_matches_trace_of_square():
    model, data, scope, H, _ = _setup()
    result = frobenius_sq(
        CurvatureEngine(model, data, scope).hessian(),
        tol=2e-2,
        max_matvecs=400,
        seed=3,
        block_size=16,
    )
    exact = float((H * H).sum())
    assert result.quantity == "trace_of_square"
    assert abs(result.estimate - exact) <= 4 * result.stderr
    assert sum(v["estimate"] for v in result.by_layer.values()) == pytest.approx(
        result.estimate, rel=1e-12
    )
    for name, value in _block_traces(H, scope, square=True).items():
        assert (
            abs(result.by_layer[name]["estimate"] - value) <= 4.5 * result.by_layer[name]["stderr"]
        )


@pytest.mark.parametrize("loss,samples", [("cross-entropy", 3), ("cross-entropy", 1), ("mse", 3)])
def test_sampled_label_ggn_trace_within_four_standard_errors(loss, samples):
    model, data, scope, _, G = _setup("gelu", loss, batch_size=10)
    result = sampled_label_ggn_trace(
        model, data, scope, samples=samples, generator=torch.Generator().manual_seed(7)
    )
    exact = float(G.trace())
    assert 0 < result.stderr < 0.5 * exact
    assert abs(result.estimate - exact) <= 4 * result.stderr
    assert result.samples == 23 * samples
    assert sum(v["estimate"] for v in result.by_layer.values()) == pytest.approx(
        result.estimate, rel=1e-12
    )
