"""The stability threshold of an optimizer: the sharpness above which its step diverges on a
quadratic, read from the optimizer's hyper-parameters as they stand (schedules included).

On a quadratic ``f(x) = lambda/2 x^2`` every optimizer below is, for a frozen
preconditioner, a linear iteration on its state; it is stable while the spectral radius of
the iteration matrix is below 1, and it loses stability when an eigenvalue of that matrix
crosses -1, at a curvature ``lambda`` that depends only on the hyper-parameters. That
curvature is the threshold: full-batch training raises the sharpness until it reaches it and
then hovers there, the edge of stability ([Cohen2021] for gradient descent and momentum,
[Cohen2022] for the preconditioned sharpness of adaptive methods).

With ``h = lr * lambda`` and the torch update rules (``b`` the momentum buffer, ``g`` the
gradient, ``mu`` the momentum, ``d`` the dampening):

- gradient descent ``x' = x - lr g``: ``x' = (1 - h) x``, stable while ``h < 2``: ``2/lr``;
- heavy ball (torch's ``SGD(momentum=mu)``): ``b' = mu b + (1 - d) g``, ``x' = x - lr b'``;
  the characteristic polynomial ``z^2 - (1 + mu - (1 - d) h) z + mu`` has a root at -1 when
  ``(1 - d) h = 2 + 2 mu``: ``(2 + 2 mu) / ((1 - d) lr)``;
- Nesterov (torch's ``SGD(momentum=mu, nesterov=True)``): ``b' = mu b + (1 - d) g``,
  ``x' = x - lr (g + mu b')``; with ``c = lr b`` the iteration matrix on ``(x, c)`` is
  ``[[1 - h - mu (1 - d) h, -mu^2], [(1 - d) h, mu]]``, of trace ``T = 1 + mu - h (1 + mu (1 -
  d))`` and determinant ``D = mu (1 - h)``; the root at -1 (``1 + T + D = 0``) is at
  ``h = (2 + 2 mu) / (1 + mu (2 - d))``, which is [Cohen2021]'s ``(2 + 2 mu) / ((1 + 2 mu)
  lr)`` for ``d = 0`` (the other Jury conditions, ``|D| < 1`` and ``1 - T + D = h (1 - mu d)
  > 0``, hold below it);
- Adam and AdamW, for the preconditioned sharpness ``lambda_max(P^-1 H)`` with ``P =
  diag(sqrt(v_hat) + eps)`` held fixed ([Cohen2022]): ``m' = b1 m + (1 - b1) g``, ``x' = (1 -
  lr wd) x - lr m' / p`` (``wd`` AdamW's decoupled weight decay, 0 for Adam); with ``a = lr
  lambda / p`` the root at -1 is at ``(1 - b1) a = (1 + b1) (2 - lr wd)``:
  ``(2 + 2 b1) (1 - lr wd / 2) / ((1 - b1) lr)``, ``38/lr`` at ``b1 = 0.9`` and ``wd = 0``;
- RMSprop, preconditioned by ``P = diag(sqrt(v) + eps)`` (centered: ``sqrt(v - g_avg^2) +
  eps``): ``2/lr`` without momentum, ``(2 + 2 mu)/lr`` with momentum ``mu`` (heavy ball on
  ``P^-1 g``).

Weight decay added to the gradient (``weight_decay`` of SGD, Adam, RMSprop) adds ``wd`` to
every curvature the optimizer sees: for SGD the threshold of the loss's ``lambda_max`` is the
formula minus ``wd``, exactly; for the adaptive methods it adds ``wd P^-1``, not a shift of
the preconditioned sharpness, and the formula (which leaves it out) says so. Adam's bias
correction of ``m`` (``1 / (1 - b1^t)``) tends to 1 and is left out, as in [Cohen2022]; so is
torch's first SGD step with dampening, which fills the buffer with the undamped gradient (a
transient that does not change the iteration's spectrum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sharpcli.errors import UsageError

__all__ = ["Threshold", "scope_threshold", "stability_threshold"]


@dataclass(frozen=True)
class Threshold:
    """The stability threshold of an optimizer at one step.

    ``value`` is the sharpness at which its step loses stability on a quadratic; ``formula``
    says how it was computed, with the hyper-parameters' values; ``paper`` is the key of the
    work it comes from (docs/references.md); ``preconditioned``: True when it bounds the
    preconditioned sharpness ``lambda_max(P^-1 H)`` (adaptive methods), False when it bounds
    the Hessian's ``lambda_max`` (the SGD family).
    """

    value: float
    formula: str
    paper: str
    preconditioned: bool


def _number(group: dict, key: str, optimizer: torch.optim.Optimizer) -> float:
    """A hyper-parameter of a param group as a float (torch allows a tensor ``lr``)."""
    value = group.get(key)
    if value is None:
        raise UsageError(
            f"{type(optimizer).__name__} has no {key!r} in its param group", source="optimizer"
        )
    return float(value)


def _refuse_maximize(group: dict, optimizer: torch.optim.Optimizer) -> None:
    """A maximising optimizer climbs the loss: no threshold of its sharpness exists."""
    if group.get("maximize", False):
        raise UsageError(
            f"{type(optimizer).__name__} with maximize=True has no stability threshold",
            source="optimizer",
        )


def _positive_lr(group: dict, optimizer: torch.optim.Optimizer) -> float:
    lr = _number(group, "lr", optimizer)
    if not lr > 0:
        raise UsageError(
            f"{type(optimizer).__name__} has learning rate {lr:g}; a threshold needs lr > 0",
            source="optimizer",
        )
    return lr


def _sgd(group: dict, optimizer: torch.optim.Optimizer) -> Threshold:
    lr = _positive_lr(group, optimizer)
    mu = _number(group, "momentum", optimizer)
    damp = float(group.get("dampening", 0.0) or 0.0)
    wd = float(group.get("weight_decay", 0.0) or 0.0)
    shift = f" - weight_decay {wd:g}" if wd else ""
    if mu == 0:
        value, formula = 2 / lr, f"2/lr with lr {lr:g}"
    elif damp == 1:
        raise UsageError(
            "SGD with dampening 1 never moves its momentum buffer past the first step; "
            "it has no stability threshold",
            source="optimizer",
        )
    elif group.get("nesterov", False):
        value = (2 + 2 * mu) / ((1 + mu * (2 - damp)) * lr)
        formula = (
            f"(2 + 2 mu)/((1 + 2 mu) lr) (Nesterov) with mu {mu:g}, lr {lr:g}"
            if damp == 0
            else f"(2 + 2 mu)/((1 + mu (2 - d)) lr) (Nesterov) with mu {mu:g}, d {damp:g}, lr {lr:g}"
        )
    else:
        value = (2 + 2 * mu) / ((1 - damp) * lr)
        formula = (
            f"(2 + 2 mu)/lr (heavy ball) with mu {mu:g}, lr {lr:g}"
            if damp == 0
            else f"(2 + 2 mu)/((1 - d) lr) (heavy ball) with mu {mu:g}, d {damp:g}, lr {lr:g}"
        )
    return Threshold(value - wd, formula + shift, "Cohen2021", False)


def _adam(group: dict, optimizer: torch.optim.Optimizer) -> Threshold:
    lr = _positive_lr(group, optimizer)
    beta1 = float(group["betas"][0])
    wd = float(group.get("weight_decay", 0.0) or 0.0)
    decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    value = (2 + 2 * beta1) / ((1 - beta1) * lr)
    formula = f"(2 + 2 beta1)/((1 - beta1) lr) with beta1 {beta1:g}, lr {lr:g}"
    if wd and decoupled:
        value *= 1 - lr * wd / 2
        formula = (
            f"(2 + 2 beta1)(1 - lr wd/2)/((1 - beta1) lr) with beta1 {beta1:g}, lr {lr:g}, "
            f"wd {wd:g} (decoupled)"
        )
    elif wd:
        formula += f"; the weight decay {wd:g} in the gradient (wd P^-1) is not counted"
    return Threshold(value, formula, "Cohen2022", True)


def _rmsprop(group: dict, optimizer: torch.optim.Optimizer) -> Threshold:
    lr = _positive_lr(group, optimizer)
    mu = float(group.get("momentum", 0.0) or 0.0)
    wd = float(group.get("weight_decay", 0.0) or 0.0)
    if mu == 0:
        value, formula = 2 / lr, f"2/lr (RMSprop) with lr {lr:g}"
    else:
        value = (2 + 2 * mu) / lr
        formula = f"(2 + 2 mu)/lr (RMSprop, momentum) with mu {mu:g}, lr {lr:g}"
    if wd:
        formula += f"; the weight decay {wd:g} in the gradient (wd P^-1) is not counted"
    return Threshold(value, formula, "Cohen2022", True)


def stability_threshold(optimizer: torch.optim.Optimizer, group: int = 0) -> Threshold:
    """The stability threshold of ``optimizer``'s param group ``group`` now (its ``lr`` as the
    scheduler left it): ``2/lr`` (gradient descent), ``(2 + 2 mu)/lr`` (heavy ball),
    ``(2 + 2 mu)/((1 + 2 mu) lr)`` (Nesterov) for ``torch.optim.SGD`` ([Cohen2021]), minus its
    ``weight_decay``; ``(2 + 2 beta1)/((1 - beta1) lr)`` for the preconditioned sharpness of
    ``Adam``/``AdamW`` (times ``1 - lr wd/2`` with decoupled weight decay) and ``2/lr``,
    ``(2 + 2 mu)/lr`` for ``RMSprop`` ([Cohen2022]). The derivations are in the module's
    docstring.

    Raises:
        UsageError: (source ``optimizer``) another optimizer class, a group index out of range,
            ``maximize=True``, a learning rate that is not positive, SGD with dampening 1.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(
            f"a stability threshold needs a torch optimizer, not {type(optimizer).__name__}",
            source="optimizer",
        )
    name = type(optimizer).__name__
    if not 0 <= group < len(optimizer.param_groups):
        raise UsageError(
            f"{name} has {len(optimizer.param_groups)} param group(s); no group {group}",
            source="optimizer",
        )
    hyper = optimizer.param_groups[group]
    _refuse_maximize(hyper, optimizer)
    # the exact torch classes (and their subclasses): an optimizer with another update rule
    # has another threshold, which this module does not know
    if isinstance(optimizer, torch.optim.SGD):
        return _sgd(hyper, optimizer)
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is a subclass of Adam in torch 2.x
        return _adam(hyper, optimizer)
    if isinstance(optimizer, torch.optim.AdamW):
        return _adam(hyper, optimizer)
    if isinstance(optimizer, torch.optim.RMSprop):
        return _rmsprop(hyper, optimizer)
    raise UsageError(
        f"no stability threshold is known for {name}; accepted: SGD (with or without momentum, "
        "Nesterov), Adam, AdamW, RMSprop",
        source="optimizer",
    )


