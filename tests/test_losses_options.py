"""torch's losses with their options (reduction, class weights, label smoothing, probability
targets, NLL after log-softmax, BCE-with-logits on any shape with pos_weight and weight, Huber,
smooth L1) through ``Curvature``: the Hessian, the Gauss-Newton matrix and the exact
Gauss-Newton trace against dense float64 references differentiated twice here from torch's
own loss module on the whole set (not from sharp's loss records)."""

from __future__ import annotations

import pytest
import torch
from hessian_helpers import double_backward_hessian, jacobian_ggn
from torch import nn

from sharpcli import Curvature
from sharpcli.errors import UsageError

C = 4  # classes


def _mlp(outputs: int, head: nn.Module | None = None, inputs: int = 3) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(inputs, 5), nn.Tanh(), nn.Linear(5, outputs)]
    return nn.Sequential(*layers, *([head] if head is not None else [])).double()


class _PerPosition(nn.Module):
    """(B, 3) inputs -> (B, C, 2) logits: classes on dim 1 at two positions."""

    def __init__(self, classes: int = C):
        super().__init__()
        torch.manual_seed(0)
        self.classes = classes
        self.body = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2 * classes)).double()

    def forward(self, x):
        return self.body(x).reshape(x.shape[0], self.classes, 2)


def _data(n: int = 12, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=gen, dtype=torch.float64), gen


def _dense_check(model, loss, x, y, *, ggn: bool = True, sharp_loss=None):
    """Sharp's dense H (and G, exact tr G) equal the double-backward references of ``loss``."""
    params = list(model.parameters())
    H = double_backward_hessian(model, params, x, y, loss_fn=loss)
    chosen = sharp_loss if sharp_loss is not None else loss
    curvature = Curvature(model, chosen, (x, y), batch_size=5)  # batches of 5, 5, 2
    H_sharp = curvature.operator().to_dense()
    scale = H.abs().max()
    assert torch.allclose(H_sharp, H, atol=1e-10 * scale, rtol=0), (H_sharp - H).abs().max()
    top = curvature.eigenvalues(top_k=1, tol=1e-10).eigenvalues[0]
    assert top == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-8)
    if ggn:
        G = jacobian_ggn(model, params, x, y, loss)
        G_sharp = curvature.operator("ggn").to_dense()
        assert torch.allclose(G_sharp, G, atol=1e-10 * scale, rtol=0), (G_sharp - G).abs().max()
        N_sharp = curvature.operator("nme").to_dense()
        assert torch.allclose(G_sharp + N_sharp, H, atol=1e-10 * scale, rtol=0)
        exact = curvature.trace("ggn", estimator="exact").estimate
        assert exact == pytest.approx(float(G.trace()), rel=1e-9)
    return curvature


# --------------------------------------------------------------------------- cross-entropy
WEIGHT = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64)


@pytest.mark.parametrize(
    "loss",
    [
        nn.CrossEntropyLoss(reduction="sum"),
        nn.CrossEntropyLoss(label_smoothing=0.15),
        nn.CrossEntropyLoss(weight=WEIGHT),
        nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.2, reduction="sum"),
        nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=2),
    ],
    ids=["sum", "smoothing", "weight", "weight-smoothing-sum", "weight-ignore"],
)
def test_cross_entropy_options_match_torch(loss):
    x, gen = _data()
    y = torch.randint(0, C, (12,), generator=gen)
    y[3] = 2
    curvature = _dense_check(_mlp(C), loss, x, y)
    assert curvature.loss.startswith("cross-entropy:")


def test_cross_entropy_probability_targets_and_weight():
    x, gen = _data()
    q = torch.softmax(torch.randn(12, C, generator=gen, dtype=torch.float64), -1)
    _dense_check(_mlp(C), nn.CrossEntropyLoss(), x, q)
    _dense_check(_mlp(C), nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.1), x, q)
    # rows that do not sum to 1: torch takes them as they are (H_z scales by sum_c w_c q'_c)
    unnormalised = torch.rand(12, C, generator=gen, dtype=torch.float64) * 2
    _dense_check(_mlp(C), nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.3), x, unnormalised)


@pytest.mark.parametrize(
    "loss",
    [
        nn.CrossEntropyLoss(),
        nn.CrossEntropyLoss(weight=WEIGHT, reduction="sum", label_smoothing=0.1),
        nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=1),
    ],
    ids=["plain", "weight-sum-smoothing", "weight-ignore"],
)
def test_cross_entropy_classes_on_dim_1_with_options(loss):
    x, gen = _data()
    y = torch.randint(0, C, (12, 2), generator=gen)
    y[0, 1] = 1
    _dense_check(_PerPosition(), loss, x, y)


def test_cross_entropy_module_on_square_outputs_reads_classes_on_dim_1():
    """(N, C, C) outputs with (N, C) labels: both readings fit a name, the module has one."""
    x, gen = _data()
    model = _PerPosition(classes=2)  # (N, 2, 2)
    y = torch.randint(0, 2, (12, 2), generator=gen)
    _dense_check(model, nn.CrossEntropyLoss(), x, y)
    with pytest.raises(UsageError, match="read two ways"):
        _inferred(model, x, y)


