"""The loss differentiated is the loss handed in: torch's loss modules on the shapes torch takes.

Every figure is checked against dense float64 references on tiny models: the Hessian by
double backward of torch's own ``loss_module(model(x), y)``, the Gauss-Newton matrix as
``J^T H_z J`` from autograd Jacobians, and their eigenvalues and traces.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharpcli import Curvature
from sharpcli.errors import UsageError
from sharpcli.io.torch_losses.readings import LossReading, check_loss_value, read_loss
from tests.hessian_helpers import double_backward_hessian, jacobian_ggn


class Shaped(nn.Module):
    """A tanh MLP whose outputs are viewed as ``(batch, *shape)``."""

    def __init__(self, shape: tuple, features: int = 3, hidden: int = 4):
        super().__init__()
        self.shape = shape
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, int(torch.tensor(shape).prod()))

    def forward(self, x):
        return self.head(self.body(x)).view(x.shape[0], *self.shape)


def _model(shape, seed=0):
    torch.manual_seed(seed)
    return Shaped(shape).double()


def _references(model, x, y, loss_fn):
    params = [p for p in model.parameters() if p.requires_grad]
    hessian = double_backward_hessian(model, params, x, y, loss_fn=loss_fn)
    return hessian, jacobian_ggn(model, params, x, y, loss_fn)


def _assert_matches(curvature: Curvature, hessian, ggn) -> None:
    """Dense operators, the top-3 eigenvalues and the exact traces against the references."""
    torch.testing.assert_close(curvature.operator().to_dense(), hessian, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(curvature.operator("ggn").to_dense(), ggn, rtol=1e-10, atol=1e-12)
    top = curvature.eigenvalues(top_k=3, tol=1e-10).eigenvalues
    exact = torch.linalg.eigvalsh(hessian).flip(0)[:3]
    torch.testing.assert_close(torch.tensor(top, dtype=torch.float64), exact, rtol=1e-8, atol=1e-10)
    trace = curvature.trace(operator="ggn", estimator="exact").estimate
    assert trace == pytest.approx(float(ggn.trace()), rel=1e-10)


@pytest.mark.parametrize("classes, positions", [(3, 4), (4, 2)])
def test_k_dim_cross_entropy_module_reads_classes_on_dim_1(classes, positions):
    """(N, C, T) outputs with (N, T) labels, T != C: torch's classes on dim 1."""
    model = _model((classes, positions))
    x = torch.randn(9, 3, dtype=torch.float64)
    y = torch.randint(0, classes, (9, positions))
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y), batch_size=4)
    assert curvature.loss_reading == LossReading("token-cross-entropy", "classes-last")
    _assert_matches(curvature, *_references(model, x, y, nn.CrossEntropyLoss()))


def test_square_outputs_read_as_the_module_and_named_either_way():
    """(N, 3, 3) with (N, 3): both readings fit; torch's module has one (classes on dim 1),
    an inferred loss is refused naming `loss`, and each name gives its own loss exactly."""
    model = _model((3, 3))
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (8, 3))
    module = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    _assert_matches(module, *_references(model, x, y, F.cross_entropy))
    with pytest.raises(UsageError, match="read two ways") as caught:
        read_loss("cross-entropy", model(x), y, named=False)
    assert caught.value.source == "loss"
    assert "`loss=cross-entropy`" in caught.value.message
    assert "`loss=token-cross-entropy`" in caught.value.message

    dim_1 = Curvature(model, "cross-entropy", (x, y))
    _assert_matches(dim_1, *_references(model, x, y, F.cross_entropy))

    def classes_last(z, labels):
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1))

    last = Curvature(model, "token-cross-entropy", (x, y))
    hessian, ggn = _references(model, x, y, classes_last)
    _assert_matches(last, hessian, ggn)
    # the two readings are different losses: the refusal is not a formality
    assert (
        abs(float(hessian.trace()) - float(_references(model, x, y, F.cross_entropy)[0].trace()))
        > 1e-3
    )


@pytest.mark.parametrize("ignore_index", [-100, 255])
def test_segmentation_outputs_with_ignored_pixels(ignore_index):
    """(N, C, H, W) outputs, (N, H, W) labels, some pixels ignored: the mean over the labelled
    pixels of the whole set, as the module computes it."""
    model = _model((3, 2, 3))
    x = torch.randn(7, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (7, 2, 3))
    y[0, 0, :2] = ignore_index
    y[3, 1, 1] = ignore_index
    module = nn.CrossEntropyLoss(ignore_index=ignore_index)
    curvature = Curvature(model, module, (x, y), batch_size=3)
    _assert_matches(curvature, *_references(model, x, y, module))


