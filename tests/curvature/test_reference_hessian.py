"""The dense float64 reference Hessian that every curvature test trusts, checked against central
differences of the gradient, on a network with LayerNorm (where torch.func's forward-over-reverse
Hessian is wrong in torch 2.13) and with a tied embedding/head."""

from __future__ import annotations

import pytest
import torch
from conftest import dense_reference
from torch import nn
from torch.func import functional_call, grad

from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope


class _TiedNormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.enc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.norm(torch.tanh(self.enc(self.emb(x))))
        h = torch.tanh(nn.functional.linear(h, self.enc.weight))  # the encoder weight twice
        return self.head(h.mean(1))


def _models():
    torch.manual_seed(0)
    norm_mlp = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 3))
    gen = torch.Generator().manual_seed(1)
    return {
        "layernorm-mlp": (
            norm_mlp.double(),
            torch.randn(9, 3, dtype=torch.float64, generator=gen),
            torch.randint(0, 3, (9,), generator=gen),
        ),
        "tied-embedding-layernorm": (
            _TiedNormModel().double().eval(),
            torch.randint(0, 7, (9, 5), generator=gen),
            torch.randint(0, 7, (9,), generator=gen),
        ),
    }


def _central_difference_hessian(model, x, y, names, eps=1e-5):
    params = dict(model.named_parameters())
    shapes = [params[n].shape for n in names]
    flat0 = torch.cat([params[n].detach().reshape(-1) for n in names])

    def loss(flat):
        out, start = {}, 0
        for n, shape in zip(names, shapes):
            out[n] = flat[start : start + shape.numel()].view(shape)
            start += shape.numel()
        return nn.functional.cross_entropy(functional_call(model, out, (x,)), y)

    g = grad(loss)  # first derivatives only: correct under every transform
    eye = torch.eye(flat0.numel(), dtype=torch.float64)
    return torch.stack([(g(flat0 + eps * e) - g(flat0 - eps * e)) / (2 * eps) for e in eye])


@pytest.mark.parametrize("case", ["layernorm-mlp", "tied-embedding-layernorm"])
def test_reference_hessian_matches_central_differences(case):
    model, x, y = _models()[case]
    H, G, names = dense_reference(model, x, y, "cross-entropy")
    fd = _central_difference_hessian(model, x, y, names)
    assert torch.allclose(H, H.T, atol=1e-12)
    assert float((H - fd).abs().max()) < 1e-7 * max(1.0, float(H.abs().max()))
    # sharp's products (eager double backward through cached first-order graphs) agree
    scope = ParamScope.resolve(model)
    engine = CurvatureEngine(model, AnalysisData(x, y, "cross-entropy", batch_size=4), scope)
    eye = torch.eye(scope.numel, dtype=torch.float64)
    assert float((engine.hessian().matmat(eye) - H).abs().max()) < 1e-10
    assert float((engine.ggn().matmat(eye) - G).abs().max()) < 1e-10
    assert float((engine.nme().matmat(eye) - (H - G)).abs().max()) < 1e-10