def _inferred(model, x, y):
    from sharpcli.io.torch_losses.readings import read_loss

    read_loss("cross-entropy", model(x), y, named=False)


def test_cross_entropy_probability_targets_per_position():
    x, gen = _data()
    q = torch.softmax(torch.randn(12, C, 2, generator=gen, dtype=torch.float64), 1)
    _dense_check(_PerPosition(), nn.CrossEntropyLoss(label_smoothing=0.1), x, q)


# --------------------------------------------------------------------------- NLL
@pytest.mark.parametrize(
    "loss",
    [nn.NLLLoss(), nn.NLLLoss(weight=WEIGHT, reduction="sum")],
    ids=["plain", "weight-sum"],
)
def test_nll_after_log_softmax(loss):
    """The Hessian is the NLL's through the log-softmax; the GGN is the cross-entropy's on
    the logits before it (the NLL's own H_z = 0 would give G = 0)."""
    x, gen = _data()
    y = torch.randint(0, C, (12,), generator=gen)
    model = _mlp(C, nn.LogSoftmax(dim=1))
    curvature = _dense_check(model, loss, x, y, ggn=False)
    logits = model[:-1]
    G = jacobian_ggn(logits, list(logits.parameters()), x, y, nn.CrossEntropyLoss(**_options(loss)))
    G_sharp = curvature.operator("ggn").to_dense()
    assert torch.allclose(G_sharp, G, atol=1e-10 * G.abs().max(), rtol=0)
    assert curvature.trace("ggn", estimator="exact").estimate == pytest.approx(
        float(G.trace()), rel=1e-9
    )


def _options(loss):
    return {"weight": loss.weight, "reduction": loss.reduction}


def test_nll_on_logits_is_refused():
    x, gen = _data()
    y = torch.randint(0, C, (12,), generator=gen)
    with pytest.raises(UsageError, match="log-probabilities") as err:
        Curvature(_mlp(C), nn.NLLLoss(), (x, y))
    assert err.value.source in ("data", "loss")


def test_value_guard_trips_on_a_wrong_reading():
    """A loss record whose value is not the module's: the guard refuses before any product."""
    from sharpcli.io.torch_losses.readings import LossReading, check_loss_value

    x, gen = _data()
    y = torch.randint(0, C, (12,), generator=gen)
    z = _mlp(C)(x).detach()
    with pytest.raises(UsageError, match="not the loss handed in"):
        check_loss_value(
            nn.CrossEntropyLoss(label_smoothing=0.3), LossReading("cross-entropy"), z, y
        )


# --------------------------------------------------------------------------- BCE with logits
@pytest.mark.parametrize(
    "shape, loss",
    [
        ((12, 1), nn.BCEWithLogitsLoss()),
        ((12, 3), nn.BCEWithLogitsLoss()),
        ((12, 3), nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0, 0.5, 3.0]))),
        ((12, 3), nn.BCEWithLogitsLoss(weight=torch.tensor([1.0, 0.2, 4.0]), reduction="sum")),
        ((12, 2, 3), nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0, 0.5, 3.0]))),
    ],
    ids=["one-logit", "multi-label", "pos-weight", "weight-sum", "per-position"],
)
def test_bce_with_logits_any_shape(shape, loss):
    x, gen = _data()
    y = torch.randint(0, 2, shape, generator=gen).double()
    outputs = shape[1] if len(shape) == 2 else shape[1] * shape[2]
    torch.manual_seed(0)
    body = _mlp(outputs)
    model = body if len(shape) == 2 else nn.Sequential(body, nn.Unflatten(1, shape[1:]))
    loss = loss.double() if loss.pos_weight is not None or loss.weight is not None else loss
    _dense_check(model, loss, x, y)


def test_bce_pos_weight_output_hessian_formula():
    """H_z = w s (1 - s) (pw y + 1 - y) element-wise, against double backward of torch's."""
    from sharpcli.io.torch_losses.options import configure_loss, module_spec
    from sharpcli.losses import get_loss

    gen = torch.Generator().manual_seed(4)
    z = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    y = torch.rand(5, 3, generator=gen, dtype=torch.float64)
    pw = torch.tensor([2.0, 0.5, 3.0], dtype=torch.float64)
    w = torch.tensor([1.0, 0.2, 4.0], dtype=torch.float64)
    module = nn.BCEWithLogitsLoss(pos_weight=pw, weight=w, reduction="sum")
    loss = get_loss(configure_loss(module_spec(module), "binary-cross-entropy", y))
    leaf = z.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(module(leaf, y), leaf, create_graph=True)
    diagonal = torch.stack(
        [
            torch.autograd.grad(g.reshape(-1)[i], leaf, retain_graph=True)[0].reshape(-1)[i]
            for i in range(15)
        ]
    ).reshape(5, 3)
    s = torch.sigmoid(z)
    assert torch.allclose(diagonal, w * s * (1 - s) * (pw * y + 1 - y), atol=1e-14)
    # sharp's per-sample loss carries N = 5 for the sum: (1/N) sum_i l_i = module's sum
    ones = torch.ones_like(z)
    assert torch.allclose(loss.hessian_matvec(z, y, ones) / 5, diagonal, atol=1e-14)


