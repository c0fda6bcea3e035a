"""The trace estimator ``exact`` and the exact diagonals of every operator (H, G, N = H - G,
the empirical Fisher, the sampled-label Fisher) against dense float64 matrices built from
double backward and per-sample gradients of torch's own losses, on an MLP with cross-entropy
and mse, on a conv net and on a layer without a ghost-norm rule; H = G + N for the exact traces and diagonals; the unit-vector
route's size limit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_cnn, make_data, make_mlp
from hessian_helpers import double_backward_hessian, jacobian_ggn
from torch import nn

from sharpcli.analyses.diagonal import diagonal_result
from sharpcli.analyses.spectrum import trace_result
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
from sharpcli.curvature.operators.fisher import FisherOperator
from sharpcli.curvature.trace import exact as exact_module
from sharpcli.errors import UsageError

OPERATORS = ("hessian", "ggn", "nme", "ef", "fisher")
TORCH_LOSS = {"cross-entropy": F.cross_entropy, "mse": F.mse_loss}


class _Head(nn.Module):
    """A layer without a ghost-norm rule (its weight used by ``matmul``): the per-sample
    Jacobian route of the outer-product traces."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 3, dtype=torch.float64) / 3)

    def forward(self, h):
        return torch.tanh(h) @ self.weight


def _case(kind: str, loss: str, batch_size: int = 7):
    """The model, its data (23 samples, batches of 7: the last one short) and the pass."""
    if kind == "custom":
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(4, 6), _Head()).double().eval()
    else:
        model = make_mlp("gelu") if kind == "mlp" else make_cnn()
    x, y = make_data("image" if kind == "cnn" else "vector", n=23)
    if loss == "mse":
        y = torch.randn(23, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    data = AnalysisData(x, y, loss, batch_size=batch_size)
    return model, x, y, CurvatureEngine(model, data, ParamScope.resolve(model))


def _per_sample_gradients(model, params, x, labels, loss_fn) -> torch.Tensor:
    """``(N, P)``: row i is the gradient of torch's loss on sample i alone with label ``labels[i]``."""
    rows = []
    for i in range(x.shape[0]):
        l_i = loss_fn(model(x[i : i + 1]), labels[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(l_i, params)]))
    return torch.stack(rows)


def _fisher_labels(engine) -> torch.Tensor:
    """The registered Fisher operator's label draws, ``(S, N, ...)``, batch by batch."""
    op = FisherOperator(engine)
    drawn = []
    for index, (x_b, _, _) in enumerate(engine.data.batches()):
        with torch.no_grad():
            drawn.append(op.labels(index, engine.model(x_b)))
    return torch.cat(drawn, dim=1)


def _dense(model, x, y, loss: str, engine) -> dict[str, torch.Tensor]:
    """H by double backward, G = J^T H_z J with H_z by double backward, N = H - G, the
    empirical Fisher (1/N) sum_i g_i g_i^T and the sampled Fisher (1/NS) sum_is g_is g_is^T at
    the operator's draws, all of torch's losses (mse: the mean over the outputs)."""
    fn = TORCH_LOSS[loss]
    params = list(model.parameters())
    H = double_backward_hessian(model, params, x, y, loss_fn=fn)
    G = jacobian_ggn(model, params, x, y, fn)
    g = _per_sample_gradients(model, params, x, y, fn)
    labels = _fisher_labels(engine)
    sampled = torch.cat([_per_sample_gradients(model, params, x, lab, fn) for lab in labels])
    N = x.shape[0]
    return {
        "hessian": H,
        "ggn": G,
        "nme": H - G,
        "ef": g.T @ g / N,
        "fisher": sampled.T @ sampled / (N * labels.shape[0]),
    }


def _layer_traces(matrix: torch.Tensor, scope) -> dict[str, float]:
    diag = torch.diagonal(matrix)
    return {name: float(diag[sl].sum()) for name, sl in scope.blocks().items()}


