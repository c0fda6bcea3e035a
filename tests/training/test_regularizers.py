"""Regularizer registry and gradient oracles of ``sharp train`` (docs/commands/train.md).

Every gradient is checked against an independent float64 computation on tiny models:
central finite differences of the stated objective (ad, wd, gp, gn-trace, fa,
hessian-trace), hand-computed perturbed gradients (sam, usam, asam, weight-noise, nso),
dense ``torch.func`` Hessians / Jacobians for the stochastic estimators' means.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from sharpcli.errors import NumericalError, UsageError
from sharpcli.losses import get_loss
from sharpcli.regularizers import registry as R
from sharpcli.regularizers.passes import StepPasses
from sharpcli.regularizers.penalties.nme import GradientPenalty
from sharpcli.regularizers.perturbed.sam import SAM
from sharpcli.regularizers.registry import (
    REGISTRY,
    model_overrides,
    parse_reg,
    validate_combination,
)
from sharpcli.regularizers.stats import StepStats
from sharpcli.regularizers.step import training_step
from sharpcli.specs import RegistryError

DT = torch.float64


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny float64 models: thread wake-ups on shared cores cost more than the math."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_model(act: type[nn.Module] = nn.Tanh, seed: int = 0, width: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, width), act(), nn.Linear(width, 3)).to(DT)


def batch(n: int = 6, seed: int = 1, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=DT)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def unflatten(model: nn.Module, vec: torch.Tensor) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for name, p in model.named_parameters():
        out[name] = vec[i : i + p.numel()].reshape(p.shape)
        i += p.numel()
    return out


def logits_at(model, vec, x):
    return functional_call(model, unflatten(model, vec), (x,))


def ce_at(model, vec, x, y):
    return F.cross_entropy(logits_at(model, vec, x), y)


def grad_at(model, vec, x, y, create_graph=False):
    vec = vec.detach().requires_grad_(True)
    loss = ce_at(model, vec, x, y)
    (g,) = torch.autograd.grad(loss, vec, create_graph=create_graph)
    return g, vec


def produced_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def central_fd(fn, vec: torch.Tensor, h: float = 1e-5) -> torch.Tensor:
    out = torch.empty_like(vec)
    for i in range(vec.numel()):
        e = torch.zeros_like(vec)
        e[i] = h
        out[i] = (fn(vec + e) - fn(vec - e)) / (2 * h)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def step(model, x, y, specs, seed=0, loss="cross-entropy") -> StepStats:
    regs = [parse_reg(s) for s in specs]
    return training_step(model, x, y, loss, regs, torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- additive penalties vs finite differences
@pytest.mark.parametrize("act", [nn.Tanh, nn.GELU])
def test_weight_decay_gradient_matches_finite_differences(act):
    model, (x, y) = tiny_model(act), batch()
    theta = flat_params(model)
    stats = step(model, x, y, ["wd:sigma=0.3"])
    objective = lambda v: ce_at(model, v, x, y) + 0.3**2 / 2 * (v**2).sum()
    assert rel_err(produced_grad(model), central_fd(objective, theta)) < 1e-6
    assert stats.penalties["wd"] == pytest.approx(0.045 * float((theta**2).sum()), rel=1e-12)
    assert stats.objective == pytest.approx(float(objective(theta)), rel=1e-12)


@pytest.mark.parametrize("act", [nn.Tanh, nn.GELU])
def test_activation_decay_gradient_matches_finite_differences(act):
    model, (x, y) = tiny_model(act), batch()
    theta = flat_params(model)

    def penultimate(v):  # input of the final Linear, computed by hand
        p = unflatten(model, v)
        return act()(x @ p["0.weight"].T + p["0.bias"])

    objective = lambda v: ce_at(model, v, x, y) + 0.5**2 / 2 * penultimate(v).pow(2).sum(1).mean()
    stats = step(model, x, y, ["ad:0.5"])
    assert rel_err(produced_grad(model), central_fd(objective, theta)) < 1e-6
    assert stats.objective == pytest.approx(float(objective(theta)), rel=1e-12)
    assert stats.loss == pytest.approx(float(ce_at(model, theta, x, y)), rel=1e-12)
    assert stats.grad_evals == 1


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("act", [nn.Tanh, nn.GELU])
def test_gradient_penalty_exact_matches_finite_differences(p, act):
    model, (x, y) = tiny_model(act), batch()
    theta = flat_params(model)
    rho = 0.2

    def objective(v):
        g, _ = grad_at(model, v, x, y)
        return ce_at(model, v, x, y) + rho * g.norm() ** p

    stats = step(model, x, y, [f"gp:rho={rho},p={p}"])
    assert rel_err(produced_grad(model), central_fd(objective, theta)) < 1e-6
    assert stats.objective == pytest.approx(float(objective(theta)), rel=1e-12)
    assert stats.grad_evals == 3


@pytest.mark.parametrize("p", [1, 2])
def test_gradient_penalty_fd_mode_approximates_exact(p):
    model, (x, y) = tiny_model(nn.GELU), batch()
    step(model, x, y, [f"gp:0.2,{p}"])
    exact = produced_grad(model).clone()
    stats = step(model, x, y, [f"gp:0.2,{p},mode=fd,eps=1e-4"])
    # central difference: O(eps^2) truncation
    assert rel_err(produced_grad(model), exact) < 1e-6
    assert stats.grad_evals == 3


def test_gradient_penalty_combines_with_activation_decay_and_weight_decay():
    model, (x, y) = tiny_model(nn.GELU), batch()
    theta = flat_params(model)

    def objective(v):
        g, _ = grad_at(model, v, x, y)
        pr = unflatten(model, v)
        h = F.gelu(x @ pr["0.weight"].T + pr["0.bias"])
        return (
            ce_at(model, v, x, y)
            + 0.1 * g.norm()
            + 0.02 * h.pow(2).sum(1).mean()
            + 0.005 * (v**2).sum()
        )

    for mode in ("exact", "fd"):
        stats = step(model, x, y, [f"gp:0.1,1,mode={mode},eps=1e-4", "ad:0.2", "wd:0.1"])
        assert rel_err(produced_grad(model), central_fd(objective, theta)) < 1e-6
        assert stats.objective == pytest.approx(float(objective(theta)), rel=1e-12)


# --------------------------------------------------------------------------- perturbation oracles
def _sam_like_expected(model, x, y, perturb):
    theta = flat_params(model)
    g, _ = grad_at(model, theta, x, y)
    eps = perturb(theta, g)
    expected, _ = grad_at(model, theta + eps, x, y)
    return expected


def test_sam_gradient_is_gradient_at_normalised_ascent_point():
    model, (x, y) = tiny_model(nn.GELU), batch()
    expected = _sam_like_expected(model, x, y, lambda t, g: 0.3 * g / g.norm())
    stats = step(model, x, y, ["sam:0.3"])
    assert rel_err(produced_grad(model), expected) < 1e-12
    assert stats.grad_evals == 2


def test_usam_gradient_is_gradient_at_unnormalised_ascent_point():
    model, (x, y) = tiny_model(nn.GELU), batch()
    expected = _sam_like_expected(model, x, y, lambda t, g: 0.7 * g)
    stats = step(model, x, y, ["usam:rho=0.7"])
    assert rel_err(produced_grad(model), expected) < 1e-12
    assert stats.grad_evals == 2


def test_asam_gradient_is_gradient_at_adaptive_ascent_point():
    model, (x, y) = tiny_model(nn.GELU), batch()
    is_weight = torch.cat([torch.full((p.numel(),), p.dim() > 1) for p in model.parameters()])

    def perturb(theta, g):
        t = torch.where(is_weight, theta.abs() + 0.05, torch.ones_like(theta))
        return 0.4 * t**2 * g / (t * g).norm()

    expected = _sam_like_expected(model, x, y, perturb)
    step(model, x, y, ["asam:rho=0.4,eta=0.05"])
    assert rel_err(produced_grad(model), expected) < 1e-12


def test_asam_with_zero_eta_never_perturbs_zero_weights():
    model, (_x, _y) = tiny_model(nn.GELU), batch()
    with torch.no_grad():
        model[0].weight[0].zero_()
    reg = parse_reg("asam:rho=0.5,eta=0")
    deltas = reg.perturbation(
        [p.detach() for p in model.parameters()], [torch.ones_like(p) for p in model.parameters()]
    )
    assert torch.count_nonzero(deltas[0][0]) == 0
    assert torch.count_nonzero(deltas[0][1:]) == deltas[0][1:].numel()


def _gaussian_draws(model, sigma, gen):
    """The documented draw of ``gaussian_like``: one flat normal_ over all parameters, times sigma."""
    total = sum(p.numel() for p in model.parameters())
    return torch.empty(total, dtype=DT).normal_(generator=gen) * sigma


@pytest.mark.parametrize("report", ["perturbed", "clean"])
def test_weight_noise_gradient_is_gradient_at_drawn_noise(report):
    model, (x, y) = tiny_model(nn.GELU), batch()
    theta = flat_params(model)
    u = _gaussian_draws(model, 0.2, torch.Generator().manual_seed(5))
    expected, _ = grad_at(model, theta + u, x, y)
    stats = step(model, x, y, [f"weight-noise:0.2,report={report}"], seed=5)
    assert rel_err(produced_grad(model), expected) < 1e-12
    at = theta + u if report == "perturbed" else theta
    assert stats.loss == pytest.approx(float(ce_at(model, at, x, y)), rel=1e-12)
    assert stats.objective == stats.loss
    assert stats.correct == int((logits_at(model, at, x).argmax(1) == y).sum())
    assert stats.grad_evals == 1


@pytest.mark.parametrize("report", ["perturbed", "clean"])
@pytest.mark.parametrize("k", [1, 3])
def test_nso_gradient_is_two_point_average(k, report):
    model, (x, y) = tiny_model(nn.GELU), batch()
    theta = flat_params(model)
    gen = torch.Generator().manual_seed(9)
    expected = torch.zeros_like(theta)
    losses, first_point = [], None
    for _ in range(k):
        u = _gaussian_draws(model, 0.1, gen)
        first_point = theta + u if first_point is None else first_point
        expected += grad_at(model, theta + u, x, y)[0] + grad_at(model, theta - u, x, y)[0]
        losses += [float(ce_at(model, theta + u, x, y)), float(ce_at(model, theta - u, x, y))]
    expected /= 2 * k
    stats = step(model, x, y, [f"nso:sigma=0.1,k={k},report={report}"], seed=9)
    assert rel_err(produced_grad(model), expected) < 1e-12
    if report == "clean":
        assert stats.loss == pytest.approx(float(ce_at(model, theta, x, y)), rel=1e-12)
        assert stats.correct == int((logits_at(model, theta, x).argmax(1) == y).sum())
    else:  # mean over the 2k passes; accuracy of the pass at theta + U_1
        assert stats.loss == pytest.approx(sum(losses) / (2 * k), rel=1e-12)
        assert stats.correct == int((logits_at(model, first_point, x).argmax(1) == y).sum())
    assert stats.grad_evals == 2 * k


def test_nso_perturbed_report_averages_penalties_over_the_passes():
    model, (x, y) = tiny_model(nn.GELU), batch()
    theta = flat_params(model)
    u = _gaussian_draws(model, 0.1, torch.Generator().manual_seed(3))
    wd = lambda v: 0.5 * 0.3**2 * float((v**2).sum())
    stats = step(model, x, y, ["nso:sigma=0.1", "wd:0.3"], seed=3)
    assert stats.penalties["wd"] == pytest.approx((wd(theta + u) + wd(theta - u)) / 2, rel=1e-12)
    mean_loss = (float(ce_at(model, theta + u, x, y)) + float(ce_at(model, theta - u, x, y))) / 2
    assert stats.objective == pytest.approx(mean_loss + stats.penalties["wd"], rel=1e-12)


def test_sam_ascends_on_the_penalised_objective_and_descends_on_it():
    model, (x, y) = tiny_model(nn.GELU), batch()
    theta = flat_params(model)
    g, _ = grad_at(model, theta, x, y)
    g = g + 0.5**2 * theta  # wd:0.5 adds sigma^2 theta
    eps = 0.1 * g / g.norm()
    expected = grad_at(model, theta + eps, x, y)[0] + 0.25 * (theta + eps)
    step(model, x, y, ["sam:0.1", "wd:0.5"])
    assert rel_err(produced_grad(model), expected) < 1e-12


# --------------------------------------------------------------------------- stochastic estimators
def _sample_stats(values):
    t = torch.tensor(values, dtype=DT)
    return float(t.mean()), float(t.std() / math.sqrt(len(values)))


def _estimator_values(model, x, y, reg_text, n, loss="cross-entropy", seed=0):
    reg = parse_reg(reg_text)
    engine = StepPasses(model, x, y, loss, [reg], torch.Generator().manual_seed(seed))
    return [float(engine.evaluate(want_grad=False).penalties[reg.name]) for _ in range(n)]


def _exact_gauss_newton_trace(model, x, loss):
    theta = flat_params(model)
    jac = torch.func.jacrev(lambda v: logits_at(model, v, x))(theta)  # (B, C, P)
    z = logits_at(model, theta, x)
    b, c = z.shape
    if loss == "cross-entropy":
        p = torch.softmax(z, -1)
        hz = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    else:
        hz = (2.0 / c) * torch.eye(c, dtype=DT).expand(b, c, c)
    return float(torch.einsum("bcp,bcd,bdp->", jac, hz, jac) / b)


@pytest.mark.parametrize("loss", ["cross-entropy", "mse"])
def test_gn_trace_estimator_is_unbiased_for_exact_gauss_newton_trace(loss):
    model, (x, y) = tiny_model(nn.GELU), batch(n=5)
    if loss == "mse":
        y = torch.randn(5, 3, dtype=DT, generator=torch.Generator().manual_seed(3))
    exact = _exact_gauss_newton_trace(model, x, loss)
    mean, se = _sample_stats(_estimator_values(model, x, y, "gn-trace:1.0", 800, loss=loss))
    assert abs(mean - exact) < 4 * se
    assert se < 0.08 * exact  # the test has power


def test_gn_trace_gradient_has_no_gradient_through_the_sampling():
    model, (x, y) = tiny_model(nn.GELU), batch()
    theta = flat_params(model)
    gen = torch.Generator().manual_seed(4)
    z = logits_at(model, theta, x)
    y_hat = get_loss("cross-entropy").sample_labels(z.detach(), gen)  # the loss's sampler

    def objective(v):  # sampled labels held fixed
        g_hat, _ = grad_at(model, v, x, y_hat)
        return ce_at(model, v, x, y) + 0.3 * x.shape[0] * (g_hat**2).sum()

    stats = step(model, x, y, ["gn-trace:0.3"], seed=4)
    assert rel_err(produced_grad(model), central_fd(objective, theta)) < 1e-6
    assert stats.objective == pytest.approx(float(objective(theta)), rel=1e-12)
    assert stats.grad_evals == 3


def _dense_hessian(model, x, y):
    theta = flat_params(model)
    return torch.func.hessian(lambda v: ce_at(model, v, x, y))(theta)


def test_fa_estimator_is_unbiased_for_trace_of_squared_hessian():
    model, (x, y) = tiny_model(nn.GELU), batch(n=5)
    hess = _dense_hessian(model, x, y)
    exact = float(torch.trace(hess @ hess))
    values = [
        v * x.shape[0] for v in _estimator_values(model, x, y, "fa:1.0", 400)
    ]  # fa reports ||Hv||^2 / B
    mean, se = _sample_stats(values)
    assert abs(mean - exact) < 4 * se
    assert se < 0.05 * exact


def test_hessian_trace_estimator_is_unbiased_for_trace_of_hessian():
    model, (x, y) = tiny_model(nn.GELU), batch(n=5)
    exact = float(torch.trace(_dense_hessian(model, x, y)))
    mean, se = _sample_stats(_estimator_values(model, x, y, "hessian-trace:1.0", 1000))
    assert abs(mean - exact) < 4 * se
    assert se < 0.08 * exact
    # several probes average: the value is the mean over probes of v^T H v
    mean4, se4 = _sample_stats(_estimator_values(model, x, y, "hessian-trace:1.0,4", 250))
    assert abs(mean4 - exact) < 4 * se4


def _rademacher_draws(model, gen):
    """The documented draw of ``rademacher_like``: one flat randint(0, 2) over all parameters."""
    total = sum(p.numel() for p in model.parameters())
    return torch.randint(0, 2, (total,), generator=gen, dtype=DT) * 2 - 1


def _hvp_at(model, v, x, y, probe):
    g, v = grad_at(model, v, x, y, create_graph=True)
    (hv,) = torch.autograd.grad(g @ probe, v)
    return hv


def test_fa_and_hessian_trace_gradients_match_finite_differences_with_fixed_probe():
    model, (x, y) = tiny_model(nn.GELU), batch()
    theta = flat_params(model)
    probe = _rademacher_draws(model, torch.Generator().manual_seed(2))
    b = x.shape[0]
    fa_objective = lambda v: (
        ce_at(model, v, x, y) + 0.3 * (_hvp_at(model, v, x, y, probe) ** 2).sum() / b
    )
    stats = step(model, x, y, ["fa:lambda=0.3,mode=exact"], seed=2)
    assert rel_err(produced_grad(model), central_fd(fa_objective, theta)) < 1e-6
    assert stats.objective == pytest.approx(float(fa_objective(theta)), rel=1e-12)
    assert stats.grad_evals == 7

    ht_objective = lambda v: ce_at(model, v, x, y) + 0.3 * probe @ _hvp_at(model, v, x, y, probe)
    stats = step(model, x, y, ["hessian-trace:sigma2=0.3,mode=exact"], seed=2)
    assert rel_err(produced_grad(model), central_fd(ht_objective, theta)) < 1e-6
    assert stats.grad_evals == 7


def _third_derivative_contraction(model, x, y, theta, a, b):
    """``D^3 L[a, b, .]`` at theta by triple autograd on the flat parameter vector (float64)."""
    g, v = grad_at(model, theta, x, y, create_graph=True)
    (hb,) = torch.autograd.grad(g @ b, v, create_graph=True)
    (out,) = torch.autograd.grad(hb @ a, v)
    return out


@pytest.mark.parametrize("act", [nn.Tanh, nn.GELU])
def test_finite_difference_modes_match_exact_third_order_gradients(act):
    """fd of hessian-trace and fa (central, O(eps^2)) against triple autograd in float64, with
    the documented step lengths s = eps/||v||, t = eps/||H v||."""
    model, (x, y) = tiny_model(act), batch()
    theta = flat_params(model)
    probe = _rademacher_draws(model, torch.Generator().manual_seed(2))
    b = x.shape[0]
    g = grad_at(model, theta, x, y)[0]
    hv = _hvp_at(model, theta, x, y, probe)

    stats = step(model, x, y, ["hessian-trace:sigma2=0.3,mode=fd,eps=1e-4"], seed=2)
    expected = g + 0.3 * _third_derivative_contraction(model, x, y, theta, probe, probe)
    assert rel_err(produced_grad(model), expected) < 1e-6
    assert stats.penalties["hessian-trace"] == pytest.approx(0.3 * float(probe @ hv), rel=1e-7)
    assert stats.grad_evals == 3
    exact = produced_grad(model).clone()
    step(model, x, y, ["hessian-trace:sigma2=0.3,mode=exact"], seed=2)
    assert rel_err(exact, produced_grad(model)) < 1e-6

    stats = step(model, x, y, ["fa:lambda=0.3,mode=fd,eps=1e-4"], seed=2)
    expected = g + 0.3 * 2 / b * _third_derivative_contraction(model, x, y, theta, probe, hv)
    assert rel_err(produced_grad(model), expected) < 1e-6
    assert stats.penalties["fa"] == pytest.approx(0.3 * float(hv @ hv) / b, rel=1e-7)
    assert stats.grad_evals == 7
    fd = produced_grad(model).clone()
    step(model, x, y, ["fa:lambda=0.3,mode=exact"], seed=2)
    assert rel_err(fd, produced_grad(model)) < 1e-6


def test_fa_fd_truncation_error_is_second_order_in_eps():
    model, (x, y) = tiny_model(nn.GELU), batch()
    theta = flat_params(model)
    probe = _rademacher_draws(model, torch.Generator().manual_seed(2))
    hv = _hvp_at(model, theta, x, y, probe)
    exact = 2 / x.shape[0] * _third_derivative_contraction(model, x, y, theta, probe, hv)
    g = grad_at(model, theta, x, y)[0]
    errors = []
    for eps in (1e-1, 1e-2):
        step(model, x, y, [f"fa:lambda=1,mode=fd,eps={eps}"], seed=2)
        errors.append(rel_err(produced_grad(model) - g, exact))
    # O(eps^2): ten times smaller step, about a hundred times smaller error
    assert 50 < errors[0] / errors[1] < 200


def test_finite_difference_penalties_combine_with_activation_and_weight_decay():
    model, (x, y) = tiny_model(nn.GELU), batch()
    theta = flat_params(model)
    probe = _rademacher_draws(model, torch.Generator().manual_seed(4))

    def objective(v):
        pr = unflatten(model, v)
        h = F.gelu(x @ pr["0.weight"].T + pr["0.bias"])
        return (
            ce_at(model, v, x, y)
            + 0.3 * probe @ _hvp_at(model, v, x, y, probe)
            + 0.02 * h.pow(2).sum(1).mean()
            + 0.005 * (v**2).sum()
        )

    stats = step(model, x, y, ["hessian-trace:0.3,mode=fd,eps=1e-4", "ad:0.2", "wd:0.1"], seed=4)
    assert rel_err(produced_grad(model), central_fd(objective, theta)) < 1e-6
    assert stats.objective == pytest.approx(float(objective(theta)), rel=1e-7)
    assert list(stats.penalties) == ["hessian-trace", "ad", "wd"]


# --------------------------------------------------------------------------- state: weights, BatchNorm, dropout RNG
ALL_REG_OPTIONS = [
    "none",
    "wd",
    "dropout",
    "ad",
    "sam",
    "usam",
    "asam",
    "gp",
    "gp:mode=fd",
    "gp:p=2",
    "hessian-trace",
    "hessian-trace:mode=fd",
    "gn-trace",
    "weight-noise",
    "weight-noise:report=clean",
    "nso:k=2",
    "nso:k=2,report=clean",
    "fa",
    "fa:mode=fd",
    "sam|hessian-trace",
]


def bn_dropout_model(p_drop=0.3):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 5), nn.BatchNorm1d(5), nn.GELU(), nn.Dropout(p_drop), nn.Linear(5, 3)
    ).to(DT)


@pytest.mark.parametrize("spec", ALL_REG_OPTIONS)
def test_weights_are_bitwise_unchanged_and_buffers_as_after_one_clean_pass(spec):
    model, (x, y) = bn_dropout_model(), batch(n=8)
    reference = bn_dropout_model()
    torch.manual_seed(123)
    reference(
        x
    )  # one plain train-mode forward: BatchNorm statistics and RNG as a clean pass leaves them
    rng_after_clean = torch.get_rng_state()
    before = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(123)
    step(model, x, y, spec.split("|"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for (name, buf), ref in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(buf, ref), name
    assert torch.equal(torch.get_rng_state(), rng_after_clean)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_sam_passes_share_dropout_masks():
    model, (x, y) = bn_dropout_model(p_drop=0.5), batch(n=8)
    # by hand: clean pass and ascent pass both start from the same RNG state
    torch.manual_seed(7)
    loss = F.cross_entropy(model(x), y)
    g = torch.autograd.grad(loss, list(model.parameters()))
    norm = torch.sqrt(sum((t**2).sum() for t in g))
    saved = [p.detach().clone() for p in model.parameters()]
    buffers = [b.detach().clone() for b in model.buffers()]
    with torch.no_grad():
        for p, t in zip(model.parameters(), g):
            p.add_(0.2 * t / norm)
    torch.manual_seed(7)
    expected = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
        for b, s in zip(model.buffers(), buffers):
            b.copy_(s)
    # fresh copy of the model state before the hand computation's clean pass
    model2 = bn_dropout_model(p_drop=0.5)
    torch.manual_seed(7)
    step(model2, x, y, ["sam:0.2"])
    got = torch.cat([p.grad.reshape(-1) for p in model2.parameters()])
    assert rel_err(got, torch.cat([t.reshape(-1) for t in expected])) < 1e-12


# --------------------------------------------------------------------------- evaluation counts
@pytest.mark.parametrize(
    "specs, evals",
    [
        (["none"], 1),
        (["wd"], 1),
        (["ad"], 1),
        (["dropout"], 1),
        (["ad", "wd"], 1),
        (["sam"], 2),
        (["usam"], 2),
        (["asam"], 2),
        (["weight-noise"], 1),
        (["nso:k=1"], 2),
        (["nso:k=3"], 6),
        (["gp"], 3),
        (["gp:mode=fd"], 3),
        (["gp:mode=fd", "ad"], 4),
        (["gn-trace"], 3),
        (["hessian-trace:mode=exact"], 7),
        (["hessian-trace:probes=2,mode=exact"], 11),
        (["fa:mode=exact"], 7),
        (["hessian-trace"], 7),  # the default mode=exact
        (["hessian-trace:mode=fd"], 3),
        (["hessian-trace:probes=2,mode=fd"], 5),
        (["fa"], 7),
        (["fa:mode=fd"], 7),
        (["hessian-trace:mode=fd", "ad"], 4),
        (["gp", "hessian-trace:mode=exact"], 7),  # the first-order graph is shared
        (["sam", "gp"], 6),
        (["ad", "sam"], 2),
        (["sam", "fa"], 14),
        (["sam", "fa:mode=fd"], 14),
        (["weight-noise", "gp"], 3),  # penalised gradient at theta+U (3), reported there
        (["weight-noise:report=clean", "gp"], 4),  # + clean value of ||grad L|| (1)
        (["nso:report=clean"], 2),
        (["weight-noise", "hessian-trace:mode=fd"], 3),
    ],
)
def test_grad_evals_follow_the_documented_counts(specs, evals):
    model, (x, y) = tiny_model(nn.GELU), batch()
    assert step(model, x, y, specs).grad_evals == evals


def test_step_stats_report_clean_pass():
    model, (x, y) = tiny_model(nn.GELU), batch()
    z = model(x).detach()
    stats = step(model, x, y, ["sam"])
    assert stats.count == 6
    assert stats.correct == int((z.argmax(1) == y).sum())
    assert stats.loss == pytest.approx(float(F.cross_entropy(z, y)), rel=1e-12)
    assert stats.penalties == {}
    yr = torch.randn(6, 3, dtype=DT, generator=torch.Generator().manual_seed(0))
    stats = step(model, x, yr, ["none"], loss="mse")
    assert stats.correct == 0
    assert stats.loss == pytest.approx(float(F.mse_loss(z, yr)), rel=1e-12)


# --------------------------------------------------------------------------- non-finite objectives, zero gradients
def test_non_finite_objective_raises_and_leaves_no_gradient():
    model, (x, y) = tiny_model(nn.GELU), batch()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(NumericalError, match=r"objective became nan \(regularizers: wd\)"):
        step(model, x, y, ["wd"])
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_objective_at_the_perturbed_pass_raises():
    # finite at theta, but SAM's ascent step (rho = 1e300 overflows the float64 logits) is not:
    # every pass of the step is checked, not only the reported one
    model, (x, y) = tiny_model(nn.GELU), batch()
    with pytest.raises(NumericalError, match="objective became nan"):
        step(model, x, y, ["sam:rho=1e300"])
    assert all(p.grad is None for p in model.parameters())


def test_sam_with_a_zero_gradient_is_a_plain_step():
    # zero weights and biases: the logits are 0 whatever x, and with these labels grad L = 0
    # in the first layer; scale everything so the whole gradient vanishes exactly
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    x, _ = batch()
    y = torch.tensor([0, 1, 2, 0, 1, 2])  # uniform softmax, balanced labels: mean gradient 0
    stats = step(model, x, y, ["sam:rho=0.5"])
    assert stats.grad_evals == 2
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    assert stats.loss == pytest.approx(math.log(3), rel=1e-12)


def test_single_pass_engine_refuses_a_second_pass():
    model, (x, y) = tiny_model(nn.GELU), batch()
    engine = StepPasses(model, x, y, "cross-entropy", [], torch.Generator(), single_pass=True)
    engine.evaluate(want_grad=True)
    with pytest.raises(RuntimeError, match="single_pass"):
        engine.evaluate(want_grad=True)


# --------------------------------------------------------------------------- parsing and combinations
def test_parse_positional_keyword_and_defaults():
    assert parse_reg("sam:rho=0.05").params == {"rho": 0.05}
    assert parse_reg("sam:0.05") == parse_reg("sam:rho=0.05")
    assert parse_reg("sam").params == {"rho": 0.05}
    assert parse_reg("asam").params == {"rho": 0.5, "eta": 0.01}
    assert parse_reg("asam:0.2").params == {"rho": 0.2, "eta": 0.01}
    assert parse_reg("gp:0.1,2").params == {"rho": 0.1, "p": 2, "mode": "exact", "eps": 1e-3}
    assert parse_reg("gp:0.1,mode=fd").params["mode"] == "fd"
    assert parse_reg("nso:0.02,4").params == {"sigma": 0.02, "k": 4, "report": "perturbed"}
    assert parse_reg("hessian-trace").params == {
        "sigma2": 0.01,
        "probes": 1,
        "mode": "exact",
        "eps": 0.1,
    }
    assert parse_reg("fa").params == {"lambda": 0.01, "mode": "exact", "eps": "auto"}
    assert parse_reg("weight-noise").params == {"sigma": 0.01, "report": "perturbed"}
    assert parse_reg("fa:lambda=0.1").params == {"lambda": 0.1, "mode": "exact", "eps": "auto"}
    assert parse_reg("fa:0.1,fd,0.02").params == {"lambda": 0.1, "mode": "fd", "eps": 0.02}
    assert parse_reg("fa:eps=AUTO").spec() == "fa:lambda=0.01,mode=exact,eps=auto"
    assert parse_reg("none").spec() == "none"
    assert parse_reg(" WD : 0.1 ").params == {"sigma": 0.1}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_spec_round_trips_and_documents_hyperparameters(name):
    reg = parse_reg(name)
    assert parse_reg(reg.spec()) == reg
    assert REGISTRY[name].__doc__ and name in REGISTRY[name].__doc__
    for h in REGISTRY[name].HYPERPARAMS:
        assert reg.params[h.name] == h.default


@pytest.mark.parametrize(
    "text, fragment",
    [
        (
            "samm:0.1",
            "accepted: none, dropout, wd, ad, fa, gp, hessian-trace, gn-trace, weight-noise, nso, sam, usam, asam",
        ),
        ("sam:radius=0.1", "accepted: rho"),
        ("asam:foo=1", "accepted: rho, eta"),
        ("sam:abc", "rho must be a number"),
        ("sam:0.1,2", "at most 1 positional"),
        ("gp:0.1,3", "p must be one of 1, 2"),
        ("gp:mode=approx", "mode must be one of exact, fd"),
        ("fa:eps=big", "eps must be a number or auto"),
        ("fa:eps=0", "eps must be > 0"),
        ("hessian-trace:eps=auto", "eps must be a number; got 'auto'"),
        ("nso:k=1.5", "k must be an integer"),
        ("nso:k=0", "k must be >= 1"),
        ("dropout:p=1", "p must be < 1"),
        ("wd:-0.1", "sigma must be >= 0"),
        ("wd:nan", "sigma must be finite"),
        ("sam:rho=0.1,rho=0.2", "rho given twice"),
        ("sam:rho=0.1,0.2", "positional value"),
        ("none:1", "at most 0 positional"),
    ],
)
def test_parse_errors_are_usage_errors_naming_what_is_accepted(text, fragment):
    with pytest.raises(UsageError) as info:
        parse_reg(text)
    assert info.value.source == "regs"
    assert fragment in info.value.message
    assert "\n" not in info.value.one_line()


def test_combinations():
    validate_combination([parse_reg("ad"), parse_reg("sam"), parse_reg("wd")])
    with pytest.raises(UsageError, match="at most one perturbation"):
        validate_combination([parse_reg("sam"), parse_reg("nso")])
    with pytest.raises(UsageError, match="more than once"):
        validate_combination([parse_reg("wd:0.1"), parse_reg("wd:0.2")])
    assert model_overrides([parse_reg("dropout:0.25"), parse_reg("ad")]) == {"dropout": 0.25}
    assert model_overrides([parse_reg("sam")]) == {}


def test_activation_decay_needs_a_final_linear():
    model = nn.Sequential(nn.Tanh()).to(DT)
    model.w = nn.Parameter(torch.ones(3, dtype=DT))
    with pytest.raises(UsageError, match="nn.Linear"):
        step(model, *batch(), ["ad"])


def test_registry_records_every_regularizer():
    gp = REGISTRY["gp"]
    assert gp is GradientPenalty
    assert [h.name for h in gp.HYPERPARAMS] == ["rho", "p", "mode", "eps"]
    assert R.data_parallel_refusal(gp) and gp.needs_penultimate is False
    assert REGISTRY["ad"].needs_penultimate is True


ALL_NAMES = "none wd dropout ad sam usam asam gp hessian-trace gn-trace weight-noise nso fa".split()


def _sam_variant(**body):
    """A new SAM variant class (not registered); ``body`` its own class attributes."""
    attributes = {"__doc__": "``sam2:rho``: a SAM variant.", "name": "sam2", **body}
    return type("SAM2", (SAM,), attributes)


def test_register_requires_data_parallel_in_the_class_body():
    # SAM's own "not exact" is deliberately not inherited: a variant must say it again.
    with pytest.raises(RegistryError, match="set data_parallel in the class body"):
        R.register(_sam_variant())
    with pytest.raises(RegistryError, match="non-empty reason"):
        R.register(_sam_variant(data_parallel=""))
    assert "sam2" not in REGISTRY
    # a class put into the registry by hand without the declaration is refused, not exact,
    # and not run per replica on the strength of the per_replica it inherits from SAM
    from sharpcli.training.data_parallel import per_replica_statement

    assert "does not declare" in R.data_parallel_refusal(_sam_variant())
    assert per_replica_statement(_sam_variant()) is None
    cls = R.register(_sam_variant(data_parallel="its ascent step needs the global gradient"))
    try:
        assert REGISTRY["sam2"] is cls and parse_reg("sam2:0.1").params == {"rho": 0.1}
        assert R.data_parallel_refusal(parse_reg("sam2")) == cls.data_parallel
        with pytest.raises(RegistryError, match="already registered"):
            R.register(cls)
    finally:
        R.unregister("sam2")
    assert "sam2" not in REGISTRY


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"name": "Sam2"}, "'Sam2': use lower case letters, digits and '-'"),
        ({"name": "sam:2"}, "'sam:2': use lower case letters, digits and '-'"),
        ({"name": "sam_2"}, "'sam_2': use lower case letters, digits and '-'"),
        ({"kind": "penalty"}, "kind 'penalty' must be one of"),
        ({"__doc__": "no name here"}, "docstring that names 'sam2'"),
        ({"summary": ""}, "needs a summary"),
    ],
)
def test_register_checks_every_entry_carries_its_record(body, fragment):
    with pytest.raises(RegistryError, match=fragment) as info:
        R.register(_sam_variant(data_parallel=None, **body))
    assert info.value.source == "regs" and info.value.exit_code == 2
    assert set(REGISTRY) == set(ALL_NAMES)


# --------------------------------------------------------------------------- NME activations
def test_gradient_penalty_sees_augmented_relu_curvature():
    activations = pytest.importorskip("sharpcli.models.activations")
    x, y = batch(n=8)
    grads = {}
    for key, act in (
        ("relu", nn.ReLU()),
        ("augmented", activations.make_activation("augmented-relu:beta=4")),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 6), act, nn.Linear(6, 3)).to(DT)
        step(model, x, y, ["gp:rho=0.5,p=1"])
        grads[key] = produced_grad(model).clone()
    # same forward (ReLU), but exact double backprop through ReLU sees no second derivative
    assert rel_err(grads["augmented"], grads["relu"]) > 1e-3
