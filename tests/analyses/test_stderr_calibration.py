"""Every standard error sharp prints against the spread of its estimate over seeds.

For each estimator, on a tiny float64 model whose true value is known (a dense Hessian, or
a reference estimate with far more draws), the z-scores ``(estimate - truth) / stderr`` over
at least 16 seeds must have a standard deviation within [0.7, 1.4] and a mean within
``3 / sqrt(seeds)`` of 0 (plus slack for the reference's own error): a standard error 10 times
too small (Theorem 2's, which combined per-sample errors of shared draws as if independent)
gives z-scores spread over +-10.
"""

from __future__ import annotations

import math

import pytest
import torch
from hessian_helpers import cross_entropy_ggn, double_backward_hessian
from torch import nn

from sharpcli.analyses.noise_stability import noise_stability_check
from sharpcli.analyses.theorem2 import theorem2_check
from sharpcli.curvature.operators.hessian import CurvatureEngine, MatrixOperator
from sharpcli.curvature.products.data import AnalysisData
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.curvature.trace.ggn import exact_ggn_trace, gn_split_trace
from sharpcli.curvature.trace.hutchinson import frobenius_sq, hutchinson
from sharpcli.curvature.trace.hutchpp import hutchpp
from sharpcli.curvature.trace.sampled_ggn import sampled_label_ggn_trace
from sharpcli.curvature.trace.split import gn_nme_split

SEEDS = range(32)


def _z_scores_calibrated(estimates, stderrs, truth, slack: float = 0.0) -> None:
    z = torch.tensor([(e - truth) / s for e, s in zip(estimates, stderrs)], dtype=torch.float64)
    assert 0.7 <= float(z.std()) <= 1.4, (float(z.std()), z.tolist())
    assert abs(float(z.mean())) <= 3 / math.sqrt(len(z)) + slack, (float(z.mean()), z.tolist())


