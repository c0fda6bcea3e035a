r"""The step an optimizer would take next, computed by its own rule without taking it.

Critical sharpness ([Kalra2026]) searches along the update direction
:math:`\Delta\theta` of the optimizer at the current weights. :func:`update_direction`
computes that step per unit learning rate, :math:`d = (\theta_{t+1} - \theta_t) / \eta`, from
the optimizer's hyper-parameters and state as ``torch.optim`` would update them with the
gradient ``g`` given, and changes neither the optimizer (its ``state`` and ``param_groups``)
nor the parameters. The rules, as torch 2 implements them (``t`` the step the update would
be, counted from 1; an empty state is the first step, with zero moments):

- ``SGD``: :math:`g \leftarrow g + \mathrm{wd}\,\theta`; with momentum :math:`\mu`,
  :math:`b \leftarrow \mu b + (1 - \tau) g` (:math:`b = g` at the first step, :math:`\tau`
  the dampening) and :math:`d = -(g + \mu b)` with Nesterov, else :math:`d = -b`; without
  momentum :math:`d = -g`.
- ``Adam`` (L2 weight decay :math:`g \leftarrow g + \mathrm{wd}\,\theta`) and ``AdamW``
  (decoupled: :math:`d \mathrel{-}= \mathrm{wd}\,\theta`): :math:`m \leftarrow \beta_1 m +
  (1 - \beta_1) g`, :math:`v \leftarrow \beta_2 v + (1 - \beta_2) g^2` (AMSGrad: the running
  maximum of :math:`v`), :math:`d = -\frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t)} +
  \epsilon}`, the bias corrections included.
- ``RMSprop``: :math:`g \leftarrow g + \mathrm{wd}\,\theta`, :math:`v \leftarrow \alpha v +
  (1 - \alpha) g^2`, the denominator :math:`\sqrt{v} + \epsilon` (centered:
  :math:`\sqrt{v - \bar g^2} + \epsilon` with :math:`\bar g \leftarrow \alpha \bar g + (1 -
  \alpha) g`), :math:`u = g / \mathrm{denominator}` and :math:`d = -(\mu b + u)` with
  momentum :math:`\mu`, else :math:`d = -u`.

Anything else (another optimizer, ``maximize``, param groups with different learning rates,
a learning rate given as a tensor schedule of its own) is refused with a UsageError on
``optimizer``.
"""

from __future__ import annotations

from typing import Any

import torch

from sharpcli.errors import UsageError

__all__ = ["optimizer_learning_rate", "update_direction"]


def optimizer_learning_rate(optimizer: Any) -> float:
    """The learning rate all of ``optimizer``'s parameter groups share at this step.

    Args:
        optimizer: a ``torch.optim`` optimizer.

    Returns:
        ``param_groups[i]["lr"]``, the same in every group.

    Raises:
        UsageError: (source ``optimizer``) no param groups, or groups with different rates.
    """
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        raise UsageError(
            f"expected a torch.optim optimizer with param_groups, got {type(optimizer).__name__}",
            source="optimizer",
        )
    rates = {float(group["lr"]) for group in groups}
    if len(rates) != 1:
        raise UsageError(
            f"the param groups have different learning rates ({sorted(rates)}); the update "
            "direction per unit learning rate needs one",
            source="optimizer",
        )
    (lr,) = rates
    if not lr > 0:
        raise UsageError(f"the learning rate is {lr}; it must be > 0", source="optimizer")
    return lr


def _kind(optimizer: Any) -> str:
    """``"sgd"``, ``"adam"``, ``"adamw"`` or ``"rmsprop"``, or a UsageError on ``optimizer``."""
    # AdamW before Adam: recent torch makes AdamW a subclass of Adam
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if isinstance(optimizer, torch.optim.RMSprop):
        return "rmsprop"
    raise UsageError(
        f"the update direction of {type(optimizer).__name__} is not known; supported: SGD "
        "(momentum, Nesterov), Adam, AdamW, RMSprop",
        source="optimizer",
    )


def _state_tensor(state: dict, key: str, like: torch.Tensor) -> torch.Tensor:
    """``state[key]`` in float64 (zeros where the optimizer has not made it yet)."""
    value = state.get(key)
    if value is None:
        return torch.zeros_like(like, dtype=torch.float64)
    return value.detach().to(device=like.device, dtype=torch.float64)


