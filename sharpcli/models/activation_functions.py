"""The activation functions of :mod:`sharpcli.models.activations`: closed forms and autograd.

The Gaussian CDF and density, the closed-form derivatives of GELU, beta-GELU and the augmented
ReLU ([NME] eqs. 13-16), and the functional forms :func:`augmented_relu`,
:func:`diminished_gelu` and :func:`beta_gelu`.

The two custom-derivative activations are ``torch.autograd.Function`` s in the ``setup_context``
style with ``generate_vmap_rule = True`` and a ``jvp`` rule. Their backward and jvp rules are
themselves built from another ``autograd.Function`` (``_HeavisideWithGaussianDerivative``,
``_GeluDerivativeWithZeroDerivative``), so the custom second derivative is what
``torch.autograd.grad(..., create_graph=True)`` followed by another ``grad`` returns, and what the
``torch.func`` transforms (``grad``, ``vjp``, ``jvp``, ``jacrev``, ``jacfwd``, ``hessian``, ``vmap``)
return, in every nesting except forward-over-forward (``jacfwd(jacfwd(f))``), where PyTorch drops
the derivative of a custom jvp rule (pytorch/pytorch#197867); that nesting raises a RuntimeError
instead of returning a silently wrong zero. ``torch.func.hessian`` is forward-over-reverse and exact.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "augmented_relu",
    "augmented_relu_second_derivative",
    "beta_gelu",
    "beta_gelu_second_derivative",
    "diminished_gelu",
    "gaussian_cdf",
    "gaussian_pdf",
    "gelu_derivative",
]

try:  # private, but the only way to see the functorch transform stack; absent -> no check
    from torch._C._functorch import TransformType as _TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters as _functorch_stack

    _SEES_TRANSFORMS = True
except ImportError:  # pragma: no cover - depends on the torch build
    _SEES_TRANSFORMS = False

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gaussian_cdf(x: torch.Tensor) -> torch.Tensor:
    """Standard normal CDF ``Phi(x) = (1 + erf(x / sqrt 2)) / 2`` (differentiable).

    Args:
        x: any tensor.

    Returns:
        ``Phi(x)`` elementwise.

    Example:
        >>> gaussian_cdf(torch.tensor([0.0]))
        tensor([0.5000])
    """
    return 0.5 * (1.0 + torch.erf(x / _SQRT2))


def gaussian_pdf(x: torch.Tensor) -> torch.Tensor:
    """Standard normal density ``phi(x) = exp(-x^2 / 2) / sqrt(2 pi)`` (differentiable).

    Args:
        x: any tensor.

    Returns:
        ``phi(x)`` elementwise.
    """
    return _INV_SQRT_2PI * torch.exp(-0.5 * x * x)


def gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU derivative ``d/dx [x Phi(x)] = Phi(x) + x phi(x)``.

    Args:
        x: any tensor.

    Returns:
        ``Phi(x) + x phi(x)`` elementwise.
    """
    return gaussian_cdf(x) + x * gaussian_pdf(x)


def augmented_relu_second_derivative(x: torch.Tensor, beta: float) -> torch.Tensor:
    """The augmented ReLU's second AD derivative ``beta / sqrt(2 pi) exp(-beta^2 x^2 / 2)`` ([NME] eq. 15).

    Args:
        x: any tensor.
        beta: the sharpness of the smoothed step.

    Returns:
        ``beta phi(beta x)`` elementwise.
    """
    return beta * gaussian_pdf(beta * x)


def beta_gelu_second_derivative(x: torch.Tensor, beta: float) -> torch.Tensor:
    """Closed form ``d^2/dx^2 [x Phi(beta x)] = beta phi(beta x) (2 - beta^2 x^2)``.

    This is [NME] eq. 14 with the prefactor corrected: the paper prints ``1 / (sqrt(2 pi) beta^-2)``
    (i.e. ``beta^2``), but differentiating eq. 13 twice gives ``beta``, which is also what makes the
    integral over x equal to 1 for every beta, as the paper states below eq. 14.

    Args:
        x: any tensor.
        beta: the GELU's inverse temperature.

    Returns:
        ``beta phi(beta x) (2 - beta^2 x^2)`` elementwise.
    """
    bx = beta * x
    return beta * gaussian_pdf(bx) * (2.0 - bx * bx)


# ------------------------------------------------------------------------------ autograd.Functions


