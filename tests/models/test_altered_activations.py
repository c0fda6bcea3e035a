"""Augmented ReLU and diminished GELU ([NME] 4.4) through the second-derivative self-check.

Their autograd second derivative differs from the true one on purpose, so central differences
of the gradient cannot confirm it: the self-check compares those layers with their intended
closed form and the rest of the model with central differences. Before, every analysis and
second-order regularizer refused them ("second derivatives wrongly, 0.12-0.35 relative").
"""

from __future__ import annotations

import pytest
import torch
from cli_helpers import run_cli
from hessian_helpers import double_backward_hessian
from torch import nn

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.errors import InputError
from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.io.data.loading import load_dataset
from sharpcli.models.activations import (
    AugmentedReLU,
    DiminishedGELU,
    intended_derivative_error,
    make_activation,
)
from sharpcli.preflight import check_second_derivatives

DATA = "blobs:n=96,dim=5,classes=3,seed=4"
ALTERED = ("augmented-relu", "augmented-relu:beta=3", "diminished-gelu")


def _mlp(activation: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 7), make_activation(activation), nn.Linear(7, 6),
        make_activation(activation), nn.Linear(6, 3),
    )  # fmt: skip


def _data(n: int = 16):
    generator = torch.Generator().manual_seed(3)
    return torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator)


class _PlainReLUUnderTheName(AugmentedReLU):
    """Claims the augmented derivative but computes plain ReLU's (second derivative 0)."""

    def forward(self, x):
        return torch.relu(x)


@pytest.mark.parametrize("activation", ALTERED)
def test_altered_layers_pass_the_self_check(activation):
    x, y = _data()
    assert intended_derivative_error(make_activation(activation)) < 1e-12
    relative = check_second_derivatives(_mlp(activation), x, y, "cross-entropy", "m.pt")
    assert relative is not None and relative < 1e-6


def test_a_layer_off_its_intended_derivative_is_still_refused():
    """The Gaussian peak beta / sqrt(2 pi) = 0.399 is what a plain ReLU misses."""
    assert intended_derivative_error(_PlainReLUUnderTheName()) == pytest.approx(0.3989, abs=1e-3)
    model = _mlp("relu")
    model[1] = _PlainReLUUnderTheName()
    x, y = _data()
    with pytest.raises(InputError, match=r"augmented-relu:beta=1.0 layers wrongly: .* by 0\.4"):
        check_second_derivatives(model, x, y, "cross-entropy", source="m.pt")


def test_other_layers_are_still_checked_beside_an_altered_one():
    """A once-differentiable layer next to an augmented ReLU is caught by central differences."""

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
        def __init__(self):
            super().__init__()
            self.body = _mlp("augmented-relu")

        def forward(self, x):
            return self.body[4](Square.apply(self.body[:4](x)))

    x, y = _data()
    with pytest.raises(InputError, match="second derivatives wrongly"):
        check_second_derivatives(Net(), x, y, "cross-entropy", source="m.pt")


def _dense_ggn(model, params, x, y) -> torch.Tensor:
    """``G = (1/N) sum_i J_i^T (diag p_i - p_i p_i^T) J_i`` from explicit logit Jacobians."""
    logits = model(x)
    rows = []
    for index in range(logits.numel()):
        grads = torch.autograd.grad(logits.reshape(-1)[index], params, retain_graph=True)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    n, c = logits.shape
    J = torch.stack(rows).reshape(n, c, -1)
    p = torch.softmax(logits.detach(), dim=1)
    hz = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("nca,ncd,ndb->ab", J, hz, J) / n


@pytest.mark.parametrize("activation", ["augmented-relu", "diminished-gelu"])
def test_gn_nme_runs_against_the_dense_hessian_of_the_intended_derivative(
    tmp_path, capsys, activation
):
    spec = tiny_mlp_spec(d_in=5, classes=3, width=6, depth=1, activation=activation)
    path = write_own_checkpoint(tmp_path / "m.safetensors", spec, data_spec=DATA, seed=5)
    model = load_checkpoint(path).model.double().eval()
    x, y = load_dataset(DATA).split("train")
    params = list(model.parameters())
    H = double_backward_hessian(model, params, x.double(), y)
    G = _dense_ggn(model, params, x.double(), y)
    # the altered derivative matters: the true one (ReLU / GELU) gives another Hessian
    twin = load_checkpoint(path).model.double().eval()
    twin[1] = make_activation("relu" if activation == "augmented-relu" else "gelu")
    H_true = double_backward_hessian(twin, list(twin.parameters()), x.double(), y)
    assert float((H - H_true).norm()) > 0.05 * float(H.norm())
    run = run_cli(capsys, "gn-nme", path, "--dtype", "float64", "--tol", "0.05", "--json", "-")
    assert run.code == 0, run.err
    assert f"{make_activation(activation).spec} layers have an autograd second" in run.err
    r = run.json()["results"]
    for key, dense in (("hessian", H), ("ggn", G), ("nme", H - G)):
        evals = torch.linalg.eigvalsh(dense)
        assert r[key]["lambda_max"] == pytest.approx(float(evals[-1]), rel=1e-5, abs=1e-9)
        assert r[key]["lambda_min"] == pytest.approx(float(evals[0]), rel=1e-5, abs=1e-9)
    assert r["hessian"]["frobenius_sq"] == pytest.approx(
        float((H * H).sum()), abs=4 * r["hessian"]["frobenius_sq_stderr"]
    )
    assert isinstance(model[1], (AugmentedReLU, DiminishedGELU))


@pytest.mark.parametrize("reg", ["gp", "hessian-trace"])
def test_second_order_regularizers_train_with_the_altered_layers(tmp_path, capsys, reg):
    run = run_cli(
        capsys, "train", "--model", "mlp", "--width", "8", "--depth", "1", "--activation", "augmented-relu",
        "--data", DATA, "--epochs", "1", "--reg", reg, "--out", str(tmp_path / "m.safetensors"),
        "--json", "-", "--quiet",
    )  # fmt: skip
    assert run.code == 0, run.err
    history = run.json()["results"]["history"]
    assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["train_loss"]))