def _step_count(state: dict) -> int:
    """The step the next update is: the optimizer's count plus one."""
    step = state.get("step", 0)
    return int(step.item() if torch.is_tensor(step) else step) + 1


def _sgd(p, g, state, group) -> torch.Tensor:
    wd, momentum = float(group.get("weight_decay", 0.0)), float(group.get("momentum", 0.0))
    if wd:
        g = g + wd * p
    if momentum:
        buffer = state.get("momentum_buffer")
        if buffer is None:
            b = g
        else:
            dampening = float(group.get("dampening", 0.0))
            b = momentum * buffer.detach().to(torch.float64) + (1.0 - dampening) * g
        g = g + momentum * b if group.get("nesterov", False) else b
    return -g


def _adam(p, g, state, group, decoupled: bool) -> torch.Tensor:
    beta1, beta2 = (float(b) for b in group["betas"])
    eps, wd = float(group["eps"]), float(group.get("weight_decay", 0.0))
    decoupled = decoupled or bool(group.get("decoupled_weight_decay", False))
    if wd and not decoupled:
        g = g + wd * p
    t = _step_count(state)
    m = beta1 * _state_tensor(state, "exp_avg", p) + (1.0 - beta1) * g
    v = beta2 * _state_tensor(state, "exp_avg_sq", p) + (1.0 - beta2) * g * g
    if group.get("amsgrad", False):
        v = torch.maximum(_state_tensor(state, "max_exp_avg_sq", p), v)
    denominator = (v / (1.0 - beta2**t)).sqrt() + eps
    d = -(m / (1.0 - beta1**t)) / denominator
    return d - wd * p if (wd and decoupled) else d


def _rmsprop(p, g, state, group) -> torch.Tensor:
    alpha, eps = float(group["alpha"]), float(group["eps"])
    wd, momentum = float(group.get("weight_decay", 0.0)), float(group.get("momentum", 0.0))
    if wd:
        g = g + wd * p
    v = alpha * _state_tensor(state, "square_avg", p) + (1.0 - alpha) * g * g
    if group.get("centered", False):
        mean = alpha * _state_tensor(state, "grad_avg", p) + (1.0 - alpha) * g
        denominator = (v - mean * mean).sqrt() + eps
    else:
        denominator = v.sqrt() + eps
    u = g / denominator
    if momentum:
        return -(momentum * _state_tensor(state, "momentum_buffer", p) + u)
    return -u


def update_direction(
    optimizer: Any, params: list[torch.Tensor], grads: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """The next step of ``optimizer`` per unit learning rate, for each of ``params``.

    Nothing is changed: the optimizer's state is read, never written, and the parameters are
    only read (for weight decay). The rules are those of the module docstring.

    Args:
        optimizer: a ``torch.optim`` SGD, Adam, AdamW or RMSprop.
        params: the parameters (tensors the optimizer holds, matched by identity).
        grads: the gradient of each, the same shapes.

    Returns:
        ``d_i`` (float64, the parameter's shape) for each parameter the optimizer holds, None
        for the others (the step does not move them).

    Raises:
        UsageError: (source ``optimizer``) an optimizer or setting it does not know.
    """
    kind = _kind(optimizer)
    optimizer_learning_rate(optimizer)
    group_of = {}
    for group in optimizer.param_groups:
        if group.get("maximize", False):
            raise UsageError("maximize=True is not supported", source="optimizer")
        for p in group["params"]:
            group_of[id(p)] = group
    out: list[torch.Tensor | None] = []
    for p, g in zip(params, grads):
        group = group_of.get(id(p))
        if group is None:
            out.append(None)
            continue
        state = optimizer.state.get(p, {})
        theta = p.detach().to(torch.float64)
        g = g.detach().to(device=theta.device, dtype=torch.float64).reshape(theta.shape)
        if kind == "sgd":
            out.append(_sgd(theta, g, state, group))
        elif kind == "rmsprop":
            out.append(_rmsprop(theta, g, state, group))
        else:
            out.append(_adam(theta, g, state, group, decoupled=kind == "adamw"))
    return out
