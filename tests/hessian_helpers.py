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


def flat_gradient(model, params, x, y, create_graph: bool = False, loss_fn=None) -> torch.Tensor:
    """``grad_theta loss_fn(model(x), y)`` over ``params``, concatenated (zeros where unused);
    ``loss_fn`` a torch loss module or function, cross-entropy by default."""
    loss = (loss_fn or F.cross_entropy)(model(x), y)
    grads = torch.autograd.grad(loss, params, create_graph=create_graph, allow_unused=True)
    return torch.cat(
        [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)]
    )


def double_backward_hessian(model, params, x, y, loss_fn=None) -> torch.Tensor:
    """The dense Hessian of ``loss_fn(model(x), y)`` (cross-entropy by default) by
    differentiating each gradient entry again."""
    g = flat_gradient(model, params, x, y, create_graph=True, loss_fn=loss_fn)
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


def _flat(tensors, params) -> torch.Tensor:
    return torch.cat(
        [(torch.zeros_like(p) if t is None else t).reshape(-1) for p, t in zip(params, tensors)]
    )


def jacobian_ggn(model, params, x, y, loss_fn) -> torch.Tensor:
    """The dense Gauss-Newton matrix ``J^T H_z J`` of ``loss_fn(model(x), y)``: ``J`` the
    Jacobian of every output entry by autograd, ``H_z`` the loss's Hessian in the outputs by
    double backward (both over the whole batch, so ``H_z`` carries the loss's reduction)."""
    z = model(x)
    rows = [
        _flat(torch.autograd.grad(entry, params, retain_graph=True, allow_unused=True), params)
        for entry in z.reshape(-1)
    ]
    jacobian = torch.stack(rows)  # (outputs, P)
    outputs = z.detach().requires_grad_(True)
    (gradient,) = torch.autograd.grad(loss_fn(outputs, y), outputs, create_graph=True)
    gradient = gradient.reshape(-1)
    hessian_z = torch.stack(
        [
            torch.autograd.grad(gradient[i], outputs, retain_graph=True)[0].reshape(-1)
            for i in range(gradient.numel())
        ]
    )
    return jacobian.T @ hessian_z @ jacobian


def cross_entropy_ggn(model, params, x) -> torch.Tensor:
    """The dense Gauss-Newton matrix of the mean cross-entropy, ``(1/N) sum_i J_i^T H_z J_i``
    with ``H_z = diag(p) - p p^T`` (it does not depend on the labels, so any labels do)."""
    labels = torch.zeros(x.shape[0], dtype=torch.long)
    return jacobian_ggn(model, params, x, labels, torch.nn.functional.cross_entropy)
