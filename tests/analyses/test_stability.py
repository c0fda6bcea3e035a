"""Stability thresholds against torch's own update rules on the quadratic f = lambda/2 x^2.

The iteration matrix of each optimizer is read off torch itself: its state (the parameter and
the momentum buffer) is set to each basis vector in turn and one ``step()`` is taken; the new
state is that column. Adaptive optimizers get a second moment so large that a step does not
change it (the preconditioner frozen at ``p``, as [Cohen2022]'s analysis holds it), so the map
is linear in (x, m). Just below the threshold the spectral radius is below 1; just above, above
1; and running the optimizer for many steps decays or grows the parameter accordingly.
"""

from __future__ import annotations

import pytest
import torch

from sharpcli.analyses.stability import Threshold, scope_threshold, stability_threshold
from sharpcli.errors import UsageError

D = torch.float64


def _quadratic_step(opt, x, lam):
    opt.zero_grad()
    (0.5 * lam * x.pow(2).sum()).backward()
    opt.step()


def _iteration_matrix(make, lam, buffer_key, frozen=None):
    """The linear map (x, buffer) -> (x', buffer') of one torch step on lambda/2 x^2
    (buffer_key None: x alone). ``frozen``: state entries set before each step (Adam's
    second moment, its step count)."""
    size = 1 if buffer_key is None else 2
    columns = []
    scale = 1e-6  # small, so that g^2 leaves a frozen second moment unchanged
    for j in range(size):
        x = torch.zeros(1, dtype=D, requires_grad=True)
        opt = make([x])
        state = opt.state[x]
        for key, value in (frozen or {}).items():
            state[key] = value.clone() if torch.is_tensor(value) else value
        with torch.no_grad():
            x.fill_(scale if j == 0 else 0.0)
        if buffer_key is not None:
            state[buffer_key] = torch.full((1,), scale if j == 1 else 0.0, dtype=D)
        _quadratic_step(opt, x, lam)
        column = [x.detach()[0] / scale]
        if buffer_key is not None:
            column.append(opt.state[x][buffer_key][0] / scale)
        columns.append(torch.stack(column))
    return torch.stack(columns, dim=1)


def _radius(matrix):
    return torch.linalg.eigvals(matrix).abs().max().item()


SGD_CASES = [
    (dict(lr=0.1), 2 / 0.1),
    (dict(lr=0.05, momentum=0.9), (2 + 2 * 0.9) / 0.05),
    (dict(lr=0.05, momentum=0.9, nesterov=True), (2 + 2 * 0.9) / ((1 + 2 * 0.9) * 0.05)),
    (dict(lr=0.02, momentum=0.5, dampening=0.3), (2 + 2 * 0.5) / ((1 - 0.3) * 0.02)),
    (dict(lr=0.1, momentum=0.9, weight_decay=0.5), (2 + 2 * 0.9) / 0.1 - 0.5),
    (dict(lr=0.1, weight_decay=0.5), 2 / 0.1 - 0.5),
]


@pytest.mark.parametrize("kwargs,expected", SGD_CASES)
def test_sgd_threshold_is_torchs_edge(kwargs, expected):
    probe = torch.optim.SGD([torch.zeros(1, dtype=D, requires_grad=True)], **kwargs)
    threshold = stability_threshold(probe)
    assert threshold.value == pytest.approx(expected, rel=1e-12)
    assert not threshold.preconditioned and threshold.paper == "Cohen2021"
    key = "momentum_buffer" if kwargs.get("momentum") else None

    def make(params):
        return torch.optim.SGD(params, **kwargs)

    below = _radius(_iteration_matrix(make, 0.99 * threshold.value, key))
    above = _radius(_iteration_matrix(make, 1.01 * threshold.value, key))
    assert below < 1 < above
    # and torch's optimizer run for 3000 steps on the quadratic: decays below, grows above
    for factor, grows in ((0.98, False), (1.02, True)):
        x = torch.ones(1, dtype=D, requires_grad=True)
        opt = make([x])
        for _ in range(3000):
            _quadratic_step(opt, x, factor * threshold.value)
        assert (x.detach().abs().item() > 1.0) is grows


def test_nesterov_with_dampening_is_torchs_edge():
    """torch refuses Nesterov with dampening at construction; a group edited after it still
    steps, and the threshold follows the general formula."""

    def make(params):
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.8, nesterov=True)
        opt.param_groups[0]["dampening"] = 0.4
        return opt

    threshold = stability_threshold(make([torch.zeros(1, dtype=D, requires_grad=True)]))
    assert threshold.value == pytest.approx((2 + 1.6) / ((1 + 0.8 * 1.6) * 0.05), rel=1e-12)
    below = _radius(_iteration_matrix(make, 0.99 * threshold.value, "momentum_buffer"))
    above = _radius(_iteration_matrix(make, 1.01 * threshold.value, "momentum_buffer"))
    assert below < 1 < above


