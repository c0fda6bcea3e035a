"""Hutch++'s sketch on rank-deficient and zero-trace operators, against dense float64 references.

The NME of a ReLU network has tr(N) = 0 exactly (a piecewise linear network's second
derivatives in one layer's weights vanish, so N's diagonal blocks are 0) and a rank below its
dimension; a GGN on a few samples has rank at most samples x (classes - 1). There the sketch
used to grow past the operator's rank, keep rounding noise as new directions and lose its
orthonormality (||Q^T Q - I|| up to 1), which biased the estimate by up to 88 standard errors
and, once the sketch was square, claimed a wrong value exact.
"""

from __future__ import annotations

import math

import pytest
import torch
from hessian_helpers import cross_entropy_ggn, double_backward_hessian
from torch import nn

from sharpcli.curvature.operators.hessian import CurvatureEngine, MatrixOperator
from sharpcli.curvature.products.data import AnalysisData
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.trace import hutchpp as hutchpp_module
from sharpcli.curvature.trace.hutchpp import RangeSketch, hutchpp

SEEDS = range(32)


def _relu_model(widths, samples: int, seed: int = 0):
    """A ReLU MLP on random data, its curvature pass and its dense H and G (float64)."""
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).double().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(samples, widths[0], generator=generator, dtype=torch.float64)
    y = torch.randint(0, widths[-1], (samples,), generator=generator)
    params = list(model.parameters())
    H = double_backward_hessian(model, params, x, y)
    G = cross_entropy_ggn(model, params, x)
    data = AnalysisData(x, y, "cross-entropy", samples)
    return CurvatureEngine(model, data, ParamScope.resolve(model, "all")), H, G


def _orthonormality_error(Q: torch.Tensor) -> float:
    return float((Q.T @ Q - torch.eye(Q.shape[1], dtype=Q.dtype)).abs().max())


def _layers_sum_to_total(result) -> None:
    total = sum(v["estimate"] for v in result.by_layer.values())
    assert abs(total - result.estimate) <= 1e-12 * (1 + abs(result.estimate)), (total, result)


@pytest.mark.parametrize("spectrum", ["positive", "zero-trace"])
def test_range_sketch_stops_at_the_rank_and_stays_orthonormal(spectrum):
    """Rank 7 in R^40: the first 16 columns span the range; further extensions, whose
    A S lies in the span to rounding, add nothing (they used to add noise directions)."""
    generator = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(40, 7, generator=generator, dtype=torch.float64))
    values = torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, 0.2, 0.1], dtype=torch.float64)
    if spectrum == "zero-trace":
        values = values - values.mean()
    A = (U * values) @ U.T
    sketch = RangeSketch(40, torch.float64, "cpu")
    products = [sketch.extend(MatrixOperator(A), 16, generator) for _ in range(3)]
    assert sketch.size == 7 and sketch.exhausted and sketch.lost is None
    assert products == [16 + 7, 16, 16]  # A S, then A Q_n for the kept columns only
    assert _orthonormality_error(sketch.Q) <= 1e-14
    exact = sketch.exact_part({"all": slice(0, 40)})
    # the range is spanned: tr(Q^T A Q) is the whole trace
    assert float(exact[0]) == pytest.approx(float(values.sum()), abs=1e-13)
    assert float(exact[1]) == pytest.approx(float(exact[0]), abs=1e-14)
    assert sketch.rounding_stderr() <= 1e-13


