"""The flatness-aware penalty of [FA]: :math:`\\mathrm{Tr}(H^2)` by Hutchinson's estimator.

``fa`` [FA] eq. 1, with two modes, each its own class: ``exact`` (third-order autograd) and
``fd`` (central finite differences of ``grad L``, the memory of a plain backward).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from sharpcli.regularizers.base import (
    Penalty,
    central_gradients,
    declare_mode,
    declare_regularizer,
)
from sharpcli.regularizers.draws import dot, global_norm, rademacher_like
from sharpcli.regularizers.passes import PassContext, StepPasses
from sharpcli.regularizers.penalties.nme import FINITE_DIFFERENCES, THIRD_ORDER_AUTOGRAD
from sharpcli.specs import Param

__all__ = [
    "auto_step_length",
    "FlatnessAware",
    "ExactFlatnessAware",
    "FiniteDifferenceFlatnessAware",
]


def auto_step_length(params: Sequence[torch.Tensor]) -> float:
    """The finite-difference step length of ``eps=auto``.

    .. math:: h = \\eta\\, \\|\\theta\\|, \\qquad \\eta = u^{1/4} / 6

    ``||theta||`` the norm of all trainable parameters (a step moves each coordinate by a fixed
    fraction of their root-mean-square size, and rescaling the network rescales the step),
    :math:`u` the unit roundoff of their dtype (``torch.finfo(dtype).eps``): :math:`\\eta` =
    3.1e-3 in float32, 2.0e-5 in float64. :math:`u^{1/4}` balances the :math:`O(h^2)`
    truncation of a central second difference against its rounding error
    :math:`\\sim u \\|\\nabla L\\| / h^2`; the factor 1/6 was tuned on the built-in GELU MLPs.

    Args:
        params: The trainable parameters.

    Returns:
        ``h``; ``eta`` itself when every parameter is zero.
    """
    eta = torch.finfo(params[0].dtype).eps ** 0.25 / 6.0
    norm = float(global_norm(params))
    return eta * (norm if norm > 0 else 1.0)


@declare_regularizer
class FlatnessAware(Penalty):
    """``fa:lambda,mode,eps``: the flatness-aware penalty of [FA] eq. 1.

    Hutchinson's estimator [Hutchinson1989] of the squared Hessian with a Rademacher
    :math:`v`, :math:`B` the batch size:

    .. math:: P(\\theta) = \\lambda \\frac{\\|H v\\|^2}{B}, \\qquad
              E \\|H v\\|^2 = \\mathrm{Tr}(H^2), \\qquad
              \\nabla_\\theta \\|H v\\|^2 = 2\\, D^3 L[v, H v, \\cdot]

    :math:`H` is the Hessian of the batch-mean loss as autograd defines it (zero second
    derivative at ReLU and max-pool kinks), as in FA's ReLU MLP. ``mode`` picks the class:
    :class:`ExactFlatnessAware` or :class:`FiniteDifferenceFlatnessAware`.

    Args (hyper-parameters):
        lambda: penalty strength (default 0.01, FA's best).
        mode: ``exact`` (default) or ``fd``.
        eps: finite-difference step length in parameter space (``fd`` only); ``auto``
            (default): :func:`auto_step_length`.
    """

    name = "fa"
    summary = "L + lambda Tr(H^2)/B, Tr(H^2) = ||Hv||^2 (FA eq. 1); exact autograd or fd"
    HYPERPARAMS = (
        Param("lambda", "float", 0.01, "penalty strength", minimum=0.0),
        Param(
            "mode",
            "choice",
            "exact",
            "exact: the FA penalty by third-order autograd; fd: central finite differences of grad L (no third-order graph; on ReLU/max-pool nets a different, kink-dominated regularizer)",
            choices=("exact", "fd"),
        ),
        Param(
            "eps",
            "float",
            "auto",
            "finite-difference step length in parameter space (mode=fd); auto: eta(dtype) * ||theta||",
            positive=True,
            auto=True,
        ),
    )
    paper = "FA"
    data_parallel = "its penalty ||H v||^2 is nonlinear in the batch Hessian product"
    per_replica = "each rank penalises ||H_r v||^2 / B_r of its own rows (fa at the local batch)"


@declare_mode("exact")
class ExactFlatnessAware(FlatnessAware):
    """``fa`` with ``mode=exact``: the FA penalty by third-order autograd.

    ``H v`` by double backward with graph and a third backward, exact to rounding:
    1 + 2 + 4 = 7 gradient evaluations; memory of about three forward graphs.
    """

    needs = THIRD_ORDER_AUTOGRAD

    def describe_mode(self) -> str:
        """What this mode computes, for the run record."""
        return "exact: lambda ||H v||^2 / B with its gradient by third-order autograd (FA eq. 1)"

    def term(self, ctx: PassContext) -> torch.Tensor:
        """:math:`\\lambda \\|H v\\|^2 / B` with its third-order graph."""
        v = rademacher_like(ctx.params, ctx.generator)
        hv = ctx.hvp(v, create_graph=ctx.want_grad)
        batch = ctx.logits.shape[0]
        return self.params["lambda"] * sum((h * h).sum() for h in hv) / batch


@declare_mode("fd")
class FiniteDifferenceFlatnessAware(FlatnessAware):
    """``fa`` with ``mode=fd``: central finite differences of :math:`g = \\nabla L`.

    Steps :math:`s = h / \\|v\\|` along :math:`v` and :math:`t = h / \\|u\\|` along
    :math:`u`, :math:`h` the step length (``eps``):

    .. math:: u \\approx \\frac{g(\\theta + s v) - g(\\theta - s v)}{2 s}, \\qquad
              D^3 L[v, u, \\cdot] \\approx \\frac{g_{++} - g_{+-} - g_{-+} + g_{--}}{4 s t}

    (:math:`g_{\\pm\\pm} = g(\\theta \\pm s v \\pm t u)`), each gradient at the clean pass's
    dropout masks and BatchNorm state, the probe drawn after the clean pass: 1 + 2 + 4 = 7
    gradient evaluations, 2 for the value alone; truncation :math:`O(h^2)`, rounding
    :math:`\\sim u \\|g\\| / h^2`. On ReLU/max-pool nets the differences cross kinks: there it
    is a different, step-dependent regularizer.
    """

    needs = FINITE_DIFFERENCES

    def describe_mode(self) -> str:
        """What this mode computes, for the run record."""
        return (
            f"fd: central finite differences of grad L, step length "
            f"{'eta(dtype) ||theta||' if self.params['eps'] == 'auto' else self.params['eps']} "
            "(approximates the exact penalty on smooth nets only; on ReLU/max-pool nets a "
            "different, kink-dominated regularizer)"
        )

    def step_length(self, params: Sequence[torch.Tensor]) -> float:
        """``h``: ``eps`` when a number, else :func:`auto_step_length`.

        Args:
            params: The trainable parameters.

        Returns:
            The step length in parameter space.
        """
        eps = self.params["eps"]
        return auto_step_length(params) if eps == "auto" else float(eps)

    def extra_passes(self, engine: StepPasses, ctx: PassContext, want_grad: bool):
        """The value from 2 extra passes and, with ``want_grad``, the gradient from 4 more."""
        lam, batch = self.params["lambda"], ctx.logits.shape[0]
        h = self.step_length([p.detach() for p in ctx.params])
        v = rademacher_like(ctx.params, ctx.generator)
        s = h / math.sqrt(sum(t.numel() for t in v))  # ||v|| = sqrt(P) for +-1 entries
        step_v = torch._foreach_mul(v, s)
        g_plus, g_minus = central_gradients(engine, step_v)
        u = torch._foreach_mul(torch._foreach_sub(g_plus, g_minus), 0.5 / s)  # H v + O(h^2)
        value = lam * dot(u, u) / batch
        if not want_grad:
            return value, None
        u_norm = float(global_norm(u))
        if u_norm == 0.0:
            return value, [torch.zeros_like(x) for x in u]
        step_u = torch._foreach_mul(u, h / u_norm)
        # the four points theta +- (s v + t u) and theta +- (s v - t u): -s v + t u is exactly
        # -(s v - t u) in floating point, so two sums serve all four
        v_plus_u = torch._foreach_add(step_v, step_u)
        v_minus_u = torch._foreach_sub(step_v, step_u)

        def gradient_at(delta: Sequence[torch.Tensor], sign: float) -> list[torch.Tensor]:
            with engine.perturbed(delta, sign=sign):
                return engine.loss_gradient()

        # [(g(+v+u) - g(+v-u)) - (g(-v+u) - g(-v-u))] / (4 s t) ~= D^3 L[v, u, .]
        upper = torch._foreach_sub(gradient_at(v_plus_u, 1.0), gradient_at(v_minus_u, 1.0))
        lower = torch._foreach_sub(gradient_at(v_minus_u, -1.0), gradient_at(v_plus_u, -1.0))
        t = h / u_norm
        return value, torch._foreach_mul(
            torch._foreach_sub(upper, lower), 2.0 * lam / (batch * 4.0 * s * t)
        )