@pytest.mark.parametrize(
    ("kind", "loss"),
    [("mlp", "cross-entropy"), ("mlp", "mse"), ("cnn", "cross-entropy"), ("custom", "mse")],
)
def test_exact_traces_and_diagonals_equal_the_dense_matrices(kind, loss):
    model, x, y, engine = _case(kind, loss)
    dense = _dense(model, x, y, loss, engine)
    traces, diagonals = {}, {}
    for operator in OPERATORS:
        result = trace_result(engine, operator, estimator="exact")
        want = dense[operator]
        assert result.estimator == "exact" and result.stderr == 0.0 and result.converged
        assert result.estimate == pytest.approx(float(want.trace()), abs=1e-11), operator
        layers = _layer_traces(want, engine.scope)
        assert set(result.by_layer) == set(layers)
        for name, value in layers.items():
            assert result.by_layer[name]["estimate"] == pytest.approx(value, abs=1e-11)
        _, diag = diagonal_result(engine, operator, estimator="exact")
        assert torch.allclose(diag.diagonal, torch.diagonal(want), atol=1e-12, rtol=0), operator
        traces[operator], diagonals[operator] = result.estimate, diag.diagonal
    # H = G + N for the exact traces and diagonals
    assert traces["hessian"] == pytest.approx(traces["ggn"] + traces["nme"], abs=1e-11)
    assert torch.allclose(diagonals["hessian"], diagonals["ggn"] + diagonals["nme"], atol=1e-12)
    # the per-sample routes: no products; the unit-vector routes: one per parameter
    P = engine.scope.numel
    matvecs = {op: trace_result(engine, op, estimator="exact").matvecs for op in OPERATORS}
    assert matvecs == {"hessian": P, "ggn": 0, "nme": P, "ef": 0, "fisher": 0}


@pytest.mark.parametrize("operator", ["ggn", "ef", "fisher"])
def test_per_sample_diagonals_of_the_outer_product_operators(operator):
    """``diagonal --estimator per-sample`` of G, F_emp and the sampled Fisher equals the dense
    diagonal, and its sum the exact trace."""
    model, x, y, engine = _case("mlp", "cross-entropy")
    want = _dense(model, x, y, "cross-entropy", engine)[operator]
    _, diag = diagonal_result(engine, operator, estimator="per-sample")
    assert torch.allclose(diag.diagonal, torch.diagonal(want), atol=1e-12, rtol=0)
    trace = trace_result(engine, operator, estimator="exact").estimate
    assert float(diag.diagonal.sum()) == pytest.approx(trace, abs=1e-12)


@pytest.mark.parametrize("operator", OPERATORS)
def test_exact_trace_of_the_square_is_the_squared_frobenius_norm(operator):
    model, x, y, engine = _case("mlp", "mse")
    want = _dense(model, x, y, "mse", engine)[operator]
    result = trace_result(engine, operator, estimator="exact", square=True)
    assert result.quantity == "trace_of_square" and result.matvecs == engine.scope.numel
    assert result.estimate == pytest.approx(float((want * want).sum()), rel=1e-12)
    # per layer: the squared norms of the layer's rows, summing to the total
    for name, sl in engine.scope.blocks().items():
        assert result.by_layer[name]["estimate"] == pytest.approx(
            float(want[sl].square().sum()), rel=1e-12
        )


@pytest.mark.parametrize("operator", ["hessian", "nme"])
def test_the_unit_vector_route_is_refused_past_its_limit(monkeypatch, operator):
    """Above EXACT_MAX_PARAMS parameters the routes of P products are refused naming the
    stochastic estimators and the scope; the outer-product routes are not limited."""
    _, _, _, engine = _case("mlp", "cross-entropy")
    P = engine.scope.numel
    monkeypatch.setattr(exact_module, "EXACT_MAX_PARAMS", P - 1)
    with pytest.raises(UsageError) as info:
        trace_result(engine, operator, estimator="exact")
    message = str(info.value)
    assert info.value.source == "estimator" and "\n" not in message
    assert f"{P:,} parameters" in message and f"{P - 1:,}" in message
    assert "`estimator=hutchpp`" in message and "`estimator=hutchinson`" in message
    with pytest.raises(UsageError, match="Tr"):
        trace_result(engine, "ggn", estimator="exact", square=True)
    for cheap in ("ggn", "ef", "fisher"):
        assert trace_result(engine, cheap, estimator="exact").matvecs == 0
    monkeypatch.setattr(exact_module, "EXACT_MAX_PARAMS", P)
    assert trace_result(engine, operator, estimator="exact").matvecs == P


