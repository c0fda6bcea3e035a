r"""The preconditioned curvature of an adaptive optimizer: :math:`P^{-1/2} A P^{-1/2}`.

An adaptive optimizer with a diagonal preconditioner :math:`P` steps
:math:`\theta' = \theta - \mathrm{lr}\, P^{-1} m`; on a quadratic with Hessian :math:`H` its
stability is that of gradient descent (or heavy ball) on :math:`P^{-1} H`, whose top
eigenvalue, the *preconditioned sharpness*, equilibrates at the optimizer's threshold
([Cohen2022]; :mod:`sharpcli.analyses.stability`). :math:`P^{-1} H` is not symmetric, but it
is similar to the symmetric

.. math::

    \tilde A = P^{-1/2} A P^{-1/2}, \qquad
    P^{-1} A = P^{-1/2} \tilde A P^{1/2},

so both have the same eigenvalues and Lanczos runs on :math:`\tilde A` (an eigenvector
:math:`u` of :math:`\tilde A` is :math:`P^{1/2} w` for the eigenvector :math:`w` of
:math:`P^{-1} A`). :math:`\tilde A` is the curvature in the coordinates
:math:`\phi = P^{1/2} \theta`, whose loss gradient is :math:`P^{-1/2} \nabla L`
(:meth:`PreconditionedOperator.loss_and_gradient`).

The diagonal :math:`P` is given (one positive tensor per parameter in scope, or one flat
tensor) or read from the optimizer's state at that step (:func:`optimizer_diagonal`), as torch
computes the denominator of its update:

- ``Adam``/``AdamW``: :math:`P = \sqrt{\hat v} + \epsilon`, :math:`\hat v = v / (1 -
  \beta_2^t)` with the optimizer's own step count :math:`t` (``amsgrad``: :math:`v` the
  running maximum ``max_exp_avg_sq``);
- ``RMSprop``: :math:`P = \sqrt{v} + \epsilon` (``centered``:
  :math:`\sqrt{v - \bar g^2} + \epsilon`, :math:`\bar g` its running mean gradient).

The operator is not an ``--operator`` name: it needs a preconditioner besides the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sharpcli.curvature.operators.hessian import CurvatureEngine, CurvatureOperator
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.errors import UsageError

__all__ = ["PreconditionedOperator", "diagonal_preconditioner", "optimizer_diagonal"]


def _parameter_state(optimizer: torch.optim.Optimizer, scope: ParamScope) -> list:
    """``(group, state)`` of each scoped parameter in ``optimizer``; a one-line UsageError on
    ``preconditioner`` for a parameter it does not hold or one it has not stepped yet."""
    name = type(optimizer).__name__
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    pairs = []
    for param_name, p in zip(scope.names, scope.params):
        group = group_of.get(id(p))
        if group is None:
            raise UsageError(
                f"parameter {param_name} is in the scope but not in the {name} optimizer",
                source="preconditioner",
            )
        state = optimizer.state.get(p)
        if not state:
            raise UsageError(
                f"the {name} optimizer has no state for {param_name} yet (no step taken); "
                "its preconditioner exists after its first step",
                source="preconditioner",
            )
        pairs.append((group, state))
    return pairs


def _adam_diagonal(group: dict, state: dict) -> torch.Tensor:
    """torch's Adam denominator ``sqrt(v / (1 - beta2^t)) + eps`` (amsgrad: ``v`` the max)."""
    beta2 = float(group["betas"][1])
    step = float(state["step"])
    v = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
    v = v.detach().to(torch.float64)
    return (v / (1 - beta2**step)).sqrt() + float(group["eps"])


def _rmsprop_diagonal(group: dict, state: dict) -> torch.Tensor:
    """torch's RMSprop denominator ``sqrt(v) + eps`` (centered: ``sqrt(v - g_avg^2) + eps``)."""
    v = state["square_avg"].detach().to(torch.float64)
    if group.get("centered", False):
        mean = state["grad_avg"].detach().to(torch.float64)
        v = v - mean * mean
    return v.sqrt() + float(group["eps"])


def optimizer_diagonal(optimizer: torch.optim.Optimizer, scope: ParamScope) -> torch.Tensor:
    """The diagonal preconditioner ``P`` of ``optimizer`` now, flat over ``scope`` (float64).

    Only the scoped parameters' state is read, in the scope's layout. ``Adam``/``AdamW``:
    ``sqrt(v_hat) + eps`` with ``v_hat = v / (1 - beta2^t)``, ``t`` the parameter's own step
    count (``amsgrad``: ``max_exp_avg_sq``); ``RMSprop``: ``sqrt(v) + eps`` (centered:
    ``sqrt(v - g_avg^2) + eps``) ([Cohen2022]).

    Raises:
        UsageError: (``preconditioner``) an optimizer without a diagonal preconditioner (SGD,
            others), one that has taken no step, a scoped parameter it does not optimise.
    """
    name = type(optimizer).__name__
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        read = _adam_diagonal
    elif isinstance(optimizer, torch.optim.RMSprop):
        read = _rmsprop_diagonal
    else:
        raise UsageError(
            f"{name} has no diagonal preconditioner to read; accepted: Adam, AdamW, RMSprop "
            "(or give the diagonal itself)",
            source="preconditioner",
        )
    parts = [read(group, state) for group, state in _parameter_state(optimizer, scope)]
    return scope.flatten(parts)


