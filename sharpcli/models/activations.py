"""Activation functions with controlled second derivatives ([NME] sections 4.3-4.4).

The nonlinear modeling error ``N = sum_c (dl/dz_c) d^2 z_c / dtheta^2`` ([NME] eq. 2) depends on the
second derivative ``phi''`` of every activation ([NME] eq. 11-12). This module provides:

``relu``             ``max(x, 0)``; under autograd ``phi' = Theta(x)`` (0 at the origin) and
                     ``phi'' = 0`` everywhere, so the diagonal of N vanishes ([NME] 4.3).
``gelu``             exact GELU ``x Phi(x)`` with the erf form of the Gaussian CDF ``Phi``.
``beta-gelu``        ``x Phi(beta x)`` ([NME] eq. 13); ``beta = 1`` is GELU, ``beta -> inf`` tends to
                     ReLU. Default ``beta = 1.0``.
``augmented-relu``   forward ReLU, first AD derivative the step ``Theta(x)``, second AD derivative
                     the Gaussian ``beta / sqrt(2 pi) exp(-beta^2 x^2 / 2)`` ([NME] eq. 15), a
                     smoothed Dirac delta of unit mass. Default ``beta = 1.0`` (the paper's
                     "beta of O(1)", numerically stable).
``diminished-gelu``  forward and first AD derivative of GELU, second AD derivative 0 ([NME] eq. 16).
``tanh``             ``tanh x`` ([Cohen2021]'s edge-of-stability networks), true derivatives.

The two custom-derivative activations are ``torch.autograd.Function`` s
(:mod:`sharpcli.models.activation_functions`) whose second derivatives every autograd and
``torch.func`` transform returns.

``make_activation("name[:k=v,...]")`` builds a module; every module has ``.spec``, the canonical
string that ``make_activation`` accepts again (used in checkpoint metadata).
"""

from __future__ import annotations

import torch
from torch import nn

from sharpcli import catalogue
from sharpcli.models.activation_functions import (
    augmented_relu,
    augmented_relu_second_derivative,
    beta_gelu,
    diminished_gelu,
    gelu_derivative,
)
from sharpcli.registry import declaration, declare
from sharpcli.specs import Param, format_value

# ----------------------------------------------------------------------------------------- Modules


def _declared_name(module: object) -> str:
    """The name declared by ``module``'s class, or by its nearest declared base class."""
    for cls in type(module).__mro__:
        declared = declaration(cls)
        if declared is not None:
            return declared[1].name
    raise TypeError(f"{type(module).__name__} is not a declared activation")


class _Named:
    """A parameter-free activation: its canonical spec string is its declared name."""

    @property
    def spec(self) -> str:
        """Canonical spec string: the name."""
        return _declared_name(self)


class _WithBeta(nn.Module):
    """An activation of one parameter ``beta``; spec ``NAME:beta=B``."""

    def __init__(self, beta: float = 1.0) -> None:
        super().__init__()
        self.beta = float(beta)

    @property
    def spec(self) -> str:
        """Canonical spec string, e.g. ``beta-gelu:beta=4.0``."""
        return f"{_declared_name(self)}:beta={format_value(self.beta)}"

    def extra_repr(self) -> str:
        """``beta=B`` in the module's repr."""
        return f"beta={self.beta}"


# the activation of the built-in models unless one is given (sharpcli.models.specs, zoo)
DEFAULT_ACTIVATION = "relu"


@declare("activation", DEFAULT_ACTIVATION, "ReLU")
class ReLU(_Named, nn.ReLU):
    """``max(x, 0)`` as ``nn.ReLU`` (AD: ``phi' = Theta(x)``, ``phi'' = 0``); spec ``relu``."""


@declare("activation", "gelu", "GELU")
class GELU(_Named, nn.GELU):
    """Exact GELU ``x Phi(x)`` (erf form, torch's default ``approximate``); spec ``gelu``."""

    def __init__(self) -> None:
        super().__init__(approximate="none")


