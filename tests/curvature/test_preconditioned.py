"""The preconditioned curvature P^-1/2 H P^-1/2 against dense float64 references.

H is the dense Hessian by double backward (tests/hessian_helpers.py); P is recovered from the
optimizer's own last update (the step torch took is ``-lr * m_hat / P`` for Adam, ``-lr * g /
P`` for RMSprop without momentum), not from the formula the code reads the state with, so the
test checks the bias correction, amsgrad and centering against torch itself.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharpcli import Curvature
from sharpcli.curvature import MatrixOperator, ParamScope
from sharpcli.curvature.operators.preconditioned import (
    PreconditionedOperator,
    diagonal_preconditioner,
    optimizer_diagonal,
)
from sharpcli.errors import UsageError
from tests.hessian_helpers import double_backward_hessian

D = torch.float64


def _problem(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(24, 3, dtype=D)
    y = torch.randint(0, 3, (24,))
    return model, x, y


def _train(model, x, y, optimizer, steps=4):
    """``steps`` full-batch steps; returns (parameters before, gradients of) the last one."""
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        grads = [p.grad.detach().clone() for p in model.parameters()]
        optimizer.step()
    return before, grads


def _p_from_last_step(optimizer, model, before, grads, kind, lr, wd=0.0):
    """P recovered from the update torch took: Adam ``theta (1 - lr wd) - theta' = lr m_hat
    / P``; RMSprop (no momentum) ``theta - theta' = lr g / P``."""
    parts = []
    for p, b, g in zip(model.parameters(), before, grads):
        state = optimizer.state[p]
        moved = b * (1 - lr * wd) - p.detach()
        if kind == "adam":
            beta1 = optimizer.param_groups[0]["betas"][0]
            m_hat = state["exp_avg"] / (1 - beta1 ** float(state["step"]))
            parts.append(lr * m_hat / moved)
        else:
            parts.append(lr * g / moved)
    return torch.cat([t.reshape(-1) for t in parts])


CASES = [
    ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.9, 0.99)), 0.01, 0.0),
    ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, eps=1e-3), 0.01, 0.0),
    ("adam", lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1), 0.02, 0.1),
    ("rmsprop", lambda ps: torch.optim.RMSprop(ps, lr=0.003), 0.003, 0.0),
    ("rmsprop", lambda ps: torch.optim.RMSprop(ps, lr=0.003, centered=True), 0.003, 0.0),
]


@pytest.mark.parametrize("kind,make,lr,wd", CASES)
def test_preconditioned_lambda_max_is_the_dense_reference(kind, make, lr, wd):
    model, x, y = _problem()
    optimizer = make(model.parameters())
    before, grads = _train(model, x, y, optimizer)
    params = list(model.parameters())
    scope = ParamScope.resolve(model)

    p_torch = _p_from_last_step(optimizer, model, before, grads, kind, lr, wd)
    p_read = optimizer_diagonal(optimizer, scope)
    torch.testing.assert_close(p_read, p_torch, rtol=1e-8, atol=0)

    H = double_backward_hessian(model, params, x, y)
    scale = p_torch.rsqrt()
    dense = scale[:, None] * H * scale[None, :]
    reference = torch.linalg.eigvalsh(dense).flip(0)
    # the same eigenvalues as the non-symmetric P^-1 H
    similar = torch.linalg.eigvals(H / p_torch[:, None]).real.sort(descending=True).values
    torch.testing.assert_close(similar[:3], reference[:3], rtol=1e-9, atol=1e-9)

    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    result = curvature.preconditioned_eigenvalues(optimizer, top_k=2, tol=1e-8)
    assert all(result.converged)
    assert result.eigenvalues == pytest.approx(reference[:2].tolist(), rel=1e-7)
    # the operator's dense form is P^-1/2 H P^-1/2 itself
    op = PreconditionedOperator(curvature.operator("hessian"), p_read)
    torch.testing.assert_close(op.to_dense(), dense, rtol=1e-9, atol=1e-10)


def test_scope_reads_only_the_scoped_parameters():
    model, x, y = _problem(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    before, grads = _train(model, x, y, optimizer)
    last = list(model.parameters())[2:]  # 2.weight, 2.bias
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y), params="2.*")
    p_all = _p_from_last_step(optimizer, model, before, grads, "adam", 0.01)
    p_last = p_all[-sum(p.numel() for p in last) :]
    H = double_backward_hessian(model, last, x, y)
    scale = p_last.rsqrt()
    reference = torch.linalg.eigvalsh(scale[:, None] * H * scale[None, :]).max().item()
    result = curvature.preconditioned_eigenvalues(optimizer, tol=1e-8)
    assert result.eigenvalues[0] == pytest.approx(reference, rel=1e-7)
    # the same P given per parameter and flat
    per_param = [t.view_as(p) for t, p in zip(p_last.split([p.numel() for p in last]), last)]
    for given in (per_param, p_last):
        again = curvature.preconditioned_eigenvalues(given, tol=1e-8)
        assert again.eigenvalues[0] == pytest.approx(reference, rel=1e-7)


def test_a_diagonal_matrix_example():
    A = MatrixOperator(torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=D))
    p = torch.tensor([1.0, 4.0], dtype=D)
    op = PreconditionedOperator(A, p)
    expected = torch.linalg.eigvals(torch.diag(1 / p) @ A.matrix).real.sort().values
    torch.testing.assert_close(torch.linalg.eigvalsh(op.to_dense()), expected)
    assert op.matvecs == 2 and A.matvecs == 2


def test_refusals_are_one_line_usage_errors():
    model, x, y = _problem()
    scope = ParamScope.resolve(model)
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(UsageError, match="no step taken") as caught:
        curvature.preconditioned_eigenvalues(fresh)
    assert caught.value.source == "preconditioner" and "\n" not in caught.value.one_line()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, x, y, sgd, steps=1)
    with pytest.raises(UsageError, match="SGD has no diagonal preconditioner"):
        curvature.preconditioned_eigenvalues(sgd)
    partial = torch.optim.Adam(list(model.parameters())[2:], lr=0.01)
    _train(model, x, y, partial, steps=1)
    with pytest.raises(UsageError, match="0.weight is in the scope but not in the Adam"):
        optimizer_diagonal(partial, scope)
    with pytest.raises(UsageError, match="positive and finite"):
        diagonal_preconditioner(torch.zeros(scope.numel, dtype=D), scope)
    with pytest.raises(UsageError, match="scope's 31 entries"):
        diagonal_preconditioner(torch.ones(5, dtype=D), scope)
    with pytest.raises(UsageError, match="one tensor per scoped parameter"):
        diagonal_preconditioner([torch.ones(3)], scope)
    with pytest.raises(UsageError) as caught:
        curvature.preconditioned_eigenvalues(torch.ones(scope.numel, dtype=D), top_k=0)
    assert caught.value.source == "top_k"