def scope_threshold(optimizer: torch.optim.Optimizer, params) -> Threshold:
    """The threshold of the param groups that hold ``params`` (a scope's parameters): the one
    :func:`stability_threshold` of those groups when they agree.

    Raises:
        UsageError: (source ``optimizer``) what :func:`stability_threshold` refuses; no group
            holding any of ``params``; groups with different thresholds (different learning
            rates, momenta or weight decays: no single number bounds the sharpness then).
    """
    wanted = {id(p) for p in params}
    groups = [
        i
        for i, group in enumerate(getattr(optimizer, "param_groups", []))
        if any(id(p) in wanted for p in group["params"])
    ]
    if not groups:
        raise UsageError(
            f"the {type(optimizer).__name__} optimizer holds none of the measured parameters",
            source="optimizer",
        )
    thresholds = [stability_threshold(optimizer, i) for i in groups]
    first = thresholds[0]
    if any(not math.isclose(t.value, first.value, rel_tol=1e-12) for t in thresholds[1:]):
        values = ", ".join(f"group {i}: {t.value:.6g}" for i, t in zip(groups, thresholds))
        raise UsageError(
            f"the measured parameters' param groups have different stability thresholds "
            f"({values}); measure one group's parameters (a parameter scope) instead",
            source="optimizer",
        )
    return first
