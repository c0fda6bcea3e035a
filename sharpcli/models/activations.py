"""Activation functions with controlled second derivatives ([NME] sections 4.3-4.4).

The nonlinear modeling error ``N = sum_c (dl/dz_c) d^2 z_c / dtheta^2`` (NME eq. 2) depends on the
second derivative ``phi''`` of every activation (NME eq. 11-12). This module provides:

``relu``             ``max(x, 0)``; under autograd ``phi' = Theta(x)`` (0 at the origin) and
                     ``phi'' = 0`` everywhere, so the diagonal of N vanishes (NME 4.3).
``gelu``             exact GELU ``x Phi(x)`` with the erf form of the Gaussian CDF ``Phi``.
``beta-gelu``        ``x Phi(beta x)`` (NME eq. 13); ``beta = 1`` is GELU, ``beta -> inf`` tends to
                     ReLU. Default ``beta = 1.0``.
``augmented-relu``   forward ReLU, first AD derivative the step ``Theta(x)``, second AD derivative
                     the Gaussian ``beta / sqrt(2 pi) exp(-beta^2 x^2 / 2)`` (NME eq. 15), a
                     smoothed Dirac delta of unit mass. Default ``beta = 1.0`` (the paper's
                     "beta of O(1)", numerically stable).
``diminished-gelu``  forward and first AD derivative of GELU, second AD derivative 0 (NME eq. 16).

The two custom-derivative activations are ``torch.autograd.Function`` s in the ``setup_context``
style with ``generate_vmap_rule = True`` and a ``jvp`` rule. Their backward and jvp rules are
themselves built from another ``autograd.Function`` (``_HeavisideWithGaussianDerivative``,
``_GeluDerivativeWithZeroDerivative``), so the custom second derivative is what
``torch.autograd.grad(..., create_graph=True)`` followed by another ``grad`` returns, and what the
``torch.func`` transforms (``grad``, ``vjp``, ``jvp``, ``jacrev``, ``jacfwd``, ``hessian``, ``vmap``)
return, in every nesting except forward-over-forward (``jacfwd(jacfwd(f))``), where PyTorch drops
the derivative of a custom jvp rule (pytorch/pytorch#197867); that nesting raises a RuntimeError
instead of returning a silently wrong zero. ``torch.func.hessian`` is forward-over-reverse and exact.

``make_activation("name[:k=v,...]")`` builds a module; every module has ``.spec``, the canonical
string that ``make_activation`` accepts again (used in checkpoint metadata).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sharpcli import catalogue

try:  # private, but the only way to see the functorch transform stack; absent -> no check
    from torch._C._functorch import TransformType as _TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters as _functorch_stack
except ImportError:  # pragma: no cover - depends on the torch build
    _functorch_stack = None
    _TransformType = None

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gaussian_cdf(x: torch.Tensor) -> torch.Tensor:
    """Standard normal CDF ``Phi(x) = (1 + erf(x / sqrt 2)) / 2`` (differentiable)."""
    return 0.5 * (1.0 + torch.erf(x / _SQRT2))


def gaussian_pdf(x: torch.Tensor) -> torch.Tensor:
    """Standard normal density ``phi(x) = exp(-x^2 / 2) / sqrt(2 pi)`` (differentiable)."""
    return _INV_SQRT_2PI * torch.exp(-0.5 * x * x)


def gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU derivative ``d/dx [x Phi(x)] = Phi(x) + x phi(x)``."""
    return gaussian_cdf(x) + x * gaussian_pdf(x)


def augmented_relu_second_derivative(x: torch.Tensor, beta: float) -> torch.Tensor:
    """The augmented ReLU's second AD derivative ``beta / sqrt(2 pi) exp(-beta^2 x^2 / 2)`` (NME eq. 15)."""
    return beta * gaussian_pdf(beta * x)


def beta_gelu_second_derivative(x: torch.Tensor, beta: float) -> torch.Tensor:
    """Closed form ``d^2/dx^2 [x Phi(beta x)] = beta phi(beta x) (2 - beta^2 x^2)``.

    This is NME eq. 14 with the prefactor corrected: the paper prints ``1 / (sqrt(2 pi) beta^-2)``
    (i.e. ``beta^2``), but differentiating eq. 13 twice gives ``beta``, which is also what makes the
    integral over x equal to 1 for every beta, as the paper states below eq. 14.
    """
    bx = beta * x
    return beta * gaussian_pdf(bx) * (2.0 - bx * bx)


# --------------------------------------------------------------------------------------------
# autograd.Functions
# --------------------------------------------------------------------------------------------


