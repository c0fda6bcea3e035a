"""Warm-started Lanczos (``lanczos(..., warm_start=...)``): same eigenvalues as a cold start, the
full operator's certificate, the warm phase's cost reported apart, and the subsample operator
is the mean curvature over its subset."""

from __future__ import annotations

import pytest
import torch
from conftest import dense_reference, make_cnn, make_data, setup_and_reference

from sharpcli.curvature import (
    AnalysisData,
    CurvatureEngine,
    MatrixOperator,
    ParamScope,
    lanczos,
)
from sharpcli.curvature.eigen.warm_start import subsample_operator
from sharpcli.curvature.operators.hessian import CurvatureOperator
from sharpcli.curvature.products.data import subsample_data
from sharpcli.errors import UsageError


def _pass(kind="gelu"):
    model, x, y, H, G = setup_and_reference(kind)
    engine = CurvatureEngine(
        model, AnalysisData(x, y, "cross-entropy", 23), ParamScope.resolve(model)
    )
    norms = {
        name: float(torch.linalg.matrix_norm(A, 2))
        for name, A in (("hessian", H), ("ggn", G), ("nme", H - G))
    }
    engine.test_norms = norms  # ||A||_2 of the exact matrices: the scale of "equal to 1e-8"
    return engine


@pytest.fixture(scope="module")
def passes():
    return {kind: _pass(kind) for kind in ("gelu", "relu", "cnn")}


CASES = [
    (which, warm)
    for which in ("largest", "smallest", "both")
    for warm in ("subsample", "gradient")
    if warm == "subsample" or which == "largest"
]


@pytest.mark.parametrize("kind", ["gelu", "relu", "cnn"])
@pytest.mark.parametrize("name", ["hessian", "ggn", "nme"])
@pytest.mark.parametrize("which,warm", CASES)
def test_warm_start_gives_the_cold_start_eigenvalues(passes, kind, name, which, warm):
    op = getattr(passes[kind], name)()
    cold = lanczos(op, 3, which, tol=1e-10, seed=1)
    before = op.matvecs
    result = lanczos(op, 3, which, tol=1e-10, seed=1, warm_start=warm)
    assert op.matvecs - before == result.matvecs  # the warm phase multiplies another operator
    scale = passes[kind].test_norms[name]
    assert len(result.eigenvalues) == len(cold.eigenvalues)
    for got, expected in zip(result.eigenvalues, cold.eigenvalues):
        assert abs(got - expected) <= 1e-8 * scale, (got, expected)
    assert all(result.converged)
    assert result.warm_start["method"] == warm
    assert any(note.startswith("warm start:") for note in result.notes)


def test_subsample_warm_start_reports_its_cost(passes):
    op = passes["gelu"].hessian()
    result = lanczos(op, 1, tol=1e-8, seed=0, warm_start="subsample", warm_fraction=0.5)
    info = result.warm_start
    assert info["samples"] == 12 and info["of_samples"] == 23 and info["fraction"] == 0.5
    assert 1 <= info["matvecs"] <= 4  # default warm steps for k = 1
    assert info["full_product_equivalents"] == pytest.approx(info["matvecs"] * 12 / 23)
    assert len(info["ritz_values"]) == 1
    assert result.to_dict()["warm_start"] == info
    assert "warm_start" not in lanczos(op, 1, tol=1e-8, seed=0).to_dict()
    steps = lanczos(op, 1, tol=1e-8, seed=0, warm_start="subsample", warm_steps=2)
    assert steps.warm_start["matvecs"] == 2