def test_a_parallel_sketch_is_not_taken_for_a_spanned_range():
    """Two Rademacher columns of a 2-vector are parallel half the time: the sketch is
    Gaussian, so a full-rank 2 x 2 operator is spanned and its trace is exact."""
    A = torch.tensor([[2.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    for seed in range(16):
        result = hutchpp(MatrixOperator(A), tol=1e-6, max_matvecs=30, seed=seed, initial_sketch=2)
        assert result.sketch_size == 2 and result.estimate == pytest.approx(1.0, abs=1e-14)
        assert any("exact up to rounding" in note for note in result.notes)


def test_an_extension_that_lost_orthogonality_is_discarded(monkeypatch):
    """With a tolerance no basis meets, every extension counts as having lost orthogonality:
    none is used, the note says so, and the probes alone give an unbiased estimate."""
    monkeypatch.setattr(hutchpp_module, "ORTH_TOL", 0.0)
    generator = torch.Generator().manual_seed(0)
    A = torch.diag(torch.linspace(0.1, 2.0, 30, dtype=torch.float64))
    result = hutchpp(MatrixOperator(A), tol=1e-9, max_matvecs=80, seed=0, initial_sketch=8)
    assert result.sketch_size == 0
    assert any("lost orthogonality" in note for note in result.notes), result.notes
    # a diagonal A: every probe gives tr(A) up to the rounding of its sum (~1e-15), which a
    # standard error of that size need not cover
    assert abs(result.estimate - float(A.trace())) <= 4 * result.stderr + 1e-13
    sketch = RangeSketch(30, torch.float64, "cpu")
    assert sketch.extend(MatrixOperator(A), 4, generator) == 4 and sketch.lost is not None


def test_hutchpp_on_the_zero_trace_nme_of_a_relu_network():
    """tr(N) = 0, rank(N) < P: over 32 seeds the sketch stops at the rank, the estimate is 0
    within its standard error (the exact part's rounding, ~1e-16), no run claims exactness,
    every layer's block trace (0 too) is within its error, and the layers sum to the total."""
    engine, H, G = _relu_model([5, 6, 3], samples=20)
    N = H - G
    assert abs(float(N.trace())) <= 1e-14
    rank = int(torch.linalg.matrix_rank(N))
    assert rank < N.shape[0]
    operator = engine.nme()
    for seed in SEEDS:
        result = hutchpp(operator, seed=seed)
        assert result.sketch_size == rank, (seed, result.sketch_size, rank)
        assert not any("exact" in note for note in result.notes), result.notes
        assert 0 < result.stderr <= 1e-13 and abs(result.estimate) <= 4 * result.stderr
        assert result.matvecs < 200  # the range spanned, the probes are not sized for tol x 0
        _layers_sum_to_total(result)
        for layer, block in engine.scope.blocks().items():
            value = result.by_layer[layer]
            assert abs(float(N[block, block].trace())) <= 1e-14
            assert abs(value["estimate"]) <= 4 * value["stderr"] + 1e-14, (layer, value)


def test_hutchpp_zero_trace_stderr_calibrated_when_the_sketch_cannot_span():
    """A deeper ReLU network's NME (tr 0, rank above the sketch's 16 columns): the residual
    carries the error, and the z-scores over 32 seeds are calibrated."""
    engine, H, G = _relu_model([5, 8, 8, 3], samples=12)
    N = H - G
    blocks = engine.scope.blocks()
    assert abs(float(N.trace())) <= 1e-14 and int(torch.linalg.matrix_rank(N)) > 16
    runs = [
        hutchpp(
            MatrixOperator(N), tol=0.02, max_matvecs=120, seed=seed, max_sketch=16, blocks=blocks
        )
        for seed in SEEDS
    ]
    assert all(r.sketch_size == 16 for r in runs)
    z = torch.tensor([r.estimate / r.stderr for r in runs], dtype=torch.float64)
    assert 0.7 <= float(z.std()) <= 1.4, z.tolist()
    assert abs(float(z.mean())) <= 3 / math.sqrt(len(z)), z.tolist()
    for r in runs:
        assert len(r.by_layer) == len(blocks)
        _layers_sum_to_total(r)


def test_hutchpp_on_a_low_rank_ggn():
    """4 samples x 3 classes: rank(G) <= 8 in R^57. The sketch spans the range, so tr(G)
    comes out to rounding in few products, the per-layer traces with it; nothing says
    "exact", and the error is within the reported standard error."""
    engine, _, G = _relu_model([5, 6, 3], samples=4)
    rank = int(torch.linalg.matrix_rank(G))
    assert rank <= 8
    truth = float(G.trace())
    operator = engine.ggn()
    for seed in SEEDS:
        result = hutchpp(operator, tol=1e-2, seed=seed)
        assert result.sketch_size == rank and result.converged
        assert not any("exact" in note for note in result.notes)
        assert abs(result.estimate - truth) <= max(4 * result.stderr, 1e-13)
        assert result.stderr <= 1e-12 * truth
        # the sketch, its products, a pilot of 30 probes (in blocks of 8) and 10 main ones
        assert result.matvecs <= 16 + rank + 32 + 10
        _layers_sum_to_total(result)
        for layer, block in engine.scope.blocks().items():
            exact = float(G[block, block].trace())
            assert result.by_layer[layer]["estimate"] == pytest.approx(exact, abs=1e-12)