def _refuse_forward_over_forward(name: str) -> None:
    """Raise when a jvp rule runs under two nested ``torch.func`` forward-mode transforms.

    PyTorch evaluates a custom Function's ``jvp`` rule with forward-mode AD switched off, so an
    outer forward transform (``jacfwd(jacfwd(f))``, ``jvp`` of ``jvp``) silently sees a zero
    derivative of the rule (pytorch/pytorch#197867): the second derivative would come out 0
    instead of the Gaussian. Refusing is better than a silently wrong curvature; every other
    nesting (``hessian`` = ``jacfwd(jacrev)``, ``jacrev(jacrev)``, ``jacrev(jacfwd)``, double
    backward, forward-over-double-backward) is exact.
    """
    if _functorch_stack is None:
        return
    forward_levels = sum(1 for interp in _functorch_stack() if interp.key() == _TransformType.Jvp)
    if forward_levels >= 2:
        raise RuntimeError(
            f"{name}: forward-over-forward differentiation (jacfwd of jacfwd, jvp of jvp) through a "
            "custom-derivative activation is not supported by PyTorch (pytorch/pytorch#197867, it "
            "would silently drop the second derivative); use torch.func.hessian / jacfwd(jacrev(...)) "
            "or reverse-over-forward instead"
        )


class _HeavisideWithGaussianDerivative(torch.autograd.Function):
    """``Theta(x)`` (1 for x > 0, else 0) whose AD derivative is ``beta phi(beta x)`` (NME eq. 15).

    This is the first AD derivative of the augmented ReLU; differentiating it once more gives the
    Gaussian second derivative. Its own backward/jvp use ordinary differentiable ops, so third
    derivatives are the true derivatives of that Gaussian.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, beta: float) -> torch.Tensor:
        return (x > 0).to(x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, beta = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        ctx.beta = beta

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * augmented_relu_second_derivative(x, ctx.beta), None

    @staticmethod
    def jvp(ctx, x_tangent, beta_tangent):
        _refuse_forward_over_forward("augmented-relu")
        (x,) = ctx.saved_tensors
        return x_tangent * augmented_relu_second_derivative(x, ctx.beta)


class _AugmentedReLUFunction(torch.autograd.Function):
    """``ReLU(x)`` with first AD derivative ``Theta(x)`` and second AD derivative ``beta phi(beta x)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, beta: float) -> torch.Tensor:
        return torch.clamp_min(x, 0.0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, beta = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        ctx.beta = beta

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * _HeavisideWithGaussianDerivative.apply(x, ctx.beta), None

    @staticmethod
    def jvp(ctx, x_tangent, beta_tangent):
        _refuse_forward_over_forward("augmented-relu")
        (x,) = ctx.saved_tensors
        return x_tangent * _HeavisideWithGaussianDerivative.apply(x, ctx.beta)


class _GeluDerivativeWithZeroDerivative(torch.autograd.Function):
    """``g(x) = Phi(x) + x phi(x)`` (the GELU derivative) whose AD derivative is defined as 0 (NME eq. 16)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return gelu_derivative(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad_output):
        return torch.zeros_like(grad_output)

    @staticmethod
    def jvp(ctx, x_tangent):
        return torch.zeros_like(x_tangent)


class _DiminishedGELUFunction(torch.autograd.Function):
    """``GELU(x)`` with first AD derivative ``g(x) = Phi(x) + x phi(x)`` and second AD derivative 0."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x)  # bit-identical to nn.GELU()

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * _GeluDerivativeWithZeroDerivative.apply(x)

    @staticmethod
    def jvp(ctx, x_tangent):
        _refuse_forward_over_forward("diminished-gelu")
        (x,) = ctx.saved_tensors
        return x_tangent * _GeluDerivativeWithZeroDerivative.apply(x)


def augmented_relu(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """Augmented ReLU (NME 4.4): ``ReLU(x)``; AD derivatives ``Theta(x)`` and ``beta phi(beta x)`` (eq. 15)."""
    return _AugmentedReLUFunction.apply(x, float(beta))


def diminished_gelu(x: torch.Tensor) -> torch.Tensor:
    """Diminished GELU (NME 4.4): ``x Phi(x)``; AD derivatives ``Phi(x) + x phi(x)`` and 0 (eq. 16)."""
    return _DiminishedGELUFunction.apply(x)


def beta_gelu(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """beta-GELU (NME eq. 13): ``x Phi(beta x)`` with true derivatives of every order."""
    return x * gaussian_cdf(beta * x)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


def _format_number(value: float) -> str:
    """Shortest round-tripping text of a float (``repr``), used in canonical specs."""
    return repr(float(value))


class ReLU(nn.ReLU):
    """``max(x, 0)`` as ``nn.ReLU`` (AD: ``phi' = Theta(x)``, ``phi'' = 0``); spec ``relu``."""

    spec = "relu"


class GELU(nn.GELU):
    """Exact GELU ``x Phi(x)`` (erf form, ``approximate='none'``); spec ``gelu``."""

    spec = "gelu"

    def __init__(self) -> None:
        super().__init__(approximate="none")


class BetaGELU(nn.Module):
    """beta-GELU ``x Phi(beta x)`` (NME eq. 13); spec ``beta-gelu:beta=B``.

    ``phi''(x) = beta phi(beta x)(2 - beta^2 x^2)`` (NME eq. 14, see
    :func:`beta_gelu_second_derivative`); beta = 1 is GELU, beta -> inf approaches ReLU.
    """

    def __init__(self, beta: float = 1.0) -> None:
        super().__init__()
        self.beta = float(beta)

    @property
    def spec(self) -> str:
        """Canonical spec string, e.g. ``beta-gelu:beta=4.0``."""
        return f"beta-gelu:beta={_format_number(self.beta)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise ``x Phi(beta x)``."""
        return beta_gelu(x, self.beta)

    def extra_repr(self) -> str:
        """``beta=B`` in the module's repr."""
        return f"beta={self.beta}"


class AugmentedReLU(nn.Module):
    """Augmented ReLU (NME 4.4, eq. 15); spec ``augmented-relu:beta=B``.

    Forward ``max(x, 0)``; first AD derivative ``Theta(x)``; second AD derivative
    ``beta / sqrt(2 pi) exp(-beta^2 x^2 / 2)``, so Hessian-vector products see a Gaussian-smoothed
    delta at every ReLU kink while the forward pass and the gradient stay those of ReLU.
    """

    def __init__(self, beta: float = 1.0) -> None:
        super().__init__()
        self.beta = float(beta)

    @property
    def spec(self) -> str:
        """Canonical spec string, e.g. ``augmented-relu:beta=4.0``."""
        return f"augmented-relu:beta={_format_number(self.beta)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise ``max(x, 0)`` with the augmented AD derivatives."""
        return augmented_relu(x, self.beta)

    def intended_derivatives(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Theta(x), beta phi(beta x))``: the AD derivatives this module is built to return."""
        return (x > 0).to(x.dtype), augmented_relu_second_derivative(x, self.beta)

    def true_derivative_twin(self) -> nn.Module:
        """``nn.ReLU``: the same forward and first derivative, with torch's true (zero) second one."""
        return ReLU()

    def extra_repr(self) -> str:
        """``beta=B`` in the module's repr."""
        return f"beta={self.beta}"


class DiminishedGELU(nn.Module):
    """Diminished GELU (NME 4.4, eq. 16); spec ``diminished-gelu``.

    Forward ``x Phi(x)``; first AD derivative ``Phi(x) + x phi(x)``; second AD derivative 0, so the
    activation's contribution to the NME diagonal is switched off as for ReLU.
    """

    spec = "diminished-gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise GELU with the diminished AD derivatives."""
        return diminished_gelu(x)

    def intended_derivatives(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Phi(x) + x phi(x), 0)``: the AD derivatives this module is built to return."""
        return gelu_derivative(x), torch.zeros_like(x)

    def true_derivative_twin(self) -> nn.Module:
        """Exact GELU: the same forward and first derivative, with its true second derivative."""
        return GELU()


# The activations by name: sharpcli.catalogue.ACTIVATIONS (name, parameters, module class).
ACTIVATIONS = catalogue.ACTIVATIONS
ACTIVATION_NAMES: tuple[str, ...] = ACTIVATIONS.builtin_names()

# Every class counted as an activation layer by activation_modules(): ours and torch's common ones
# (so foreign models are covered too). Our ReLU/GELU subclass nn.ReLU/nn.GELU.
ACTIVATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.GELU,
    BetaGELU,
    AugmentedReLU,
    DiminishedGELU,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ReLU6,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Hardswish,
    nn.Hardtanh,
    nn.Tanh,
    nn.Sigmoid,
)

_POSITIVELY_HOMOGENEOUS_TYPES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    AugmentedReLU,
    nn.LeakyReLU,
    nn.PReLU,
)


def is_positively_homogeneous(module: nn.Module) -> bool:
    """True when the module's forward map satisfies ``f(a x) = a f(x)`` for every ``a > 0``.

    That is ReLU, augmented ReLU (ReLU in the forward pass), leaky ReLU and PReLU. Rescaling one
    layer by ``alpha`` and the next by ``1 / alpha`` preserves the network function exactly only
    through such activations (Dinh et al. 2017; MAN Fig. 1). False for the GELU family and every
    other activation (``nn.ReLU6`` clips, so it is not).
    """
    if isinstance(module, nn.ReLU6):
        return False
    return isinstance(module, _POSITIVELY_HOMOGENEOUS_TYPES)


def parse_activation_spec(spec: str) -> tuple[str, dict[str, float]]:
    """Parse ``name[:k=v,...]`` into ``(canonical name, complete parameter dict)``.

    The grammar is :func:`sharpcli.specs.parse_spec`, every item ``key=value``: names are
    case-insensitive and ``_`` may stand for ``-``; every parameter is a finite number > 0;
    missing parameters take their defaults.

    Args:
        spec: the activation spec.

    Returns:
        The name and its parameters.

    Raises:
        RegistryError: (a UsageError, source ``activation``) an unknown name, listing the
            accepted ones with their parameters, or a bad, unknown or repeated parameter.
    """
    hints = ", ".join(e.spec_hint() for e in ACTIVATIONS.entries())
    entry, params = ACTIVATIONS.parse(spec, positional=False, accepted=hints)
    return entry.name, params


def make_activation(spec: str) -> nn.Module:
    """Build a fresh activation module from ``name[:k=v,...]``.

    Names: ``relu``, ``gelu``, ``beta-gelu[:beta=B]``, ``augmented-relu[:beta=B]``,
    ``diminished-gelu`` (NME 4.3-4.4). The module's ``.spec`` is the canonical form (parameters
    written out), and ``make_activation(m.spec)`` rebuilds an identical module. Unknown names or
    bad parameters raise ``UsageError(source="activation")`` listing the accepted names.
    """
    name, params = parse_activation_spec(spec)
    return ACTIVATIONS[name](**params)


def canonical_activation_spec(spec: str) -> str:
    """The canonical spelling of an activation spec (``'BETA_GELU:beta=4'`` -> ``'beta-gelu:beta=4.0'``)."""
    return make_activation(spec).spec


def activation_spec(module: nn.Module) -> str | None:
    """The spec string of an activation module built here, or None for foreign modules.

    Plain ``nn.ReLU`` maps to ``relu`` and exact ``nn.GELU`` to ``gelu``, since they compute the same
    function with the same derivatives.
    """
    spec = getattr(module, "spec", None)
    if isinstance(spec, str):
        return spec
    if type(module) is nn.ReLU:
        return "relu"
    if type(module) is nn.GELU and module.approximate == "none":
        return "gelu"
    return None


# --------------------------------------------------------------------------------------------
# Deliberately altered second derivatives, for the self-check of a model's second derivatives
# --------------------------------------------------------------------------------------------

ALTERED_DERIVATIVE_TYPES: tuple[type[nn.Module], ...] = (AugmentedReLU, DiminishedGELU)
"""Modules whose autograd second derivative differs from the true one by design (NME 4.4)."""


def replace_altered_activations(model: nn.Module) -> list[nn.Module]:
    """Swap every :data:`ALTERED_DERIVATIVE_TYPES` layer of ``model`` (in place) for its
    ``true_derivative_twin()``; return the replaced modules (each once).

    The twin has the same forward and first derivative (augmented ReLU -> ReLU, diminished
    GELU -> GELU), so the model's loss and gradient are unchanged and central differences of
    the gradient then match torch's double backward wherever torch's layers are right. A
    model that is itself such a layer is left as it is.
    """
    replaced: list[nn.Module] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, ALTERED_DERIVATIVE_TYPES):
                setattr(parent, name, child.true_derivative_twin())
                if all(child is not seen for seen in replaced):
                    replaced.append(child)
    return replaced


def intended_derivative_error(module: nn.Module, points: int = 241) -> float:
    """Largest deviation of ``module``'s AD derivatives from its ``intended_derivatives``.

    On ``points`` float64 inputs spread over ``[-6, 6] / beta`` (beta of augmented ReLU, 1
    otherwise; the grid misses 0, where the step of ``Theta`` sits): the first derivative by
    ``autograd.grad`` with a graph and the second by differentiating it again, each compared
    with the closed form (NME eq. 15, 16); the error is ``max |AD - intended|`` divided by
    ``max(1, max |intended|)`` over both. A torch that differentiated the custom
    ``autograd.Function`` s wrongly shows here at order 1; rounding is ~1e-16.
    """
    scale = float(getattr(module, "beta", 1.0))
    x = (torch.linspace(-6.0, 6.0, points, dtype=torch.float64) / scale).requires_grad_(True)
    with torch.enable_grad():
        first = torch.autograd.grad(module(x).sum(), x, create_graph=True)[0]
        second = (
            torch.autograd.grad(first.sum(), x, allow_unused=True)[0]
            if first.requires_grad
            else None
        )
    second = torch.zeros_like(x) if second is None else second
    want_first, want_second = module.intended_derivatives(x.detach())
    error = 0.0
    for got, want in ((first.detach(), want_first), (second.detach(), want_second)):
        error = max(error, float((got - want).abs().max()) / max(1.0, float(want.abs().max())))
    return error


ACTIVATIONS.load_all()  # the built-ins, resolved at import
