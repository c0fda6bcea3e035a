"""The curvature penalties of [NME]: gradient penalty, Hessian trace and Gauss-Newton trace.

``gp`` [NME] eq. 7 (its update eq. 8; penalty SAM/USAM, App. B eq. 46-47); ``hessian-trace``
[NME] section 5.2, eq. 19, by Hutchinson's estimator [Hutchinson1989]; ``gn-trace`` [NME]
eq. 20, the estimator of [Wei2020]. ``gp`` and ``hessian-trace`` have two modes, each its own
class: ``exact`` (autograd) and ``fd`` (finite differences of ``grad L``).
"""

from __future__ import annotations

import functools
import math
import operator

import torch
import torch.nn.functional as F

from sharpcli.losses import IGNORE_INDEX, get_loss, token_weights
from sharpcli.regularizers.base import (
    Penalty,
    PenaltyNeeds,
    central_gradients,
    declare_mode,
    declare_regularizer,
)
from sharpcli.regularizers.draws import dot, global_norm, rademacher_like
from sharpcli.regularizers.passes import PassContext, StepPasses
from sharpcli.specs import Param

__all__ = [
    "GradientPenalty",
    "ExactGradientPenalty",
    "FiniteDifferenceGradientPenalty",
    "HessianTrace",
    "ExactHessianTrace",
    "FiniteDifferenceHessianTrace",
    "GaussNewtonTrace",
    "THIRD_ORDER_AUTOGRAD",
    "FINITE_DIFFERENCES",
]

#: An exact curvature penalty (``hessian-trace``, ``fa``): ``H v`` from the graph of
#: ``grad L`` in every pass, its gradient by a third backward.
THIRD_ORDER_AUTOGRAD = PenaltyNeeds(autograd=True, loss_grad_graph="always")
#: A finite-difference curvature penalty: value and gradient from extra passes at perturbed
#: weights, no graph beyond a plain backward.
FINITE_DIFFERENCES = PenaltyNeeds(extra_passes=True, deferred_value=True)


@declare_regularizer
class GradientPenalty(Penalty):
    """``gp:rho,p,mode,eps``: the gradient-norm penalty of [NME] eq. 7.

    .. math:: P(\\theta) = \\rho\\, \\|\\nabla L(\\theta)\\|^p, \\qquad
              \\nabla P = \\rho\\, p\\, \\|g\\|^{p-2} H g, \\quad g = \\nabla L, \\; p \\in \\{1, 2\\}

    ``p = 1`` is penalty SAM, ``p = 2`` penalty USAM ([NME] App. B eq. 46-47; eq. 8 for the
    update). ``mode`` picks the class: :class:`ExactGradientPenalty` (double backprop) or
    :class:`FiniteDifferenceGradientPenalty` (central differences for ``H g``).

    Args (hyper-parameters):
        rho: penalty strength (default 0.01).
        p: power of the gradient norm, 1 or 2 (default 1, the case [NME] section 4 studies).
        mode: ``exact`` (default) or ``fd``.
        eps: finite-difference step length in parameter space (``fd`` only; default 1e-3).
    """

    name = "gp"
    summary = "L + rho ||grad L||^p, p in {1,2} (NME eq. 7)"
    HYPERPARAMS = (
        Param("rho", "float", 0.01, "penalty strength", minimum=0.0),
        Param("p", "choice", 1, "power of the gradient norm", choices=(1, 2)),
        Param(
            "mode",
            "choice",
            "exact",
            "exact double backprop or finite-difference HVP",
            choices=("exact", "fd"),
        ),
        Param("eps", "float", 0.001, "finite-difference step length (mode=fd)", positive=True),
    )
    paper = "NME"
    data_parallel = "its penalty ||grad L||^p is nonlinear in the batch gradient"
    per_replica = "each rank penalises the gradient norm of its own rows (gp at the local batch)"

    def _norm_term(self, squared: torch.Tensor) -> torch.Tensor:
        """:math:`\\rho \\|g\\|^p` from :math:`\\|g\\|^2` (clamped: a zero gradient at an
        exact stationary point, not NaN)."""
        if self.params["p"] == 2:
            return self.params["rho"] * squared
        return self.params["rho"] * torch.sqrt(squared.clamp_min(torch.finfo(squared.dtype).tiny))


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """:math:`\\|g\\|^2` summed parameter by parameter, in order (a 0-dim tensor)."""
    return functools.reduce(operator.add, [(g * g).sum() for g in grads])


