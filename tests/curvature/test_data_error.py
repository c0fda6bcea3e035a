"""The data's standard error of traces and eigenvalues (batch means over the analysis set's
batches): equal to its closed form on per-batch dense float64 Hessians, free of extra
products for traces, and calibrated over disjoint samples of a task with a known population
Hessian."""

from __future__ import annotations

import math

import pytest
import torch
from hessian_helpers import double_backward_hessian
from torch import nn

from sharpcli.analyses.spectrum import eigen_result, trace_result
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
from sharpcli.curvature.eigen.data_error import eigen_data_error
from sharpcli.curvature.products.batch_forms import batch_means_stderr
from sharpcli.curvature.trace.hutchinson import hutchinson
from sharpcli.curvature.trace.hutchpp import hutchpp


def _mlp_and_data(n=10, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(n, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (n,))
    return model, x, y


def _per_batch_hessians(model, x, y, batch_size):
    """Dense float64 Hessians of each batch's mean loss (double backward), and the sizes."""
    params = list(model.parameters())
    out = []
    for start in range(0, x.shape[0], batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        out.append((double_backward_hessian(model, params, xb, yb), xb.shape[0]))
    return out


def _closed_form(values, sizes):
    """sqrt(sum_b w_b (x_b - t)^2 / (K - 1)), w_b = B_b / N, t = sum_b w_b x_b."""
    N = sum(sizes)
    t = sum(B / N * v for v, B in zip(values, sizes))
    return t, math.sqrt(sum(B / N * (v - t) ** 2 for v, B in zip(values, sizes)) / (len(sizes) - 1))


def test_batch_means_by_hand():
    # batch means 1, 2, 6 of sizes 2, 2, 1: t = (2 + 4 + 6) / 5 = 2.4;
    # se^2 = (0.4 * 1.96 + 0.4 * 0.16 + 0.2 * 12.96) / 2 = 1.72
    error = batch_means_stderr([2 / 5 * 1, 2 / 5 * 2, 1 / 5 * 6], [2, 2, 1])
    assert error.stderr == pytest.approx(math.sqrt(1.72), rel=1e-12)
    assert error.per_batch == pytest.approx([1.0, 2.0, 6.0])
    assert error.method == "batch means over 3 batches" and error.samples == 5
    assert batch_means_stderr([3.0], [4]).stderr is None  # one batch: no spread to measure


def test_trace_data_error_equals_closed_form_on_dense_batch_hessians():
    model, x, y = _mlp_and_data(n=10)
    engine = CurvatureEngine(
        model, AnalysisData(x, y, "cross-entropy", 4), ParamScope.resolve(model)
    )
    dense = _per_batch_hessians(model, x, y, 4)  # batches of 4, 4, 2
    traces = [float(torch.trace(H)) for H, _ in dense]
    sizes = [B for _, B in dense]
    total, expected = _closed_form(traces, sizes)
    P = engine.scope.numel
    # a sketch spanning the space: the trace and its per-batch parts are exact
    result = hutchpp(engine.hessian(), initial_sketch=P, max_matvecs=4 * P)
    assert result.estimate == pytest.approx(total, rel=1e-10)
    assert result.data is not None and result.data.batches == 3
    assert result.data.per_batch == pytest.approx(traces, rel=1e-9)
    assert result.data.stderr == pytest.approx(expected, rel=1e-9)


def test_hutchinson_per_batch_parts_sum_to_the_estimate_at_no_extra_product():
    model, x, y = _mlp_and_data(n=12, seed=1)
    engine = CurvatureEngine(
        model, AnalysisData(x, y, "cross-entropy", 5), ParamScope.resolve(model)
    )
    columns = []
    apply = engine._apply

    def counted(V, *args, **kwargs):  # the columns of every pass over the data
        columns.append(1 if V.dim() == 1 else V.shape[1])
        return apply(V, *args, **kwargs)

    engine._apply = counted
    for op in (engine.hessian(), engine.ggn(), engine.nme(), engine.hessian() + 2 * engine.ggn()):
        columns.clear()
        result = hutchinson(op, max_matvecs=64, tol=1e-6, seed=3)
        assert result.data is not None and result.data.batches == 3
        weights = [5 / 12, 5 / 12, 2 / 12]
        assert sum(w * v for w, v in zip(weights, result.data.per_batch)) == pytest.approx(
            result.estimate, rel=1e-10, abs=1e-12
        )
        assert result.matvecs == 64 and sum(columns) == 64  # the probes' products, no more


def test_eigen_data_error_equals_closed_form_of_rayleigh_quotients():
    model, x, y = _mlp_and_data(n=10, seed=2)
    engine = CurvatureEngine(
        model, AnalysisData(x, y, "cross-entropy", 4), ParamScope.resolve(model)
    )
    dense = _per_batch_hessians(model, x, y, 4)
    sizes = [B for _, B in dense]
    H = sum(B / 10 * Hb for Hb, B in dense)
    evals, evecs = torch.linalg.eigh(H)
    u = evecs[:, -1:]
    quotients = [float(u[:, 0] @ Hb @ u[:, 0]) for Hb, _ in dense]
    _, expected = _closed_form(quotients, sizes)
    error = eigen_data_error(engine.hessian(), u)
    assert error is not None and error.matvecs == 1
    assert error.rayleigh[0] == pytest.approx(float(evals[-1]), rel=1e-10)
    assert error.stderr[0] == pytest.approx(expected, rel=1e-9)
    result = eigen_result(engine, top_k=1, tol=1e-10)
    assert result.data_stderr[0] == pytest.approx(expected, rel=1e-6)
    assert result.data_matvecs == 1 and result.eigenvectors is None


def test_float32_eigen_reads_its_data_error_from_the_residual_product():
    """In float32 the residuals are explicit: that product of the returned vectors is the data
    error's product too, recorded batch by batch, so no product is spent on the data error and
    its value is the one a product of its own gives (and the float64 closed form's, to float32
    rounding)."""
    model64, x64, y = _mlp_and_data(n=10, seed=2)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    model.load_state_dict({k: v.float() for k, v in model64.state_dict().items()})
    engine = CurvatureEngine(
        model, AnalysisData(x64.float(), y, "cross-entropy", 4), ParamScope.resolve(model)
    )
    result = eigen_result(engine, top_k=2, tol=1e-4, return_eigenvectors=True)
    assert result.data_matvecs == 0 and any("residuals are explicit" in n for n in result.notes)
    own = eigen_data_error(engine.hessian(), result.eigenvectors)
    assert own is not None and own.matvecs == 2
    assert result.data_stderr == pytest.approx(own.stderr, rel=1e-6)
    dense = _per_batch_hessians(model64, x64, y, 4)
    sizes = [B for _, B in dense]
    u = result.eigenvectors.to(torch.float64)
    for i in range(2):
        quotients = [float(u[:, i] @ Hb @ u[:, i]) for Hb, _ in dense]
        _, expected = _closed_form(quotients, sizes)
        assert result.data_stderr[i] == pytest.approx(expected, rel=1e-3)


SCALES = torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64)
# single-output linear regression with mse: H = 2 E[(x, 1)(x, 1)^T], x ~ N(0, diag(SCALES^2))
POPULATION_TRACE = 2 * (float((SCALES**2).sum()) + 1)  # 22.5
POPULATION_LAMBDA_MAX = 2 * 9.0  # 18, well apart from the next (2)


def test_data_error_calibrated_over_disjoint_samples():
    """Over disjoint samples of a task with known population Hessian, (estimate - truth) / se
    has standard deviation within 0.7-1.4 for tr(H) and for lambda_max."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Linear(3, 1).double()
    scope = ParamScope.resolve(model)
    replicates, n, batch = 200, 96, 6  # 16 batches per sample
    z_trace, z_lambda = [], []
    for _ in range(replicates):
        x = torch.randn(n, 3, dtype=torch.float64, generator=generator) * SCALES
        y = torch.randn(n, 1, dtype=torch.float64, generator=generator)
        engine = CurvatureEngine(model, AnalysisData(x, y, "mse", batch), scope)
        trace = trace_result(engine, estimator="hutchpp", tol=1e-6, max_matvecs=40)
        z_trace.append((trace.estimate - POPULATION_TRACE) / trace.data.stderr)
        eig = eigen_result(engine, top_k=1, tol=1e-10)
        z_lambda.append((eig.eigenvalues[0] - POPULATION_LAMBDA_MAX) / eig.data_stderr[0])
    for z in (torch.tensor(z_trace), torch.tensor(z_lambda)):
        print(f"z: mean {float(z.mean()):.3f}, sd {float(z.std()):.3f}")
        assert abs(float(z.mean())) < 0.3
        assert 0.7 <= float(z.std()) <= 1.4


def test_gn_nme_split_per_batch_parts_keep_h_equal_g_plus_n():
    from sharpcli.curvature.trace.split import gn_nme_split

    model, x, y = _mlp_and_data(n=12, seed=4)
    engine = CurvatureEngine(
        model, AnalysisData(x, y, "cross-entropy", 4), ParamScope.resolve(model)
    )
    split = gn_nme_split(engine, max_matvecs=40, tol=1e-6)
    parts = {name: split.data[name] for name in ("hessian", "ggn", "nme")}
    assert all(p is not None and p.batches == 3 for p in parts.values())
    for name, error in parts.items():  # equal batches: the estimate is the batch means' mean
        mean = sum(error.per_batch) / 3
        assert mean == pytest.approx(split.values[name]["trace"]["estimate"], rel=1e-9, abs=1e-12)
    h, g, n = (torch.tensor(parts[k].per_batch) for k in ("hessian", "ggn", "nme"))
    assert torch.allclose(h, g + n, rtol=1e-10, atol=1e-12)
