"""Registry of the sharpness regularizers of ``sharp train`` as gradient oracles.

``--reg NAME[:k=v,...]`` (repeatable) selects them; :func:`parse_reg` turns one option
into a :class:`Regularizer`, :func:`validate_combination` checks a list, and
:func:`training_step` leaves the gradient of the regularised objective at theta in
``p.grad`` of every trainable parameter. The optimizer and the schedule stay plain: each
regularizer is a gradient oracle. User guide: docs/commands/train.md ("Regularizers").

Sources, by key of docs/references.md: ``wd`` [AD] section 2.3; ``dropout`` [AD] section 4.2;
``ad`` [AD] Theorem 2; ``gp`` [NME] eq. 7 (its update eq. 8; penalty SAM/USAM, App. B
eq. 46-47); ``hessian-trace`` [NME] section 5.2, eq. 19, by Hutchinson's estimator
[Hutchinson1989]; ``gn-trace`` [NME] eq. 20 [Wei2020]; ``sam`` [SAM] as in [NME] App. B
eq. 42; ``usam`` [USAM] as in [NME] App. B eq. 43; ``asam`` [ASAM] (combined with ``ad`` in
[AD] Table 1); ``weight-noise`` WP-SGD of [NSO] section 2.1 ([NME] eq. 17); ``nso`` [NSO]
Algorithm 1, eq. 4; ``fa`` [FA] eq. 1.

Three kinds of regularizer combine:

- *model* (``dropout``): changes how the model is built (:func:`model_overrides`).
- *additive penalties* (``wd``, ``ad``, ``gp``, ``hessian-trace``, ``gn-trace``, ``fa``):
  the objective is ``O(theta) = L(theta) + sum_k P_k(theta)``, ``L`` the batch-mean
  task loss of :func:`sharpcli.losses.loss_fn`.
- at most one *perturbation oracle* (``sam``, ``usam``, ``asam``, ``weight-noise``,
  ``nso``): the gradient it returns is ``grad O`` evaluated at perturbed weights,
  applied at theta. Without an oracle the gradient is ``grad O(theta)``.

Every random draw (weight noise, Hutchinson probes, sampled labels) comes from the
step's ``generator`` so a resumed run reproduces bit-for-bit; dropout masks come from
the global torch RNG and every pass of a step replays the same masks. Extra passes
leave BatchNorm running statistics as the clean pass left them; perturbed weights are
restored by copy. ``StepStats.grad_evals`` counts gradient evaluations as defined in
:mod:`sharpcli.training.step` (plain gradient 1, double-backward 2, triple 4); each
class documents its count.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sharpcli import catalogue
from sharpcli.errors import UsageError
from sharpcli.losses import IGNORE_INDEX, token_weights
from sharpcli.registry import Entry, Param, format_value
from sharpcli.training.step import (
    PassContext,
    PassResult,
    StepEngine,
    StepStats,
    gaussian_like,
    global_norm,
    rademacher_like,
)

__all__ = [
    "StepStats",
    "HyperParam",
    "Regularizer",
    "REGISTRY",
    "register",
    "unregister",
    "data_parallel_refusal",
    "parse_reg",
    "validate_combination",
    "model_overrides",
    "training_step",
    "describe_registry",
]

# The parameter regularizer errors name: TrainConfig.regs, training_step(regs); the CLI's --reg.
_PARAMETER = "regs"


# --------------------------------------------------------------------------- hyper-parameters
# One typed parameter (sharpcli.registry.Param): name, type, default, range, description.
HyperParam = Param
_format_value = format_value


# --------------------------------------------------------------------------- base classes
class Regularizer:
    """A regularizer selected by ``--reg``: a name, hyper-parameters in effect, a kind.

    A registered class carries everything about itself (:func:`register` checks it):

    - ``name``: what ``--reg`` calls it; ``kind``: ``"none"``, ``"model"``, ``"penalty"``
      (subclass :class:`Penalty`) or ``"oracle"`` (subclass :class:`Oracle`);
    - ``HYPERPARAMS``: the hyper-parameters with defaults, in documented positional order;
    - ``summary``: one line for ``--help``; the class docstring: the formula, the paper
      key (NME, NSO, AD, FA, MAN, SAM, ASAM) and the cost in gradient evaluations;
    - ``data_parallel``: ``None`` when the row-weighted average of per-rank gradients
      (``sharpcli.training.loop.data_parallel_step``) is the gradient of the global batch,
      otherwise the reason it is not, which the refusal under torchrun quotes. Every
      registered class states it in its own body, never by inheritance: a new SAM variant
      that inherited "exact" would silently run as local SAM;
    - ``needs_penultimate``: whether it needs the input of the final ``nn.Linear``;
    - :meth:`model_args`: what it changes in the model's construction.

    ``params`` maps each hyper-parameter name to its value (JSON-serialisable); ``spec()``
    is the canonical ``name:k=v,...`` that :func:`parse_reg` accepts again.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # "none", "model", "penalty" or "oracle"
    HYPERPARAMS: ClassVar[tuple[HyperParam, ...]] = ()
    summary: ClassVar[str] = ""
    needs_penultimate: ClassVar[bool] = False  # needs the input of the final nn.Linear
    # Deliberately no default (see the class docstring); :func:`register` refuses a class
    # whose own body does not set it.
    data_parallel: ClassVar[str | None]

    def __init__(self, **params: Any):
        known = {h.name: h for h in self.HYPERPARAMS}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise UsageError(
                f"{self.name}: unknown hyper-parameter {unknown[0]!r}; accepted: {_accepted_params(self)}",
                source=_PARAMETER,
            )
        self.params: dict[str, Any] = {}
        for h in self.HYPERPARAMS:
            value = params.get(h.name, h.default)
            self.params[h.name] = h.convert(
                self.name, value if isinstance(value, str) else _format_value(value), _PARAMETER
            )

    def model_args(self) -> dict[str, Any]:
        """Model-construction arguments this regularizer implies (none unless ``kind == "model"``)."""
        return {}

    def describe_mode(self) -> str | None:
        """What the selected ``mode`` computes, for a regularizer whose modes are different
        computations (``gp``, ``hessian-trace``, ``fa``); None for the others."""
        return None

    def run_record(self) -> dict[str, Any]:
        """What ran, for the train report and checkpoint metadata: ``spec`` (canonical),
        ``kind`` and ``computes`` (:meth:`describe_mode`, else the one-line summary)."""
        return {
            "spec": self.spec(),
            "kind": self.kind,
            "computes": self.describe_mode() or self.summary,
        }

    def spec(self) -> str:
        """Canonical text form ``name:k=v,...`` (``name`` alone without hyper-parameters)."""
        if not self.params:
            return self.name
        body = ",".join(f"{k}={_format_value(v)}" for k, v in self.params.items())
        return f"{self.name}:{body}"

    def __repr__(self) -> str:
        return f"Regularizer({self.spec()!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Regularizer) and self.spec() == other.spec()

    def __hash__(self) -> int:
        return hash(self.spec())


def _accepted_params(reg: type[Regularizer] | Regularizer) -> str:
    if not reg.HYPERPARAMS:
        return "(none)"
    return ", ".join(h.name for h in reg.HYPERPARAMS)


