"""Fisher-Rao norm against a dense float64 Fisher; PAC-Bayes sigma's bisection meets its target
([Liang2019]; [Jiang2019])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharpcli.analyses.flatness import fisher_rao_norm, pac_bayes_sigma
from sharpcli.curvature.products.data import AnalysisData


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double().eval()


def _data(n: int = 24):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, dtype=torch.float64, generator=gen), torch.randint(
        0, 4, (n,), generator=gen
    )


def test_fisher_rao_norm_against_a_dense_float64_fisher():
    model = _net()
    x, y = _data()
    params = list(model.parameters())
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    fisher = torch.zeros(theta.numel(), theta.numel(), dtype=torch.float64)
    empirical = torch.zeros_like(fisher)
    for i in range(x.shape[0]):
        z = model(x[i : i + 1])[0]
        jac = torch.stack(
            [torch.cat([g.reshape(-1) for g in torch.autograd.grad(z[c], params, retain_graph=True)])
             for c in range(z.numel())]
        )  # fmt: skip
        p = torch.softmax(z.detach(), 0)
        fisher += jac.T @ (torch.diag(p) - torch.outer(p, p)) @ jac  # sum_y p_y g_y g_y^T
        g = torch.autograd.grad(F.cross_entropy(z[None], y[i : i + 1]), params)
        g = torch.cat([t.reshape(-1) for t in g])
        empirical += torch.outer(g, g)
    n = x.shape[0]
    result = fisher_rao_norm(model, AnalysisData(x, y, "cross-entropy", 7))
    assert result["fisher_rao_norm_sq"] == pytest.approx(
        float(theta @ fisher @ theta) / n, rel=1e-10
    )
    assert result["fisher_rao_norm_sq_empirical"] == pytest.approx(
        float(theta @ empirical @ theta) / n, rel=1e-10
    )


def _trained(n: int = 200):
    """A net fitted to a teacher's labels: accuracy near 1, which weight noise lowers."""
    model = _net()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, 3, dtype=torch.float64, generator=gen)
    y = (x @ torch.randn(3, 4, dtype=torch.float64, generator=gen)).argmax(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(150):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval(), x, y


@pytest.mark.parametrize("magnitude_aware", [False, True])
def test_pac_bayes_sigma_meets_its_target_and_restores_the_model(magnitude_aware):
    model, x, y = _trained()
    before = [p.detach().clone() for p in model.parameters()]
    data = AnalysisData(x, y, "cross-entropy", 64)
    found = pac_bayes_sigma(model, data, magnitude_aware=magnitude_aware, samples=10, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert found.converged and abs(found.deviation - 0.1) < 0.01
    assert found.flatness == pytest.approx(1 / found.sigma**2)
    assert found.deviation_stderr > 0 and found.quantity == "accuracy"
    # a sigma a quarter as large moves the accuracy much less (monotone in expectation)
    smaller = pac_bayes_sigma(model, data, magnitude_aware=magnitude_aware, upper=found.sigma / 2,
                              max_halvings=1, seed=3)  # fmt: skip
    assert smaller.deviation < found.deviation
