"""Shared tiny float64 models and exact dense references (torch.func) for curvature tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

torch.set_num_threads(1)


def make_mlp(activation: str = "gelu", sizes=(4, 6, 6, 3), seed: int = 0) -> nn.Sequential:
    """A float64 MLP ``sizes[0] -> ... -> sizes[-1]`` with the given activation (eval mode)."""
    torch.manual_seed(seed)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(sizes) - 2:
            layers.append(nn.GELU() if activation == "gelu" else nn.ReLU())
    return nn.Sequential(*layers).double().eval()


def make_cnn(seed: int = 0) -> nn.Sequential:
    """Conv(1->2, 3x3) -> BatchNorm (eval, non-trivial running stats) -> ReLU -> Linear(18 -> 3)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(18, 3)
    ).double()
    with torch.no_grad():
        model[1].running_mean.copy_(torch.tensor([0.1, -0.2]))
        model[1].running_var.copy_(torch.tensor([0.8, 1.3]))
        model[1].weight.copy_(torch.tensor([1.2, 0.7]))
        model[1].bias.copy_(torch.tensor([0.05, -0.1]))
    return model.eval()


def make_data(kind: str = "vector", n: int = 23, classes: int = 3, seed: int = 1):
    """Inputs and integer labels: vectors of dim 4 or 1x5x5 images."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, 4) if kind == "vector" else (n, 1, 5, 5)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=gen)
    return x, y


def dense_reference(model: nn.Module, x, y, loss: str, param_names=None):
    """Exact float64 ``(H, G, names)`` of the mean loss over (x, y) w.r.t. the named parameters.

    H by eager double backward (``torch.autograd.functional.hessian``); ``G = (1/N) sum_i J_i^T H_z,i J_i`` with ``J_i`` from
    ``torch.func.jacrev`` and ``H_z`` = ``diag(p) - p p^T`` (cross-entropy) or ``(2/C) I`` (mse).
    """
    from torch.func import functional_call, jacrev

    params = dict(model.named_parameters())
    names = list(params) if param_names is None else list(param_names)
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]
    flat0 = torch.cat([params[n].detach().reshape(-1) for n in names])

    def unflat(flat):
        out, start = {}, 0
        for n, shape, size in zip(names, shapes, sizes):
            out[n] = flat[start : start + size].view(shape)
            start += size
        return out

    def logits(flat):
        return functional_call(model, unflat(flat), (x,))

    def mean_loss(flat):
        z = logits(flat)
        if loss == "cross-entropy":
            return torch.nn.functional.cross_entropy(z, y)
        return torch.nn.functional.mse_loss(z, y.reshape(z.shape))

    # Reverse-over-reverse (eager double backward): torch.func.hessian (forward-over-reverse)
    # and jacrev(jacrev) return a wrong, non-symmetric block between a LayerNorm's weight and
    # the parameters before it in torch 2.13 (0.17 off on a 3-layer net, against central
    # differences of the gradient); tests/curvature/test_reference_hessian.py guards this reference.
    H = torch.autograd.functional.hessian(mean_loss, flat0, vectorize=True)
    J = jacrev(logits)(flat0)  # (N, C, P)
    z = logits(flat0).detach()
    n, c = z.shape
    if loss == "cross-entropy":
        p = torch.softmax(z, dim=-1)
        Hz = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    else:
        Hz = (2.0 / c) * torch.eye(c, dtype=z.dtype).expand(n, c, c)
    G = torch.einsum("ncp,ncd,ndq->pq", J, Hz, J) / n
    return H.detach(), G.detach(), names


_REFERENCES: dict = {}


def setup_and_reference(kind: str = "gelu", loss: str = "cross-entropy"):
    """Fresh ``(model, x, y)`` for ``kind`` in {gelu, relu, cnn} plus its cached exact ``(H, G)``.

    mse targets are seeded Gaussians with 3 outputs.
    """
    model = make_cnn() if kind == "cnn" else make_mlp(kind)
    x, y = make_data("image" if kind == "cnn" else "vector")
    if loss == "mse":
        y = torch.randn(
            x.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5)
        )
    key = (kind, loss)
    if key not in _REFERENCES:
        H, G, _ = dense_reference(model, x, y, loss)
        _REFERENCES[key] = (H, G)
    H, G = _REFERENCES[key]
    return model, x, y, H, G


@pytest.fixture
def gelu_setup():
    model = make_mlp("gelu")
    x, y = make_data("vector")
    return model, x, y


@pytest.fixture
def relu_setup():
    model = make_mlp("relu")
    x, y = make_data("vector")
    return model, x, y


@pytest.fixture
def cnn_setup():
    model = make_cnn()
    x, y = make_data("image")
    return model, x, y
