"""Batch sharpness, critical sharpness, the gradient's top-k share and the optimizer's next step,
against dense float64 references on tiny models (double backward, the exact loss).

- batch sharpness: each mini-batch's g_B^T H_B g_B / ||g_B||^2 from its own dense Hessian,
  averaged over disjoint batches that cover the drawn samples, and its standard error;
- critical sharpness: on an exact quadratic (linear model, MSE) the closed form
  d^T H d / (-g.d); on a tanh network the mean curvature along the step from finite
  differences of the exact loss over the slope, at the bracket the search promises;
- the update direction: the step the optimizer then takes, for SGD (momentum, Nesterov,
  dampening, weight decay), Adam (AMSGrad, L2), AdamW and RMSprop (centered, momentum);
- the gradient share: ||V_k^T g||^2 / ||g||^2 from a dense eigendecomposition.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharpcli import Curvature
from sharpcli.analyses.step_curvature import (
    BATCH_SHARPNESS,
    CRITICAL_SHARPNESS,
    GRADIENT_SHARE,
    minibatch_indices,
)
from sharpcli.analyses.tracking import StepContext, measure
from sharpcli.analyses.update_direction import update_direction
from sharpcli.errors import UsageError
from tests.hessian_helpers import double_backward_hessian, flat_gradient


def tanh_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def blobs(n: int = 30, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=generator)
    return x, y


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())


def exact_loss(model, x, y, flat_step: torch.Tensor | None = None, loss_fn=F.cross_entropy):
    """The loss at theta + flat_step on a copy of the model (float64, no sharp code)."""
    moved = copy.deepcopy(model)
    if flat_step is not None:
        with torch.no_grad():
            offset = 0
            for p in moved.parameters():
                p.add_(flat_step[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
    with torch.no_grad():
        return float(loss_fn(moved(x), y))


# ----------------------------------------------------------------------------- batch sharpness
def test_batch_sharpness_is_its_definition_averaged_over_the_batches():
    model = tanh_net()
    x, y = blobs(30)
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y), batch_size=4)
    result = curvature.batch_sharpness(7, seed=5)
    batches = minibatch_indices(30, 7, seed=5)
    assert len(batches) == 4 == result.batches == result.matvecs  # 30 // 7, one product each
    drawn = torch.cat(batches)
    assert drawn.unique().numel() == drawn.numel() == 28  # without replacement
    params = params_of(model)
    expected = []
    for indices in batches:
        xb, yb = x[indices], y[indices]
        g = flat_gradient(model, params, xb, yb)
        H = double_backward_hessian(model, params, xb, yb)
        expected.append(float(g @ H @ g / (g @ g)))
    assert result.values == pytest.approx(expected, rel=1e-10)
    mean = sum(expected) / 4
    assert result.estimate == pytest.approx(mean, rel=1e-10)
    stderr = math.sqrt(sum((v - mean) ** 2 for v in expected) / 3 / 4)
    assert result.stderr == pytest.approx(stderr, rel=1e-8)
    # the same seed draws the same batches; another seed others
    assert curvature.batch_sharpness(7, seed=5).values == result.values
    assert curvature.batch_sharpness(7, seed=6).values != result.values


def test_batch_sharpness_of_the_whole_set_is_the_gradients_rayleigh_quotient():
    model = tanh_net(2)
    x, y = blobs(12)
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    result = curvature.batch_sharpness(64, max_batches=3)
    params = params_of(model)
    g = flat_gradient(model, params, x, y)
    H = double_backward_hessian(model, params, x, y)
    assert result.batches == 1 and result.batch_size == 12 and result.stderr is None
    assert result.estimate == pytest.approx(float(g @ H @ g / (g @ g)), rel=1e-10)


def test_batch_sharpness_refuses_bad_arguments():
    curvature = Curvature(tanh_net(), nn.CrossEntropyLoss(), blobs(12))
    with pytest.raises(UsageError) as caught:
        curvature.batch_sharpness(0)
    assert caught.value.source == "batch_size"
    with pytest.raises(UsageError) as caught:
        curvature.batch_sharpness(4, max_batches=0)
    assert caught.value.source == "max_batches"


# -------------------------------------------------------------------------- critical sharpness
def test_critical_sharpness_on_an_exact_quadratic_is_the_closed_form():
    # a linear model under MSE: the loss is exactly quadratic in the weights
    torch.manual_seed(3)
    model = nn.Linear(4, 2).double()
    x = torch.randn(25, 4, dtype=torch.float64)
    y = torch.randn(25, 2, dtype=torch.float64)
    curvature = Curvature(model, nn.MSELoss(), (x, y))
    params = params_of(model)
    g = flat_gradient(model, params, x, y, loss_fn=F.mse_loss)
    H = double_backward_hessian(model, params, x, y, loss_fn=F.mse_loss)
    for tol in (0.05, 0.01):
        result = curvature.critical_sharpness(tol=tol, start=1e-3)
        rayleigh = float(g @ H @ g / (g @ g))  # d = -g
        lo, hi = result.bracket
        assert result.converged and hi <= (1 + tol) * lo
        assert lo <= 2 / rayleigh <= hi  # the exact eta_c = -2 g.d / d^T H d is bracketed
        assert result.estimate == pytest.approx(rayleigh, rel=tol / 2)
        assert result.slope == pytest.approx(-float(g @ g), rel=1e-12)
        assert result.forward_passes <= 6  # the quadratic model is exact
    # another direction: d^T H d / (-g.d)
    generator = torch.Generator().manual_seed(0)
    d = -g + 0.3 * torch.randn(g.numel(), generator=generator, dtype=torch.float64)
    result = curvature.critical_sharpness(direction=d, tol=0.02)
    assert result.direction == "given"
    assert result.estimate == pytest.approx(float(d @ H @ d / -(g @ d)), rel=0.01)


def test_critical_sharpness_is_the_mean_curvature_along_the_step_by_finite_differences():
    model = tanh_net(4)
    x, y = blobs(30, seed=7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, nesterov=True)
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    tol = 0.02
    result = curvature.critical_sharpness(optimizer, tol=tol)
    # neither the model nor the optimizer moved
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert str(optimizer.state_dict()) == str(state)
    assert result.direction == "SGD" and result.learning_rate == 0.3
    assert result.threshold == pytest.approx(2 / 0.3)
    # the direction, independently: the step a copy of the optimizer takes, per unit rate
    params = params_of(model)
    g = flat_gradient(model, params, x, y)
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.3, momentum=0.9, nesterov=True)
    twin_optimizer.load_state_dict(optimizer.state_dict())
    twin_optimizer.zero_grad()
    F.cross_entropy(twin(x), y).backward()
    twin_optimizer.step()
    pairs = zip(twin.parameters(), model.parameters())
    d = torch.cat([(a - b).detach().reshape(-1) for a, b in pairs])
    d = d / 0.3
    lo, hi = result.bracket
    L0 = exact_loss(model, x, y)
    assert exact_loss(model, x, y, lo * d) <= L0 < exact_loss(model, x, y, hi * d)
    assert hi <= (1 + tol) * lo
    # slope and mean curvature along the step by central differences of the exact loss
    h = 1e-4
    slope = (exact_loss(model, x, y, h * d) - exact_loss(model, x, y, -h * d)) / (2 * h)
    assert result.slope == pytest.approx(slope, rel=1e-6)
    assert result.slope == pytest.approx(float(g @ d), rel=1e-10)
    eta = result.rate
    kappa = 2 * (exact_loss(model, x, y, eta * d) - L0 - eta * slope) / eta**2
    assert result.estimate == pytest.approx(kappa / -slope, rel=tol)


def test_critical_sharpness_reports_a_direction_that_does_not_descend():
    model = tanh_net()
    x, y = blobs(12)
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    g = flat_gradient(model, params_of(model), x, y)
    result = curvature.critical_sharpness(direction=g)  # ascent
    assert result.estimate is None and result.rate is None and "descent" in result.note


def test_critical_sharpness_refuses_what_it_cannot_do():
    model = tanh_net()
    curvature = Curvature(model, nn.CrossEntropyLoss(), blobs(12))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (dict(optimizer=torch.optim.LBFGS(model.parameters())), "optimizer"),
        (dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1, maximize=True)), "optimizer"),
        (dict(optimizer=sgd, direction=torch.zeros(curvature.num_params)), "direction"),
        (dict(direction=torch.zeros(3)), "direction"),
        (dict(tol=1.5), "tol"),
        (dict(start=-1.0), "start"),
        (dict(max_passes=0), "max_passes"),
        # a copy's optimizer holds none of the measured parameters
        (dict(optimizer=torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)), "optimizer"),
    ]
    for kwargs, source in cases:
        with pytest.raises(UsageError) as caught:
            curvature.critical_sharpness(**kwargs)
        assert caught.value.source == source, kwargs
    two_rates = torch.optim.SGD(
        [{"params": [model[0].weight], "lr": 0.1}, {"params": [model[2].weight], "lr": 0.2}]
    )
    with pytest.raises(UsageError, match="different learning rates"):
        curvature.critical_sharpness(two_rates)


# ------------------------------------------------------------------------- the update direction
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.2),
    "nesterov-wd": lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.01
    ),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.05),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, betas=(0.8, 0.9)),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(
        p, lr=0.01, centered=True, momentum=0.5, weight_decay=0.01
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("steps", [0, 3])
def test_update_direction_is_the_step_the_optimizer_takes(name, steps):
    model = tanh_net(5)
    x, y = blobs(16)
    optimizer = OPTIMIZERS[name](model.parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    params = params_of(model)
    g = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    state = str(optimizer.state_dict())
    directions = update_direction(optimizer, params, list(g))
    assert str(optimizer.state_dict()) == state  # only read
    before = [p.detach().clone() for p in params]
    for p, gi in zip(params, g):
        p.grad = gi.clone()
    optimizer.step()
    lr = optimizer.param_groups[0]["lr"]
    for d, p, b in zip(directions, params, before):
        torch.testing.assert_close(d, (p.detach() - b) / lr, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- gradient share
def test_gradient_share_against_a_dense_eigendecomposition():
    model = tanh_net(6)
    x, y = blobs(24, seed=3)
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    params = params_of(model)
    H = double_backward_hessian(model, params, x, y)
    g = flat_gradient(model, params, x, y)
    values, vectors = torch.linalg.eigh(H)
    P = H.shape[0]
    for k in (None, 1, 5):
        result = curvature.gradient_share(k, tol=1e-10, max_matvecs=P)
        kk = 3 if k is None else k  # None: the number of classes
        top = vectors[:, -kk:]
        expected = float((top.T @ g).square().sum() / (g @ g))
        assert result.k == kk
        assert result.eigenvalues == pytest.approx(values[-kk:].flip(0).tolist(), rel=1e-8)
        assert result.share == pytest.approx(expected, rel=1e-7, abs=1e-10)
    with pytest.raises(UsageError) as caught:
        curvature.gradient_share(0)
    assert caught.value.source == "k"


# ---------------------------------------------------------------------------- tracked quantities
def test_tracked_step_quantities_with_and_without_an_optimizer():
    model = tanh_net(7)
    x, y = blobs(24)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    names = [BATCH_SHARPNESS, CRITICAL_SHARPNESS, GRADIENT_SHARE]
    context = StepContext(optimizer=optimizer, step=2, batch_size=8)
    with curvature._analysis_mode():
        values, products = measure(curvature.engine, names, seed=3, step=context)
    reference = curvature.batch_sharpness(8, seed=3)
    assert values["batch_sharpness"] == pytest.approx(reference.estimate, rel=1e-12)
    assert values["batch_sharpness_stderr"] == pytest.approx(reference.stderr, rel=1e-12)
    assert values["batch_sharpness_batches"] == 3
    assert values["batch_sharpness_threshold"] == pytest.approx((2 + 2 * 0.5) / 0.2)
    critical = curvature.critical_sharpness(optimizer)
    assert values["critical_sharpness"] == pytest.approx(critical.estimate, rel=0.05)
    assert values["critical_sharpness_threshold"] == pytest.approx(2 / 0.2)
    assert values["critical_sharpness_forward_passes"] >= 2
    share = curvature.gradient_share(tol=1e-10, max_matvecs=38)
    assert values["gradient_share_k"] == 3
    assert values["gradient_share"] == pytest.approx(share.share, rel=1e-2)
    assert products >= 3
    # warm state kept for the next measurement: the critical rate and the top eigenvector
    last_rate = context.warm[CRITICAL_SHARPNESS]
    assert torch.is_tensor(last_rate)  # saved with a resumable run's state, as every warm start
    assert float(last_rate) == pytest.approx(2 / values["critical_sharpness"])
    assert context.warm[GRADIENT_SHARE].shape == (curvature.num_params,)
    again, _ = measure(curvature.engine, [CRITICAL_SHARPNESS], seed=3, step=context)
    assert again["critical_sharpness"] == pytest.approx(values["critical_sharpness"], rel=0.05)
    # no optimizer: gradient descent's direction, no thresholds; the engine's batch size
    with curvature._analysis_mode():
        bare, _ = measure(curvature.engine, names, seed=3)
    assert "batch_sharpness_threshold" not in bare and "critical_sharpness_threshold" not in bare
    assert bare["batch_sharpness_batches"] == 1  # the analysis batch (256) covers all 24


def test_adaptive_optimizers_have_no_batch_sharpness_threshold():
    model = tanh_net(8)
    x, y = blobs(16)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    context = StepContext(optimizer=optimizer, batch_size=8)
    with curvature._analysis_mode():
        values, _ = measure(curvature.engine, [BATCH_SHARPNESS], step=context)
    assert values["batch_sharpness"] is not None
    assert "batch_sharpness_threshold" not in values


def test_batch_sharpness_by_finite_differences_of_gradients_agrees():
    model = tanh_net(9)
    x, y = blobs(24)
    exact = Curvature(model, nn.CrossEntropyLoss(), (x, y)).batch_sharpness(6, seed=1)
    differences = Curvature(model, nn.CrossEntropyLoss(), (x, y), hvp="finite-difference")
    result = differences.batch_sharpness(6, seed=1)
    assert result.values == pytest.approx(exact.values, rel=1e-6)


def test_batch_sharpness_of_a_token_loss_averages_each_batch_over_its_own_tokens():
    from tests.test_api import _padded_lm_problem

    model, ids, labels = _padded_lm_problem()
    module = nn.CrossEntropyLoss(ignore_index=-100)
    curvature = Curvature(model, module, (ids, labels), batch_size=3)
    result = curvature.batch_sharpness(4, seed=2)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = []
    for indices in minibatch_indices(8, 4, seed=2):
        xb, yb = ids[indices], labels[indices]

        def batch_loss(z, target, yb=yb):  # the mean over the batch's labelled tokens
            return module(z.reshape(-1, z.shape[-1]), yb.reshape(-1))

        g = flat_gradient(model, params, xb, yb, loss_fn=batch_loss)
        H = double_backward_hessian(model, params, xb, yb, loss_fn=batch_loss)
        expected.append(float(g @ H @ g / (g @ g)))
    assert result.values == pytest.approx(expected, rel=1e-8)


# ------------------------------------------------------------------ two gloo ranks on CPU
def _step_quantities(engine) -> dict:
    """The three quantities on ``engine`` (every rank runs the same calls)."""
    from sharpcli.analyses.step_curvature import (
        batch_sharpness,
        critical_sharpness,
        gradient_share,
    )

    bs = batch_sharpness(engine, 7, seed=4)
    critical = critical_sharpness(engine, tol=0.01)
    share = gradient_share(engine, 2, tol=1e-10, max_matvecs=38)
    return {
        "values": bs.values,
        "estimate": bs.estimate,
        "rate": critical.rate,
        "passes": critical.forward_passes,
        "share": share.share,
    }


def _ranked_engine(rank: int = 0):
    from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope

    model = tanh_net(11)
    x, y = blobs(30, seed=5)
    data = AnalysisData(x, y, "cross-entropy", batch_size=4)  # sharded by the process group
    return CurvatureEngine(model, data, ParamScope.resolve(model))


def _rank_main(rank: int, port: int, results) -> None:
    import os

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results[rank] = _step_quantities(_ranked_engine(rank))
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_measure_what_one_process_does():
    """Each mini-batch's samples are split by the ranks' shards and the products summed."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(port, results), nprocs=2, join=True)
    single = _step_quantities(_ranked_engine())
    for rank in (0, 1):
        ranked = results[rank]
        assert ranked["values"] == pytest.approx(single["values"], rel=1e-10)
        assert ranked["rate"] == pytest.approx(single["rate"], rel=1e-10)
        assert ranked["passes"] == single["passes"]
        assert ranked["share"] == pytest.approx(single["share"], rel=1e-8)
