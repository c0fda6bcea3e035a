"""Hessian products by central differences of gradients (sharpcli.curvature.products.finite_difference):
within their stated bound of exact double-backward products, weights restored bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope, build_operator
from sharpcli.curvature.products.finite_difference import FiniteDifferenceEngine, relative_step
from sharpcli.errors import InputError, UsageError
from sharpcli.preflight import check_second_derivatives


def _model(kind: str) -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(0)
    if kind == "mlp":
        layers = [nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.GELU(), nn.Linear(12, 3)]
        return nn.Sequential(*layers), (6,)
    layers = [
        nn.Conv2d(1, 3, 3),
        nn.BatchNorm2d(3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 3),
    ]
    return nn.Sequential(*layers), (1, 6, 6)


def _setup(kind: str, dtype: torch.dtype, samples: int = 40):
    model, shape = _model(kind)
    model = model.to(dtype).eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, *shape, generator=generator, dtype=dtype)
    y = torch.randint(0, 3, (samples,), generator=generator)
    data = AnalysisData(x, y, "cross-entropy", 16)  # batches of 16, 16 and 8
    return model, data, ParamScope.resolve(model)


def _dense_hessian(model, data, scope) -> torch.Tensor:
    """H column by column from exact double-backward products, in float64, symmetrised."""
    exact = CurvatureEngine(model, data, scope)
    H = exact.hessian_matmat(torch.eye(scope.numel, dtype=scope.dtype)).double()
    return (H + H.T) / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_products_are_within_the_stated_bound_of_double_backward(kind, dtype):
    model, data, scope = _setup(kind, dtype)
    H = _dense_hessian(model, data, scope)
    eigenvalues, eigenvectors = torch.linalg.eigh(H)
    generator = torch.Generator().manual_seed(2)
    random = torch.randn(scope.numel, 4, generator=generator, dtype=torch.float64)
    # the directions of the largest error: the extreme eigenvectors (largest truncation)
    V = torch.cat([eigenvectors[:, -3:], eigenvectors[:, :3], random], dim=1)
    fd = FiniteDifferenceEngine(model, data, scope)
    D = fd.hessian_matmat(V.to(dtype)).double()
    beta = fd.error_bound()
    errors = torch.linalg.vector_norm(D - H @ V, dim=0) / torch.linalg.vector_norm(V, dim=0)
    assert (errors <= beta).all(), (errors.tolist(), beta)
    # and the bound says something: O(eps^(2/3)) of the spectral norm
    spectral = float(eigenvalues.abs().max())
    assert beta <= (1e-2 if dtype == torch.float32 else 1e-7) * spectral, (beta, spectral)
    record = fd.bound_record()
    assert record["relative_step"] == pytest.approx(torch.finfo(dtype).eps ** (1 / 3))
    assert record["gradients"] == 2 * V.shape[1] + record["calibration_gradients"]
    assert 30 <= record["calibration_gradients"] <= 48
    assert record["step_norm"] == pytest.approx(record["initial_step"] * record["step_factor"])


def test_initial_step_is_eps_cube_root_times_one_plus_the_weight_norm():
    model, data, scope = _setup("mlp", torch.float32)
    fd = FiniteDifferenceEngine(model, data, scope)
    weights = torch.cat([p.detach().double().reshape(-1) for p in scope.params])
    assert relative_step(torch.float32) == pytest.approx(4.921566601e-3)
    assert relative_step(torch.float64) == pytest.approx(6.055454452e-6)
    s0 = relative_step(torch.float32) * (1 + weights.norm())
    assert fd.initial_step() == pytest.approx(s0)
    assert fd.bound_record()["step_factor"] in (1, 1 / 4, 1 / 16, 1 / 64)
    v = torch.randn(scope.numel, generator=torch.Generator().manual_seed(3))
    # h = s / ||v||: the product is homogeneous in v whatever its scale (each within beta)
    gap = fd.hessian_matmat(1e3 * v) - 1e3 * fd.hessian_matmat(v)
    assert gap.norm() <= 2 * fd.error_bound() * 1e3 * v.norm()
    assert torch.equal(fd.hessian_matmat(torch.zeros_like(v)), torch.zeros_like(v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_weights_and_buffers_restored_bit_for_bit(dtype):
    model, data, scope = _setup("cnn", dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fd = FiniteDifferenceEngine(model, data, scope)
    fd.hessian_matmat(torch.randn(scope.numel, 3, dtype=dtype))
    fd.bound_record()
    fd.loss_and_gradient()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_weights_restored_when_a_product_fails_midway():
    model, data, scope = _setup("mlp", torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    calls = {"n": 0}

    def fail_on_the_third_forward(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a kernel failed")

    handle = model.register_forward_pre_hook(fail_on_the_third_forward)
    fd = FiniteDifferenceEngine(model, data, scope)
    with pytest.raises(RuntimeError, match="kernel failed"):
        fd.hessian_matmat(torch.randn(scope.numel, dtype=torch.float64))
    handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_loss_and_gradient_equal_the_exact_engine():
    model, data, scope = _setup("mlp", torch.float64)
    loss, grad = FiniteDifferenceEngine(model, data, scope).loss_and_gradient()
    ref_loss, ref_grad = CurvatureEngine(model, data, scope).loss_and_gradient()
    assert loss == pytest.approx(ref_loss, rel=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["ggn", "nme"])
def test_gauss_newton_and_nme_are_refused_naming_hvp(name):
    fd = FiniteDifferenceEngine(*_setup("mlp", torch.float64))
    with pytest.raises(UsageError, match="Hessian only") as error:
        build_operator(name, fd)
    assert error.value.source == "hvp"
    with pytest.raises(UsageError, match="Hessian only"):
        fd.hessian_and_ggn_matvec(torch.zeros(fd.scope.numel, dtype=torch.float64))


class _FirstOrderTanh(torch.autograd.Function):
    """tanh whose backward torch cannot differentiate (as a fused kernel's)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class _Tanh(nn.Module):
    def forward(self, x):
        return _FirstOrderTanh.apply(x)


def test_a_model_without_a_double_backward_gets_its_hessian():
    model, data, scope = _setup("mlp", torch.float64)
    H = _dense_hessian(model, data, scope)  # the same function with torch's own tanh
    model[1] = _Tanh()
    # double backward drops the tanh's second derivative without an error, so the
    # self-check refuses the model for `hvp=exact`
    with pytest.raises(InputError, match="central differences"):
        check_second_derivatives(model, data.x[:8], data.y[:8], "cross-entropy", "model")
    v = torch.randn(scope.numel, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    fd = FiniteDifferenceEngine(model, data, scope)
    error = torch.linalg.vector_norm(fd.hessian_matmat(v) - H @ v)
    assert error <= fd.error_bound() * torch.linalg.vector_norm(v)


def test_a_kink_at_the_step_shows_in_the_bound_and_a_note():
    """A ReLU pre-activation exactly 0 (hand-built weights): the gradient jumps within the
    step, the bound is of the size of the products, and the results say so."""
    from sharpcli.analyses.hvp import add_hvp_record

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, -1.0], [1.0, 1.0]]))
        model[0].bias.zero_()
    x = torch.tensor([[1.0, 1.0], [2.0, 0.5], [-1.0, 0.5]], dtype=torch.float64)
    data = AnalysisData(x, torch.tensor([0, 1, 2]), "cross-entropy", 3)
    results = add_hvp_record({}, FiniteDifferenceEngine(model, data, ParamScope.resolve(model)))
    assert results["hvp"]["error_bound_relative"] > 0.1
    assert any("not smooth" in note for note in results["notes"])
    smooth = _setup("mlp", torch.float64)
    assert "notes" not in add_hvp_record({}, FiniteDifferenceEngine(*smooth))


class _Checkpointed(nn.Module):
    """A first block under reentrant activation checkpointing (torch's old default)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=True))


def test_reentrant_checkpointing_keeps_its_parameters_gradients():
    """With data that do not require gradients, torch drops the checkpointed block's
    parameter gradients (a warning only): the products would miss its rows."""
    model = _Checkpointed().double().eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(24, 6, generator=generator, dtype=torch.float64)
    data = AnalysisData(x, torch.randint(0, 3, (24,), generator=generator), "cross-entropy", 8)
    scope = ParamScope.resolve(model)
    v = torch.randn(scope.numel, generator=generator, dtype=torch.float64)
    exact = CurvatureEngine(model, data, scope).hessian_matmat(v)
    fd = FiniteDifferenceEngine(model, data, scope)
    with pytest.warns(UserWarning, match="requires_grad"):  # torch's, outside the engine
        model(x).sum().backward()
    assert torch.linalg.vector_norm(fd.hessian_matmat(v) - exact) <= fd.error_bound() * v.norm()
    assert exact[: 6 * 8 + 8].abs().max() > 0  # the block's rows are there