class Penalty(Regularizer):
    """An additive penalty ``P(theta)``: its value enters the objective and its gradient
    enters the step's gradient.

    Protocol used by :class:`sharpcli.training.step.StepEngine`:
    ``term(ctx)`` returns ``P`` at the current weights (differentiable through the
    graph when ``grad_from_graph``); ``analytic_grad(params)`` a closed-form gradient
    (when not from the graph); ``extra_passes(engine, ctx, want_grad)`` a value (when
    ``deferred_value``; ``term`` is then not called) and/or a gradient from extra passes
    run after the pass (finite differences of ``grad L``).
    """

    kind = "penalty"
    needs_autograd = False  # needs autograd even to compute its value
    grad_from_graph = True
    has_extra_passes = False
    deferred_value = False

    def first_grad_mode(self, want_grad: bool) -> str | None:
        """Whether the pass must compute ``grad L``: None, ``"value"`` or ``"graph"`` (with create_graph)."""
        return None

    def term(self, ctx: PassContext) -> torch.Tensor:
        raise TypeError(
            f"{type(self).__name__} is a penalty without a term(); define term() or extra_passes()"
        )

    def analytic_grad(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        return None

    def extra_passes(
        self, engine: StepEngine, ctx: PassContext, want_grad: bool
    ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        raise TypeError(
            f"{type(self).__name__} sets has_extra_passes but defines no extra_passes()"
        )


class Oracle(Regularizer):
    """A perturbation oracle: returns the gradient of the objective at perturbed weights.

    ``gradient(engine) -> (clean PassResult at theta, gradient list)``.
    """

    kind = "oracle"

    def gradient(self, engine: StepEngine) -> tuple[PassResult, list[torch.Tensor]]:
        raise TypeError(f"{type(self).__name__} is an oracle without gradient()")


# --------------------------------------------------------------------------- none / dropout
class NoRegularizer(Regularizer):
    """``none``: the plain loss ``L(theta)``; 1 gradient evaluation per step."""

    name = "none"
    kind = "none"
    summary = "plain loss"
    data_parallel = None  # the batch-mean loss is linear in the batch


class Dropout(Regularizer):
    """``dropout:p``: dropout with probability ``p`` on hidden representations ([AD] section 4.2).

    The model is built with it (:func:`model_overrides` returns ``{"dropout": p}``); the
    step itself is a plain gradient (1 evaluation), its masks drawn from the global RNG.
    Where it acts is the model's ``dropout`` argument (:mod:`sharpcli.models.zoo`): in
    ``mlp`` after every hidden activation; in the conv nets (``cnn``, ``vgg-small``,
    ``resnet``) only once, on the flattened features entering the classifier head, never
    between convolutions. Default ``p = 0.1``, the best rate of AD Fig. 2 (an MLP).
    """

    name = "dropout"
    kind = "model"
    summary = (
        "dropout p: after each hidden activation (mlp); before the head only (conv nets) (AD 4.2)"
    )
    HYPERPARAMS = (HyperParam("p", "float", 0.1, "drop probability", minimum=0.0, below=1.0),)
    # Linear in the batch. The masks differ from a single process (independent per rank,
    # reseeded per epoch from (seed, epoch, rank) so resume stays exact) but are a valid draw.
    data_parallel = None

    def model_args(self) -> dict[str, Any]:
        return {"dropout": self.params["p"]}


# --------------------------------------------------------------------------- additive penalties
class WeightDecay(Penalty):
    """``wd:sigma``: ``P = sigma^2/2 ||theta||^2`` over all trainable parameters ([AD] section 2.3).

    Value and gradient ``sigma^2 theta`` are closed-form (no backward pass: 0 extra
    evaluations). Default ``sigma = 1e-3``, the best weight-decay strength of AD Fig. 2.
    """

    name = "wd"
    summary = "L + s^2/2 ||theta||^2 (AD 2.3)"
    HYPERPARAMS = (
        HyperParam("sigma", "float", 1e-3, "smoothing scale; coefficient sigma^2/2", minimum=0.0),
    )
    grad_from_graph = False
    data_parallel = None  # sigma^2 theta is the same on every rank; the row weights sum to 1

    def term(self, ctx: PassContext) -> torch.Tensor:
        sigma = self.params["sigma"]
        with torch.no_grad():
            sq = torch.stack(torch._foreach_norm([p.detach() for p in ctx.params])).square().sum()
        return 0.5 * sigma**2 * sq

    def analytic_grad(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        coeff = self.params["sigma"] ** 2
        return list(torch._foreach_mul([p.detach() for p in params], coeff))


class ActivationDecay(Penalty):
    """``ad:sigma``: ``P = sigma^2/2 * (1/B) sum_b ||h_b||^2``, ``h`` the penultimate activation.

    [AD] Theorem 2: Gaussian noise ``N(0, sigma^2 I)`` on the final weight matrix smooths
    cross-entropy to at most ``CE + sigma^2/2 ||h^(L-1)||^2``. ``h`` is the input of the
    last ``nn.Linear`` in ``model.named_modules()``: in ``mlp`` the last hidden activation;
    in the conv nets only the flattened (pooled) features entering the head, so on a conv
    net it acts on that one representation, not on the convolutional layers (which the
    theorem, about noise on the final layer, does not cover). It is captured by a forward
    hook (no extra
    pass; its gradient flows through the clean backward: 0 extra evaluations). With
    ``--loss mse`` the same penalty is added (for mse the exact smoothing would be
    ``sigma^2 ||h||^2``; the table's form is kept for both). Default ``sigma = 0.1``
    (best AD strength of AD Fig. 2).

    Sequence models (``token-cross-entropy``, ``h`` of shape (B, T, D)): the head maps each
    position's ``h_it`` to its logits, and the loss of a sample is ``sum_t w_it CE_it`` with
    ``w_it = 1/n_i`` on its ``n_i`` labelled positions, so the bound applies per position
    and ``P = sigma^2/2 * (1/B) sum_i sum_t w_it ||h_it||^2``: unlabelled positions (``-100``)
    are not penalised, as they are not in the loss.
    """

    name = "ad"
    summary = (
        "CE + s^2/2 mean ||h||^2, h = the head's input (conv nets: pooled features) (AD Thm 2)"
    )
    HYPERPARAMS = (
        HyperParam("sigma", "float", 0.1, "weight-noise scale of the final layer", minimum=0.0),
    )
    needs_penultimate = True
    data_parallel = None  # a mean over samples: linear in the batch

    def term(self, ctx: PassContext) -> torch.Tensor:
        h = ctx.penultimate
        if ctx.loss_name == "token-cross-entropy":
            if h.ndim != 3 or h.shape[:2] != ctx.y.shape:
                raise UsageError(
                    f"ad on a sequence model needs the penultimate activation per position "
                    f"(batch, length, features) like the labels {tuple(ctx.y.shape)}; got "
                    f"{tuple(h.shape)} (choose the module with `penultimate`)",
                    source="regs",
                )
            sq = h.pow(2).sum(dim=-1)  # (B, T)
            per_sample = (sq * token_weights(sq, ctx.y)).sum(dim=1)
        else:
            per_sample = h.reshape(h.shape[0], -1).pow(2).sum(dim=1)
        return 0.5 * self.params["sigma"] ** 2 * per_sample.mean()


class GradientPenalty(Penalty):
    """``gp:rho,p,mode``: ``P = rho ||grad L||^p``, ``p`` in {1, 2} ([NME] eq. 7).

    ``p = 1`` is penalty SAM, ``p = 2`` penalty USAM (NME App. B eq. 46-47); the
    gradient is ``grad L + rho p ||g||^(p-2) H g`` (NME eq. 8 for ``p = 1``).

    - ``mode=exact`` (default): double backprop; ``g = grad L`` with ``create_graph`` (1)
      and one backward through the doubled graph (2): **3** evaluations. Through ReLU it
      sees zero second derivative (the NME paper's point; use ``augmented-relu``).
    - ``mode=fd``: ``H g`` by a central finite difference along ``u = g/||g||``:
      ``H g ~= ||g|| (grad L(theta + eps u) - grad L(theta - eps u)) / (2 eps)``, each
      gradient at the clean pass's dropout masks and BatchNorm state; it sees ReLU kinks
      within ``eps``. 1 (clean, ``grad L`` kept apart) + 2 = **3** evaluations (+1 when
      another graph penalty such as ``ad`` needs its own backward).

    Defaults ``rho = 0.01``, ``p = 1`` (the case NME section 4 studies), ``eps = 1e-3``
    (length of the finite-difference step in parameter space, fd mode only).
    """

    name = "gp"
    summary = "L + rho ||grad L||^p, p in {1,2} (NME eq. 7)"
    HYPERPARAMS = (
        HyperParam("rho", "float", 0.01, "penalty strength", minimum=0.0),
        HyperParam("p", "choice", 1, "power of the gradient norm", choices=(1, 2)),
        HyperParam(
            "mode",
            "choice",
            "exact",
            "exact double backprop or finite-difference HVP",
            choices=("exact", "fd"),
        ),
        HyperParam("eps", "float", 1e-3, "finite-difference step length (mode=fd)", positive=True),
    )
    needs_autograd = True
    data_parallel = "its penalty ||grad L||^p is nonlinear in the batch gradient"

    @property
    def grad_from_graph(self) -> bool:  # type: ignore[override]
        return self.params["mode"] == "exact"

    @property
    def has_extra_passes(self) -> bool:  # type: ignore[override]
        return self.params["mode"] == "fd"

    def first_grad_mode(self, want_grad: bool) -> str | None:
        return "graph" if (want_grad and self.params["mode"] == "exact") else "value"

    def describe_mode(self) -> str:
        if self.params["mode"] == "exact":
            return "exact: gradient by double backprop (autograd Hessian, zero at ReLU kinks)"
        return (
            f"fd: H g by central differences at step eps={self.params['eps']:g} (sees the ReLU "
            "kinks within eps)"
        )

    def term(self, ctx: PassContext) -> torch.Tensor:
        grads = ctx.first_grad()
        sq = sum((g * g).sum() for g in grads)
        if self.params["mode"] == "fd":
            sq = sq.detach()
        if self.params["p"] == 2:
            return self.params["rho"] * sq
        # clamp keeps the gradient finite (zero) at an exact stationary point
        return self.params["rho"] * torch.sqrt(sq.clamp_min(torch.finfo(sq.dtype).tiny))

    def extra_passes(self, engine: StepEngine, ctx: PassContext, want_grad: bool):
        if not want_grad:
            return None, None
        grads = [g.detach() for g in ctx.first_grad()]
        norm = global_norm(grads)
        if float(norm) == 0.0:
            return None, [torch.zeros_like(g) for g in grads]
        eps = self.params["eps"]
        step = [eps * g / norm for g in grads]
        with engine.perturbed(step):
            plus = engine.loss_gradient()
        with engine.perturbed(step, sign=-1.0):
            minus = engine.loss_gradient()
        # (g+ - g-)/(2 eps) ~= H u;  d/dtheta rho ||g||^p = rho p ||g||^(p-1) H u
        scale = self.params["rho"] * self.params["p"] * norm ** (self.params["p"] - 1) / (2 * eps)
        return None, [scale * (a - b) for a, b in zip(plus, minus)]


class HessianTrace(Penalty):
    """``hessian-trace:sigma2,probes,mode,eps``: ``P = sigma2 (1/m) sum_j v_j^T H v_j`` ([NME] eq. 19).

    The Hessian trace penalty of [NME] section 5.2: Hutchinson's estimator [Hutchinson1989]
    of ``sigma2 tr(H)`` with ``m = probes`` Rademacher vectors
    ``v_j`` from the step's generator (``E[v^T H v] = tr(H)``). Its gradient (``v`` held
    fixed) is the third-derivative contraction ``grad_theta v^T H v = D^3 L[v, v, .]``.

    *Correspondence with weight noise.* NME eq. 17/19 write ``E L(theta + e) ~ L + sigma^2
    tr(H)`` for ``e ~ N(0, sigma^2 I)``; the Taylor expansion has ``sigma^2/2 tr(H)`` ([NSO]
    eq. 4, what ``weight-noise:sigma`` and ``nso:sigma`` minimise to second order). So
    ``hessian-trace:sigma2=S`` penalises twice the second-order term of ``weight-noise`` with
    ``sigma^2 = S``: ``hessian-trace:sigma2=s^2/2`` matches ``weight-noise:sigma=s``. The same
    holds for ``gn-trace`` (NME eq. 19's Gauss-Newton term).

    The two modes are two regularizers on piecewise-linear nets (ReLU, max-pool), one on
    smooth nets:

    - ``mode=exact`` (default), *the autograd Hessian trace*: ``H v`` by double backward
      reusing the first-order graph, the gradient by a third backward through it: ``grad L``
      (1) + ``m`` HVPs (2 each) + the final backward over ``2 + 2m`` units = **3 + 4m**
      evaluations (7 for one probe). Through ReLU it sees zero second derivative (NME section 4.3), as
      ``gp`` does.
    - ``mode=fd``, *the finite-difference curvature at step eps*: central finite
      differences of ``grad L`` along ``v`` with step ``s = eps/||v||`` (``eps`` the step
      length in parameter space):
      ``v^T H v ~= v . (g(theta + s v) - g(theta - s v)) / (2 s)`` and
      ``D^3 L[v, v, .] ~= ((g(theta + s v) - g(theta)) + (g(theta - s v) - g(theta))) / s^2``,
      each gradient at the clean pass's dropout masks and BatchNorm state. ``g(theta)`` is the
      clean pass's ``grad L``. 1 + 2m evaluations (**3** for one probe; 2m for the value
      alone); the probes are drawn after the clean pass. On smooth nets (GELU, tanh) it
      approximates ``mode=exact`` with ``O(eps^2)`` truncation error. On ReLU/max-pool nets
      it is *not* an approximation of ``mode=exact``: the differences see the kinks within
      ``eps`` of theta (the curvature the NME paper says the exact penalty misses), the value
      is a curvature smoothed over ``eps`` and the gradient holds kink terms growing as
      ``1/eps``; on the built-in ReLU MLP its penalty gradient was 120-140x the exact one and
      its single-probe values 1.6-4x the exact ones.
      ``eps`` is then part of the regularizer's definition, not a numerical knob.

    exact is the default because fd at its defaults (``sigma2 = 0.01``, ``eps = 0.1``) trained
    the built-in ReLU MLP (``blobs``) and CNN (``images``) to NaN within 5 epochs at the default
    learning rate, and ``sigma2 = 1e-3`` still reached losses of 1e3-1e7 there; exact trains
    both (tests/test_regularizer_accuracy.py). It costs 7 gradient evaluations per step against
    fd's 3: third-order autograd is about 6x a plain step on the built-in MLP and 4.6x on the
    CNN, over the <= 4x budget that fd meets (docs/benchmarks.md,
    "Training regularizers").
    Accuracy on smooth nets (relative error of the penalty gradient against float64 exact
    autograd, same probe): float32 gradients carry rounding noise of relative size ~1e-7 that
    the division by ``s^2`` amplifies as ``1/eps^2``, while truncation grows as ``eps^2``. On
    the built-in GELU MLPs (``blobs``, 1.7k-5.5k parameters, batch 64, at initialisation and
    after 100 SGD steps) at the default ``eps = 0.1`` the error was 4e-4 to 1.8e-3 in float32
    and 8e-5 to 1.7e-4 in float64: **2e-3 (float32) and 2e-4 (float64)** are the stated,
    tested bounds for those nets; a sharper activation truncates more (``beta-gelu:beta=4``:
    9e-4 in float64), and so does a smaller net, whose per-coordinate step ``eps/sqrt(P)`` is
    larger (a GELU MLP 64-4-4-10, 330 parameters, on the digits data in float64: 7.7e-4 at
    ``eps = 0.1``, 1.9e-4 at 0.05, falling as ``eps^2``). On a 26k-parameter GELU MLP (64-128-128-10, batch 128) the float32 error was 0.5
    at ``eps = 1e-2``, 5e-3 at ``eps = 0.1`` and 6e-4 at ``eps = 0.3`` (float64: 4e-5 at
    0.1). Float64 runs may use smaller steps. Defaults ``sigma2 = 0.01``, ``probes = 1`` (NME
    draws a single sample), ``mode = exact``, ``eps = 0.1`` (used by ``mode=fd``).
    """

    name = "hessian-trace"
    summary = (
        "L + s^2 v^T H v, v Rademacher (NME eq. 19; s^2 = 2x the tr(H) weight of weight-noise "
        "sigma^2); fd: finite-difference curvature at step eps, exact: autograd Hessian"
    )
    HYPERPARAMS = (
        HyperParam("sigma2", "float", 0.01, "penalty strength (noise variance)", minimum=0.0),
        HyperParam("probes", "int", 1, "Rademacher probes averaged per step", minimum=1),
        HyperParam(
            "mode",
            "choice",
            "exact",
            "exact: the autograd Hessian (zero at kinks), third-order autograd; fd: "
            "finite-difference curvature at step eps (sees ReLU kinks: on ReLU nets a "
            "different regularizer, which diverged at its defaults on the built-in nets)",
            choices=("exact", "fd"),
        ),
        HyperParam(
            "eps",
            "float",
            0.1,
            "finite-difference step length in parameter space (mode=fd)",
            positive=True,
        ),
    )
    # The probes v come from the step generator, identical on every rank, and v^T H v (its
    # finite differences too) is linear in the batch.
    data_parallel = None

    @property
    def needs_autograd(self) -> bool:  # type: ignore[override]
        return self.params["mode"] == "exact"

    @property
    def has_extra_passes(self) -> bool:  # type: ignore[override]
        return self.params["mode"] == "fd"

    @property
    def deferred_value(self) -> bool:  # type: ignore[override]
        return self.params["mode"] == "fd"

    def first_grad_mode(self, want_grad: bool) -> str | None:
        if self.params["mode"] == "exact":
            return "graph"
        return "value" if want_grad else None

    def describe_mode(self) -> str:
        if self.params["mode"] == "exact":
            return (
                "exact: sigma2 v^T H v with H the autograd Hessian (zero second derivative at "
                "ReLU kinks), gradient by third-order autograd (NME eq. 19)"
            )
        return (
            f"fd: finite-difference curvature at step eps={self.params['eps']:g}, "
            "sigma2 v.(g(theta+s v) - g(theta-s v))/(2s); approximates the exact penalty on "
            "smooth nets only, sees the kinks within eps on ReLU/max-pool nets (a different "
            "regularizer there)"
        )

    def term(self, ctx: PassContext) -> torch.Tensor:
        total = 0.0
        m = self.params["probes"]
        for _ in range(m):
            v = rademacher_like(ctx.params, ctx.generator)
            hv = ctx.hvp(v, create_graph=ctx.want_grad)
            total = total + sum((a * b).sum() for a, b in zip(v, hv))
        return self.params["sigma2"] * total / m

    def extra_passes(self, engine: StepEngine, ctx: PassContext, want_grad: bool):
        m, eps, sigma2 = self.params["probes"], self.params["eps"], self.params["sigma2"]
        g0 = [g.detach() for g in ctx.first_grad()] if want_grad else None
        value = torch.zeros((), dtype=ctx.loss.dtype, device=ctx.loss.device)
        curvature = [torch.zeros_like(p) for p in ctx.params] if want_grad else None
        for _ in range(m):
            v = rademacher_like(ctx.params, ctx.generator)
            s = eps / math.sqrt(sum(t.numel() for t in v))  # ||v|| = sqrt(P) for +-1 entries
            step = torch._foreach_mul(v, s)
            with engine.perturbed(step):
                plus = engine.loss_gradient()
            with engine.perturbed(step, sign=-1.0):
                minus = engine.loss_gradient()
            value = value + _dot(v, torch._foreach_sub(plus, minus)) / (2 * s)
            if want_grad:
                # (g+ - g0) + (g- - g0): each difference of nearby values is exact in floating point
                second = torch._foreach_sub(plus, g0)
                torch._foreach_add_(second, torch._foreach_sub(minus, g0))
                torch._foreach_add_(curvature, second, alpha=1.0 / s**2)
        grad = torch._foreach_mul(curvature, sigma2 / m) if want_grad else None
        return sigma2 * value / m, grad


class GaussNewtonTrace(Penalty):
    """``gn-trace:sigma2``: ``P = sigma2 * B ||grad_theta Lhat||^2``, an unbiased estimate of
    ``sigma2 tr(G)`` ([NME] eq. 20, the estimator of [Wei2020]).

    ``G = (1/B) sum_i J_i^T H_z,i J_i`` is the Gauss-Newton matrix of the batch-mean loss
    and ``Lhat = (1/B) sum_i l(z_i, yhat_i)`` the loss at labels sampled from the model
    with no gradient through the sampling: cross-entropy ``yhat_i ~ Cat(softmax(z_i))``;
    binary cross-entropy ``yhat_i ~ Bernoulli(sigmoid(z_i))``; mse
    ``yhat_i = z_i + sqrt(C/2) xi_i``, ``xi_i ~ N(0, I)`` (the model's Gaussian with
    covariance matching ``H_z = (2/C) I``). Per sample ``a_i = J_i^T grad_z l(z_i, yhat_i)``
    has ``E[a_i a_i^T] = J_i^T H_z,i J_i`` (Fisher identity) and ``E[a_i] = 0``
    (``E[grad_z l] = p - E[e_yhat] = 0``), and the ``a_i`` are independent, so
    ``E ||(1/B) sum_i a_i||^2 = (1/B^2) sum_i tr(J_i^T H_z,i J_i) = tr(G)/B``: the cross
    terms vanish and ``B ||grad Lhat||^2`` is unbiased for ``tr(G)`` without per-sample
    gradients. ``Lhat`` shares the clean forward pass; ``grad Lhat`` with graph (1) and
    the backward through it (2): **3** evaluations. Default ``sigma2 = 0.01``.

    Token cross-entropy (sequence outputs z (B, T, V), ``l_i = sum_t w_it CE(z_it, y_it)``,
    ``w_it = 1/n_i`` on the sample's ``n_i`` labelled positions): ``H_z,i`` is block diagonal
    with blocks ``w_it (diag p_it - p_it p_it^T)``. One label ``yhat_it ~ Cat(softmax(z_it))``
    is drawn per labelled position (``-100`` kept) and
    ``Lhat = (1/B) sum_i sum_t sqrt(w_it) CE(z_it, yhat_it)``: then
    ``a_i = sum_t sqrt(w_it) J_it^T (p_it - e_yhat_it)`` has ``E[a_i a_i^T] = J_i^T H_z,i J_i``
    (the positions' draws are independent with mean zero, the blocks' weights are
    ``sqrt(w)^2 = w``), and ``B ||grad Lhat||^2`` is again unbiased for ``tr(G)``.

    Like ``hessian-trace``, it weighs the trace by ``sigma2`` as NME eq. 19 does, twice the
    ``sigma^2/2`` of the second-order term of ``weight-noise:sigma`` ([NSO] eq. 4):
    ``gn-trace:sigma2=s^2/2`` is the Gauss-Newton part of ``weight-noise:sigma=s`` to second
    order.
    """

    name = "gn-trace"
    summary = (
        "L + s^2 tr(G), sampled-label estimator (NME eq. 20; s^2 = 2x the tr weight of "
        "weight-noise sigma^2)"
    )
    HYPERPARAMS = (
        HyperParam("sigma2", "float", 0.01, "penalty strength (noise variance)", minimum=0.0),
    )
    needs_autograd = True
    data_parallel = "its estimate B ||grad L(y^)||^2 is nonlinear in the batch gradient"

    def sample_labels(
        self, logits: torch.Tensor, loss_name: str, generator: torch.Generator
    ) -> torch.Tensor:
        """Labels drawn from the model's predictive distribution at ``logits`` (detached)."""
        z = logits.detach()
        if loss_name in ("cross-entropy", "token-cross-entropy"):
            probs = torch.softmax(z.to(torch.float64), dim=-1).to(generator.device)
            flat = probs.reshape(-1, probs.shape[-1])
            drawn = torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
            return drawn.to(z.device)
        if loss_name == "binary-cross-entropy":
            probs = torch.sigmoid(z.to(torch.float64)).to(generator.device)
            return torch.bernoulli(probs, generator=generator).to(device=z.device, dtype=z.dtype)
        noise = torch.randn(
            z.shape, dtype=z.dtype, generator=generator, device=generator.device
        ).to(z.device)
        return z + math.sqrt(z.shape[-1] / 2.0) * noise

    def sampled_loss(self, ctx: PassContext) -> torch.Tensor:
        """``Lhat``: the batch loss at labels drawn from the model (see the class docstring)."""
        y_hat = self.sample_labels(ctx.logits, ctx.loss_name, ctx.generator)
        if ctx.loss_name != "token-cross-entropy":
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
        sampled_loss = self.sampled_loss(ctx)
        grads = ctx.gradient_of(sampled_loss, create_graph=ctx.want_grad)
        batch = ctx.logits.shape[0]
        return self.params["sigma2"] * batch * sum((g * g).sum() for g in grads)


def auto_step_length(params: Sequence[torch.Tensor]) -> float:
    """The finite-difference step length ``h = eta ||theta||`` of ``eps=auto``.

    ``||theta||`` is the norm of all trainable parameters (so a step moves each coordinate by
    a fixed fraction ``eta`` of their root-mean-square size, and rescaling the network rescales
    the step) and ``eta = u^(1/4) / 4`` with ``u`` the unit roundoff of the parameters' dtype
    (``torch.finfo(dtype).eps``): ``eta`` = 3.1e-3 in float32, 2.0e-5 in float64. ``u^(1/4)``
    balances the ``O(h^2)`` truncation of a central second difference against its rounding
    error ``~ u ||grad L|| / h^2``; the factor 1/6 was tuned on the built-in GELU MLPs
    (measurements in :class:`FlatnessAware`). ``h = eta`` when every parameter is zero.
    """
    eta = torch.finfo(params[0].dtype).eps ** 0.25 / 6.0
    norm = float(global_norm(params))
    return eta * (norm if norm > 0 else 1.0)


class FlatnessAware(Penalty):
    """``fa:lambda,mode,eps``: ``P = lambda * ||H v||^2 / B``, ``v`` Rademacher ([FA] eq. 1).

    Hutchinson's estimator [Hutchinson1989] for the squared Hessian:
    ``E[v^T H^2 v] = E||H v||^2 = Tr(H^2)`` for ``v`` with independent zero-mean
    unit-variance entries; ``B`` the batch size as in FA eq. 1. ``H`` is the Hessian of the
    batch-mean loss as autograd defines it (zero second derivative at ReLU and max-pool
    kinks), as in FA's ReLU MLP. With ``v`` held fixed and ``u = H v``,
    ``grad_theta ||H v||^2 = 2 D^3 L[v, u, .]`` (the third-derivative tensor contracted
    with ``v`` and ``H v``). The two modes compute different things on piecewise-linear nets:

    - ``mode=exact`` (default), *the FA penalty*: ``H v`` by double backward with graph
      and a third backward, exact to rounding: 1 + 2 + 4 = **7** evaluations (about 6x a
      plain step on a GELU MLP and 4.6x on the small CNN in process, the cost of a
      hand-written third-order step, docs/benchmarks.md; the FA paper reports about 38x for its
      exact penalty). Memory: the third-order graph, about three forward graphs.
    - ``mode=fd``, *a finite-difference penalty*: central differences of ``grad L`` (``g``)
      with no higher-order graph (the memory of a plain backward). Steps ``s = h/||v||``
      along ``v`` and ``t = h/||u||`` along ``u``, ``h`` the step length in parameter space:

      ``u ~= (g(theta + s v) - g(theta - s v)) / (2 s)``,
      ``D^3 L[v, u, .] ~= [g(+s v + t u) - g(+s v - t u) - g(-s v + t u) + g(-s v - t u)] / (4 s t)``

      (``g(+s v + t u)`` short for ``g(theta + s v + t u)``), each gradient at the clean
      pass's dropout masks and BatchNorm state, the probe drawn after the clean pass:
      1 + 2 + 4 = **7** evaluations with the gradient, **2** for the value alone. Both
      differences are central, so the truncation error is ``O(h^2)``; rounding adds
      ``~ u ||g|| / h^2`` (``u`` the unit roundoff). ``eps=auto`` (default) takes
      ``h = eta ||theta||`` from the parameters' scale and dtype (:func:`auto_step_length`:
      ``eta`` = 3.1e-3 in float32, 2.0e-5 in float64); a number sets ``h`` itself.
      *Accuracy on smooth nets* (MLPs of the built-in ``blobs`` with GELU or
      ``beta-gelu:beta=4``, 1.7k-5.5k parameters, batch 64, at initialisation and after 100
      SGD steps; relative error of the penalty gradient against float64 triple autograd with
      the same probe): float64 <= 1e-7 (1e-3 is the tested bound), float32 <= 1.1e-3, at
      ``eps=auto``; the value ``||H v||^2`` within 4e-5 (float32). The former default, a
      forward scheme with ``eps=0.03`` (4 evaluations, ``O(eps)``), was 1.3-6.3 % off on the
      same nets in both dtypes and trained ReLU MLPs to NaN. *On piecewise-linear nets*
      (ReLU, max-pool: the built-in ``cnn`` pools with ``MaxPool2d`` whatever its activation)
      the differences cross kinks where ``g`` jumps: ``u`` then holds jump terms of size
      ``1/h`` and the mixed difference terms growing as ``1/h^2``, so fd is not an
      approximation of the exact penalty there but a different, step-dependent regularizer
      (on the built-in ReLU MLP the float32 fd gradient was 30-300 times the exact one).
      Use it on smooth nets, where it trades no accuracy that matters for the memory of a
      plain backward.

    Defaults ``lambda = 0.01`` (FA's best strength), ``mode = exact``, ``eps = auto``.
    """

    name = "fa"
    summary = "L + lambda Tr(H^2)/B, Tr(H^2) = ||Hv||^2 (FA eq. 1); exact autograd or fd"
    HYPERPARAMS = (
        HyperParam("lambda", "float", 0.01, "penalty strength", minimum=0.0),
        HyperParam(
            "mode",
            "choice",
            "exact",
            "exact: the FA penalty by third-order autograd; fd: central finite differences of "
            "grad L (no third-order graph; on ReLU/max-pool nets a different, kink-dominated "
            "regularizer)",
            choices=("exact", "fd"),
        ),
        HyperParam(
            "eps",
            "float",
            "auto",
            "finite-difference step length in parameter space (mode=fd); auto: "
            "eta(dtype) * ||theta||",
            positive=True,
            auto=True,
        ),
    )
    data_parallel = "its penalty ||H v||^2 is nonlinear in the batch Hessian product"

    @property
    def needs_autograd(self) -> bool:  # type: ignore[override]
        return self.params["mode"] == "exact"

    @property
    def has_extra_passes(self) -> bool:  # type: ignore[override]
        return self.params["mode"] == "fd"

    @property
    def deferred_value(self) -> bool:  # type: ignore[override]
        return self.params["mode"] == "fd"

    def first_grad_mode(self, want_grad: bool) -> str | None:
        if self.params["mode"] == "exact":
            return "graph"
        return "value" if want_grad else None

    def describe_mode(self) -> str:
        if self.params["mode"] == "exact":
            return (
                "exact: lambda ||H v||^2 / B with its gradient by third-order autograd (FA eq. 1)"
            )
        return (
            f"fd: central finite differences of grad L, step length "
            f"{'eta(dtype) ||theta||' if self.params['eps'] == 'auto' else self.params['eps']} "
            "(approximates the exact penalty on smooth nets only; on ReLU/max-pool nets a "
            "different, kink-dominated regularizer)"
        )

    def step_length(self, params: Sequence[torch.Tensor]) -> float:
        """``h``: ``eps`` when a number, else :func:`auto_step_length`."""
        eps = self.params["eps"]
        return auto_step_length(params) if eps == "auto" else float(eps)

    def term(self, ctx: PassContext) -> torch.Tensor:
        v = rademacher_like(ctx.params, ctx.generator)
        hv = ctx.hvp(v, create_graph=ctx.want_grad)
        batch = ctx.logits.shape[0]
        return self.params["lambda"] * sum((h * h).sum() for h in hv) / batch

    def extra_passes(self, engine: StepEngine, ctx: PassContext, want_grad: bool):
        lam, batch = self.params["lambda"], ctx.logits.shape[0]
        h = self.step_length([p.detach() for p in ctx.params])
        v = rademacher_like(ctx.params, ctx.generator)
        s = h / math.sqrt(sum(t.numel() for t in v))  # ||v|| = sqrt(P) for +-1 entries
        step_v = torch._foreach_mul(v, s)
        with engine.perturbed(step_v):
            g_plus = engine.loss_gradient()
        with engine.perturbed(step_v, sign=-1.0):
            g_minus = engine.loss_gradient()
        u = torch._foreach_mul(torch._foreach_sub(g_plus, g_minus), 0.5 / s)  # H v + O(h^2)
        value = lam * _dot(u, u) / batch
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

        def gradient_at(delta: list[torch.Tensor], sign: float) -> list[torch.Tensor]:
            with engine.perturbed(delta, sign=sign):
                return engine.loss_gradient()

        # [(g(+v+u) - g(+v-u)) - (g(-v+u) - g(-v-u))] / (4 s t) ~= D^3 L[v, u, .]
        upper = torch._foreach_sub(gradient_at(v_plus_u, 1.0), gradient_at(v_minus_u, 1.0))
        lower = torch._foreach_sub(gradient_at(v_minus_u, -1.0), gradient_at(v_plus_u, -1.0))
        t = h / u_norm
        return value, torch._foreach_mul(
            torch._foreach_sub(upper, lower), 2.0 * lam / (batch * 4.0 * s * t)
        )


# --------------------------------------------------------------------------- perturbation oracles
class _AscentOracle(Oracle):
    """Two-step sharpness-aware oracle: clean gradient ``g = grad O(theta)``, perturbation
    ``e(g)``, returned gradient ``grad O(theta + e)`` ([NME] App. B eq. 42-43).

    2 x (evaluations of one objective gradient): **2** with no penalty.
    """

    def perturbation(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        raise TypeError(f"{type(self).__name__} defines no perturbation()")

    def gradient(self, engine: StepEngine) -> tuple[PassResult, list[torch.Tensor]]:
        clean = engine.evaluate(want_grad=True)
        deltas = self.perturbation(engine.weights, clean.grads)
        with engine.perturbed(deltas):
            at_perturbed = engine.evaluate(want_grad=True)
        return clean, at_perturbed.grads


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_t <a_t, b_t>`` over two lists of like-shaped tensors, as a 0-dim tensor (one fused
    elementwise product, one sum per tensor)."""
    return torch.stack([t.sum() for t in torch._foreach_mul(list(a), list(b))]).sum()


def _mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The mean of equally shaped tensors: one stacked ``mean`` (two operations whatever their
    number)."""
    return torch.stack(list(values)).mean(dim=0)


def _radius_over(rho: float, norm: torch.Tensor) -> torch.Tensor:
    """``rho / max(norm, tiny)`` as a 0-dim tensor (``tiny`` the smallest normal number of
    its dtype, 1.2e-38 in float32): ``rho / norm`` for every norm above it, and a zero
    perturbation when ``norm == 0`` (every entry is then 0), without reading the norm back
    to the host. A NaN norm stays NaN (the step's finiteness check reports it)."""
    return rho / norm.clamp_min(torch.finfo(norm.dtype).tiny)


class SAM(_AscentOracle):
    """``sam:rho``: ``e = rho g/||g||`` (global norm over all trainable parameters), [SAM] as
    written in [NME] eq. 42.

    ``e = 0`` when ``g = 0``. Default ``rho = 0.05`` ([SAM]). 2 evaluations.
    """

    name = "sam"
    summary = "gradient at theta + rho g/||g|| (NME App. B eq. 42)"
    HYPERPARAMS = (HyperParam("rho", "float", 0.05, "radius of the ascent step", minimum=0.0),)
    # Per-rank ascent steps ("local SAM") would be a different algorithm.
    data_parallel = "its ascent step needs the global gradient norm before the second pass"

    def perturbation(self, params, grads):
        return torch._foreach_mul(grads, _radius_over(self.params["rho"], global_norm(grads)))


class USAM(_AscentOracle):
    """``usam:rho``: unnormalised SAM [USAM], ``e = rho g`` ([NME] eq. 43).

    Default ``rho = 0.05``. 2 evaluations.
    """

    name = "usam"
    summary = "gradient at theta + rho g (NME App. B eq. 43)"
    HYPERPARAMS = (HyperParam("rho", "float", 0.05, "scale of the ascent step", minimum=0.0),)
    data_parallel = "its ascent step needs the global gradient before the second pass"

    def perturbation(self, params, grads):
        return [self.params["rho"] * g for g in grads]


class ASAM(_AscentOracle):
    """``asam:rho,eta``: adaptive SAM [ASAM] (Kwon et al. 2021), ``e = rho T^2 g / ||T g||``.

    [AD] Table 1 trains it alone and combined with ``ad``. ``T = diag(|w| + eta)`` on weights
    (parameters with ``dim > 1``) and ``T = I`` on the others (biases, normalisation scales),
    following ASAM's reference code (whose bias handling applies a single factor; here
    ``T = I`` on them throughout).
    With ``eta = 0`` zero weights are never perturbed. ``e = 0`` when ``T g = 0``.
    Defaults ``rho = 0.5`` (ASAM's recommended radius), ``eta = 0.01``. 2 evaluations.
    """

    name = "asam"
    summary = "gradient at theta + rho T^2 g/||T g||, T = |w| + eta (ASAM, Kwon et al. 2021)"
    HYPERPARAMS = (
        HyperParam("rho", "float", 0.5, "radius of the ascent step", minimum=0.0),
        HyperParam("eta", "float", 0.01, "offset of the adaptive scale |w| + eta", minimum=0.0),
    )
    data_parallel = "its ascent step needs the global scaled gradient norm before the second pass"

    def scales(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """``T`` per parameter: ``|w| + eta`` for ``dim > 1``, ``None`` (identity) otherwise."""
        return [p.abs() + self.params["eta"] if p.dim() > 1 else None for p in params]

    def perturbation(self, params, grads):
        scales = self.scales(params)
        scaled = [g if t is None else t * g for t, g in zip(scales, grads)]
        factor = _radius_over(self.params["rho"], global_norm(scaled))
        return torch._foreach_mul(
            [s if t is None else t * s for t, s in zip(scales, scaled)], factor
        )


_REPORT = HyperParam(
    "report",
    "choice",
    "perturbed",
    "reported loss: at the perturbed weights (free) or clean at theta (one more forward)",
    choices=("perturbed", "clean"),
)


class WeightNoise(Oracle):
    """``weight-noise:sigma,report``: gradient of O at ``theta + U``, ``U ~ N(0, sigma^2 I)``,
    applied at theta (WP-SGD, [NSO] section 2.1; ``E_U[L(theta+U)] ~ L + sigma^2/2 tr(H)``:
    [NSO] eq. 4, [NME] eq. 17, written there without the 1/2, and its Gauss-Newton/NME
    split, eq. 19). So ``weight-noise:sigma=s`` corresponds to second order to
    ``hessian-trace:sigma2=s^2/2`` (and its Gauss-Newton part to ``gn-trace:sigma2=s^2/2``),
    not to ``sigma2=s^2``.

    **1** evaluation with no penalty. ``U`` is drawn over all trainable parameters in
    order with :func:`sharpcli.training.step.gaussian_like`. What the step reports:

    - ``report=perturbed`` (default): the pass at ``theta + U`` whose gradient is returned
      (loss, objective, penalties, accuracy): a one-sample estimate of the smoothed
      objective ``E_U O(theta + U)`` the method minimises, at no extra cost (as WP-SGD and
      NSO implementations log it). When the model has buffers (BatchNorm), a clean
      no-grad forward at theta runs first so the running statistics are those of theta.
    - ``report=clean``: a clean pass at theta reports ``L(theta)``; a forward under
      ``torch.no_grad()`` (0 evaluations, about a third of a plain step) unless a
      gradient-based penalty needs autograd for its value.

    Default ``sigma = 0.01``.
    """

    name = "weight-noise"
    summary = (
        "gradient at theta + U, U ~ N(0, s^2 I) (NSO 2.1); to 2nd order L + s^2/2 tr(H), "
        "= hessian-trace:sigma2=s^2/2"
    )
    HYPERPARAMS = (
        HyperParam("sigma", "float", 0.01, "noise standard deviation", minimum=0.0),
        _REPORT,
    )
    # U comes from the step generator, identical on every rank; grad L(theta + U) is linear
    # in the batch.
    data_parallel = None

    def gradient(self, engine: StepEngine) -> tuple[PassResult, list[torch.Tensor]]:
        report = self.params["report"]
        clean = None
        if report == "clean":
            clean = engine.evaluate(want_grad=False)
        elif engine.has_buffers:
            engine.forward_only()
        noise = gaussian_like(engine.weights, self.params["sigma"], engine.generator)
        with engine.perturbed(noise):
            at_noisy = engine.evaluate(want_grad=True)
        return (clean if clean is not None else at_noisy), at_noisy.grads


class NSO(Oracle):
    """``nso:sigma,k,report``: noise stability optimization, [NSO] Algorithm 1 / section 2.2.

    Returns ``(1/2k) sum_{j=1..k} [grad O(theta + U_j) + grad O(theta - U_j)]`` with
    ``U_j ~ N(0, sigma^2 I)`` independent, one global ``sigma`` on every trainable
    parameter (the authors' code). The two-point average cancels the first-order term of
    the perturbation, leaving ``grad [L + sigma^2/2 tr(H)]`` to second order (NSO eq. 4).
    The clean gradient is not used. ``U_j`` drawn with
    :func:`sharpcli.training.step.gaussian_like`, ``j = 1..k`` in order. **2k**
    evaluations with no penalty. What the step reports:

    - ``report=perturbed`` (default): loss, objective and penalties are the means over
      the ``2k`` passes at ``theta +- U_j`` (their mean is ``O(theta) + 1/2 U^T H U`` to
      fourth order: an estimate of the smoothed objective), the accuracy that of the pass
      at ``theta + U_1``; no extra cost. When the model has buffers (BatchNorm), a clean
      no-grad forward at theta runs first so the running statistics are those of theta.
    - ``report=clean``: a clean forward at theta reports ``L(theta)`` (as ``weight-noise``).

    Defaults ``sigma = 0.01``, ``k = 1``.
    """

    name = "nso"
    summary = "gradient averaged over theta +- U_j, j = 1..k (NSO Alg. 1)"
    HYPERPARAMS = (
        HyperParam("sigma", "float", 0.01, "noise standard deviation", minimum=0.0),
        HyperParam("k", "int", 1, "number of noise pairs per step", minimum=1),
        _REPORT,
    )
    data_parallel = None  # as weight-noise: the same U_j on every rank, linear in the batch

    def gradient(self, engine: StepEngine) -> tuple[PassResult, list[torch.Tensor]]:
        report = self.params["report"]
        clean = None
        if report == "clean":
            clean = engine.evaluate(want_grad=False)
        elif engine.has_buffers:
            engine.forward_only()
        total: list[torch.Tensor] | None = None  # the first pass's gradient, summed into
        passes: list[PassResult] = []
        k = self.params["k"]
        for _ in range(k):
            noise = gaussian_like(engine.weights, self.params["sigma"], engine.generator)
            for sign in (1.0, -1.0):
                with engine.perturbed(noise, sign=sign):
                    result = engine.evaluate(want_grad=True)
                if total is None:
                    total = result.grads  # a fresh list of fresh tensors: summed into in place
                else:
                    torch._foreach_add_(total, result.grads)
                passes.append(result)
        torch._foreach_div_(total, 2 * k)
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


# --------------------------------------------------------------------------- registry and parsing
# The regularizers by name: sharpcli.catalogue.REGULARIZERS, whose records (name, kind,
# summary, hyper-parameters, paper, data_parallel) the built-in classes take on at registration.
REGISTRY = catalogue.REGULARIZERS
_KIND_BASES: dict[str, type[Regularizer]] = {
    "none": Regularizer,
    "model": Regularizer,
    "penalty": Penalty,
    "oracle": Oracle,
}


def _record_attributes(entry: Entry) -> dict[str, Any]:
    """The class attributes a catalogue record declares."""
    return {
        "kind": entry.info.get("kind", ""),
        "summary": entry.summary,
        "HYPERPARAMS": tuple(entry.params),
        "data_parallel": entry.data_parallel,
        "needs_penultimate": entry.info.get("needs_penultimate", False),
    }


def _entry_of(name: str, cls: type[Regularizer]) -> Entry:
    """The record of an extension registered without one: read from its class attributes."""
    return Entry(
        name,
        cls.summary,
        f"{cls.__module__}:{cls.__qualname__}",
        tuple(cls.HYPERPARAMS),
        data_parallel=vars(cls).get("data_parallel"),
        info={"kind": cls.kind, "needs_penultimate": cls.needs_penultimate},
    )


def _adopt_record(entry: Entry, cls: type[Regularizer], where: str) -> None:
    """Give a built-in class the attributes of its catalogue record; one it states itself
    must agree with the record."""
    for attr, value in _record_attributes(entry).items():
        if attr not in vars(cls):
            setattr(cls, attr, value)
        elif vars(cls)[attr] != value:
            raise REGISTRY.error(
                f"{where}: {attr} {vars(cls)[attr]!r} differs from its catalogue record {value!r}"
            )


def _check_class(entry: Entry, cls: type[Regularizer]) -> type[Regularizer]:
    """The registry's check of a regularizer class (see :func:`register`)."""
    where = f"regularizer class {getattr(cls, '__name__', cls)!r}"
    if not (isinstance(cls, type) and issubclass(cls, Regularizer)):
        raise REGISTRY.error(f"{where}: a regularizer is a subclass of Regularizer")
    if cls.name != entry.name:
        raise REGISTRY.error(f"{where}: its name {cls.name!r} is not {entry.name!r}")
    if entry.name in REGISTRY.builtin_names():
        _adopt_record(entry, cls, where)
    name = entry.name
    base = _KIND_BASES.get(cls.kind)
    if base is None or not issubclass(cls, base):
        raise REGISTRY.error(
            f"{where}: kind {cls.kind!r} must be one of {', '.join(_KIND_BASES)}, "
            "a penalty subclassing Penalty and an oracle subclassing Oracle"
        )
    if not cls.summary or not cls.__doc__ or name not in cls.__doc__:
        raise REGISTRY.error(f"{where}: needs a summary and a docstring that names {name!r}")
    if "data_parallel" not in vars(cls):
        raise REGISTRY.error(
            f"{where}: set data_parallel in the class body: None when averaging per-rank "
            "gradients is exact, else the reason it is not"
        )
    reason = cls.data_parallel
    if reason is not None and not (isinstance(reason, str) and reason.strip()):
        raise REGISTRY.error(f"{where}: data_parallel must be None or a non-empty reason")
    cls()  # the defaults must pass the hyper-parameters' own checks
    return cls


REGISTRY.check = _check_class
REGISTRY.make_entry = _entry_of


def register(cls: type[Regularizer], *, replace: bool = False) -> type[Regularizer]:
    """Add a regularizer class to :data:`REGISTRY` as ``cls.name`` (usable as a class decorator).

    A built-in (a name with a record in :data:`sharpcli.catalogue.REGULARIZERS`) takes on its
    record's kind, summary, hyper-parameters, ``data_parallel`` and ``needs_penultimate``; an
    extension states them in its class body (see :class:`Regularizer`). Either way the class
    must carry a name ``--reg`` can parse, a known ``kind`` with the matching base class, a
    summary, a docstring naming the regularizer, ``data_parallel`` (``None`` or a non-empty
    reason) and defaults its own hyper-parameters accept.

    Args:
        cls: the class.
        replace: replace a class registered under the same name.

    Returns:
        ``cls``.

    Raises:
        RegistryError: a malformed or taken name, or a class missing part of its record.
    """
    return REGISTRY.register(cls.name, cls, replace=replace)


def unregister(name: str) -> type[Regularizer]:
    """Remove and return the class registered as ``name``.

    Args:
        name: the name.

    Returns:
        The class.

    Raises:
        RegistryError: nothing is registered as ``name``.
    """
    return REGISTRY.unregister(name)


REGISTRY.load_all()  # the built-ins, checked at import


def data_parallel_refusal(reg: Regularizer | type[Regularizer]) -> str | None:
    """Why averaging per-rank gradients is not exact for ``reg``, or None when it is.

    A class that does not state ``data_parallel`` in its own body (one put into
    :data:`REGISTRY` without :func:`register`) is refused rather than assumed exact.
    """
    cls = reg if isinstance(reg, type) else type(reg)
    if "data_parallel" not in vars(cls):
        return "it does not declare whether averaging per-rank gradients is exact (data_parallel)"
    return cls.data_parallel


def describe_registry() -> list[dict[str, Any]]:
    """One row per regularizer (for ``--help`` and reports): name, kind, summary, its
    hyper-parameters with defaults in positional order, ``data_parallel`` (None when exact
    under torchrun, else why not) and ``needs_penultimate``."""
    return [
        {
            "name": name,
            "kind": cls.kind,
            "summary": cls.summary,
            "data_parallel": data_parallel_refusal(cls),
            "needs_penultimate": cls.needs_penultimate,
            "hyperparameters": [
                {
                    "name": h.name,
                    "default": h.default,
                    "doc": h.doc,
                    "choices": list(h.choices) or None,
                }
                for h in cls.HYPERPARAMS
            ],
        }
        for name, cls in REGISTRY.items()
    ]


def parse_reg(text: str) -> Regularizer:
    """Parse one ``--reg`` value: ``NAME``, ``NAME:v1,v2`` (positional in the documented
    order), ``NAME:k=v,...`` or a mix (positional first), by the one grammar of
    :func:`sharpcli.registry.parse_spec`. Missing hyper-parameters take their defaults.

    Args:
        text: the value.

    Returns:
        The regularizer.

    Raises:
        RegistryError: (a UsageError, source ``regs``) an unknown regularizer, listing the
            accepted names, or an unknown or bad hyper-parameter, listing the accepted ones.
    """
    entry, values = REGISTRY.parse(text)
    return REGISTRY[entry.name](**values)


def validate_combination(regs: Sequence[Regularizer]) -> None:
    """Check that ``--reg`` options combine: each name at most once and at most one
    perturbation oracle (sam, usam, asam, weight-noise, nso). Raises UsageError."""
    seen: set[str] = set()
    for reg in regs:
        if reg.name in seen and reg.name != "none":
            raise UsageError(f"{reg.name} given more than once", source=_PARAMETER)
        seen.add(reg.name)
    oracles = [r.name for r in regs if r.kind == "oracle"]
    if len(oracles) > 1:
        accepted = ", ".join(n for n, c in REGISTRY.items() if c.kind == "oracle")
        raise UsageError(
            f"at most one perturbation regularizer ({accepted}) per run; got {', '.join(oracles)}",
            source=_PARAMETER,
        )


def model_overrides(regs: Sequence[Regularizer]) -> dict[str, Any]:
    """Model-construction arguments implied by the regularizers (each one's
    :meth:`Regularizer.model_args`): ``{"dropout": p}`` for ``dropout:p``."""
    out: dict[str, Any] = {}
    for reg in regs:
        out.update(reg.model_args())
    return out


def training_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_name: str,
    regs: Sequence[Regularizer],
    generator: torch.Generator,
) -> StepStats:
    """One regularised step's gradient: sets ``p.grad`` of every trainable parameter to the
    gradient of the regularised objective at theta (as defined by the oracle, if any) and
    returns the reported pass's statistics (the clean pass at theta unless a noise
    oracle reports its perturbed passes, see :class:`StepStats`). Weights are unchanged on return (restored by
    copy); the optimizer is not called; the model's train/eval mode is left as given.
    """
    validate_combination(regs)
    penalties = [r for r in regs if r.kind == "penalty"]
    oracles = [r for r in regs if r.kind == "oracle"]
    single_pass = not oracles and not any(p.has_extra_passes for p in penalties)
    engine = StepEngine(model, x, y, loss_name, penalties, generator, single_pass=single_pass)
    try:
        if oracles:
            reported, grads = oracles[0].gradient(engine)
        else:
            reported = engine.evaluate(want_grad=True)
            grads = reported.grads
    finally:
        engine.finish()
    stats = engine.stats(reported, int(x.shape[0]))  # the step's one read-back; raises on NaN
    engine.write_grads(grads)
    return stats
