"""Diagonal estimators (sharpcli/curvature/diagonal.py, analyses/diagonal.py) against dense
float64 matrices: the exact and per-sample diagonals equal the dense ones, Hutchinson's and the
GNB estimator's errors are within their standard errors (z-scores over the entries), and the
GNB estimator's mean is the Gauss-Newton diagonal."""

from __future__ import annotations

import pytest
import torch
from conftest import make_data, make_mlp
from hessian_helpers import double_backward_hessian
from torch import nn

from sharpcli.analyses.diagonal import block_summary, diagonal_result
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
from sharpcli.errors import UsageError
from sharpcli.losses import get_loss


def _pass(loss: str = "cross-entropy", batch_size: int = 10, n: int = 23):
    model = make_mlp("gelu")
    x, y = make_data("vector", n=n)
    if loss == "mse":
        y = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    data = AnalysisData(x, y, loss, batch_size=batch_size)
    return model, x, y, CurvatureEngine(model, data, ParamScope.resolve(model))


def _dense_ef(model, x, y, loss: str) -> torch.Tensor:
    params = list(model.parameters())
    rows = []
    for i in range(x.shape[0]):
        l_i = get_loss(loss).per_sample(model(x[i : i + 1]), y[i : i + 1]).sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(l_i, params)]))
    Gm = torch.stack(rows)
    return Gm.T @ Gm / x.shape[0]


def _z_scores(result, truth: torch.Tensor) -> torch.Tensor:
    assert result.stderr is not None and (result.stderr > 0).all()
    return (result.diagonal - truth) / result.stderr


def test_exact_diagonal_equals_the_double_backward_hessians():
    model, x, y, engine = _pass()
    H = double_backward_hessian(model, list(model.parameters()), x, y)
    _, result = diagonal_result(engine, "hessian", estimator="exact", max_products=1000)
    assert torch.allclose(result.diagonal, torch.diagonal(H), atol=1e-12, rtol=0)
    assert result.matvecs == H.shape[0] and result.stderr is None
    # each parameter's sum is its block's trace, the total the full trace
    blocks, total = block_summary(result, engine.scope)
    assert total["sum"] == pytest.approx(float(H.trace()), abs=1e-12)
    offsets = engine.scope.offsets
    for b, a, z in zip(blocks, offsets[:-1], offsets[1:]):
        block = torch.diagonal(H)[a:z]
        assert b["sum"] == pytest.approx(float(block.sum()), abs=1e-12)
        assert b["sum_sq"] == pytest.approx(float(block.square().sum()), abs=1e-12)
        assert b["min"] == pytest.approx(float(block.min()), abs=1e-12)
        assert b["max"] == pytest.approx(float(block.max()), abs=1e-12)


@pytest.mark.parametrize("operator", ["ggn", "nme", "ef"])
def test_exact_diagonal_of_the_other_operators(operator):
    model, x, y, engine = _pass()
    dense = {
        "ggn": lambda: engine.ggn().to_dense(),
        "nme": lambda: (
            double_backward_hessian(model, list(model.parameters()), x, y) - engine.ggn().to_dense()
        ),
        "ef": lambda: _dense_ef(model, x, y, "cross-entropy"),
    }[operator]()
    _, result = diagonal_result(engine, operator, estimator="exact", max_products=1000)
    assert torch.allclose(result.diagonal, torch.diagonal(dense), atol=1e-12, rtol=0)


def test_exact_diagonal_is_refused_beyond_its_budget_naming_the_cost():
    _, _, _, engine = _pass()
    with pytest.raises(UsageError, match="needs 93 products") as info:
        diagonal_result(engine, "hessian", estimator="exact", max_products=92)
    assert info.value.source == "max_products"


def test_hutchinson_diagonal_is_within_its_standard_errors():
    """z-scores of the 93 entries: mean near 0, spread near 1 (the errors are calibrated)."""
    model, x, y, engine = _pass()
    H = double_backward_hessian(model, list(model.parameters()), x, y)
    _, result = diagonal_result(engine, "hessian", estimator="hutchinson", probes=400, seed=3)
    z = _z_scores(result, torch.diagonal(H))
    assert abs(float(z.mean())) < 0.35 and 0.7 < float(z.std()) < 1.3, (z.mean(), z.std())
    # the stderr of each parameter's sum and of the total are those of Hutchinson traces
    blocks, total = block_summary(result, engine.scope)
    assert abs(total["sum"] - float(H.trace())) < 4 * total["sum_stderr"]
    assert all(b["sum_stderr"] > 0 for b in blocks)
    assert result.samples == 400 and result.matvecs == 400


@pytest.mark.parametrize("loss", ["cross-entropy", "mse"])
def test_per_sample_diagonal_is_the_exact_gauss_newton_diagonal(loss):
    _, _, _, engine = _pass(loss)
    _, result = diagonal_result(engine, estimator="per-sample")
    G = engine.ggn().to_dense()
    assert torch.allclose(result.diagonal, torch.diagonal(G), atol=1e-12, rtol=0)