@declare(
    "activation",
    "beta-gelu",
    "x Phi(beta x): GELU with sharpness beta",
    params=(Param("beta", "float", 1.0, "sharpness, > 0; 1 = GELU", positive=True),),
    paper="NME",
)
class BetaGELU(_WithBeta):
    """beta-GELU ``x Phi(beta x)`` ([NME] eq. 13); spec ``beta-gelu:beta=B``.

    ``phi''(x) = beta phi(beta x)(2 - beta^2 x^2)`` ([NME] eq. 14, see
    :func:`~sharpcli.models.activation_functions.beta_gelu_second_derivative`); beta = 1 is GELU, beta -> inf approaches ReLU.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise ``x Phi(beta x)``."""
        return beta_gelu(x, self.beta)


@declare(
    "activation",
    "augmented-relu",
    "ReLU forward, a Gaussian of inverse width beta as its second derivative",
    params=(Param("beta", "float", 1.0, "inverse width of the Gaussian, > 0", positive=True),),
    paper="NME",
)
class AugmentedReLU(_WithBeta):
    """Augmented ReLU ([NME] 4.4, eq. 15); spec ``augmented-relu:beta=B``.

    Forward ``max(x, 0)``; first AD derivative ``Theta(x)``; second AD derivative
    ``beta / sqrt(2 pi) exp(-beta^2 x^2 / 2)``, so Hessian-vector products see a Gaussian-smoothed
    delta at every ReLU kink while the forward pass and the gradient stay those of ReLU.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise ``max(x, 0)`` with the augmented AD derivatives."""
        return augmented_relu(x, self.beta)

    def intended_derivatives(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Theta(x), beta phi(beta x))``: the AD derivatives this module is built to return.

        Args:
            x: the inputs.

        Returns:
            The first and second derivatives at ``x``.
        """
        return (x > 0).to(x.dtype), augmented_relu_second_derivative(x, self.beta)

    def true_derivative_twin(self) -> nn.Module:
        """``nn.ReLU``: the same forward and first derivative, with torch's true (zero) second one."""
        return ReLU()


@declare("activation", "diminished-gelu", "GELU forward, no second derivative", paper="NME")
class DiminishedGELU(_Named, nn.Module):
    """Diminished GELU ([NME] 4.4, eq. 16); spec ``diminished-gelu``.

    Forward ``x Phi(x)``; first AD derivative ``Phi(x) + x phi(x)``; second AD derivative 0, so the
    activation's contribution to the NME diagonal is switched off as for ReLU.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise GELU with the diminished AD derivatives."""
        return diminished_gelu(x)

    def intended_derivatives(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Phi(x) + x phi(x), 0)``: the AD derivatives this module is built to return.

        Args:
            x: the inputs.

        Returns:
            The first and second derivatives at ``x``.
        """
        return gelu_derivative(x), torch.zeros_like(x)

    def true_derivative_twin(self) -> nn.Module:
        """Exact GELU: the same forward and first derivative, with its true second derivative."""
        return GELU()


@declare("activation", "tanh", "tanh", paper="Cohen2021")
class Tanh(_Named, nn.Tanh):
    """``tanh x`` as ``nn.Tanh``, the activation of [Cohen2021]'s edge-of-stability networks;
    spec ``tanh``. Its autograd derivatives are the true ones: ``phi' = 1 - tanh^2 x`` and
    ``phi'' = -2 tanh x (1 - tanh^2 x)``, so N has a nonzero diagonal ([NME] eq. 11-12)."""


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
    through such activations ([Dinh2017]; [MAN] Fig. 1). False for the GELU family and every
    other activation (``nn.ReLU6`` clips, so it is not).

    Args:
        module: any module.

    Returns:
        Whether rescaling passes through it unchanged.
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
    ``diminished-gelu`` ([NME] 4.3-4.4), ``tanh``. The module's ``.spec`` is the canonical form (parameters
    written out), and ``make_activation(m.spec)`` rebuilds an identical module. Unknown names or
    bad parameters raise ``UsageError(source="activation")`` listing the accepted names.

    Args:
        spec: ``name[:k=v,...]``.

    Returns:
        A new activation module.

    Raises:
        RegistryError: (a UsageError, source ``activation``) an unknown name or a bad parameter.

    Example:
        >>> make_activation("BETA_GELU:beta=4").spec
        'beta-gelu:beta=4.0'
    """
    name, params = parse_activation_spec(spec)
    return ACTIVATIONS[name](**params)


