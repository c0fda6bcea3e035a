"""``Curvature(..., hvp="finite-difference")``: the Hessian's eigenvalues and trace within the
measured bound of the exact ones; what it cannot give refused on ``hvp`` or ``blocks``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharpcli import Curvature
from sharpcli.errors import UsageError


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (32,), generator=generator)
    exact = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    fd = Curvature(model, nn.CrossEntropyLoss(), (x, y), hvp="finite-difference")
    return exact, fd


def test_eigenvalues_and_trace_within_the_bound(pair):
    exact, fd = pair
    beta = fd.engine.error_bound()
    assert 0 < beta < 1e-8
    a, b = exact.eigenvalues(top_k=2, tol=1e-9), fd.eigenvalues(top_k=2, tol=1e-9)
    for x, y, rx, ry in zip(a.eigenvalues, b.eigenvalues, a.residuals, b.residuals):
        assert abs(x - y) <= beta + rx + ry
    ta = exact.trace(estimator="hutchinson", tol=1e-9, max_matvecs=12, seed=3)
    tb = fd.trace(estimator="hutchinson", tol=1e-9, max_matvecs=12, seed=3)
    assert abs(ta.estimate - tb.estimate) <= beta * exact.num_params


def test_weights_of_the_callers_model_unchanged(pair):
    _, fd = pair
    before = [p.detach().clone() for p in fd.model.parameters()]
    fd.operator() @ torch.ones(fd.num_params, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(before, fd.model.parameters()))


@pytest.mark.parametrize("name", ["ggn", "nme"])
def test_gauss_newton_and_nme_refused_on_hvp(pair, name):
    with pytest.raises(UsageError, match="Hessian only") as error:
        pair[1].operator(name)
    assert error.value.source == "hvp"


def test_blocks_and_unknown_methods_refused(pair):
    with pytest.raises(UsageError) as error:
        pair[1].eigenvalues(blocks="params")
    assert error.value.source == "blocks"
    with pytest.raises(UsageError) as error:
        Curvature(
            pair[0].model,
            "cross-entropy",
            (torch.zeros(2, 4).double(), torch.zeros(2).long()),
            hvp="central",
        )
    assert error.value.source == "hvp"