def diagonal_preconditioner(
    preconditioner: torch.optim.Optimizer | torch.Tensor | Sequence[torch.Tensor],
    scope: ParamScope,
) -> torch.Tensor:
    """The flat diagonal ``P`` (float64, on the scope's device) of ``preconditioner``: an
    optimizer (:func:`optimizer_diagonal`), one flat tensor of the scope's size, or one
    tensor per scoped parameter shaped like it. Every entry must be positive and finite.

    Raises:
        UsageError: (``preconditioner``) a wrong size or shape, a non-positive or non-finite
            entry, or an optimizer it cannot read.
    """
    if isinstance(preconditioner, torch.optim.Optimizer):
        flat = optimizer_diagonal(preconditioner, scope)
    elif isinstance(preconditioner, torch.Tensor):
        if preconditioner.numel() != scope.numel or preconditioner.dim() != 1:
            raise UsageError(
                f"a flat diagonal must have the scope's {scope.numel} entries, got shape "
                f"{tuple(preconditioner.shape)}",
                source="preconditioner",
            )
        flat = preconditioner.detach().to(torch.float64)
    elif isinstance(preconditioner, Sequence) and all(
        isinstance(t, torch.Tensor) for t in preconditioner
    ):
        shapes = [tuple(t.shape) for t in preconditioner]
        if shapes != [tuple(s) for s in scope.shapes]:
            raise UsageError(
                f"one tensor per scoped parameter, shaped like it: expected "
                f"{len(scope.shapes)} of shapes {[tuple(s) for s in scope.shapes]}, got {shapes}",
                source="preconditioner",
            )
        flat = scope.flatten([t.detach().to(torch.float64) for t in preconditioner])
    else:
        raise UsageError(
            "expected an optimizer (Adam, AdamW, RMSprop), a flat tensor or one tensor per "
            f"parameter, got {type(preconditioner).__name__}",
            source="preconditioner",
        )
    flat = flat.to(scope.device)
    if not bool(torch.isfinite(flat).all()) or not bool((flat > 0).all()):
        raise UsageError(
            "every entry of the diagonal preconditioner must be positive and finite",
            source="preconditioner",
        )
    return flat


class PreconditionedOperator(CurvatureOperator):
    r"""The symmetric :math:`P^{-1/2} A P^{-1/2}` of a curvature operator :math:`A` and a
    positive diagonal :math:`P`: the eigenvalues of :math:`P^{-1} A` ([Cohen2022]).

    .. math::

        \tilde A v = P^{-1/2} \bigl(A (P^{-1/2} v)\bigr)

    one product of :math:`A` per product (``matvecs`` counts both).

    Args:
        op: the curvature operator :math:`A` (the Hessian, usually).
        diagonal: :math:`P`, flat, positive (:func:`diagonal_preconditioner` builds it from an
            optimizer, a flat tensor or one tensor per parameter).

    Example:
        >>> import torch
        >>> from sharpcli.curvature.operators.hessian import MatrixOperator
        >>> A = MatrixOperator(torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64))
        >>> pre = PreconditionedOperator(A, torch.tensor([1.0, 4.0], dtype=torch.float64))
        >>> pre.to_dense()
        tensor([[2.0000, 0.5000],
                [0.5000, 0.5000]], dtype=torch.float64)
    """

    def __init__(self, op: CurvatureOperator, diagonal: torch.Tensor):
        if diagonal.dim() != 1 or diagonal.numel() != op.shape[0]:
            raise ValueError(
                f"a diagonal of {op.shape[0]} entries expected, got shape {tuple(diagonal.shape)}"
            )
        if not bool((diagonal > 0).all()):
            raise ValueError("the diagonal preconditioner must be positive")
        super().__init__(op.shape[0], op.dtype, op.device)
        self.op = op
        self.diagonal = diagonal
        # P^-1/2, computed in float64 and kept in the products' dtype
        self.scale = diagonal.to(torch.float64).rsqrt().to(dtype=op.dtype, device=op.device)
        self.engine = op.engine
        self.name = f"P^-1/2 {op.name} P^-1/2"

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        scale = self.scale[:, None]
        return scale * self.op.matmat(scale * V)

    def _rebuild(self, engine: CurvatureEngine) -> CurvatureOperator:
        return PreconditionedOperator(self.op._rebuild(engine), self.diagonal)

    def loss_and_gradient(self) -> tuple[float, torch.Tensor]:
        """The loss and its gradient in the preconditioned coordinates ``phi = P^1/2 theta``:
        ``P^-1/2 grad L`` (the start of ``lanczos(..., warm_start="gradient")``)."""
        loss, gradient = self.op.loss_and_gradient()
        return loss, self.scale.to(gradient.dtype) * gradient
