"""The data's error of the numbers beyond tr(A) and lambda: Tr(A^2) (first order), the G/N
split's Tr(A^2), the density's trace estimate, the blocks' traces and eigenvalues and their
sum, the Fisher-Rao norms; each equal to its closed form on dense float64 per-batch matrices
(double backward). And the batch-means error against a delete-one-batch jackknife computed
directly: equal for a trace (linear in the data), within a stated tolerance for lambda_max
(first order)."""

from __future__ import annotations

import math

import pytest
import torch
from hessian_helpers import cross_entropy_ggn, double_backward_hessian
from torch import nn

from sharpcli.analyses.blocks import block_engines, eigen_blocks, trace_blocks
from sharpcli.analyses.flatness import fisher_rao_norm
from sharpcli.analyses.spectrum import eigen_result, trace_result
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
from sharpcli.curvature.density import spectral_density
from sharpcli.curvature.products.batch_forms import batch_means_stderr, summed_error
from sharpcli.curvature.products.scope import rademacher_like
from sharpcli.curvature.trace.hutchinson import frobenius_sq
from sharpcli.curvature.trace.probes import pilot_size
from sharpcli.curvature.trace.split import gn_nme_split


def _mlp_and_data(n=12, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(n, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (n,))
    return model, x, y


def _batches(x, y, batch_size):
    return [
        (x[s : s + batch_size], y[s : s + batch_size]) for s in range(0, x.shape[0], batch_size)
    ]


def _per_batch_hessians(model, x, y, batch_size):
    """Dense float64 Hessians of each batch's mean loss, and the batches' sizes."""
    params = list(model.parameters())
    parts = [
        (double_backward_hessian(model, params, xb, yb), xb.shape[0])
        for xb, yb in _batches(x, y, batch_size)
    ]
    return [H for H, _ in parts], [B for _, B in parts]


def _closed_form(values, sizes):
    """sqrt(sum_b w_b (x_b - t)^2 / (K - 1)), w_b = B_b / N, t = sum_b w_b x_b."""
    N = sum(sizes)
    t = sum(B / N * v for v, B in zip(values, sizes))
    return math.sqrt(sum(B / N * (v - t) ** 2 for v, B in zip(values, sizes)) / (len(sizes) - 1))


def _mean_matrix(matrices, sizes):
    N = sum(sizes)
    return sum(B / N * M for M, B in zip(matrices, sizes))


def _engine(model, x, y, batch_size, params=None):
    return CurvatureEngine(
        model, AnalysisData(x, y, "cross-entropy", batch_size), ParamScope.resolve(model, params)
    )


def _square_parts(A, matrices, probes):
    """2 mean_j (A g_j)^T A_b g_j per batch (A_b the batch's mean matrix)."""
    AG = A @ probes
    return [2 * float(((AG) * (Ab @ probes)).sum(0).mean()) for Ab in matrices]


def test_frobenius_data_error_equals_closed_form_of_first_order_parts():
    model, x, y = _mlp_and_data(n=12)
    engine = _engine(model, x, y, 4)
    dense, sizes = _per_batch_hessians(model, x, y, 4)
    H = _mean_matrix(dense, sizes)
    budget, block = 64, 8
    result = frobenius_sq(engine.hessian(), max_matvecs=budget, tol=1e-6, seed=5, block_size=block)
    # the probes of the main sample's first block: after the pilot's, from the same seed
    pilot = pilot_size(10, budget)
    P = H.shape[0]
    probes = rademacher_like(
        P, torch.Generator().manual_seed(5), torch.float64, "cpu", pilot + block
    )
    parts = _square_parts(H, dense, probes[:, pilot:])
    assert result.data is not None and result.data_matvecs == block
    assert result.matvecs == budget  # the data error's products are beside the budget
    assert result.data.per_batch == pytest.approx(parts, rel=1e-9)
    assert result.data.stderr == pytest.approx(_closed_form(parts, sizes), rel=1e-9)
    assert result.data.method == "batch means of 2 (A v)^T A_b v over 3 batches (first order)"
    # and off when asked: no product spent
    off = frobenius_sq(engine.hessian(), max_matvecs=budget, seed=5, data_error=False)
    assert off.data is None and off.data_matvecs == 0


def test_split_frobenius_data_errors_equal_closed_forms_for_h_g_and_n():
    model, x, y = _mlp_and_data(n=12, seed=1)
    engine = _engine(model, x, y, 4)
    dense_h, sizes = _per_batch_hessians(model, x, y, 4)
    params = list(model.parameters())
    dense_g = [cross_entropy_ggn(model, params, xb) for xb, _ in _batches(x, y, 4)]
    dense_n = [h - g for h, g in zip(dense_h, dense_g)]
    budget, block = 64, 8
    split = gn_nme_split(engine, max_matvecs=budget, tol=1e-6, seed=2, block_size=block)
    pilot = pilot_size(10, budget)
    P = dense_h[0].shape[0]
    probes = rademacher_like(
        P, torch.Generator().manual_seed(2), torch.float64, "cpu", pilot + block
    )
    assert split.data_matvecs == block
    for name, dense in (("hessian", dense_h), ("ggn", dense_g), ("nme", dense_n)):
        parts = _square_parts(_mean_matrix(dense, sizes), dense, probes[:, pilot:])
        error = split.square_data[name]
        assert error.per_batch == pytest.approx(parts, rel=1e-8), name
        assert error.stderr == pytest.approx(_closed_form(parts, sizes), rel=1e-8), name


def test_density_trace_data_error_from_the_first_lanczos_product():
    model, x, y = _mlp_and_data(n=10, seed=3)
    engine = _engine(model, x, y, 4)  # batches of 4, 4, 2
    dense, sizes = _per_batch_hessians(model, x, y, 4)
    P = dense[0].shape[0]
    columns = []
    apply = engine._apply

    def counted(V, *args, **kwargs):
        columns.append(1 if V.dim() == 1 else V.shape[1])
        return apply(V, *args, **kwargs)

    engine._apply = counted
    result = spectral_density(engine.hessian(), probes=3, steps=5, seed=4)
    assert sum(columns) == result.matvecs == 15  # no extra product
    generator = torch.Generator().manual_seed(4)
    starts = [rademacher_like(P, generator, torch.float64, "cpu") for _ in range(3)]
    parts = [float(sum(z @ Hb @ z for z in starts)) / 3 for Hb in dense]  # P v^T A_b v
    assert result.data is not None
    assert result.data.per_batch == pytest.approx(parts, rel=1e-9)
    assert result.to_dict()["trace_data_stderr"] == pytest.approx(
        _closed_form(parts, sizes), rel=1e-9
    )


def test_blocks_trace_and_eigen_data_errors_and_the_sum_of_correlated_blocks():
    model, x, y = _mlp_and_data(n=12, seed=4)
    dense, sizes = _per_batch_hessians(model, x, y, 4)
    first = slice(0, 12)  # the first Linear's weight and bias, then the second's
    second = slice(12, 20)

    def make(spec):
        return _engine(model, x, y, 4, spec)

    names = [name for name, _ in model.named_parameters()]
    passes = block_engines(names, "modules", model, make)  # "0" and "2"
    # the exact estimator has no data error; Hutch++ whose sketch spans a block is exact
    rows, total = trace_blocks(
        passes,
        operator="hessian",
        estimator="hutchpp",
        tol=1e-8,
        max_matvecs=200,
        square=False,
        seed=0,
    )
    for row, sl in zip(rows, (first, second)):
        parts = [float(torch.trace(Hb[sl, sl])) for Hb in dense]
        assert row["estimate"] == pytest.approx(
            sum(B / 12 * v for v, B in zip(parts, sizes)), rel=1e-9
        )
        assert row["data_stderr"] == pytest.approx(_closed_form(parts, sizes), rel=1e-8)
    whole = [float(torch.trace(Hb)) for Hb in dense]
    assert total["data_stderr"] == pytest.approx(_closed_form(whole, sizes), rel=1e-8)
    # not the blocks' errors in quadrature: they share the batches
    quadrature = math.hypot(rows[0]["data_stderr"], rows[1]["data_stderr"])
    assert total["data_stderr"] != pytest.approx(quadrature, rel=1e-3)

    eigen_rows = eigen_blocks(
        block_engines(names, "modules", model, make),
        operator="hessian",
        top_k=1,
        which="largest",
        method="lanczos",
        tol=1e-10,
        max_matvecs=None,
        seed=0,
    )
    for row, sl in zip(eigen_rows, (first, second)):
        block = _mean_matrix([Hb[sl, sl] for Hb in dense], sizes)
        u = torch.linalg.eigh(block).eigenvectors[:, -1]
        parts = [float(u @ Hb[sl, sl] @ u) for Hb in dense]
        assert row["data_stderr"][0] == pytest.approx(_closed_form(parts, sizes), rel=1e-6)
        assert row["data_matvecs"] == 1


def test_summed_error_refuses_different_batches():
    a = batch_means_stderr([0.5, 1.5], [2, 2])
    b = batch_means_stderr([0.5, 1.5, 1.0], [1, 1, 2])
    assert summed_error([a, b]) is None and summed_error([a, None]) is None


def test_fisher_rao_data_errors_equal_closed_forms():
    model, x, y = _mlp_and_data(n=10, seed=5)
    found = fisher_rao_norm(model, AnalysisData(x, y, "cross-entropy", 4))
    params = list(model.parameters())
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    model_parts, empirical_parts, sizes = [], [], []
    for xb, yb in _batches(x, y, 4):
        G = cross_entropy_ggn(model, params, xb)  # the batch's mean GGN
        model_parts.append(float(theta @ G @ theta))
        squares = []
        for i in range(xb.shape[0]):  # per-sample gradients by autograd
            loss = nn.functional.cross_entropy(model(xb[i : i + 1]), yb[i : i + 1])
            grads = torch.autograd.grad(loss, params)
            squares.append(float(torch.cat([g.reshape(-1) for g in grads]) @ theta) ** 2)
        empirical_parts.append(sum(squares) / len(squares))
        sizes.append(xb.shape[0])
    assert found["fisher_rao_norm_sq_data_stderr"] == pytest.approx(
        _closed_form(model_parts, sizes), rel=1e-8
    )
    assert found["fisher_rao_norm_sq_empirical_data_stderr"] == pytest.approx(
        _closed_form(empirical_parts, sizes), rel=1e-8
    )


# -- the batch-means error against a delete-one-batch jackknife, computed directly ------------

# lambda_max's first-order error misses the eigenvector's movement (second order in the
# data's spread): on this model (K = 8 batches of 25; lambda_1 = 0.692, lambda_2 = 0.486, a
# gap of four data errors) the first order is 2.4 % above the jackknife (0.0531 and 0.0519);
# 5 % is the stated tolerance (the case is deterministic: no probe, the data seeded).
JACKKNIFE_LAMBDA_RTOL = 0.05


def _jackknife(values):
    """sqrt((K - 1) / K sum_b (theta_(-b) - mean)^2) of the delete-one-batch values."""
    K = len(values)
    mean = sum(values) / K
    return math.sqrt((K - 1) / K * sum((v - mean) ** 2 for v in values))


def _jackknife_case():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(200, 4, dtype=torch.float64) * torch.tensor([2.0, 1.0, 0.5, 0.3])
    y = torch.randint(0, 3, (200,))
    dense, sizes = _per_batch_hessians(model, x, y, 25)
    return model, x, y, dense, sizes


def test_trace_batch_means_equals_the_delete_one_batch_jackknife():
    model, x, y, dense, sizes = _jackknife_case()
    K = len(dense)
    # delete-one-batch traces, directly: the mean Hessian of the other K - 1 batches
    left_out = [
        float(torch.trace(sum(dense[c] for c in range(K) if c != b))) / (K - 1) for b in range(K)
    ]
    engine = _engine(model, x, y, 25)
    P = engine.scope.numel
    result = trace_result(engine, estimator="hutchpp", tol=1e-10, max_matvecs=4 * P)
    # linear in the data, equal batches: the two are the same number (to rounding)
    assert result.data.stderr == pytest.approx(_jackknife(left_out), rel=1e-9)


def test_lambda_max_first_order_agrees_with_the_delete_one_batch_jackknife():
    model, x, y, dense, sizes = _jackknife_case()
    K = len(dense)
    left_out = [
        float(torch.linalg.eigvalsh(sum(dense[c] for c in range(K) if c != b) / (K - 1))[-1])
        for b in range(K)
    ]
    result = eigen_result(_engine(model, x, y, 25), top_k=1, tol=1e-10)
    assert result.data_stderr[0] == pytest.approx(_jackknife(left_out), rel=JACKKNIFE_LAMBDA_RTOL)


SCALES = torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64)
# single-output linear regression with mse: H = 2 E[(x, 1)(x, 1)^T] = 2 diag(9, 1, 0.25, 1)
POPULATION_SQUARE = 4 * (float((SCALES**4).sum()) + 1)  # Tr(H^2) = 332.25