def _refuse_forward_over_forward(name: str) -> None:
    """Raise when a jvp rule runs under two nested ``torch.func`` forward-mode transforms.

    PyTorch evaluates a custom Function's ``jvp`` rule with forward-mode AD switched off, so an
    outer forward transform (``jacfwd(jacfwd(f))``, ``jvp`` of ``jvp``) silently sees a zero
    derivative of the rule (pytorch/pytorch#197867): the second derivative would come out 0
    instead of the Gaussian. Refusing is better than a silently wrong curvature; every other
    nesting (``hessian`` = ``jacfwd(jacrev)``, ``jacrev(jacrev)``, ``jacrev(jacfwd)``, double
    backward, forward-over-double-backward) is exact.
    """
    if not _SEES_TRANSFORMS:
        return
    forward_levels = sum(1 for interp in _functorch_stack() if interp.key() == _TransformType.Jvp)
    if forward_levels >= 2:
        raise RuntimeError(
            f"{name}: forward-over-forward differentiation (jacfwd of jacfwd, jvp of jvp) through a "
            "custom-derivative activation is not supported by PyTorch (pytorch/pytorch#197867, it "
            "would silently drop the second derivative); use torch.func.hessian / jacfwd(jacrev(...)) "
            "or reverse-over-forward instead"
        )


class _KeepsInput(torch.autograd.Function):
    """A function whose backward and jvp read its input ``x`` (and ``beta`` where it takes one)."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])
        ctx.beta = inputs[1] if len(inputs) > 1 else None


class _HeavisideWithGaussianDerivative(_KeepsInput):
    """``Theta(x)`` (1 for x > 0, else 0) whose AD derivative is ``beta phi(beta x)`` ([NME] eq. 15).

    This is the first AD derivative of the augmented ReLU; differentiating it once more gives the
    Gaussian second derivative. Its own backward/jvp use ordinary differentiable ops, so third
    derivatives are the true derivatives of that Gaussian.
    """

    @staticmethod
    def forward(x: torch.Tensor, beta: float) -> torch.Tensor:
        return (x > 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * augmented_relu_second_derivative(x, ctx.beta), None

    @staticmethod
    def jvp(ctx, x_tangent, beta_tangent):
        _refuse_forward_over_forward("augmented_relu")
        (x,) = ctx.saved_tensors
        return x_tangent * augmented_relu_second_derivative(x, ctx.beta)


class _AugmentedReLUFunction(_KeepsInput):
    """``ReLU(x)`` with first AD derivative ``Theta(x)`` and second AD derivative ``beta phi(beta x)``."""

    @staticmethod
    def forward(x: torch.Tensor, beta: float) -> torch.Tensor:
        return torch.clamp_min(x, 0.0)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * _HeavisideWithGaussianDerivative.apply(x, ctx.beta), None

    @staticmethod
    def jvp(ctx, x_tangent, beta_tangent):
        _refuse_forward_over_forward("augmented_relu")
        (x,) = ctx.saved_tensors
        return x_tangent * _HeavisideWithGaussianDerivative.apply(x, ctx.beta)


class _GeluDerivativeWithZeroDerivative(torch.autograd.Function):
    """``g(x) = Phi(x) + x phi(x)`` (the GELU derivative) whose AD derivative is defined as 0 ([NME] eq. 16)."""

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


class _DiminishedGELUFunction(_KeepsInput):
    """``GELU(x)`` with first AD derivative ``g(x) = Phi(x) + x phi(x)`` and second AD derivative 0."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x)  # bit-identical to nn.GELU()

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * _GeluDerivativeWithZeroDerivative.apply(x)

    @staticmethod
    def jvp(ctx, x_tangent):
        _refuse_forward_over_forward("diminished_gelu")
        (x,) = ctx.saved_tensors
        return x_tangent * _GeluDerivativeWithZeroDerivative.apply(x)


def augmented_relu(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """Augmented ReLU ([NME] 4.4): ``ReLU(x)``; AD derivatives ``Theta(x)`` and ``beta phi(beta x)`` (eq. 15).

    Args:
        x: any tensor.
        beta: the sharpness of the second derivative's bump.

    Returns:
        ``ReLU(x)``, with the altered second derivative under autograd.
    """
    return _AugmentedReLUFunction.apply(x, float(beta))


def diminished_gelu(x: torch.Tensor) -> torch.Tensor:
    """Diminished GELU ([NME] 4.4): ``x Phi(x)``; AD derivatives ``Phi(x) + x phi(x)`` and 0 (eq. 16).

    Args:
        x: any tensor.

    Returns:
        ``x Phi(x)``, with a zero second derivative under autograd.
    """
    return _DiminishedGELUFunction.apply(x)


def beta_gelu(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """beta-GELU ([NME] eq. 13): ``x Phi(beta x)`` with true derivatives of every order.

    Args:
        x: any tensor.
        beta: the inverse temperature (``beta -> inf`` gives ReLU).

    Returns:
        ``x Phi(beta x)`` elementwise.
    """
    return x * gaussian_cdf(beta * x)