def test_subsample_operator_is_the_mean_curvature_of_its_subset():
    model, x, y = make_cnn(), *make_data("image")
    data = AnalysisData(x, y, "cross-entropy", 5)  # several batches: weights B_b / N_S
    engine = CurvatureEngine(model, data, ParamScope.resolve(model))
    sub = subsample_data(data, 0.4, seed=3)
    assert sub.num_samples == sub.local_num_samples == 9 and data.num_samples == 23
    rows = [int((x == row).all(dim=(1, 2, 3)).nonzero()) for row in sub.x]
    assert rows == sorted(rows) and len(set(rows)) == 9  # distinct samples, original order
    H_S, G_S, _ = dense_reference(model, x[rows], y[rows], "cross-entropy")
    for name, dense in (("hessian", H_S), ("ggn", G_S), ("nme", H_S - G_S)):
        sub_op = subsample_operator(getattr(engine, name)(), 0.4, seed=3)
        assert type(sub_op) is type(getattr(engine, name)())
        assert torch.allclose(sub_op.to_dense(), dense, atol=1e-10)
    whole = subsample_operator(engine.hessian(), 1.0)
    v = torch.randn(
        engine.scope.numel, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(whole.matvec(v), engine.hessian().matvec(v))
    assert subsample_data(data, 1e-6).num_samples == 1  # at least one sample


class _Reflected(CurvatureOperator):
    """``R diag(d) R`` with the Householder reflection ``R = I - 2 u u^T``: eigenvalues ``d``."""

    name = "reflected diagonal"

    def __init__(self, d, u):
        super().__init__(d.numel(), torch.float64, "cpu")
        self.d, self.u = d, u / torch.linalg.vector_norm(u)

    def _reflect(self, X):
        return X - 2 * self.u[:, None] * (self.u @ X)[None, :]

    def _matmat(self, V):
        return self._reflect(self.d[:, None] * self._reflect(V))


def test_a_close_operator_warm_start_saves_full_products():
    gen = torch.Generator().manual_seed(0)
    dim = 4000
    d = torch.cat(
        [torch.tensor([10.0, 9.0]), torch.rand(dim - 2, generator=gen, dtype=torch.float64) * 8]
    )
    u = torch.randn(dim, generator=gen, dtype=torch.float64)
    op = _Reflected(d, u)
    # the same spectrum with eigenvectors rotated a little: a cheap approximation of op
    near = _Reflected(d, u + 0.05 * torch.randn(dim, generator=gen, dtype=torch.float64))
    cold = lanczos(op, 1, tol=1e-3, seed=0)
    warm = lanczos(op, 1, tol=1e-3, seed=0, warm_start=near, warm_steps=30)
    for result in (cold, warm):  # eigenvalue error ~ residual^2 / gap
        assert result.converged == [True] and result.residuals[0] <= 1e-3 * 10
        assert result.eigenvalues[0] == pytest.approx(10.0, rel=1e-5)
    assert warm.matvecs < cold.matvecs / 2, (warm.matvecs, cold.matvecs)  # 5 vs 13
    assert warm.warm_start["method"] == "operator" and warm.warm_start["matvecs"] <= 30


def test_zero_gradient_falls_back_to_a_cold_start():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model = model.double().eval()
    x = torch.randn(10, 4, dtype=torch.float64)
    with torch.no_grad():
        y = model(x)  # mse targets = outputs: the gradient is exactly zero
    engine = CurvatureEngine(model, AnalysisData(x, y, "mse", 10), ParamScope.resolve(model))
    op = engine.hessian()
    result = lanczos(op, 2, tol=1e-10, seed=4, warm_start="gradient")
    assert "fallback" in result.warm_start
    assert result.eigenvalues == lanczos(op, 2, tol=1e-10, seed=4).eigenvalues


def test_float32_warm_start_keeps_the_explicit_residual():
    model, x, y, H, _ = setup_and_reference("cnn")
    model = model.float()
    engine = CurvatureEngine(
        model, AnalysisData(x.float(), y, "cross-entropy", 23), ParamScope.resolve(model)
    )
    exact = float(torch.linalg.eigvalsh(H)[-1])
    for warm in ("subsample", "gradient"):
        result = lanczos(engine.hessian(), 1, tol=1e-4, seed=0, warm_start=warm)
        assert result.matvecs == result.krylov_dim + 1  # the certificate: one explicit product
        assert result.converged == [True]
        assert result.eigenvalues[0] == pytest.approx(exact, rel=1e-5)


def test_bad_warm_starts_are_usage_errors(passes):
    op = passes["gelu"].hessian()
    cases = [
        ({"warm_start": "fastest"}, "warm_start"),
        ({"warm_start": "subsample", "start": torch.ones(op.shape[0])}, "warm_start"),
        ({"warm_start": "subsample", "warm_fraction": 0.0}, "warm_fraction"),
        ({"warm_start": "subsample", "warm_fraction": 1.5}, "warm_fraction"),
        ({"warm_start": "subsample", "warm_steps": 0}, "warm_steps"),
        ({"warm_start": "gradient", "which": "smallest"}, "warm_start"),
        ({"warm_start": MatrixOperator(torch.eye(3, dtype=torch.float64))}, "warm_start"),
    ]
    for kwargs, source in cases:
        with pytest.raises(UsageError) as info:
            lanczos(op, 1, **kwargs)
        assert info.value.source == source, kwargs
    matrix = MatrixOperator(torch.diag(torch.arange(5.0, dtype=torch.float64)))
    for warm in ("subsample", "gradient"):
        with pytest.raises(UsageError) as info:
            lanczos(matrix, 1, warm_start=warm)
        assert info.value.source == "warm_start"


class _RegisteredStyle(CurvatureOperator):
    """An operator class in the registry's convention: built from the pass, keeping model, data
    and scope (here the Gauss-Newton matrix through the pass's own product)."""

    name = "registered-style Gauss-Newton"

    def __init__(self, engine):
        scope = engine.scope
        super().__init__(scope.numel, scope.dtype, scope.device)
        self.model, self.data, self.scope = engine.model, engine.data, scope
        self._pass = engine

    def _matmat(self, V):
        return self._pass.ggn_matmat(V)


def test_registered_operator_classes_warm_start_on_their_own_subsample(passes):
    op = _RegisteredStyle(passes["relu"])
    sub = subsample_operator(op, 0.5, seed=1)
    assert type(sub) is _RegisteredStyle and sub.data.num_samples == 12
    cold = lanczos(op, 2, tol=1e-10, seed=0)
    for warm in ("subsample", "gradient"):
        result = lanczos(op, 2, tol=1e-10, seed=0, warm_start=warm)
        assert result.eigenvalues == pytest.approx(cold.eigenvalues, rel=1e-8)
