r"""The additive penalties of ``sharp train`` as terms added to the loss of one's own loop.

:class:`LossPenalty` wraps a parsed penalty (``wd``, ``ad``, ``gp``, ``hessian-trace``,
``gn-trace``, ``fa``): calling it with the batch's loss, logits and labels returns
:math:`P(\theta)` as a 0-dim tensor whose gradient is the penalty's, to add to the loss
before the backward. The value is the penalty class's own ``term`` (the code ``sharp train``
runs, on the same :class:`~sharpcli.regularizers.passes.PassContext`); a term computed in
closed form without a graph (``wd``) carries its closed-form gradient
(``analytic_grad``) into the backward.

Precision: the term is computed with autocast disabled, from float32 copies of logits and
activations that autocast produced in a lower precision, so under ``torch.autocast`` a
penalty is computed in float32 (float64 in a float64 model); its derivatives of the loss
(``grad L``, ``H v``) go through the forward as autocast ran it. Under a
``torch.amp.GradScaler`` add the term to the *unscaled* loss and scale the sum: the inner
derivatives are then unscaled and only the final backward is scaled.

The finite-difference modes (``mode=fd``) evaluate ``grad L`` at perturbed weights after the
step's backward, which ``sharp train`` schedules; in one's own loop use ``mode=exact``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from sharpcli.errors import UsageError
from sharpcli.losses import CROSS_ENTROPY, get_loss
from sharpcli.regularizers.base import Penalty
from sharpcli.regularizers.passes import PassContext, StepPasses
from sharpcli.regularizers.replay import model_facts

__all__ = ["LossPenalty"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _ClosedFormTerm(torch.autograd.Function):
    """A value computed without a graph, whose gradient is given (``wd``: ``sigma^2 theta``)."""

    @staticmethod
    def forward(
        ctx: Any, value: torch.Tensor, grads: list[torch.Tensor], *params: torch.Tensor
    ) -> torch.Tensor:
        """The value, detached: a new leaf of the graph whose inputs are ``params``.

        Returns:
            A copy of ``value`` (autograd gives it this function as its ``grad_fn``).
        """
        ctx.grads = grads
        return value.detach().clone()

    @staticmethod
    def backward(ctx: Any, *outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The upstream gradient times the given gradient, for each parameter.

        Returns:
            None for ``value`` and ``grads``, then ``upstream * grad`` per parameter.
        """
        (upstream,) = outputs
        return (None, None, *[upstream * g for g in ctx.grads])


def _float32(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.float() if t is not None and t.dtype in _LOW_PRECISION else t


class LossPenalty:
    """A penalty of ``sharp train --reg`` for one's own loop: ``loss + penalty(loss, logits, y)``.

    Args:
        regularizer: A parsed penalty (``sharpcli.regularizers.make("gp:rho=0.01", model=m)``
            builds this object from its spec).
        model: The model whose trainable parameters the penalty differentiates (``ad``:
            a forward hook on its final ``nn.Linear`` captures the penultimate activation).
        loss: The task loss of :mod:`sharpcli.losses` the penalty assumes (``gn-trace``
            samples its labels from it; ``ad`` on a sequence model reads its positions):
            ``"cross-entropy"`` by default. The loss tensor passed in is the one
            differentiated (``gp``, ``hessian-trace``, ``fa``).
        generator: The Hutchinson probes' and sampled labels' generator (default: seeded from
            ``torch.initial_seed()`` on the parameters' device).
    """

    def __init__(
        self,
        regularizer: Penalty,
        model: nn.Module,
        *,
        loss: str = CROSS_ENTROPY,
        generator: torch.Generator | None = None,
    ):
        if not isinstance(regularizer, Penalty):
            raise UsageError(
                f"{regularizer!r} is not an additive penalty (wd, ad, gp, hessian-trace, "
                "gn-trace, fa)",
                source="regularizer",
            )
        if regularizer.needs.extra_passes:
            raise UsageError(
                f"{regularizer.spec()}: mode=fd evaluates grad L at perturbed weights after the "
                "backward, which `sharp train` schedules; in your own loop use mode=exact",
                source="regularizer",
            )
        get_loss(loss)  # a known loss, or the registry's error
        self.regularizer = regularizer
        self.model = model
        self.loss_name = loss
        params = [p for p in model_facts(model, "params") if p.requires_grad]
        if not params:
            raise UsageError("the model has no trainable parameters", source="model")
        self.generator = generator or torch.Generator(device=params[0].device).manual_seed(
            torch.initial_seed()
        )
        self._captured: torch.Tensor | None = None
        self._engine: StepPasses | None = None
        self._hook = None
        if regularizer.needs_penultimate:
            module, _ = model_facts(model, "head")
            self._hook = module.register_forward_hook(self._capture)

    @property
    def name(self) -> str:
        """The regularizer's name (``gp``, ...)."""
        return self.regularizer.name

    def _capture(self, module: nn.Module, inputs: Sequence[torch.Tensor], output: Any) -> None:
        self._captured = inputs[0]

    def remove(self) -> None:
        """Remove the forward hook of ``ad`` (nothing for the other penalties)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __call__(
        self, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        r""":math:`P(\theta)` at the current weights, with its gradient.

        Args:
            loss: The batch-mean task loss, with its graph (unscaled).
            logits: The model's outputs on the batch, with their graph.
            targets: The batch's labels or targets.

        Returns:
            A 0-dim float tensor (float32 under autocast) to add to the loss.
        """
        reg = self.regularizer
        if self._engine is None:  # what a PassContext reads: params, loss, generator
            self._engine = StepPasses(
                self.model, None, None, self.loss_name, [reg], self.generator, single_pass=True
            )
        engine = self._engine
        engine.y = targets
        with torch.autocast(logits.device.type, enabled=False):
            ctx = PassContext(
                engine,
                _float32(logits),
                _float32(loss),
                _float32(self._captured),
                want_grad=True,
                first_grad_graph=reg.needs.keeps_loss_grad_graph(True),
            )
            value = reg.term(ctx)
            if value.requires_grad:
                return value
            grads = reg.analytic_grad(engine.params)
            if grads is None:
                return value
            # torch leaves Function.apply unannotated (it returns forward's output)
            term: torch.Tensor = _ClosedFormTerm.apply(value, grads, *engine.params)  # type: ignore[no-untyped-call]
            return term

    def __repr__(self) -> str:
        return f"LossPenalty({self.regularizer.spec()!r})"