@declare_mode("exact")
class ExactGradientPenalty(GradientPenalty):
    """``gp`` with ``mode=exact``: the gradient by double backprop.

    ``g = grad L`` with ``create_graph`` (1) and one backward through the doubled graph (2):
    3 gradient evaluations. Through ReLU it sees zero second derivative ([NME] section 4;
    ``augmented-relu`` restores it).
    """

    needs = PenaltyNeeds(autograd=True, loss_grad_graph="to_differentiate")

    def describe_mode(self) -> str:
        """What this mode computes, for the run record."""
        return "exact: gradient by double backprop (autograd Hessian, zero at ReLU kinks)"

    def term(self, ctx: PassContext) -> torch.Tensor:
        """:math:`\\rho \\|\\nabla L\\|^p`, differentiable through ``grad L`` when the step
        differentiates the objective."""
        return self._norm_term(_sum_of_squares(ctx.first_grad()))


@declare_mode("fd")
class FiniteDifferenceGradientPenalty(GradientPenalty):
    """``gp`` with ``mode=fd``: ``H g`` by a central difference along ``u = g/||g||``.

    .. math:: H g \\approx \\|g\\|\\, \\frac{\\nabla L(\\theta + \\epsilon u)
              - \\nabla L(\\theta - \\epsilon u)}{2 \\epsilon}

    Each gradient at the clean pass's dropout masks and BatchNorm state; it sees ReLU kinks
    within ``eps``. 1 (clean, ``grad L`` kept apart) + 2 = 3 gradient evaluations (+1 when
    another graph penalty such as ``ad`` needs its own backward).
    """

    needs = PenaltyNeeds(autograd=True, extra_passes=True)

    def describe_mode(self) -> str:
        """What this mode computes, for the run record."""
        return (
            f"fd: H g by central differences at step eps={self.params['eps']:g} (sees the ReLU "
            "kinks within eps)"
        )

    def term(self, ctx: PassContext) -> torch.Tensor:
        """:math:`\\rho \\|\\nabla L\\|^p` as a value (its gradient comes from extra passes)."""
        return self._norm_term(_sum_of_squares(ctx.first_grad()).detach())

    def extra_passes(self, engine: StepPasses, ctx: PassContext, want_grad: bool):
        """No value; with ``want_grad`` the gradient :math:`\\rho p \\|g\\|^{p-1} H u`."""
        if not want_grad:
            return None, None
        grads = [g.detach() for g in ctx.first_grad()]
        norm = global_norm(grads)
        if float(norm) == 0.0:
            return None, [torch.zeros_like(g) for g in grads]
        eps = self.params["eps"]
        plus, minus = central_gradients(engine, [eps * g / norm for g in grads])
        # (g+ - g-)/(2 eps) ~= H u;  d/dtheta rho ||g||^p = rho p ||g||^(p-1) H u
        scale = self.params["rho"] * self.params["p"] * norm ** (self.params["p"] - 1) / (2 * eps)
        return None, [scale * (a - b) for a, b in zip(plus, minus)]