def test_loss_guard_trips_on_the_other_reading():
    """The guard: sharp's classes-last value on (N, 3, 3) against the module's classes on dim 1."""
    torch.manual_seed(1)
    z = torch.randn(6, 3, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (6, 3))
    with pytest.raises(UsageError, match="not the loss handed in") as caught:
        check_loss_value(nn.CrossEntropyLoss(), LossReading("token-cross-entropy"), z, y, -100)
    wrong = F.cross_entropy(z.reshape(-1, 3), y.reshape(-1))
    right = F.cross_entropy(z, y)
    assert f"{float(wrong):.10g}" in caught.value.message
    assert f"{float(right):.10g}" in caught.value.message
    check_loss_value(
        nn.CrossEntropyLoss(), LossReading("token-cross-entropy", "classes-last"), z, y, -100
    )


def test_loss_guard_trips_on_a_module_computing_another_loss():
    """A subclass whose forward is not its base's: refused before any product."""

    class Smoothed(nn.CrossEntropyLoss):
        def forward(self, z, y):
            return F.cross_entropy(z, y) + 0.5 * z.pow(2).mean()

    model = _model((4,))
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (8,))
    with pytest.raises(UsageError, match="Smoothed\\(\\) gives") as caught:
        Curvature(model, Smoothed(), (x, y))
    assert caught.value.source == "loss"


def test_bce_with_outputs_and_labels_both_n_by_1():
    model = _model((1,))
    x = torch.randn(10, 3, dtype=torch.float64)
    y = (torch.rand(10, 1) > 0.5).double()
    curvature = Curvature(model, nn.BCEWithLogitsLoss(), (x, y))
    _assert_matches(curvature, *_references(model, x, y, nn.BCEWithLogitsLoss()))


def test_bce_module_refuses_n_labels_for_n_by_1_outputs_as_torch_does():
    """(N, 1) outputs with (N,) labels: torch's module refuses them, so does sharp; the name
    ``binary-cross-entropy`` (one label per sample) takes them."""
    model = _model((1,))
    x = torch.randn(10, 3, dtype=torch.float64)
    y = (torch.rand(10) > 0.5).double()
    with pytest.raises(UsageError, match="BCEWithLogitsLoss\\(\\) refuses") as caught:
        Curvature(model, nn.BCEWithLogitsLoss(), (x, y))
    assert caught.value.source == "loss"
    named = Curvature(model, "binary-cross-entropy", (x, y))
    column = y.unsqueeze(1)
    _assert_matches(named, *_references(model, x, column, nn.BCEWithLogitsLoss()))


@pytest.mark.parametrize("shape", [(5, 3), (2, 2, 3)], ids=["n-5-3", "image-n-c-h-w"])
def test_mse_over_any_output_shape(shape):
    """nn.MSELoss on (N, 5, 3) and image-shaped (N, C, H, W) outputs: the mean over all
    elements, H_z = 2/(N M) I for the batch."""
    model = _model(shape)
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.randn(6, *shape, dtype=torch.float64)
    curvature = Curvature(model, nn.MSELoss(), (x, y), batch_size=4)
    assert curvature.loss_reading == LossReading("mse", "flat")
    _assert_matches(curvature, *_references(model, x, y, nn.MSELoss()))


@pytest.mark.parametrize(
    "shape, targets", [((5, 3), (6, 15)), ((1,), (6,))], ids=["flattened", "n-for-n-by-1"]
)
def test_mse_module_refuses_targets_torch_would_broadcast(shape, targets):
    """nn.MSELoss broadcasts targets of another shape into another loss: refused. The name
    ``mse`` takes one target per sample of a one-output model, (N,) for (N, 1)."""
    model = _model(shape)
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.randn(*targets, dtype=torch.float64)
    with pytest.raises(UsageError, match="outputs' shape") as caught:
        Curvature(model, nn.MSELoss(), (x, y))
    assert caught.value.source == "data"
    if shape == (1,):
        named = Curvature(model, "mse", (x, y))
        column = y.unsqueeze(1)
        _assert_matches(named, *_references(model, x, column, nn.MSELoss()))