@pytest.mark.parametrize(
    "loss",
    [nn.BCELoss(), nn.BCELoss(weight=torch.tensor([1.0, 0.2, 4.0]), reduction="sum")],
    ids=["mean", "weight-sum"],
)
def test_bce_on_probabilities_after_a_sigmoid(loss):
    """``nn.BCELoss`` on a Sigmoid head's probabilities, soft targets: the Hessian is the
    module's; the GGN is the one through the probabilities, ``H_z = y/p^2 + (1-y)/(1-p)^2``."""
    x, gen = _data()
    y = torch.rand(12, 3, generator=gen, dtype=torch.float64)
    loss = loss.double()
    curvature = _dense_check(_mlp(3, nn.Sigmoid()), loss, x, y)
    assert curvature.loss.startswith("bce-probabilities")


def test_bce_on_logits_given_to_bce_probabilities_is_refused():
    x, gen = _data()
    y = torch.randint(0, 2, (12, 3), generator=gen).double()
    with pytest.raises(UsageError, match="takes probabilities"):
        Curvature(_mlp(3), "bce-probabilities", (x, y))


# --------------------------------------------------------------------------- regression
@pytest.mark.parametrize(
    "loss",
    [
        nn.MSELoss(reduction="sum"),
        nn.HuberLoss(delta=0.3),
        nn.HuberLoss(reduction="sum"),
        nn.SmoothL1Loss(beta=0.4),
        nn.SmoothL1Loss(beta=2.0, reduction="sum"),
    ],
    ids=["mse-sum", "huber", "huber-sum", "smooth-l1", "smooth-l1-sum"],
)
def test_regression_losses(loss):
    x, gen = _data()
    y = torch.randn(12, 2, generator=gen, dtype=torch.float64)
    _dense_check(_mlp(2), loss, x, y)


def test_loss_options_as_a_spec_string():
    x, gen = _data()
    y = torch.randint(0, C, (12,), generator=gen)
    module = nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.1, reduction="sum")
    _dense_check(
        _mlp(C),
        module,
        x,
        y,
        sharp_loss="cross-entropy:weight=1;2;0.5;3,label_smoothing=0.1,reduction=sum",
    )


@pytest.mark.parametrize(
    "loss, needle",
    [
        (nn.CrossEntropyLoss(reduction="none"), "reduction='none'"),
        (nn.GaussianNLLLoss(), "variance"),
        (nn.KLDivLoss(), "nn.CrossEntropyLoss, nn.NLLLoss"),
        ("cross-entropy:smoothing=0.1", "accepted: reduction, weight, label_smoothing"),
        ("mse:reduction=max", "reduction must be one of mean, sum"),
    ],
)
def test_unsupported_losses_are_refused_in_one_line(loss, needle):
    x, gen = _data()
    y = torch.randint(0, C, (12,), generator=gen)
    with pytest.raises(UsageError) as err:
        Curvature(_mlp(C), loss, (x, y))
    assert needle in err.value.message and "\n" not in err.value.message
    assert err.value.source == "loss"


def test_nll_per_position_after_log_softmax_over_dim_1():
    """(N, C, d) log-probabilities with (N, d) labels and class weights: the Hessian is the
    module's, the GGN the weighted cross-entropy's on the logits before the log-softmax."""
    x, gen = _data()
    y = torch.randint(0, C, (12, 2), generator=gen)
    logits = _PerPosition()
    model = nn.Sequential(logits, nn.LogSoftmax(dim=1))
    loss = nn.NLLLoss(weight=WEIGHT)
    curvature = _dense_check(model, loss, x, y, ggn=False)
    assert curvature.loss.endswith(" per position")
    G = jacobian_ggn(logits, list(logits.parameters()), x, y, nn.CrossEntropyLoss(weight=WEIGHT))
    G_sharp = curvature.operator("ggn").to_dense()
    assert torch.allclose(G_sharp, G, atol=1e-10 * G.abs().max(), rtol=0)


def test_options_leave_the_fisher_refused_and_the_registered_losses_unshadowed():
    from sharpcli.losses import get_loss

    x, gen = _data()
    q = torch.softmax(torch.randn(12, C, generator=gen, dtype=torch.float64), -1)
    curvature = Curvature(_mlp(C), nn.CrossEntropyLoss(), (x, q))
    assert curvature.loss == "cross-entropy probability targets"
    assert get_loss("cross-entropy").check is not None
    assert get_loss("cross-entropy").batch_value is None  # the registered record
    with pytest.raises(UsageError, match="predictive distribution"):
        curvature.trace("fisher", max_matvecs=20)
