"""One regularised training step: :func:`training_step` and its cost accounting.

A training step evaluates the regularised objective

    O(theta) = L(theta) + sum_k P_k(theta)

(``L`` the batch-mean task loss of :mod:`sharpcli.losses`, ``P_k`` the additive
penalties of :mod:`sharpcli.regularizers.penalties`) once at the clean point and,
for the perturbation oracles, at perturbed points ``theta + delta``. :func:`training_step` runs it on
one batch with the engine of :mod:`sharpcli.regularizers.passes`:

- :class:`StepPasses`: one batch, one model; ``evaluate`` runs a forward pass and
  the penalties, returns values and (optionally) the gradient of ``O`` as tensors;
  ``perturbed(deltas)`` moves the weights to ``theta + delta`` and restores them
  *by copy* (never by subtraction, which does not give theta back exactly in floating point).
- Extra passes (every pass after the first of the step) see the same dropout masks
  as the first (the global torch RNG is replayed from its state at the start of
  the step, and left as the first pass left it), and leave every module buffer
  (BatchNorm running statistics, ``num_batches_tracked``) as the first pass left it.
- :class:`PassContext`: what a penalty sees during one pass (logits, loss,
  penultimate activations, the shared first-order gradient of ``L``), and the
  bookkeeping of reverse-mode sweeps.

Cost accounting (``StepStats.grad_evals``): a forward graph is 1 *unit*. A
reverse sweep over a graph of ``U`` units costs ``U`` gradient evaluations, and
when it is taken with ``create_graph=True`` it adds the units it traversed to the
graph (a double-backward graph holds a forward and a backward, 2 units). Hence a
plain gradient costs 1, a gradient penalty ``||grad L||^p`` costs 1 (``grad L``
with graph) + 2 (backward through the doubled graph) = 3, a Hessian-vector product
taken from that graph costs 2, and the exact gradient of ``v^T H v`` costs
1 + 2 + 4 = 7. A forward pass without a backward costs 0, and every extra pass of a
finite-difference scheme (:meth:`StepPasses.loss_gradient`, a plain ``grad L`` at
perturbed weights) costs 1: the fd gradient of ``v^T H v`` costs 1 + 2 = 3 and the
central-difference one of ``||H v||^2`` 1 + 2 + 4 = 7.

Random draws (:mod:`sharpcli.regularizers.draws`: Rademacher, Gaussian) are one flat draw over
all parameters per call: a step pays one generator call per probe or noise sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence, cast

import torch
from torch import nn

from sharpcli.regularizers.passes import StepPasses
from sharpcli.regularizers.stats import StepStats

if TYPE_CHECKING:
    from sharpcli.regularizers.base import Oracle, Penalty, Regularizer

__all__ = ["training_step"]


def training_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_name: str,
    regs: Sequence[Regularizer],
    generator: torch.Generator,
    *,
    autocast_dtype: torch.dtype | None = None,
    loss_scale: float = 1.0,
    ascent_reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> StepStats:
    """One regularised step's gradient, left in ``p.grad`` of every trainable parameter.

    With penalties :math:`P_k` and at most one perturbation oracle (which returns the
    gradient at perturbed weights :math:`\\theta + \\delta`), the gradient is

    .. math:: g = \\nabla_\\theta \\Big[L + \\sum_k P_k\\Big](\\theta + \\delta),

    :math:`\\delta = 0` without an oracle. The weights are unchanged on return (restored
    by copy); the optimizer is not called; the model's train/eval mode is left as given.
    ``regs`` is a combination :func:`sharpcli.regularizers.registry.validate_combination`
    accepted (``TrainConfig`` checks it once, when it is built).

    Args:
        model: The model, its trainable parameters those with ``requires_grad``.
        x: The batch's inputs.
        y: The batch's labels or targets.
        loss_name: A loss of :mod:`sharpcli.losses`.
        regs: Parsed regularizers (``dropout`` and ``none`` take no part in the step).
        generator: The step's generator: every probe, noise sample and sampled label.
        autocast_dtype: Run the model's forward passes under ``torch.autocast`` in this
            dtype (``--precision bf16|fp16``); None: in the parameters' dtype.
        loss_scale: The loss scale ``S`` of fp16 training: every reverse sweep differentiates
            ``S`` times its scalar and divides by ``S`` (:class:`StepPasses`); the gradient
            left in ``p.grad`` is unscaled.
        ascent_reduce: All-reduces the clean gradient an ascent oracle follows
            (``--ascent-sync global`` under torchrun); None: this process's own.

    Returns:
        The reported pass's :class:`StepStats` (the clean pass at theta unless a noise
        oracle reports its perturbed passes).

    Raises:
        NumericalError: the objective of a pass of the step was not finite.
    """
    # a regularizer's kind says which base class it has
    penalties = [cast("Penalty", r) for r in regs if r.kind == "penalty"]
    oracles = [cast("Oracle", r) for r in regs if r.kind == "oracle"]
    single_pass = not oracles and not any(p.needs.extra_passes for p in penalties)
    engine = StepPasses(
        model,
        x,
        y,
        loss_name,
        penalties,
        generator,
        single_pass=single_pass,
        autocast_dtype=autocast_dtype,
        loss_scale=loss_scale,
        ascent_reduce=ascent_reduce,
    )
    try:
        if oracles:
            reported, grads = oracles[0].gradient(engine)
        else:
            reported = engine.evaluate(want_grad=True)
            assert reported.grads is not None  # asked for (want_grad)
            grads = reported.grads
    finally:
        engine.finish()
    stats = engine.stats(reported, int(x.shape[0]))  # the step's one read-back; raises on NaN
    engine.write_grads(grads)
    return stats
