"""The self-check of second derivatives every analysis session runs before measuring.

A custom ``autograd.Function`` whose backward is not differentiable (``@once_differentiable``)
contributes nothing to torch's double backward, without an error: ``eigen`` read lambda_max
0.67 against 1.03 from central differences on such a model. ``build_session`` now compares one
Hessian-vector product with central differences of the gradient on a float64 copy and refuses
the model (exit 2) when they disagree and the gradient is smooth along the probe.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fixtures.weight_norm_model import wn_model
from sharpcli.curvature.products.differentiable import twice_differentiable
from sharpcli.errors import InputError
from sharpcli.preflight import check_second_derivatives
from tests.cli_helpers import assert_one_line_error, run_cli

ONCE_MODULE = """
import torch
from torch import nn


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class Net(nn.Module):
    def __init__(self, custom=True):
        super().__init__()
        self.custom = custom
        self.first = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.first(x)
        return self.head(Square.apply(h) if self.custom else h * h)


def make(custom=True):
    return Net(custom)
"""


def _module(custom: bool = True) -> nn.Module:
    namespace: dict = {}
    exec(compile(ONCE_MODULE, "oncemodel.py", "exec"), namespace)
    torch.manual_seed(0)
    return namespace["make"](custom)


def _data(n=32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator)


@pytest.fixture
def once_dir(tmp_path, monkeypatch):
    """The cwd: ``oncemodel.py`` (importable), its seeded weights ``once.pt`` and ``data.npz``."""
    (tmp_path / "oncemodel.py").write_text(ONCE_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.save(_module().state_dict(), tmp_path / "once.pt")
    x, y = _data(40)
    np.savez(tmp_path / "data.npz", x=x.numpy(), y=y.numpy())
    return tmp_path


def test_a_once_differentiable_function_is_refused_and_its_twin_passes():
    x, y = _data()
    with pytest.raises(InputError, match=r"second derivatives wrongly: .* by 0\.\d"):
        check_second_derivatives(_module(custom=True), x, y, "cross-entropy", source="net.pt")
    relative = check_second_derivatives(_module(custom=False), x, y, "cross-entropy", "net.pt")
    assert relative is not None and relative < 1e-7


def test_the_check_would_have_caught_torchs_weight_norm():
    x, y = _data()
    model = wn_model()
    with pytest.raises(InputError, match="second derivatives wrongly"):
        check_second_derivatives(model, x, y, "cross-entropy", source="wn.pt")
    with twice_differentiable():
        assert check_second_derivatives(model, x, y, "cross-entropy", source="wn.pt") < 1e-7


def test_kinks_at_exact_zeros_make_the_check_inconclusive_not_a_refusal():
    """A ReLU pre-activation exactly 0 (hand-built weights): difference quotients jump."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, -1.0], [1.0, 1.0]]))
        model[0].bias.zero_()
    x = torch.tensor([[1.0, 1.0], [2.0, 0.5], [-1.0, 0.5]])  # unit 0 at exactly 0 on sample 0
    y = torch.tensor([0, 1, 2])
    assert check_second_derivatives(model, x, y, "cross-entropy", source="relu.pt") is None


def test_eigen_refuses_the_model_with_a_one_line_error(once_dir, capsys):
    run = run_cli(
        capsys, "eigen", "once.pt", "--model-factory", "oncemodel:make", "--data", "data.npz",
        "--quiet",
    )  # fmt: skip
    assert_one_line_error(run, 2, "once.pt", "second derivatives wrongly")


@pytest.mark.parametrize("reg, code", [("gp", 2), ("hessian-trace", 2), ("sam", 0)])
def test_train_checks_before_a_second_order_regularizer(once_dir, capsys, reg, code):
    """Second-order penalties differentiate the model twice: refused up front on such a model;
    first-order training (sam) does not need the check and runs."""
    run = run_cli(
        capsys, "train", "--model-factory", "oncemodel:make", "--data", "data.npz",
        "--epochs", "1", "--reg", reg, "--out", "m.safetensors", "--quiet",
    )  # fmt: skip
    if code:
        assert_one_line_error(run, code, "factory:oncemodel:make", "second derivatives wrongly")
    else:
        assert run.code == 0, run.err


def test_activation_stats_needs_no_second_derivatives(once_dir, capsys):
    """Activation statistics differentiate once: the model is measured, not refused."""
    run = run_cli(
        capsys, "activation-stats", "once.pt", "--model-factory", "oncemodel:make",
        "--data", "data.npz", "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    x, y = _data(40)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(_module()(x), y)
    assert run.json()["results"]["output"]["loss"] == pytest.approx(float(expected), rel=1e-6)
