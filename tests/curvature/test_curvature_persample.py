"""The exact GGN trace's per-sample norms (ghost norms of Linear/Conv2d layers, Jacobians for the
rest) against dense float64 Gauss-Newton matrices, on layouts the fast path must get right."""

from __future__ import annotations

import pytest
import torch
from conftest import dense_reference
from torch import nn

from sharpcli.curvature import AnalysisData, ParamScope, exact_ggn_trace
from sharpcli.curvature.products.persample import LayerTaps


class _Tokens(nn.Module):
    """Linear layers on (B, T, d) inputs: per-sample gradients sum over the T positions."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 5)
        self.mix = nn.Linear(5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.embed(x.reshape(x.shape[0], 4, 3)))
        return self.head(torch.relu(self.mix(h)).mean(1))


class _Twice(nn.Module):
    """One Linear applied twice and a weight tied between two layers: not separable per call."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 6)
        self.square = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.tied = nn.Linear(6, 6)
        self.tied.weight = self.b.weight
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.square(torch.tanh(self.square(h))))
        return self.head(torch.tanh(self.tied(torch.tanh(self.b(h)))))


def _conv_net():
    """Strided, padded and dilated convolutions, an in-place ReLU, eval BatchNorm with running statistics."""
    net = nn.Sequential(
        nn.Conv2d(1, 3, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(3, 4, 2, dilation=2, bias=False),
        nn.BatchNorm2d(4),
        nn.GELU(),
        nn.Flatten(),
        nn.Linear(4, 3),
        nn.BatchNorm1d(3),
    )
    with torch.no_grad():
        for bn in (net[3], net[7]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    return net


class _FunctionalReuse(nn.Module):
    """The encoder's weight used twice: its own call, then a functional ``F.linear`` on it."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        return self.head(torch.tanh(nn.functional.linear(h, self.enc.weight)))


class _TiedLanguageModel(nn.Module):
    """An embedding tied to the output head, LayerNorm, token positions (ids in, 7 classes)."""

    def __init__(self, vocab=7, dim=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.norm(torch.tanh(self.mix(self.emb(x))))
        return self.head(h.mean(1))


class _SharedAcrossModules(nn.Module):
    """A Linear weight and a LayerNorm gain each shared by two modules; a layer called twice."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.c.weight = self.b.weight
        self.n1 = nn.LayerNorm(4)
        self.n2 = nn.LayerNorm(4)
        self.n2.weight = self.n1.weight
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.n1(torch.tanh(self.b(torch.tanh(self.a(x)))))
        h = self.n2(torch.tanh(self.c(torch.tanh(self.c(h)))))
        return self.head(h)


CASES = {
    "tokens": (_Tokens, (12,)),
    "twice-and-tied": (_Twice, (12,)),
    "conv": (_conv_net, (1, 6, 6)),
    "functional-reuse": (_FunctionalReuse, (12,)),
    "tied-embedding-head": (_TiedLanguageModel, "ids"),
    "shared-across-modules": (_SharedAcrossModules, (12,)),
}


def _case_batch(shape, classes, loss, gen):
    if shape == "ids":
        x = torch.randint(0, 7, (17, 5), generator=gen)
    else:
        x = torch.randn(17, *shape, dtype=torch.float64, generator=gen)
    if loss == "cross-entropy":
        return x, torch.randint(0, classes, (17,), generator=gen)
    return x, torch.randn(17, classes, dtype=torch.float64, generator=gen)


@pytest.mark.parametrize("batch_size", [5, 17])
@pytest.mark.parametrize("loss", ["cross-entropy", "mse"])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_ggn_trace_matches_dense_gauss_newton(case, loss, batch_size):
    make, shape = CASES[case]
    torch.manual_seed(3)
    model = make().double().eval()
    gen = torch.Generator().manual_seed(4)
    classes = 7 if shape == "ids" else 3
    x, y = _case_batch(shape, classes, loss, gen)
    _, G, names = dense_reference(model, x, y, loss)
    scope = ParamScope.resolve(model)
    assert list(scope.names) == names
    result = exact_ggn_trace(model, AnalysisData(x, y, loss, batch_size=batch_size), scope)
    assert result.estimate == pytest.approx(float(G.trace()), rel=1e-10)
    for name, sl in scope.blocks().items():
        assert result.by_layer[name]["estimate"] == pytest.approx(
            float(G[sl, sl].trace()), rel=1e-10, abs=1e-14
        )


def test_taps_cover_plain_layers_and_leave_the_rest_to_jacobians():
    torch.manual_seed(0)
    model = _Twice().double().eval()
    scope = ParamScope.resolve(model)
    taps = LayerTaps(model, scope)
    with torch.enable_grad(), taps:
        z = model(torch.randn(2, 12, dtype=torch.float64))
    taps.resolve(z)
    # `square` ran twice and b and tied share a weight: every use is a tapped call, so the
    # uses' gradients are summed per sample before squaring, on the fast path
    assert taps.uncovered == []

    model = _FunctionalReuse().double().eval()
    scope = ParamScope.resolve(model)
    taps = LayerTaps(model, scope)
    with torch.enable_grad(), taps:
        z = model(torch.randn(2, 12, dtype=torch.float64))
    taps.resolve(z)
    # a use outside any tapped call (F.linear on enc.weight) is seen in the autograd graph
    assert [scope.names[i] for i in taps.uncovered] == ["enc.weight"]

    conv = _conv_net().double().eval()
    scope = ParamScope.resolve(conv)
    taps = LayerTaps(conv, scope)
    with torch.enable_grad(), taps:
        z = conv(torch.randn(2, 1, 6, 6, dtype=torch.float64))
    taps.resolve(z)
    assert taps.uncovered == []  # eval-mode BatchNorm is tapped too
    conv[3].train()  # batch statistics couple the samples: left to the Jacobian path
    taps = LayerTaps(conv, ParamScope.resolve(conv))
    with torch.enable_grad(), taps:
        z = conv(torch.randn(2, 1, 6, 6, dtype=torch.float64))
    taps.resolve(z)
    assert {scope.names[i] for i in taps.uncovered} == {"3.weight", "3.bias"}