ADAPTIVE_CASES = [
    (torch.optim.Adam, dict(lr=0.01), (2 + 2 * 0.9) / (0.1 * 0.01)),
    (torch.optim.Adam, dict(lr=0.01, betas=(0.5, 0.999)), (2 + 1.0) / (0.5 * 0.01)),
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=3.0), 38 / 0.01 * (1 - 0.01 * 3.0 / 2)),
    (torch.optim.Adam, dict(lr=0.01, amsgrad=True), 38 / 0.01),
    (torch.optim.RMSprop, dict(lr=0.01), 2 / 0.01),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.7), (2 + 1.4) / 0.01),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.7, centered=True), (2 + 1.4) / 0.01),
]


@pytest.mark.parametrize("cls,kwargs,expected", ADAPTIVE_CASES)
def test_adaptive_threshold_is_torchs_edge(cls, kwargs, expected):
    """The preconditioned curvature lambda / p at which torch's step, with its second moment
    frozen so that p = sqrt(v_hat) + eps = 4, loses stability."""
    threshold = stability_threshold(cls([torch.zeros(1, dtype=D, requires_grad=True)], **kwargs))
    assert threshold.value == pytest.approx(expected, rel=1e-12)
    assert threshold.preconditioned and threshold.paper == "Cohen2022"
    eps = 1e-8
    p = 4.0
    v = torch.full((1,), (p - eps) ** 2, dtype=D)  # sqrt(v) + eps = p
    if cls is torch.optim.RMSprop:
        frozen = {"step": torch.tensor(10.0), "square_avg": v}
        if kwargs.get("centered"):
            frozen["grad_avg"] = torch.zeros(1, dtype=D)
        key = "momentum_buffer" if kwargs.get("momentum") else None
    else:
        # a step count so large that both bias corrections are 1
        frozen = {"step": torch.tensor(1e7, dtype=D), "exp_avg_sq": v}
        if kwargs.get("amsgrad"):
            frozen["max_exp_avg_sq"] = v
        key = "exp_avg"

    def make(params):
        return cls(params, eps=eps, **kwargs)

    below = _radius(_iteration_matrix(make, 0.99 * threshold.value * p, key, frozen))
    above = _radius(_iteration_matrix(make, 1.01 * threshold.value * p, key, frozen))
    assert below < 1 < above


def test_adam_run_at_a_large_eps_decays_below_and_grows_above():
    """torch's Adam run on the quadratic with eps so large that P = eps (and a step count so
    large that its bias corrections are 1): from x = 1e-30 the parameter decays below 38/lr
    (preconditioned) and grows until its second moment stops it above."""
    eps, lr = 1e4, 0.01
    threshold = stability_threshold(
        torch.optim.Adam([torch.zeros(1, dtype=D, requires_grad=True)], lr=lr, eps=eps)
    )
    assert threshold.value == pytest.approx(38 / lr)
    for factor, grows in ((0.97, False), (1.03, True)):
        x = torch.full((1,), 1e-30, dtype=D, requires_grad=True)
        opt = torch.optim.Adam([x], lr=lr, eps=eps)
        opt.state[x].update(
            step=torch.tensor(1e7, dtype=D),
            exp_avg=torch.zeros(1, dtype=D),
            exp_avg_sq=torch.zeros(1, dtype=D),
        )
        for _ in range(600):
            _quadratic_step(opt, x, factor * threshold.value * eps)
        assert (x.detach().abs().item() > 1e-20) is grows
        assert (x.detach().abs().item() < 1e-30) is not grows


def test_threshold_follows_the_schedule():
    x = torch.zeros(1, dtype=D, requires_grad=True)
    opt = torch.optim.SGD([x], lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _quadratic_step(opt, x, 1.0)
    schedule.step()
    assert stability_threshold(opt).value == pytest.approx(2 / 0.05)
    assert "0.05" in stability_threshold(opt).formula


def test_threshold_is_a_frozen_record():
    t = stability_threshold(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0))
    assert t == Threshold(2.0, "2/lr with lr 1", "Cohen2021", False)
    with pytest.raises(AttributeError):
        t.value = 3.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda p: torch.optim.Adagrad(p, lr=0.1), "Adagrad"),
        (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), "maximize"),
        (lambda p: torch.optim.Adam(p, lr=0.0), "lr > 0"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=1.0), "dampening 1"),
    ],
)
def test_refusals_name_the_problem(make, words):
    opt = make([torch.zeros(1, requires_grad=True)])
    with pytest.raises(UsageError, match=words) as caught:
        stability_threshold(opt)
    assert caught.value.source == "optimizer"
    with pytest.raises(UsageError, match="no group 3"):
        stability_threshold(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), 3)


def test_scope_threshold_reads_the_groups_holding_the_parameters():
    a, b, c = (torch.zeros(2, requires_grad=True) for _ in range(3))
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1)
    assert scope_threshold(opt, [a, b]).value == pytest.approx(20.0)
    assert scope_threshold(opt, [c]).value == pytest.approx(4.0)
    with pytest.raises(UsageError, match="group 0: 20, group 1: 4"):
        scope_threshold(opt, [a, c])
    with pytest.raises(UsageError, match="holds none of the measured parameters"):
        scope_threshold(opt, [torch.zeros(1, requires_grad=True)])
