"""Reference Hessians of a model's mean cross-entropy for tests, float64, from first principles.

- :func:`double_backward_hessian`: row ``i`` is ``grad(g_i)`` of the gradient ``g`` taken with
  a graph (eager autograd, as sharp's own products; ``torch.func.hessian`` is avoided, see
  tests/curvature/test_reference_hessian.py);
- :func:`central_difference_hessian`: column ``i`` is ``(g(theta + h e_i) - g(theta - h e_i)) /
  2h``, which needs first derivatives only, so it checks second derivatives independently.

Parameters that do not reach the loss get zero rows and columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def flat_gradient(model, params, x, y, create_graph: bool = False) -> torch.Tensor:
    """``grad_theta CE(model(x), y)`` over ``params``, concatenated (zeros where unused)."""
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, params, create_graph=create_graph, allow_unused=True)
    return torch.cat(
        [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)]
    )


def double_backward_hessian(model, params, x, y) -> torch.Tensor:
    """The dense Hessian by differentiating each gradient entry again."""
    g = flat_gradient(model, params, x, y, create_graph=True)
    rows = []
    for i in range(g.numel()):
        row = torch.autograd.grad(g[i], params, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if r is None else r).reshape(-1) for p, r in zip(params, row)]
            )
        )
    return torch.stack(rows)


def central_difference_hessian(model, params, x, y, h: float = 1e-6) -> torch.Tensor:
    """The dense Hessian by central differences of the gradient (parameters restored after)."""
    theta = [p.detach().clone() for p in params]
    flat = torch.cat([t.reshape(-1) for t in theta])
    sizes = [p.numel() for p in params]
    columns = []
    for i in range(flat.numel()):
        step = torch.zeros_like(flat)
        step[i] = h
        pair = []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for p, t in zip(params, (flat + sign * step).split(sizes)):
                    p.copy_(t.view_as(p))
            pair.append(flat_gradient(model, params, x, y))
        columns.append((pair[0] - pair[1]) / (2 * h))
    with torch.no_grad():
        torch._foreach_copy_(params, theta)
    return torch.stack(columns, dim=1)


def cross_entropy_ggn(model, params, x) -> torch.Tensor:
    """The dense Gauss-Newton matrix of the mean cross-entropy, ``(1/N) sum_i J_i^T H_z J_i``
    with ``H_z = diag(p) - p p^T``, from the logits' Jacobian row by row (zeros where a
    parameter does not reach the logits)."""
    logits = model(x)
    rows = []
    for value in logits.reshape(-1):
        grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for p, g in zip(params, grads)
                ]
            )
        )
    n, classes = logits.shape
    J = torch.stack(rows).reshape(n, classes, -1)
    p = torch.softmax(logits.detach(), 1)
    hz = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("nca,ncd,ndb->ab", J, hz, J) / n
