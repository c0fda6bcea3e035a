"""The stability quantities tracked in training: lambda_max against SGD's threshold, Adam's
preconditioned sharpness against dense float64 references, and the warm start that makes a
measurement every step cheap.

The warm start is measured along a slowly moving trajectory (a tanh MLP trained by full-batch
SGD, a measurement after every step): from the fifth measurement on, a warm-started
measurement certifies the same residual (tol 1e-3) in a fraction of a cold one's products.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharpcli.analyses.stability import stability_threshold
from sharpcli.analyses.tracking import PRECONDITIONED, StepContext, measure
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
from sharpcli.errors import UsageError
from tests.hessian_helpers import double_backward_hessian

D = torch.float64


def _problem(width=32, classes=10, n=256, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, classes),
    ).double()
    x = torch.randn(n, 8, dtype=D)
    y = torch.randint(0, classes, (n,))
    return model, x, y


def _engine(model, x, y):
    data = AnalysisData(x, y, loss="cross-entropy", batch_size=x.shape[0])
    return CurvatureEngine(model, data, ParamScope.resolve(model, None))


def _step(model, x, y, optimizer):
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _measured(model, x, y, names, step):
    was = model.training
    model.eval()
    try:
        return measure(_engine(model, x, y), names, step=step)
    finally:
        model.train(was)


@pytest.mark.parametrize(
    "name,make",
    [
        ("eigen", lambda ps: torch.optim.SGD(ps, lr=0.1)),
        (PRECONDITIONED, lambda ps: torch.optim.Adam(ps, lr=1e-3)),
    ],
)
def test_warm_start_takes_fewer_products_than_a_cold_start(name, make):
    """Every step measured twice: with the run's StepContext (warm) and with a fresh one
    (cold); the same eigenvalue, and from the fifth measurement on at most half the
    products (measured on this MLP, 1706 parameters: SGD lr 0.1 from 8 falling to 4 products
    against 13-17 cold; Adam lr 1e-3 2-3 against 6)."""
    model, x, y = _problem()
    optimizer = make(model.parameters())
    run = StepContext(optimizer=optimizer)
    key = "lambda_max" if name == "eigen" else "preconditioned_sharpness"
    warm, cold = [], []
    for step in range(1, 26):
        _step(model, x, y, optimizer)
        run.step = step
        out_warm, products_warm = _measured(model, x, y, [name], run)
        out_cold, products_cold = _measured(model, x, y, [name], StepContext(optimizer=optimizer))
        assert out_warm[key] == pytest.approx(out_cold[key], rel=1e-4)
        warm.append(products_warm)
        cold.append(products_cold)
    assert warm[0] == cold[0]  # the first measurement has nothing to start from
    settled_warm, settled_cold = sum(warm[4:]) / 21, sum(cold[4:]) / 21
    assert settled_warm <= 0.5 * settled_cold, (warm, cold)
    assert name in run.warm and run.warm[name].shape == (ParamScope.resolve(model).numel,)


def test_lambda_max_threshold_is_sgds_and_left_out_for_adaptive_optimizers():
    model, x, y = _problem(width=6, classes=3, n=40)
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)
    _step(model, x, y, sgd)
    out, _ = _measured(model, x, y, ["eigen"], StepContext(optimizer=sgd, step=1))
    assert out["lambda_max_threshold"] == pytest.approx(3.8 / (2.8 * 0.05), rel=1e-12)
    H = double_backward_hessian(model, params, x, y)
    assert out["lambda_max"] == pytest.approx(torch.linalg.eigvalsh(H)[-1].item(), rel=1e-6)
    adam = torch.optim.Adam(params, lr=1e-3)
    _step(model, x, y, adam)
    out, _ = _measured(model, x, y, ["eigen"], StepContext(optimizer=adam, step=1))
    assert "lambda_max_threshold" not in out and "lambda_max" in out
    out, _ = _measured(model, x, y, ["eigen"], None)
    assert tuple(out) == ("lambda_max",)
    # groups of different learning rates: no single threshold, lambda_max alone
    split = torch.optim.SGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:]}], lr=0.2)
    out, _ = _measured(model, x, y, ["eigen"], StepContext(optimizer=split))
    assert tuple(out) == ("lambda_max",)


@pytest.mark.parametrize(
    "make,threshold",
    [
        (lambda ps: torch.optim.Adam(ps, lr=1e-2), 38 / 1e-2),
        (
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.99)),
            3.6 / 0.2 / 1e-2 * (1 - 1e-2 * 0.01 / 2),
        ),
        (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5), 3.0 / 1e-3),
    ],
)
def test_preconditioned_sharpness_is_the_dense_reference(make, threshold):
    """lambda_max(P^-1/2 H P^-1/2), H by double backward, P torch's denominator read off
    the state as torch's own update divides by it (bias-corrected v for Adam)."""
    model, x, y = _problem(width=6, classes=3, n=40)
    params = list(model.parameters())
    optimizer = make(params)
    for _ in range(3):
        _step(model, x, y, optimizer)
    out, products = _measured(model, x, y, [PRECONDITIONED], StepContext(optimizer=optimizer))
    group = optimizer.param_groups[0]
    parts = []
    for p in params:
        state = optimizer.state[p]
        if isinstance(optimizer, torch.optim.RMSprop):
            parts.append(state["square_avg"].sqrt() + group["eps"])
        else:
            v_hat = state["exp_avg_sq"] / (1 - group["betas"][1] ** float(state["step"]))
            parts.append(v_hat.sqrt() + group["eps"])
    scale = torch.cat([t.reshape(-1) for t in parts]).rsqrt()
    H = double_backward_hessian(model, params, x, y)
    reference = torch.linalg.eigvalsh(scale[:, None] * H * scale[None, :])[-1].item()
    assert out["preconditioned_sharpness"] == pytest.approx(reference, rel=1e-5)
    assert out["preconditioned_threshold"] == pytest.approx(threshold, rel=1e-6)
    assert out["preconditioned_threshold"] == stability_threshold(optimizer).value
    assert products > 0


@pytest.mark.parametrize(
    "optimizer,words",
    [
        (None, "needs the training optimizer"),
        ("sgd", "needs an adaptive optimizer .* not SGD"),
        ("adagrad", "no stability threshold is known for Adagrad"),
        ("fresh-adam", "no step taken"),
    ],
)
def test_preconditioned_refuses_without_an_adaptive_optimizer(optimizer, words):
    model, x, y = _problem(width=4, classes=3, n=20)
    params = list(model.parameters())
    made = {
        None: None,
        "sgd": torch.optim.SGD(params, lr=0.1),
        "adagrad": torch.optim.Adagrad(params, lr=0.1),
        "fresh-adam": torch.optim.Adam(params, lr=0.1),
    }[optimizer]
    with pytest.raises(UsageError, match=words) as caught:
        _measured(model, x, y, [PRECONDITIONED], StepContext(optimizer=made))
    assert caught.value.source == "track" and "\n" not in caught.value.one_line()