@declare_regularizer
class HessianTrace(Penalty):
    """``hessian-trace:sigma2,probes,mode,eps``: the Hessian trace penalty of [NME] eq. 19.

    Hutchinson's estimator [Hutchinson1989] with :math:`m` Rademacher probes :math:`v_j` from
    the step's generator (:math:`E[v^T H v] = \\mathrm{tr}(H)`):

    .. math:: P(\\theta) = \\sigma^2 \\frac{1}{m} \\sum_{j=1}^m v_j^T H v_j, \\qquad
              \\nabla_\\theta\\, v^T H v = D^3 L[v, v, \\cdot]

    ``hessian-trace:sigma2=s^2/2`` matches ``weight-noise:sigma=s`` to second order ([NSO]
    eq. 4 has :math:`\\sigma^2/2\\, \\mathrm{tr}(H)`, [NME] eq. 17/19 write it without the 1/2).
    ``mode`` picks the class: :class:`ExactHessianTrace` (autograd Hessian, zero at ReLU kinks)
    or :class:`FiniteDifferenceHessianTrace` (a curvature smoothed over ``eps``: on
    piecewise-linear nets a different regularizer).

    Args (hyper-parameters):
        sigma2: penalty strength, the noise variance (default 0.01).
        probes: Rademacher probes averaged per step (default 1, as [NME]).
        mode: ``exact`` (default) or ``fd``.
        eps: finite-difference step length in parameter space (``fd`` only; default 0.1).
    """

    name = "hessian-trace"
    summary = "L + s^2 v^T H v, v Rademacher (NME eq. 19; s^2 = 2x the tr(H) weight of weight-noise sigma^2); fd: finite-difference curvature at step eps, exact: autograd Hessian"
    HYPERPARAMS = (
        Param("sigma2", "float", 0.01, "penalty strength (noise variance)", minimum=0.0),
        Param("probes", "int", 1, "Rademacher probes averaged per step", minimum=1),
        Param(
            "mode",
            "choice",
            "exact",
            "exact: the autograd Hessian (zero at kinks), third-order autograd; fd: finite-difference curvature at step eps (sees ReLU kinks: on ReLU nets a different regularizer, which diverged at its defaults on the built-in nets)",
            choices=("exact", "fd"),
        ),
        Param(
            "eps",
            "float",
            0.1,
            "finite-difference step length in parameter space (mode=fd)",
            positive=True,
        ),
    )
    paper = "NME"
    data_parallel = None  # the probes are shared, v^T H v linear in the batch


@declare_mode("exact")
class ExactHessianTrace(HessianTrace):
    """``hessian-trace`` with ``mode=exact``: the autograd Hessian trace.

    ``H v`` by double backward reusing the first-order graph, the gradient by a third backward
    through it: ``grad L`` (1) + ``m`` HVPs (2 each) + the final backward over ``2 + 2m`` units
    = 3 + 4m gradient evaluations (7 for one probe). Through ReLU it sees zero second
    derivative ([NME] section 4.3).
    """

    needs = THIRD_ORDER_AUTOGRAD

    def describe_mode(self) -> str:
        """What this mode computes, for the run record."""
        return (
            "exact: sigma2 v^T H v with H the autograd Hessian (zero second derivative at "
            "ReLU kinks), gradient by third-order autograd (NME eq. 19)"
        )

    def term(self, ctx: PassContext) -> torch.Tensor:
        """:math:`\\sigma^2 \\frac1m \\sum_j v_j^T H v_j` with its third-order graph."""
        total: torch.Tensor | float = 0.0
        m = self.params["probes"]
        for _ in range(m):
            v = rademacher_like(ctx.params, ctx.generator)
            hv = ctx.hvp(v, create_graph=ctx.want_grad)
            total = total + sum((a * b).sum() for a, b in zip(v, hv))
        return self.params["sigma2"] * total / m


