"""The regularizers of ``sharp train`` in one's own PyTorch loop (docs/own-loop.md).

Every regularizer ``sharp train --reg`` lists, under the same names, hyper-parameters and
defaults (one declaration serves both: the classes of :mod:`sharpcli.regularizers.penalties`
and :mod:`sharpcli.regularizers.perturbed`):

- the perturbation oracles (``sam``, ``usam``, ``asam``, ``weight-noise``, ``nso``) as an
  optimizer wrapper, :class:`PerturbedOptimizer`, around any ``torch.optim`` optimizer:
  ``step(closure)`` or ``first_step`` / ``second_step``;
- the additive penalties (``wd``, ``ad``, ``gp``, ``hessian-trace``, ``gn-trace``, ``fa``)
  as :class:`LossPenalty` objects whose value, with its gradient, is added to the loss.

::

    from sharpcli import regularizers

    optimizer = regularizers.make("sam:rho=0.05", torch.optim.SGD(model.parameters(), lr=0.1),
                                  model=model)
    penalty = regularizers.make("gp:rho=0.01", model=model)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sharpcli.errors import UsageError
from sharpcli.regularizers.base import Oracle, Penalty, PerturbationOracle, Regularizer
from sharpcli.regularizers.loss_penalty import LossPenalty
from sharpcli.regularizers.optimizer import ASCENT_SYNC, PerturbedOptimizer, check_optimizer
from sharpcli.regularizers.registry import REGISTRY, parse_reg

__all__ = ["ASCENT_SYNC", "LossPenalty", "PerturbedOptimizer", "make", "names"]


def names() -> dict[str, str]:
    """The regularizers usable here, by name, with their kind.

    Returns:
        ``{name: kind}`` over the registry of ``sharp train --reg``, extensions included:
        kind ``"oracle"`` (an optimizer wrapper, :func:`make` with an optimizer: the oracles
        with the methods of :class:`~sharpcli.regularizers.base.PerturbationOracle`, as one
        defining only ``gradient(engine)`` runs under ``sharp train`` only) or ``"penalty"``
        (a loss term, :func:`make` with ``model=``).
    """
    return {
        name: cls.kind
        for name, cls in REGISTRY.items()
        if issubclass(cls, Penalty)
        or (issubclass(cls, Oracle) and issubclass(cls, PerturbationOracle))
    }


def make(
    spec: str | Regularizer,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model: nn.Module | None = None,
    **options: Any,
) -> PerturbedOptimizer | LossPenalty:
    """A regularizer of ``sharp train --reg`` for one's own loop, from its spec.

    Args:
        spec: ``NAME[:k=v,...]`` exactly as ``--reg`` takes it (``"sam:rho=0.1"``,
            ``"asam"``, ``"gp:rho=0.01,p=2"``), or a parsed regularizer.
        optimizer: The base optimizer an oracle wraps (a ``torch.optim`` optimizer; oracles
            only: a penalty refuses one rather than leave it unused).
        model: The model: a penalty's parameters; an oracle's parameter names, buffers and
            ``no_sync`` (optional for oracles).
        **options: Keyword arguments of :class:`PerturbedOptimizer` (``grad_scaler``,
            ``ascent_sync``, ``perturbed_updates_buffers``, ``generator``) or of
            :class:`LossPenalty` (``loss``, ``generator``).

    Returns:
        A :class:`PerturbedOptimizer` for an oracle, a :class:`LossPenalty` for a penalty.

    Raises:
        UsageError: an unknown name or hyper-parameter (the message of ``--reg``), a
            regularizer that changes the model (``dropout``: add ``nn.Dropout``) or none,
            a missing optimizer or model, something else than an optimizer for an oracle
            (the model, its parameters; source ``optimizer``), an optimizer for a penalty.
    """
    reg = parse_reg(spec) if isinstance(spec, str) else spec
    if isinstance(reg, Oracle):
        if optimizer is None:
            raise UsageError(
                f"{reg.name} wraps an optimizer: make({reg.spec()!r}, optimizer)",
                source="optimizer",
            )
        check_optimizer(optimizer, reg.spec())  # a model or its parameters in its place
        return PerturbedOptimizer(optimizer, reg, model=model, **options)
    if isinstance(reg, Penalty):
        if optimizer is not None:
            # a penalty is a loss term: an optimizer handed to it would be silently unused
            handed = "the model" if isinstance(optimizer, nn.Module) else "an optimizer"
            raise UsageError(
                f"{reg.name} is a penalty added to the loss and takes no optimizer, got "
                f"{handed} in its place: make({reg.spec()!r}, model=model), and step your "
                "optimizer as usual",
                source="optimizer",
            )
        if model is None:
            raise UsageError(
                f"{reg.name} is a penalty on the model's parameters: make({reg.spec()!r}, "
                "model=model)",
                source="model",
            )
        return LossPenalty(reg, model, **options)
    raise UsageError(
        f"{reg.name} is neither an oracle nor a penalty"
        + (" (it changes the model: add nn.Dropout to yours)" if reg.kind == "model" else ""),
        source="regularizer",
    )