def test_per_sample_diagonal_of_the_empirical_fisher():
    model, x, y, engine = _pass()
    _, result = diagonal_result(engine, "ef", estimator="per-sample")
    F = _dense_ef(model, x, y, "cross-entropy")
    assert torch.allclose(result.diagonal, torch.diagonal(F), atol=1e-12, rtol=0)
    with pytest.raises(UsageError, match="needs 3 backward passes per sample") as info:
        diagonal_result(engine, "ggn", estimator="per-sample", max_products=2)
    assert info.value.source == "max_products"


@pytest.mark.parametrize("loss", ["cross-entropy", "mse"])
def test_gnb_estimates_the_gauss_newton_diagonal_within_its_standard_errors(loss):
    """Sophia's B g^2 at sampled labels, batches of 4 (so the cross terms between a batch's
    samples must cancel in the mean): the mean of 1500 draws within its per-entry stderr of
    diag(G), and the empirical Fisher's diagonal is not what it estimates."""
    model, x, y, engine = _pass(loss, batch_size=4, n=12)
    G = torch.diagonal(engine.ggn().to_dense())
    _, result = diagonal_result(engine, estimator="gnb", probes=1500, seed=1)
    # the entries share the draws, so their z-scores are correlated: their spread, not their
    # mean, checks the per-entry errors; the total's z-score checks the mean
    z = _z_scores(result, G)
    assert 0.6 < float(z.std()) < 1.4, z.std()
    _, total = block_summary(result, engine.scope)
    assert abs(total["sum"] - float(G.sum())) < 4 * total["sum_stderr"]
    assert float((result.diagonal - G).abs().max()) < 0.15 * float(G.abs().max())
    if loss == "cross-entropy":
        ef = torch.diagonal(_dense_ef(model, x, y, loss))
        assert float(_z_scores(result, ef).abs().mean()) > 3


def test_estimators_refuse_operators_they_do_not_compute_and_bad_probes():
    _, _, _, engine = _pass()
    with pytest.raises(UsageError, match="`operator=ggn`") as info:
        diagonal_result(engine, "hessian", estimator="gnb")
    assert info.value.source == "operator"
    with pytest.raises(UsageError) as info:
        diagonal_result(engine, "nme", estimator="per-sample")
    assert info.value.source == "operator"
    with pytest.raises(UsageError) as info:
        diagonal_result(engine, estimator="hutchinson", probes=1)
    assert info.value.source == "probes"
    with pytest.raises(UsageError, match="accepted") as info:
        diagonal_result(engine, estimator="bartlett")
    assert info.value.source == "estimator"


def test_api_diagonal_by_parameter_name_and_shape():
    from sharpcli import Curvature

    model = make_mlp("gelu")
    x, y = make_data("vector", n=23)
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y), batch_size=10)
    result = curvature.diagonal(estimator="exact")
    H = double_backward_hessian(model, list(model.parameters()), x, y)
    tensors = result.tensors()
    assert list(tensors) == [n for n, _ in model.named_parameters()]
    assert [t.shape for t in tensors.values()] == [p.shape for p in model.parameters()]
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    assert torch.allclose(flat, torch.diagonal(H), atol=1e-12, rtol=0)


def test_a_declared_diagonal_estimator_is_dispatched_through_the_registry():
    """An extension declared as a diagonal estimator is reached by name, with the operator its
    record names by default and only those it accepts; its declaration is the built-ins'."""
    from sharpcli.catalogue import DIAGONAL_ESTIMATORS
    from sharpcli.curvature.diagonal import DiagonalResult, exact_diagonal
    from sharpcli.registry import declare

    @declare("diagonal estimator", "dense-ggn", "the exact ggn diagonal", info={"operator": "ggn"})
    def dense_ggn(request):
        """``exact_diagonal`` of the request's operator, labelled as this estimator."""
        found = exact_diagonal(request.build(), max_products=request.max_products)
        return DiagonalResult(found.diagonal, None, None, "dense-ggn")

    model, x, y, engine = _pass()
    DIAGONAL_ESTIMATORS.add(dense_ggn)
    try:
        operator, result = diagonal_result(engine, estimator="dense-ggn", max_products=1000)
        _, exact = diagonal_result(engine, "ggn", estimator="exact", max_products=1000)
        assert operator == "ggn" and result.estimator == "dense-ggn"
        assert torch.equal(result.diagonal, exact.diagonal)
        assert result.scope is engine.scope
    finally:
        DIAGONAL_ESTIMATORS.unregister("dense-ggn")
    with pytest.raises(UsageError, match="accepted: hutchinson, exact, gnb, per-sample"):
        diagonal_result(engine, estimator="dense-ggn")