@declare_mode("fd")
class FiniteDifferenceHessianTrace(HessianTrace):
    """``hessian-trace`` with ``mode=fd``: the finite-difference curvature at step ``eps``.

    Central differences of :math:`g = \\nabla L` along :math:`v` with step
    :math:`s = \\epsilon / \\|v\\|`, :math:`g_0` the clean pass's gradient:

    .. math:: v^T H v \\approx \\frac{v \\cdot (g(\\theta + s v) - g(\\theta - s v))}{2 s},
              \\qquad D^3 L[v, v, \\cdot] \\approx
              \\frac{(g(\\theta + s v) - g_0) + (g(\\theta - s v) - g_0)}{s^2}

    each gradient at the clean pass's dropout masks and BatchNorm state, the probes drawn
    after the clean pass: 1 + 2m gradient evaluations (3 for one probe; 2m for the value
    alone). On smooth nets it approximates the exact mode with :math:`O(\\epsilon^2)`
    truncation error; on ReLU/max-pool nets the differences see the kinks within ``eps`` and
    ``eps`` is part of the regularizer's definition.
    """

    needs = FINITE_DIFFERENCES

    def describe_mode(self) -> str:
        """What this mode computes, for the run record."""
        return (
            f"fd: finite-difference curvature at step eps={self.params['eps']:g}, "
            "sigma2 v.(g(theta+s v) - g(theta-s v))/(2s); approximates the exact penalty on "
            "smooth nets only, sees the kinks within eps on ReLU/max-pool nets (a different "
            "regularizer there)"
        )

    def extra_passes(self, engine: StepPasses, ctx: PassContext, want_grad: bool):
        """The value and, with ``want_grad``, the gradient, from ``2m`` extra passes."""
        m, eps, sigma2 = self.params["probes"], self.params["eps"], self.params["sigma2"]
        g0 = [g.detach() for g in ctx.first_grad()] if want_grad else None
        value = torch.zeros((), dtype=ctx.loss.dtype, device=ctx.loss.device)
        curvature = [torch.zeros_like(p) for p in ctx.params] if want_grad else None
        for _ in range(m):
            v = rademacher_like(ctx.params, ctx.generator)
            s = eps / math.sqrt(sum(t.numel() for t in v))  # ||v|| = sqrt(P) for +-1 entries
            plus, minus = central_gradients(engine, torch._foreach_mul(v, s))
            value = value + dot(v, torch._foreach_sub(plus, minus)) / (2 * s)
            if want_grad:
                assert g0 is not None and curvature is not None  # made with want_grad
                # (g+ - g0) + (g- - g0): each difference of nearby values is exact in floating point
                second = torch._foreach_sub(plus, g0)
                torch._foreach_add_(second, torch._foreach_sub(minus, g0))
                torch._foreach_add_(curvature, second, alpha=1.0 / s**2)
        grad = list(torch._foreach_mul(curvature, sigma2 / m)) if curvature is not None else None
        return sigma2 * value / m, grad