@pytest.fixture(scope="module")
def tiny():
    """A GELU MLP (75 parameters) on 48 samples, its dense Hessian and Gauss-Newton matrix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 3)).double().eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(48, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (48,), generator=generator)
    params = list(model.parameters())
    H = double_backward_hessian(model, params, x, y)
    logits = model(x)
    rows = [
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(v, params, retain_graph=True)])
        for v in logits.reshape(-1)
    ]
    J = torch.stack(rows).reshape(48, 3, -1)
    p = torch.softmax(logits.detach(), 1)
    hz = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    G = torch.einsum("nca,ncd,ndb->ab", J, hz, J) / 48
    data = AnalysisData(x, y, "cross-entropy", 48)
    return model, data, ParamScope.resolve(model, "all"), H, G


def test_hutchinson_and_square_stderrs(tiny):
    """At a fixed budget (tolerance unreachable): no stopping rule selects the probes."""
    model, data, scope, H, _ = tiny
    op = CurvatureEngine(model, data, scope).hessian()
    for estimator, truth in (
        (hutchinson, float(torch.trace(H))),
        (frobenius_sq, float((H * H).sum())),
    ):
        runs = [estimator(op, tol=1e-9, max_matvecs=32, seed=seed) for seed in SEEDS]
        _z_scores_calibrated([r.estimate for r in runs], [r.stderr for r in runs], truth)


def test_gn_nme_split_stderrs(tiny):
    """Traces and Tr(A^2) of H, G and N from shared probes, each against its dense value."""
    model, data, scope, H, G = tiny
    engine = CurvatureEngine(model, data, scope)
    runs = [gn_nme_split(engine, tol=1e-9, max_matvecs=32, seed=seed) for seed in SEEDS]
    N = H - G
    for name, A in (("hessian", H), ("ggn", G), ("nme", N)):
        for quantity, truth in (("trace", torch.trace(A)), ("frobenius_sq", (A * A).sum())):
            values = [r.values[name][quantity] for r in runs]
            _z_scores_calibrated(
                [v["estimate"] for v in values], [v["stderr"] for v in values], float(truth)
            )


def test_sampled_label_ggn_trace_stderr(tiny):
    """With several label draws per sample the error is over the draws alone (one draw
    falls back on the spread over points, conservative by design)."""
    model, data, scope, _, G = tiny
    runs = [
        sampled_label_ggn_trace(
            model, data, scope, samples=4, generator=torch.Generator().manual_seed(seed)
        )
        for seed in SEEDS
    ]
    _z_scores_calibrated(
        [r.estimate for r in runs], [r.stderr for r in runs], float(torch.trace(G))
    )


def test_theorem2_smoothed_stderr_is_that_of_the_dataset_mean(tiny):
    """The K draws are shared by every sample: the standard error is over draws."""
    model, data, _, _, _ = tiny
    reference = theorem2_check(model, data, [0.5], mc_samples=20000, seed=999)[0]
    rows = [theorem2_check(model, data, [0.5], mc_samples=64, seed=seed)[0] for seed in SEEDS]
    estimates = [r.smoothed_cross_entropy for r in rows]
    stderrs = [r.smoothed_stderr for r in rows]
    # the reference's own error, relative to one run's: sqrt(64 / 20000) = 0.06
    _z_scores_calibrated(estimates, stderrs, reference.smoothed_cross_entropy, slack=0.3)
    spread = float(torch.tensor(estimates).std())
    assert 0.6 < sum(stderrs) / len(stderrs) / spread < 1.6


@pytest.mark.parametrize(
    "estimator,quantity,tol",
    [(frobenius_sq, "square", 0.05), (hutchinson, "trace", 0.2), (hutchpp, "trace", 0.03)],
    ids=["frobenius_sq", "hutchinson", "hutchpp"],
)
def test_stderrs_when_the_tolerance_sizes_the_sample(tiny, estimator, quantity, tol):
    """At the CLI's defaults but a tolerance the probes reach: a pilot sizes the sample and
    the reported mean and standard error are those of the probes drawn after it (stopping
    at the first probe count whose own standard error passed would bias it low)."""
    _, _, _, H, _ = tiny
    op = MatrixOperator(H)  # the same products as the Hessian operator, faster
    truth = float((H * H).sum()) if quantity == "square" else float(torch.trace(H))
    runs = [estimator(op, tol=tol, seed=seed) for seed in range(48)]
    # sized by the tolerance, not the budget; the pilot's probes are not in the estimate
    assert all(r.matvecs < 1000 and r.samples <= r.matvecs - 10 for r in runs)
    _z_scores_calibrated([r.estimate for r in runs], [r.stderr for r in runs], truth)
    assert (
        sum(r.converged for r in runs) >= 2 * len(runs) // 3
    )  # mostly sized for tol (a heavy-tailed tiny case)
    for r in runs:
        if r.converged:
            assert r.stderr <= tol * abs(r.estimate)


def test_hutchpp_exact_part_plus_residual_stderr(tiny):
    """Hutch++ with a sketch of a third of the space: the exact part adds no error, the
    residual's probes give all of it (a fixed budget, and gn-split's known part)."""
    model, data, scope, H, G = tiny
    op = MatrixOperator(H)
    runs = [
        hutchpp(op, tol=1e-9, max_matvecs=90, seed=seed, initial_sketch=24, max_sketch=24)
        for seed in SEEDS
    ]
    assert all(r.sketch_size == 24 and r.samples >= 20 for r in runs)
    truth = float(torch.trace(H))
    _z_scores_calibrated([r.estimate for r in runs], [r.stderr for r in runs], truth)
    engine = CurvatureEngine(model, data, scope)
    split = [gn_split_trace(engine, tol=0.05, seed=seed) for seed in range(16)]
    _z_scores_calibrated([r.estimate for r in split], [r.stderr for r in split], truth)


def _expected_gap(model, data, sigma: float, draws: int) -> float:
    """``E_U (L(theta + U) + L(theta - U))/2 - L(theta)``, ``U ~ N(0, sigma^2 I)``, by plain
    Monte Carlo over ``draws`` directions with vmapped forward passes (no Hessian)."""
    names = [n for n, _ in model.named_parameters()]
    theta = [p.detach() for _, p in model.named_parameters()]

    def loss_at(*params):
        logits = torch.func.functional_call(model, dict(zip(names, params)), (data.x,))
        return nn.functional.cross_entropy(logits, data.y)

    generator = torch.Generator().manual_seed(12345)
    Z = [torch.randn(draws, *p.shape, generator=generator, dtype=p.dtype) for p in theta]
    at = torch.func.vmap(loss_at)
    with torch.no_grad():
        plus = at(*[p + sigma * z for p, z in zip(theta, Z)])
        minus = at(*[p - sigma * z for p, z in zip(theta, Z)])
        return float(((plus + minus) / 2).mean() - loss_at(*theta))


def test_noise_stability_stderrs(tiny):
    """NSO eq. 4: the plain and control-variate gaps, the predicted sigma^2/2 tr(H) and the
    Taylor residual, each against its expectation (the gap's from 4000 other draws)."""
    model, data, scope, H, _ = tiny
    sigma = 0.3
    gap = _expected_gap(model, data, sigma, 4000)
    predicted = sigma**2 / 2 * float(torch.trace(H))
    rows = [
        noise_stability_check(
            model, data, [sigma], scope, noise_pairs=32, trace_tol=0.05, seed=seed
        )["rows"][0]
        for seed in range(16)
    ]
    # the reference's own error, relative to one run's: sqrt(32 / 4000) = 0.09
    for key, truth in (
        ("gap", gap),
        ("gap_control_variate", gap),
        ("predicted", predicted),
        ("taylor_residual", gap - predicted),
    ):
        values = [r[key] for r in rows]
        stderrs = [r[f"{key}_stderr"] for r in rows]
        _z_scores_calibrated(values, stderrs, truth, slack=0.0 if key == "predicted" else 0.3)


def test_gn_nme_split_stderrs_when_the_tolerance_sizes_the_sample(tiny):
    """gn-nme's joint estimates sized by a pilot for the slower of tr(H) and tr(G): the
    reported standard errors are fixed-n ones, calibrated over seeds, and mostly reach tol."""
    model, data, scope, H, G = tiny
    engine = CurvatureEngine(model, data, scope)
    tol = 0.1
    runs = [gn_nme_split(engine, tol=tol, seed=seed) for seed in range(24)]
    assert all(r.matvecs < 1000 and r.samples <= r.matvecs - 10 for r in runs)
    for name, A in (("hessian", H), ("ggn", G)):
        values = [r.values[name]["trace"] for r in runs]
        _z_scores_calibrated(
            [v["estimate"] for v in values], [v["stderr"] for v in values], float(torch.trace(A))
        )
    assert sum(r.converged for r in runs) >= 2 * len(runs) // 3


def test_density_trace_stderr(tiny):
    """SLQ's trace and its standard error (each probe's quadrature value is a Hutchinson
    sample) against tr(H) over seeds."""
    from sharpcli.curvature.density import spectral_density

    _, _, _, H, _ = tiny
    op = MatrixOperator(H)
    runs = [spectral_density(op, probes=32, steps=6, seed=seed) for seed in SEEDS]
    _z_scores_calibrated(
        [r.trace_estimate for r in runs], [r.trace_stderr for r in runs], float(torch.trace(H))
    )


class _TiedModule(nn.Module):
    """One hidden ``nn.Linear`` applied twice (a tied module)."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return self.out(h)


def _model_case(model: nn.Module, x: torch.Tensor):
    """``(model, data, scope, H)`` of ``model`` on ``x`` with random labels of 3 classes."""
    model = model.double().eval()
    y = torch.randint(0, 3, (x.shape[0],), generator=torch.Generator().manual_seed(2))
    H = double_backward_hessian(model, list(model.parameters()), x, y)
    data = AnalysisData(x, y, "cross-entropy", x.shape[0])
    return model, data, ParamScope.resolve(model, "all"), H


@pytest.fixture(scope="module")
def tied_module():
    """The tied-module model (93 parameters) on 32 samples, its dense Hessian."""
    torch.manual_seed(0)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return _model_case(_TiedModule(), x)


def _hutchpp_case(case: str, tied_module) -> torch.Tensor:
    """The dense operator of each case where the sketch holds most of the trace."""
    if case == "tied-module":
        return tied_module[3]
    if case == "grouped-conv":
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(4, 4, 3, groups=2),
            nn.Tanh(),
            nn.Conv2d(4, 4, 3, groups=4),
            nn.Flatten(),
            nn.Linear(16, 3),
        )
        x = torch.randn(8, 4, 6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        return _model_case(model, x)[3]
    # a spectrum dominated by a few directions: 1/i^2 in a random basis of R^200
    U, _ = torch.linalg.qr(
        torch.randn(200, 200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    )
    return (U / torch.arange(1, 201, dtype=torch.float64) ** 2) @ U.T


@pytest.mark.parametrize("case", ["few-directions", "grouped-conv", "tied-module"])
def test_hutchpp_stderr_covers_when_the_sketch_holds_most_of_the_trace(case, tied_module):
    """At `trace --trace-tol 0.02` (400 products at most), where the sketch takes most of the
    trace and the residual's main sample is often at its floor of 10 probes: a variance from
    those 10 alone spread the z-scores with sd 1.2 to 1.5 (and a basis that lost
    orthogonality biased them); pooled with the pilot's probes it covers."""
    A = _hutchpp_case(case, tied_module)
    truth = float(torch.trace(A))
    runs = [hutchpp(MatrixOperator(A), tol=0.02, max_matvecs=400, seed=seed) for seed in range(48)]
    if case != "tied-module":  # the floor case is exercised
        assert sum(r.samples <= 12 for r in runs) >= 16
    assert all(r.sketch_size > 0 and r.matvecs <= 400 for r in runs)
    _z_scores_calibrated([r.estimate for r in runs], [r.stderr for r in runs], truth)


def test_gn_nme_estimates_on_a_tied_module(tied_module):
    """A module used twice: the joint split's tr(H), tr(G) and tr(N), and gn-split's tr(H)
    (exact tr(G), whose per-sample norms square the sum of both uses' gradients, plus
    Hutch++ on N), against the dense Hessian and Gauss-Newton matrix."""
    model, data, scope, H = tied_module
    params = list(model.parameters())
    G = cross_entropy_ggn(model, params, data.x)
    engine = CurvatureEngine(model, data, scope)
    exact = exact_ggn_trace(model, data, scope)
    assert exact.estimate == pytest.approx(float(G.trace()), rel=1e-12)
    for layer, block in scope.blocks().items():
        assert exact.by_layer[layer]["estimate"] == pytest.approx(
            float(G[block, block].trace()), rel=1e-12
        )
    runs = [gn_nme_split(engine, tol=1e-9, max_matvecs=32, seed=seed) for seed in SEEDS]
    for name, A in (("hessian", H), ("ggn", G), ("nme", H - G)):
        values = [r.values[name]["trace"] for r in runs]
        _z_scores_calibrated(
            [v["estimate"] for v in values], [v["stderr"] for v in values], float(A.trace())
        )
    split = [gn_split_trace(engine, tol=0.05, max_matvecs=100, seed=seed) for seed in SEEDS]
    _z_scores_calibrated(
        [r.estimate for r in split], [r.stderr for r in split], float(torch.trace(H))
    )