def test_the_library_gives_every_exact_trace_and_diagonal():
    """``sharpcli.Curvature``: ``trace(op, estimator="exact")`` and ``diagonal(op, "exact")``
    for every operator, on a torch loss module, equal the dense ones; per-layer blocks too."""
    from sharpcli import Curvature

    model, x, y, engine = _case("cnn", "cross-entropy")
    dense = _dense(model, x, y, "cross-entropy", engine)
    curvature = Curvature(model, torch.nn.CrossEntropyLoss(), (x, y), batch_size=7)
    for operator in OPERATORS:
        want = dense[operator]
        result = curvature.trace(operator, estimator="exact")
        assert result.estimate == pytest.approx(float(want.trace()), abs=1e-11), operator
        diag = curvature.diagonal(operator, estimator="exact").diagonal
        assert torch.allclose(diag, torch.diagonal(want), atol=1e-12, rtol=0), operator
    blocks = curvature.trace("hessian", estimator="exact", blocks="conv=0.*,head=4.*")
    prefix = {"conv": "0.", "head": "4."}
    flat_diagonal = torch.diagonal(dense["hessian"])
    layout = engine.scope  # the model's parameters in order, as the dense matrices
    assert [b["name"] for b in blocks] == list(prefix)
    for block in blocks:
        owned = [
            flat_diagonal[a:b].sum()
            for name, a, b in zip(layout.names, layout.offsets[:-1], layout.offsets[1:])
            if name.startswith(prefix[block["name"]])
        ]
        assert block["estimate"] == pytest.approx(float(sum(owned)), abs=1e-11)


def test_exact_fisher_trace_with_several_draws_is_the_operators_trace():
    """S = 3 label draws per sample (the 1/S of the average in the directions): the
    per-sample trace equals the trace of the operator's own products, e_j^T F e_j summed."""
    from sharpcli.curvature.diagonal import exact_diagonal
    from sharpcli.curvature.trace.exact import exact_fisher_trace

    _, _, _, engine = _case("mlp", "cross-entropy")
    op = FisherOperator(engine, samples=3, seed=4)
    by_products = exact_diagonal(op, max_products=engine.scope.numel).diagonal
    result = exact_fisher_trace(op)
    assert result.estimate == pytest.approx(float(by_products.sum()), abs=1e-12)
    assert any("3 label draw(s)" in note for note in result.notes)


class _Tokens(nn.Module):
    """Embedding -> tanh -> Linear: ``(B, T, V)`` logits for token cross-entropy."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(5, 4), nn.Linear(4, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


@pytest.mark.parametrize("loss", ["token-cross-entropy", "binary-cross-entropy"])
def test_exact_trace_is_the_sum_of_the_operators_own_diagonal(loss):
    """For the losses whose per-sample reading differs (a sequence's weighted positions, -100
    unlabelled; one logit per sample): each operator's exact trace is the sum of the diagonal
    its own products give, e_j^T A e_j, so the per-sample routes use the products'
    normalisation."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    if loss == "token-cross-entropy":
        model = _Tokens().double().eval()
        x, y = (
            torch.randint(0, 5, (9, 6), generator=gen),
            torch.randint(0, 5, (9, 6), generator=gen),
        )
        y[0, :3], y[3, 4:] = -100, -100
    else:
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).double().eval()
        x = torch.randn(9, 4, dtype=torch.float64, generator=gen)
        y = torch.randint(0, 2, (9,), generator=gen).double()
    data = AnalysisData(x, y, loss, batch_size=4)
    engine = CurvatureEngine(model, data, ParamScope.resolve(model))
    for operator in OPERATORS:
        trace = trace_result(engine, operator, estimator="exact").estimate
        _, diag = diagonal_result(engine, operator, estimator="exact")
        assert trace == pytest.approx(float(diag.diagonal.sum()), abs=1e-12), operator