@declare_regularizer
class GaussNewtonTrace(Penalty):
    """``gn-trace:sigma2``: an unbiased estimate of :math:`\\sigma^2 \\mathrm{tr}(G)` ([NME]
    eq. 20, the estimator of [Wei2020]).

    .. math:: P(\\theta) = \\sigma^2 B\\, \\|\\nabla_\\theta \\hat L\\|^2, \\qquad
              \\hat L = \\frac1B \\sum_i l(z_i, \\hat y_i), \\qquad
              E\\, B \\|\\nabla \\hat L\\|^2 = \\mathrm{tr}(G)

    :math:`G = \\frac1B \\sum_i J_i^T H_{z,i} J_i` is the Gauss-Newton matrix of the batch-mean
    loss, :math:`\\hat y_i` labels sampled from the model with no gradient through the
    sampling: cross-entropy :math:`\\mathrm{Cat}(\\mathrm{softmax}(z_i))`; binary cross-entropy
    :math:`\\mathrm{Bernoulli}(\\sigma(z_i))`; mse :math:`z_i + \\sqrt{C/2}\\, \\xi_i`,
    :math:`\\xi_i \\sim N(0, I)` (covariance matching :math:`H_z = (2/C) I`). Per sample
    :math:`a_i = J_i^T \\nabla_z l(z_i, \\hat y_i)` has :math:`E[a_i a_i^T] = J_i^T H_{z,i} J_i`
    (Fisher identity) and :math:`E[a_i] = 0`; the :math:`a_i` are independent, so the cross
    terms vanish and no per-sample gradient is needed. :math:`\\hat L` shares the clean forward
    pass; ``grad Lhat`` with graph (1) and the backward through it (2): 3 gradient evaluations.

    Token cross-entropy (``l_i = sum_t w_it CE(z_it, y_it)``, ``w_it = 1/n_i`` on the sample's
    ``n_i`` labelled positions): one label is drawn per labelled position (``-100`` kept) and
    :math:`\\hat L = \\frac1B \\sum_i \\sum_t \\sqrt{w_{it}}\\, CE(z_{it}, \\hat y_{it})`, so that
    :math:`E[a_i a_i^T] = J_i^T H_{z,i} J_i` with the blocks' weights
    :math:`\\sqrt{w}^2 = w`: again unbiased. ``gn-trace:sigma2=s^2/2`` is the Gauss-Newton
    part of ``weight-noise:sigma=s`` to second order ([NSO] eq. 4).

    Args (hyper-parameters):
        sigma2: penalty strength, the noise variance (default 0.01).
    """

    name = "gn-trace"
    summary = "L + s^2 tr(G), sampled-label estimator (NME eq. 20; s^2 = 2x the tr weight of weight-noise sigma^2)"
    HYPERPARAMS = (
        Param("sigma2", "float", 0.01, "penalty strength (noise variance)", minimum=0.0),
    )
    paper = "NME"
    data_parallel = "its estimate B ||grad L(y^)||^2 is nonlinear in the batch gradient"
    per_replica = (
        "each rank estimates tr(G) of its own rows, B_r ||grad L_r(y^)||^2; their row-weighted "
        "mean is unbiased for the whole batch's tr(G)"
    )
    needs = PenaltyNeeds(autograd=True)

    def sample_labels(
        self,
        logits: torch.Tensor,
        loss_name: str,
        generator: torch.Generator,
        y: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Labels drawn from the model's predictive distribution at ``logits`` (detached), by
        the loss's own sampler (:meth:`sharpcli.losses.Loss.sample_labels`).

        Args:
            logits: The model's outputs.
            loss_name: The task loss, which defines the predictive distribution.
            generator: The step's generator (its device draws the random numbers).
            y: The data's labels, whose unlabelled positions a per-token loss keeps
                (optional).

        Returns:
            Class indices (cross-entropy), 0/1 targets (binary) or real targets (mse).
        """
        return get_loss(loss_name).sample_labels(logits.detach(), generator, y)

    def sampled_loss(self, ctx: PassContext) -> torch.Tensor:
        """:math:`\\hat L`: the batch loss at labels drawn from the model.

        Args:
            ctx: The pass (logits, labels, loss, generator).

        Returns:
            A 0-dim tensor with the forward graph.
        """
        y_hat = self.sample_labels(ctx.logits, ctx.loss_name, ctx.generator, ctx.y)
        if not get_loss(ctx.loss_name).per_token:
            return ctx.loss_of(ctx.logits, y_hat)
        labelled = ctx.y != IGNORE_INDEX
        y_hat = torch.where(labelled, y_hat, torch.full_like(y_hat, IGNORE_INDEX))
        z = ctx.logits
        ce = F.cross_entropy(
            z.reshape(-1, z.shape[-1]),
            y_hat.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        ).reshape(y_hat.shape)
        return (ce * token_weights(z, ctx.y).sqrt()).sum() / z.shape[0]

    def term(self, ctx: PassContext) -> torch.Tensor:
        """:math:`\\sigma^2 B \\|\\nabla \\hat L\\|^2`, with its graph when the step wants it."""
        sampled_loss = self.sampled_loss(ctx)
        grads = ctx.gradient_of(sampled_loss, create_graph=ctx.want_grad)
        batch = ctx.logits.shape[0]
        return self.params["sigma2"] * batch * sum((g * g).sum() for g in grads)