def canonical_activation_spec(spec: str) -> str:
    """The canonical spelling of an activation spec (``'BETA_GELU:beta=4'`` -> ``'beta-gelu:beta=4.0'``).

    Args:
        spec: ``name[:k=v,...]``.

    Returns:
        The spec with its name canonical and every parameter written out.

    Raises:
        RegistryError: (a UsageError, source ``activation``) an unknown name or a bad parameter.
    """
    canonical = activation_spec(make_activation(spec))
    assert canonical is not None  # every built-in activation has its ``spec``
    return canonical


def activation_spec(module: nn.Module) -> str | None:
    """The spec string of an activation module built here, or None for foreign modules.

    Plain ``nn.ReLU`` maps to ``relu`` and exact ``nn.GELU`` to ``gelu``, since they compute the same
    function with the same derivatives.

    Args:
        module: any module.

    Returns:
        Its canonical spec, or ``None``.
    """
    spec = getattr(module, "spec", None)
    if isinstance(spec, str):
        return spec
    if type(module) is nn.ReLU:
        return ReLU().spec
    if type(module) is nn.Tanh:
        return Tanh().spec
    if type(module) is nn.GELU and module.approximate == GELU().approximate:
        return GELU().spec
    return None


# --- Deliberately altered second derivatives, for the self-check of a model's second derivatives

ALTERED_DERIVATIVE_TYPES: tuple[type[AugmentedReLU], type[DiminishedGELU]] = (
    AugmentedReLU,
    DiminishedGELU,
)
"""Modules whose autograd second derivative differs from the true one by design ([NME] 4.4)."""


def replace_altered_activations(model: nn.Module) -> list[AugmentedReLU | DiminishedGELU]:
    """Swap every :data:`ALTERED_DERIVATIVE_TYPES` layer of ``model`` (in place) for its
    ``true_derivative_twin()``; return the replaced modules (each once).

    The twin has the same forward and first derivative (augmented ReLU -> ReLU, diminished
    GELU -> GELU), so the model's loss and gradient are unchanged and central differences of
    the gradient then match torch's double backward wherever torch's layers are right. A
    model that is itself such a layer is left as it is.

    Args:
        model: the model changed in place.

    Returns:
        The replaced modules, each once.
    """
    replaced: list[AugmentedReLU | DiminishedGELU] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, ALTERED_DERIVATIVE_TYPES):
                setattr(parent, name, child.true_derivative_twin())
                if all(child is not seen for seen in replaced):
                    replaced.append(child)
    return replaced


def intended_derivative_error(module: AugmentedReLU | DiminishedGELU, points: int = 241) -> float:
    """Largest deviation of ``module``'s AD derivatives from its ``intended_derivatives``.

    On ``points`` float64 inputs spread over ``[-6, 6] / beta`` (beta of augmented ReLU, 1
    otherwise; the grid misses 0, where the step of ``Theta`` sits): the first derivative by
    ``autograd.grad`` with a graph and the second by differentiating it again, each compared
    with the closed form ([NME] eq. 15, 16); the error is ``max |AD - intended|`` divided by
    ``max(1, max |intended|)`` over both. A torch that differentiated the custom
    ``autograd.Function`` s wrongly shows here at order 1; rounding is ~1e-16.

    Args:
        module: an activation with ``intended_derivatives``.
        points: the grid's size.

    Returns:
        The largest relative deviation over both derivatives.
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


def activation_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every activation layer ``(name, module)`` in ``named_modules()`` order.

    An activation layer is an instance of :data:`sharpcli.models.activations.ACTIVATION_TYPES`
    (ours and torch's common ones). Its forward hook sees the pre-activation (input) and the
    activation (output) used by activation statistics ([MAN] section 2).

    Args:
        model: any module.

    Returns:
        ``(name, module)`` of each activation layer.
    """
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, ACTIVATION_TYPES)
    ]