def test_square_data_error_calibrated_over_disjoint_samples():
    """Over 120 disjoint samples of a task with a known population Hessian,
    (Tr(H^2) - truth) / data_stderr has sd within 0.7-1.4 (measured 0.98), and the reported
    errors' root mean square is the estimates' spread (measured 1.16 times): the first order
    and its 8 probes' per-batch parts cover. (Tr(H^2) of a sample is biased up by about
    Tr(Var H_hat), here 0.2 of an error.) 8 CPU s."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Linear(3, 1).double()
    scope = ParamScope.resolve(model)
    estimates, errors = [], []
    for replicate in range(120):
        x = torch.randn(96, 3, dtype=torch.float64, generator=generator) * SCALES
        y = torch.randn(96, 1, dtype=torch.float64, generator=generator)
        engine = CurvatureEngine(model, AnalysisData(x, y, "mse", 6), scope)  # 16 batches
        result = frobenius_sq(engine.hessian(), max_matvecs=20, tol=1e-9, seed=replicate)
        estimates.append(result.estimate)
        errors.append(result.data.stderr)
    estimates_t = torch.tensor(estimates, dtype=torch.float64)
    errors_t = torch.tensor(errors, dtype=torch.float64)
    z = (estimates_t - POPULATION_SQUARE) / errors_t
    assert 0.7 <= float(z.std()) <= 1.4, float(z.std())
    ratio = float((errors_t**2).mean().sqrt() / estimates_t.std())
    assert 0.7 <= ratio <= 1.4, ratio
