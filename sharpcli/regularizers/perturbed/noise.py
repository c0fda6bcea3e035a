"""The weight-noise oracles of [NSO]: WP-SGD (``weight-noise``) and noise stability
optimization (``nso``).

Both return gradients at :math:`\\theta + U`, :math:`U \\sim N(0, \\sigma^2 I)` drawn from the
step's generator; to second order they minimise :math:`L + \\sigma^2/2\\, \\mathrm{tr}(H)`
([NSO] eq. 4).
"""

from __future__ import annotations

from typing import Sequence

import torch

from sharpcli.regularizers.base import Oracle, ParamNames, Points, Tensors, declare_regularizer
from sharpcli.regularizers.draws import gaussian_like
from sharpcli.regularizers.passes import PassResult, StepPasses
from sharpcli.specs import Param

__all__ = ["WeightNoise", "NSO"]


# the reported loss of the noise oracles
_REPORT = Param(
    "report",
    "choice",
    "perturbed",
    "reported loss: at the perturbed weights (free) or clean at theta (one more forward)",
    choices=("perturbed", "clean"),
)


def _mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The mean of equally shaped tensors: one stacked ``mean`` (two operations whatever their
    number)."""
    return torch.stack(list(values)).mean(dim=0)


def _clean_pass(engine: StepPasses, report: str) -> PassResult | None:
    """``report=clean``: the reported pass at theta; else None, after a forward at theta where
    the model has buffers (BatchNorm: running statistics of theta, not of the noisy weights)."""
    if report == "clean":
        return engine.evaluate(want_grad=False)
    if engine.has_buffers:
        engine.forward_only()
    return None


@declare_regularizer
class WeightNoise(Oracle):
    """``weight-noise:sigma,report``: WP-SGD ([NSO] section 2.1), the gradient at noisy weights.

    .. math:: g = \\nabla O(\\theta + U), \\quad U \\sim N(0, \\sigma^2 I), \\qquad
              E_U\\, L(\\theta + U) \\approx L + \\frac{\\sigma^2}{2} \\mathrm{tr}(H)

    applied at theta (the expansion:
    [NSO] eq. 4, [NME] eq. 17, written there without the 1/2, and its Gauss-Newton/NME
    split, eq. 19). So ``weight-noise:sigma=s`` corresponds to second order to
    ``hessian-trace:sigma2=s^2/2`` (and its Gauss-Newton part to ``gn-trace:sigma2=s^2/2``),
    not to ``sigma2=s^2``.

    **1** evaluation with no penalty. ``U`` is drawn over all trainable parameters in
    order with :func:`sharpcli.regularizers.draws.gaussian_like`. What the step reports:

    - ``report=perturbed`` (default): the pass at ``theta + U`` whose gradient is returned
      (loss, objective, penalties, accuracy): a one-sample estimate of the smoothed
      objective ``E_U O(theta + U)`` the method minimises, at no extra cost (as WP-SGD and
      NSO implementations log it). When the model has buffers (BatchNorm), a clean
      no-grad forward at theta runs first so the running statistics are those of theta.
    - ``report=clean``: a clean pass at theta reports ``L(theta)``; a forward under
      ``torch.no_grad()`` (0 evaluations, about a third of a plain step) unless a
      gradient-based penalty needs autograd for its value.

    Args (hyper-parameters):
        sigma: noise standard deviation (default 0.01).
        report: ``perturbed`` (default) or ``clean``.
    """

    name = "weight-noise"
    summary = "gradient at theta + U, U ~ N(0, s^2 I) (NSO 2.1); to 2nd order L + s^2/2 tr(H), = hessian-trace:sigma2=s^2/2"
    HYPERPARAMS = (
        Param("sigma", "float", 0.01, "noise standard deviation", minimum=0.0),
        _REPORT,
    )
    paper = "NSO"
    # U comes from the step generator, the same on every rank; grad L(theta + U) is linear
    # in the batch
    data_parallel = None

    def gradient(self, engine: StepPasses) -> tuple[PassResult, list[torch.Tensor]]:
        """The gradient at :math:`\\theta + U` and the reported pass (see the class)."""
        clean = _clean_pass(engine, self.params["report"])
        with engine.perturbed(self.noise(engine.weights, engine.generator)):
            at_noisy = engine.evaluate(want_grad=True)
        assert at_noisy.grads is not None  # asked for (want_grad)
        return (clean if clean is not None else at_noisy), at_noisy.grads

    def perturbations(
        self, weights: Tensors, grads: Tensors | None, names: ParamNames, generator: torch.Generator
    ) -> Points:
        """The one point :math:`\\theta + U`, for the optimizer wrapper.

        Yields:
            ``(U, 1.0)``, :meth:`noise` drawn from ``generator``.
        """
        yield self.noise(weights, generator), 1.0

    def noise(
        self, weights: Sequence[torch.Tensor], generator: torch.Generator
    ) -> list[torch.Tensor]:
        """:math:`U \\sim N(0, \\sigma^2 I)` shaped like ``weights``, drawn from ``generator``
        (:func:`sharpcli.regularizers.draws.gaussian_like`): the step of ``sharp train`` and of the
        optimizer wrapper of :mod:`sharpcli.regularizers`.

        Args:
            weights: The trainable parameters, in order.
            generator: The step's generator.

        Returns:
            One noise tensor per parameter.
        """
        return gaussian_like(weights, self.params["sigma"], generator)


@declare_regularizer
class NSO(Oracle):
    """``nso:sigma,k,report``: noise stability optimization, [NSO] Algorithm 1 / section 2.2.

    .. math:: g = \\frac{1}{2k} \\sum_{j=1}^k \\big[\\nabla O(\\theta + U_j)
              + \\nabla O(\\theta - U_j)\\big], \\quad U_j \\sim N(0, \\sigma^2 I)

    with the :math:`U_j` independent, one global ``sigma`` on every trainable
    parameter (the authors' code). The two-point average cancels the first-order term of
    the perturbation, leaving ``grad [L + sigma^2/2 tr(H)]`` to second order (NSO eq. 4).
    The clean gradient is not used. ``U_j`` drawn with
    :func:`sharpcli.regularizers.draws.gaussian_like`, ``j = 1..k`` in order. **2k**
    evaluations with no penalty. What the step reports:

    - ``report=perturbed`` (default): loss, objective and penalties are the means over
      the ``2k`` passes at ``theta +- U_j`` (their mean is ``O(theta) + 1/2 U^T H U`` to
      fourth order: an estimate of the smoothed objective), the accuracy that of the pass
      at ``theta + U_1``; no extra cost. When the model has buffers (BatchNorm), a clean
      no-grad forward at theta runs first so the running statistics are those of theta.
    - ``report=clean``: a clean forward at theta reports ``L(theta)`` (as ``weight-noise``).

    Args (hyper-parameters):
        sigma: noise standard deviation (default 0.01).
        k: number of noise pairs per step (default 1).
        report: ``perturbed`` (default) or ``clean``.
    """

    name = "nso"
    summary = "gradient averaged over theta +- U_j, j = 1..k (NSO Alg. 1)"
    HYPERPARAMS = (
        Param("sigma", "float", 0.01, "noise standard deviation", minimum=0.0),
        Param("k", "int", 1, "number of noise pairs per step", minimum=1),
        _REPORT,
    )
    paper = "NSO"
    data_parallel = None  # as weight-noise: the same U_j on every rank

    def gradient(self, engine: StepPasses) -> tuple[PassResult, list[torch.Tensor]]:
        """The mean gradient over :math:`\\theta \\pm U_j` and the reported pass."""
        clean = _clean_pass(engine, self.params["report"])
        total: list[torch.Tensor] | None = None  # the first pass's gradient, summed into
        passes: list[PassResult] = []
        for noise, sign in self.perturbations(engine.weights, None, None, engine.generator):
            with engine.perturbed(noise, sign=sign):
                result = engine.evaluate(want_grad=True)
            assert result.grads is not None  # asked for (want_grad)
            if total is None:
                total = result.grads  # a fresh list of fresh tensors: summed into in place
            else:
                torch._foreach_add_(total, result.grads)
            passes.append(result)
        assert total is not None  # k >= 1 pairs
        torch._foreach_div_(total, 2 * self.params["k"])
        if clean is not None:
            return clean, total
        mean = PassResult(
            loss=_mean([r.loss for r in passes]),
            objective=_mean([r.objective for r in passes]),
            penalties={
                name: _mean([r.penalties[name] for r in passes]) for name in passes[0].penalties
            },
            grads=None,
            logits=passes[0].logits,  # the accuracy of the pass at theta + U_1
            labels=passes[0].labels,
            scorer=passes[0].scorer,
        )
        return mean, total

    def perturbed_passes(self) -> int:
        """``2k``: the points :math:`\\theta \\pm U_j` (the optimizer wrapper's protocol)."""
        return 2 * int(self.params["k"])

    def perturbations(
        self, weights: Tensors, grads: Tensors | None, names: ParamNames, generator: torch.Generator
    ) -> Points:
        """The ``2k`` points :math:`\\theta \\pm U_j` as ``(U_j, sign)``, ``U_j`` drawn from
        ``generator`` when its pair starts (the order of ``sharp train`` and of the optimizer
        wrapper of :mod:`sharpcli.regularizers`); the gradient is their mean.

        Args:
            weights: The trainable parameters, in order.
            grads: Not read (None from the wrapper).
            names: Not read.
            generator: The step's generator.

        Yields:
            ``(noise, sign)``, ``sign`` +1 then -1 for each pair.
        """
        for _ in range(self.params["k"]):
            noise = gaussian_like(weights, self.params["sigma"], generator)
            for sign in (1.0, -1.0):
                yield noise, sign
