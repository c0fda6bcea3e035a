"""Worst-case and average-case sharpness against independent float64 references
([Andriushchenko2023]), the invariance of the adaptive measures under a [MAN] rescale, m-sharpness."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharpcli.analyses.rescale_plan import apply_rescale, plan_rescale
from sharpcli.analyses.sharpness import SharpnessConfig, apgd_checkpoints, sharpness
from sharpcli.curvature.products.data import AnalysisData
from sharpcli.errors import UsageError


def _relu_net(seed: int = 0, batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(3, 6)] + ([nn.BatchNorm1d(6)] if batch_norm else [])
    layers += [nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)]
    return nn.Sequential(*layers).double().eval()


def _smooth_net(seed: int = 0) -> nn.Module:
    # tanh: no dead units, whose zero gradients leave a ReLU net's ascent at different local
    # maxima depending on the path (the box of linf has many)
    torch.manual_seed(seed)
    layers = [nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)]
    return nn.Sequential(*layers).double().eval()


def _data(n: int = 40, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, dtype=torch.float64, generator=gen)
    return x, torch.randint(0, 3, (n,), generator=gen)


def _flat_loss(model: nn.Module, x, y):
    """L(w) of a float64 copy as a function of the flat weight vector (the reference's own)."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    w0 = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])

    def loss(w: torch.Tensor) -> torch.Tensor:
        params, offset = {}, 0
        for name, shape in zip(names, shapes):
            size = math.prod(shape)
            params[name] = w[offset : offset + size].view(shape)
            offset += size
        z = torch.func.functional_call(model, params, (x,))
        return F.cross_entropy(z, y)

    return loss, w0


def _reference_worst_case(model, x, y, rho, *, adaptive, norm, restarts=8, steps=300, seed=0):
    """Projected gradient ascent in u = delta / c, fixed decreasing steps, random restarts, float64."""
    loss, w0 = _flat_loss(model, x, y)
    c = w0.abs() if adaptive else torch.ones_like(w0)
    base = float(loss(w0))
    gen = torch.Generator().manual_seed(seed + 1000)
    best = base
    for restart in range(restarts):
        if restart == 0:
            u = torch.zeros_like(w0)
        else:
            u = torch.randn(w0.numel(), generator=gen, dtype=torch.float64)
            u = u * rho / u.norm() if norm == "l2" else rho * u.sign()
        for step in range(steps):
            u = u.detach().requires_grad_(True)
            value = loss(w0 + c * u)
            best = max(best, float(value.detach()))
            (g,) = torch.autograd.grad(value, u)
            eta = rho * 0.5 * (1 - step / steps) + rho * 1e-3
            with torch.no_grad():
                if norm == "l2":
                    u = u + eta * g / max(float(g.norm()), 1e-30)
                    u = u * min(1.0, rho / float(u.norm()))
                else:
                    u = (u + eta * g.sign()).clamp(-rho, rho)
        best = max(best, float(loss(w0 + c * u.detach())))
    return best - base


@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_worst_case_at_least_a_careful_ascent_and_inside_the_ball(norm, adaptive):
    model = _smooth_net()
    x, y = _data()
    rho = 0.1 if adaptive else 0.05
    config = SharpnessConfig(norm=norm, rhos=(rho,), adaptive=adaptive, steps=100, restarts=3)
    result = sharpness(model, AnalysisData(x, y, "cross-entropy", 16), config)
    row = result.rows[0]
    reference = _reference_worst_case(model, x, y, rho, adaptive=adaptive, norm=norm)
    assert reference > 0
    assert row.sharpness >= reference * (1 - 1e-9), (row.sharpness, reference)
    assert row.perturbation_norm <= rho * (1 + 1e-12)
    assert row.sharpness == pytest.approx(row.loss_perturbed - row.loss, rel=1e-12)
    # the history is the best found so far: it never decreases and ends at the result
    assert all(b >= a for a, b in zip(row.history, row.history[1:]))
    assert row.history[0] >= 0 and row.history[-1] == pytest.approx(row.sharpness, rel=1e-12)


@pytest.mark.parametrize(
    "norm, adaptive, rho",
    [("linf", True, 0.1), ("l2", True, 0.1), ("l2", False, 0.05)],
)
def test_worst_case_on_a_relu_net_at_least_a_careful_ascent(norm, adaptive, rho):
    # ReLU kinks: sign(g) flips across them, and stepping along sign(g) alone stopped at
    # 0.0156078 on the linf/adaptive case where the reference ascent finds 0.0156337
    model = _relu_net()
    x, y = _data()
    config = SharpnessConfig(norm=norm, rhos=(rho,), adaptive=adaptive, steps=100, restarts=3)
    row = sharpness(model, AnalysisData(x, y, "cross-entropy", 16), config).rows[0]
    reference = _reference_worst_case(model, x, y, rho, adaptive=adaptive, norm=norm)
    assert reference > 0
    # 1e-6: l2 ends within the precision of Auto-PGD's last step (2 rho / 2^8) of the maximum
    assert row.sharpness >= reference * (1 - 1e-6), (row.sharpness, reference)
    assert row.perturbation_norm <= rho * (1 + 1e-12)


def test_the_maximum_is_a_loss_the_model_takes_and_the_model_is_restored():
    model = _relu_net()
    before = copy.deepcopy(model.state_dict())
    x, y = _data()
    config = SharpnessConfig(rhos=(0.05, 0.2), steps=30)
    result = sharpness(model, AnalysisData(x, y, "cross-entropy", 7), config)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    loss, w0 = _flat_loss(model, x, y)
    assert result.rows[0].loss == pytest.approx(float(loss(w0)), rel=1e-12)
    # a larger ball holds the smaller one: sharpness grows with rho
    assert result.rows[1].sharpness > result.rows[0].sharpness > 0


def test_average_case_agrees_with_an_independent_monte_carlo_estimate():
    model = _relu_net()
    x, y = _data()
    loss, w0 = _flat_loss(model, x, y)
    rho = 0.3
    config = SharpnessConfig(kind="average", rhos=(rho,), noise_draws=400, seed=3)
    row = sharpness(model, AnalysisData(x, y, "cross-entropy", 40), config).rows[0]
    gen = torch.Generator().manual_seed(12345)
    base = float(loss(w0))
    with torch.no_grad():
        values = [
            float(
                loss(
                    w0
                    + rho * w0.abs() * torch.randn(w0.numel(), generator=gen, dtype=torch.float64)
                )
            )
            - base
            for _ in range(2000)
        ]
    mean = sum(values) / len(values)
    stderr = (sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5
    assert row.stderr == row.stderr_noise  # one batch: the noise's standard error
    assert abs(row.sharpness - mean) <= 4 * math.hypot(row.stderr, stderr), (row, mean, stderr)
    assert row.perturbation_norm is None and row.history is None


def test_m_sharpness_is_the_mean_over_batches_of_each_batch_sharpness():
    model = _relu_net()
    x, y = _data(n=36)
    config = SharpnessConfig(rhos=(0.1,), m=12, steps=15)
    whole = sharpness(model, AnalysisData(x, y, "cross-entropy", 5), config)
    assert whole.batches == 3 and whole.m == 12
    singles = [
        sharpness(model, AnalysisData(x[s : s + 12], y[s : s + 12], "cross-entropy", 5), config)
        .rows[0]
        .sharpness
        for s in (0, 12, 24)
    ]
    assert whole.rows[0].sharpness == pytest.approx(sum(singles) / 3, rel=1e-12)
    mean = sum(singles) / 3
    spread = (sum((v - mean) ** 2 for v in singles) / 2 / 3) ** 0.5
    assert whole.rows[0].stderr == pytest.approx(spread, rel=1e-9)


@pytest.mark.parametrize("kind", ["worst-case", "average"])
def test_adaptive_sharpness_is_invariant_under_a_function_preserving_rescale(kind):
    model = _relu_net()
    x, y = _data()
    data = AnalysisData(x, y, "cross-entropy", 40)
    scaled = copy.deepcopy(model)
    plan = plan_rescale(scaled, x[:8], "layer", "0")
    apply_rescale(scaled, plan, 10.0)
    assert torch.allclose(scaled(x), model(x), atol=1e-12)  # the same function
    common = dict(kind=kind, rhos=(0.1,), steps=40, noise_draws=50, seed=5)
    adaptive = [sharpness(m, data, SharpnessConfig(**common)).rows[0] for m in (model, scaled)]
    assert adaptive[1].sharpness == pytest.approx(adaptive[0].sharpness, rel=1e-8)
    standard = [
        sharpness(m, data, SharpnessConfig(adaptive=False, **common)).rows[0]
        for m in (model, scaled)
    ]
    assert abs(standard[1].sharpness / standard[0].sharpness - 1) > 0.2


def test_normalization_layers_excluded_stay_fixed():
    model = _relu_net(batch_norm=True)
    x, y = _data()
    data = AnalysisData(x, y, "cross-entropy", 40)
    result = sharpness(model, data, SharpnessConfig(rhos=(0.1,), norm_layers="exclude", steps=5))
    assert result.excluded == ["1.weight", "1.bias"]
    assert result.num_params == sum(p.numel() for p in model.parameters()) - 12
    with pytest.raises(UsageError) as info:
        sharpness(model, data, SharpnessConfig(params="1.*", norm_layers="exclude"))
    assert info.value.source == "norm_layers"


def test_apgd_checkpoints_match_the_schedule_of_the_paper():
    # p = 0, 0.22, 0.41, 0.57, 0.7, 0.8, 0.87, 0.93, 0.99 ([Croce2020] section 3.2)
    assert apgd_checkpoints(100) == [22, 41, 58, 70, 80, 87, 93, 99]


@pytest.mark.parametrize(
    "field, value, source",
    [
        ("rhos", (0.1, 0.0), "rho"),
        ("rhos", (-1.0,), "rho"),
        ("kind", "best", "kind"),
        ("norm", "l1", "norm"),
        ("m", 0, "m"),
        ("steps", 0, "steps"),
        ("noise_draws", 1, "noise_draws"),
        ("step_size", float("nan"), "step_size"),
    ],
)
def test_bad_settings_name_their_parameter(field, value, source):
    with pytest.raises(UsageError) as info:
        SharpnessConfig(**{field: value}).validate()
    assert info.value.source == source


def test_the_l2_projection_of_a_float32_vector_past_1e19_keeps_its_radius():
    """The float32 norm of a vector of entries 1e25 overflows (its square is past float32's
    largest): the norm is accumulated in float64, so the projection onto the ball of radius
    1e24 has that norm, not 0, and the ascent direction is a unit vector, not 0."""
    from sharpcli.analyses.sharpness import _ascent_direction, _project

    u = torch.full((10,), 1e25, dtype=torch.float32)
    assert not torch.isfinite(u.norm())  # the overflow the projection must not inherit
    projected = _project(u, 1e24, "l2")
    norm = float(torch.linalg.vector_norm(projected, dtype=torch.float64))
    assert norm == pytest.approx(1e24, rel=1e-6)
    unit = _ascent_direction(u, "l2")
    assert float(torch.linalg.vector_norm(unit, dtype=torch.float64)) == pytest.approx(1.0)
