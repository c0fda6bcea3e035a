"""Activations with controlled second derivatives (NME sections 4.3-4.4), checked in float64.

Every custom derivative is checked along both differentiation paths a curvature code uses:
autograd double backward (``torch.autograd.grad(..., create_graph=True)`` then ``grad``) and
``torch.func`` (``grad``/``jacrev``/``jacfwd``/``hessian``/``vmap``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from sharpcli.errors import UsageError
from sharpcli.models import (
    ACTIVATION_NAMES,
    ACTIVATION_TYPES,
    AugmentedReLU,
    BetaGELU,
    DiminishedGELU,
    activation_spec,
    augmented_relu,
    beta_gelu,
    diminished_gelu,
    is_positively_homogeneous,
    make_activation,
    parse_activation_spec,
)

DT = torch.float64
# many points, including the kink, both tails and points within 1/beta of the origin
POINTS = torch.cat(
    [torch.linspace(-6.0, 6.0, 241, dtype=DT), torch.tensor([0.0, 1e-9, -1e-9, 0.3], dtype=DT)]
)
BETAS = [0.5, 1.0, 4.0, 25.0]


def normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gaussian_bump(x: torch.Tensor, beta: float) -> torch.Tensor:
    """NME eq. 15: beta / sqrt(2 pi) exp(-beta^2 x^2 / 2)."""
    return beta / math.sqrt(2.0 * math.pi) * torch.exp(-(beta**2) * x * x / 2.0)


def autograd_derivatives(f, x: torch.Tensor, order: int) -> list[torch.Tensor]:
    """Elementwise derivatives 1..order of an elementwise f by repeated autograd.grad(create_graph=True)."""
    x = x.clone().requires_grad_(True)
    out = f(x)
    derivatives = []
    for _ in range(order):
        (out,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        derivatives.append(out.detach())
    return derivatives


def func_second_derivatives(f, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Elementwise second derivative through every supported torch.func nesting."""
    return {
        "grad(grad)": vmap(grad(grad(f)))(x),
        "hessian (jacfwd o jacrev)": vmap(hessian(f))(x),
        "jacrev(jacrev)": vmap(jacrev(jacrev(f)))(x),
        "jacrev(jacfwd)": vmap(jacrev(jacfwd(f)))(x),
        "jacfwd(grad)": vmap(jacfwd(grad(f)))(x),
    }


# ------------------------------------------------------------------------------------------
# augmented ReLU (NME eq. 15)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", BETAS)
def test_augmented_relu_value_and_first_derivative_are_relu_exactly(beta):
    x = POINTS
    assert torch.equal(augmented_relu(x, beta), torch.relu(x))
    (first,) = autograd_derivatives(lambda t: augmented_relu(t, beta), x, 1)
    assert torch.equal(first, (x > 0).to(DT))  # Heaviside, 0 at the origin like torch.relu
    f = lambda t: augmented_relu(t, beta)
    assert torch.equal(vmap(grad(f))(x), (x > 0).to(DT))
    _, tangent = jvp(f, (x,), (torch.ones_like(x),))
    assert torch.equal(tangent, (x > 0).to(DT))
    _, pullback = vjp(f, x)
    assert torch.equal(pullback(torch.ones_like(x))[0], (x > 0).to(DT))


@pytest.mark.parametrize("beta", BETAS)
def test_augmented_relu_second_derivative_is_the_gaussian_by_double_backward(beta):
    first, second, third = autograd_derivatives(lambda t: augmented_relu(t, beta), POINTS, 3)
    torch.testing.assert_close(second, gaussian_bump(POINTS, beta), rtol=0, atol=1e-12)
    # third AD derivative: the true derivative of the Gaussian, -beta^2 x * bump
    torch.testing.assert_close(
        third, -(beta**2) * POINTS * gaussian_bump(POINTS, beta), rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("beta", BETAS)
def test_augmented_relu_second_derivative_is_the_gaussian_under_torch_func(beta):
    expected = gaussian_bump(POINTS, beta)
    for path, value in func_second_derivatives(lambda t: augmented_relu(t, beta), POINTS).items():
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-12, msg=path)


@pytest.mark.parametrize(
    "f, expected",
    [
        (lambda t: augmented_relu(t, 3.0), lambda x: gaussian_bump(x, 3.0)),
        (diminished_gelu, torch.zeros_like),
    ],
    ids=["augmented", "diminished"],
)
def test_plain_forward_ad_over_double_backward(f, expected):
    """torch.autograd.forward_ad tangent of an autograd gradient (a forward-over-reverse HVP)."""
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(POINTS.clone().requires_grad_(True), torch.ones_like(POINTS))
        (gradient,) = torch.autograd.grad(f(dual).sum(), dual, create_graph=True)
        second = fwAD.unpack_dual(gradient).tangent.detach()
    torch.testing.assert_close(second, expected(POINTS), rtol=0, atol=1e-12)


def test_augmented_relu_second_derivative_has_unit_mass():
    """The Gaussian approximates the Dirac delta of the ReLU kink: its integral is 1 (NME 4.4)."""
    beta = 4.0
    x = torch.linspace(-3.0, 3.0, 20001, dtype=DT)
    (_, second) = autograd_derivatives(lambda t: augmented_relu(t, beta), x, 2)
    assert abs(torch.trapezoid(second, x).item() - 1.0) < 1e-9


@pytest.mark.parametrize(
    "f", [lambda t: augmented_relu(t, 2.0), diminished_gelu], ids=["augmented", "diminished"]
)
def test_forward_over_forward_is_refused_not_silently_wrong(f):
    """PyTorch drops a custom jvp rule's derivative under nested jacfwd (pytorch#197867)."""
    with pytest.raises(RuntimeError, match="forward-over-forward"):
        vmap(jacfwd(jacfwd(f)))(POINTS[:5])


def test_vmap_of_forward_and_module_preserves_dtype():
    module = AugmentedReLU(3.0)
    x32 = torch.randn(4, 5)
    assert module(x32).dtype == torch.float32
    batched = torch.randn(3, 4, 5, dtype=DT)
    assert torch.equal(vmap(module)(batched), torch.relu(batched))
    assert torch.equal(vmap(DiminishedGELU())(batched), F.gelu(batched))


# ------------------------------------------------------------------------------------------
# diminished GELU (NME eq. 16)
# ------------------------------------------------------------------------------------------


def test_diminished_gelu_value_and_first_derivative_equal_gelu():
    x = POINTS
    assert torch.equal(diminished_gelu(x), F.gelu(x))
    (first,) = autograd_derivatives(diminished_gelu, x, 1)
    (gelu_first,) = autograd_derivatives(F.gelu, x, 1)
    torch.testing.assert_close(first, gelu_first, rtol=0, atol=1e-15)
    torch.testing.assert_close(first, normal_cdf(x) + x * normal_pdf(x), rtol=0, atol=1e-15)
    torch.testing.assert_close(vmap(grad(diminished_gelu))(x), gelu_first, rtol=0, atol=1e-15)
    _, tangent = jvp(diminished_gelu, (x,), (torch.ones_like(x),))
    torch.testing.assert_close(tangent, gelu_first, rtol=0, atol=1e-15)


def test_diminished_gelu_second_derivative_is_zero_both_ways():
    (_, second) = autograd_derivatives(diminished_gelu, POINTS, 2)
    assert torch.equal(second, torch.zeros_like(POINTS))
    for path, value in func_second_derivatives(diminished_gelu, POINTS).items():
        assert torch.equal(value, torch.zeros_like(POINTS)), path
    # plain GELU's second derivative is not zero: phi(x)(2 - x^2)
    (_, gelu_second) = autograd_derivatives(F.gelu, POINTS, 2)
    torch.testing.assert_close(
        gelu_second, normal_pdf(POINTS) * (2 - POINTS**2), rtol=0, atol=1e-12
    )


# ------------------------------------------------------------------------------------------
# beta-GELU (NME eqs. 13-14) and plain ReLU/GELU
# ------------------------------------------------------------------------------------------


def test_beta_gelu_with_beta_one_is_gelu():
    torch.testing.assert_close(BetaGELU(1.0)(POINTS), F.gelu(POINTS), rtol=0, atol=1e-15)
    torch.testing.assert_close(
        make_activation("beta-gelu")(POINTS), F.gelu(POINTS), rtol=0, atol=1e-15
    )


@pytest.mark.parametrize("beta", BETAS)
def test_beta_gelu_derivatives_match_closed_form(beta):
    x = POINTS
    bx = beta * x
    first_closed = normal_cdf(bx) + bx * normal_pdf(bx)
    second_closed = beta * normal_pdf(bx) * (2.0 - bx * bx)  # eq. 14 with prefactor beta
    torch.testing.assert_close(beta_gelu(x, beta), x * normal_cdf(bx), rtol=0, atol=1e-15)
    first, second = autograd_derivatives(lambda t: beta_gelu(t, beta), x, 2)
    torch.testing.assert_close(first, first_closed, rtol=0, atol=1e-12)
    torch.testing.assert_close(second, second_closed, rtol=0, atol=1e-10 * beta)
    for path, value in func_second_derivatives(lambda t: beta_gelu(t, beta), x).items():
        torch.testing.assert_close(value, second_closed, rtol=0, atol=1e-10 * beta, msg=path)
    # the closed forms themselves, by central differences of the value and of the first derivative
    h = 1e-5 / beta
    fd_first = (beta_gelu(x + h, beta) - beta_gelu(x - h, beta)) / (2 * h)
    torch.testing.assert_close(fd_first, first_closed, rtol=0, atol=1e-8)
    fd_second = (
        (normal_cdf(beta * (x + h)) + beta * (x + h) * normal_pdf(beta * (x + h)))
        - (normal_cdf(beta * (x - h)) + beta * (x - h) * normal_pdf(beta * (x - h)))
    ) / (2 * h)
    torch.testing.assert_close(fd_second, second_closed, rtol=0, atol=1e-7 * beta)


def test_beta_gelu_second_derivative_integrates_to_one_and_peaks_at_two_beta_phi0():
    """The paper's remark below eq. 14: unit integral for every beta; at 0 the value is 2 beta phi(0)."""
    for beta in (1.0, 8.0):
        x = torch.linspace(-40.0 / beta, 40.0 / beta, 40001, dtype=DT)
        (_, second) = autograd_derivatives(lambda t: beta_gelu(t, beta), x, 2)
        assert abs(torch.trapezoid(second, x).item() - 1.0) < 1e-8
        (_, at_zero) = autograd_derivatives(
            lambda t: beta_gelu(t, beta), torch.zeros(1, dtype=DT), 2
        )
        assert at_zero.item() == pytest.approx(2 * beta / math.sqrt(2 * math.pi), rel=1e-14)


def test_relu_second_derivative_is_zero_under_autograd_and_torch_func():
    """NME 4.3: in practice ReLU's second derivative is 0 everywhere (the origin included)."""
    relu = make_activation("relu")
    (_, second) = autograd_derivatives(relu, POINTS, 2)
    assert torch.equal(second, torch.zeros_like(POINTS))
    for path, value in func_second_derivatives(relu, POINTS).items():
        assert torch.equal(value, torch.zeros_like(POINTS)), path


# ------------------------------------------------------------------------------------------
# Hessians of a tiny MLP through every activation
# ------------------------------------------------------------------------------------------

# elementwise second AD derivative phi'' of each activation spec
SECOND_DERIVATIVE = {
    "relu": lambda a: torch.zeros_like(a),
    "gelu": lambda a: normal_pdf(a) * (2 - a * a),
    "beta-gelu:beta=3": lambda a: 3.0 * normal_pdf(3.0 * a) * (2 - 9.0 * a * a),
    "augmented-relu:beta=3": lambda a: gaussian_bump(a, 3.0),
    "diminished-gelu": lambda a: torch.zeros_like(a),
}


def tiny_mlp(spec: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), make_activation(spec), nn.Linear(4, 2)).to(DT)


@pytest.mark.parametrize("spec", list(SECOND_DERIVATIVE))
def test_parameter_hessian_of_tiny_mlp_matches_double_backward_and_closed_form(spec):
    model = tiny_mlp(spec)
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.manual_seed(1)
    x = torch.randn(5, 3, dtype=DT)
    y = torch.tensor([0, 1, 1, 0, 1])

    def unflatten(flat):
        return {n: c.reshape(s) for n, c, s in zip(names, flat.split(sizes), shapes)}

    def loss(flat):
        return F.cross_entropy(functional_call(model, unflatten(flat), (x,)), y)

    hess_func = hessian(loss)(flat0)
    P = flat0.numel()
    assert hess_func.shape == (P, P) and torch.isfinite(hess_func).all()
    torch.testing.assert_close(hess_func, hess_func.T, rtol=0, atol=1e-14)

    # the same Hessian by autograd double backward, row by row
    flat = flat0.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss(flat), flat, create_graph=True)
    hess_autograd = torch.stack(
        [torch.autograd.grad(g[i], flat, retain_graph=True)[0] for i in range(P)]
    )
    torch.testing.assert_close(hess_func, hess_autograd, rtol=0, atol=1e-13)

    # first-layer weight block of the Hessian of the logit z_c:
    # d^2 z_c / dW1[j,k] dW1[j',k'] = delta_jj' W2[c,j] phi''(a_j) x_k x_k' (NME eq. 11, one example)
    sample, c = x[:1], 1
    a = model[0](sample)[0].detach()
    w2 = model[2].weight.detach()

    def logit(flat):
        return functional_call(model, unflatten(flat), (sample,))[0, c]

    block = hessian(logit)(flat0)[:12, :12].reshape(4, 3, 4, 3)
    phi2 = SECOND_DERIVATIVE[spec](a)
    xs = sample[0]
    expected = torch.einsum("jJ,j,k,K->jkJK", torch.eye(4, dtype=DT), w2[c] * phi2, xs, xs)
    torch.testing.assert_close(block, expected, rtol=0, atol=1e-12)
    if spec in ("relu", "diminished-gelu"):
        assert torch.equal(block, torch.zeros_like(block))  # the NME diagonal block vanishes


# ------------------------------------------------------------------------------------------
# make_activation, specs, classification
# ------------------------------------------------------------------------------------------


def test_make_activation_canonical_specs_round_trip():
    cases = {
        "relu": "relu",
        "GELU": "gelu",
        "beta-gelu": "beta-gelu:beta=1.0",
        "beta_gelu:beta=4": "beta-gelu:beta=4.0",
        "augmented-relu:beta=4": "augmented-relu:beta=4.0",
        "Augmented-ReLU": "augmented-relu:beta=1.0",
        " diminished-gelu ": "diminished-gelu",
        "beta-gelu:beta=0.25": "beta-gelu:beta=0.25",
        "TANH": "tanh",
    }
    for text, canonical in cases.items():
        module = make_activation(text)
        assert module.spec == canonical
        again = make_activation(module.spec)
        assert type(again) is type(module) and again.spec == canonical
        assert activation_spec(module) == canonical
    assert make_activation("augmented-relu:beta=4").beta == 4.0
    assert parse_activation_spec("beta-gelu:beta=2.5") == ("beta-gelu", {"beta": 2.5})
    assert set(ACTIVATION_NAMES) == {
        "relu",
        "gelu",
        "beta-gelu",
        "augmented-relu",
        "diminished-gelu",
        "tanh",
    }
    assert activation_spec(nn.Tanh()) == "tanh"  # torch's own tanh is the same function
    assert activation_spec(nn.ReLU()) == "relu" and activation_spec(nn.GELU()) == "gelu"
    assert activation_spec(nn.GELU(approximate="tanh")) is None  # another function


def test_make_activation_returns_fresh_instances_of_activation_types():
    for name in ACTIVATION_NAMES:
        first, second = make_activation(name), make_activation(name)
        assert first is not second
        assert isinstance(first, ACTIVATION_TYPES)
        assert not list(first.parameters())


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("swish", "unknown activation 'swish'"),
        ("", "non-empty"),
        ("relu:beta=2", "relu: unknown parameter 'beta'; accepted: (none)"),
        ("beta-gelu:gamma=2", "beta-gelu: unknown parameter 'gamma'; accepted: beta"),
        ("beta-gelu:beta=abc", "beta must be a number"),
        ("beta-gelu:beta=1,beta=2", "beta given twice"),
        ("beta-gelu:beta=-1", "> 0"),
        ("augmented-relu:beta=0", "> 0"),
        ("augmented-relu:beta=inf", "finite"),
        ("augmented-relu:beta", "expected key=value"),
    ],
)
def test_bad_activation_specs_raise_usage_error(spec, fragment):
    with pytest.raises(UsageError) as info:
        make_activation(spec)
    assert info.value.source == "activation"
    assert fragment in info.value.message
    if "unknown activation" in fragment:
        for name in ACTIVATION_NAMES:
            assert name in info.value.message


def test_positive_homogeneity_flags_match_the_forward_maps():
    x = torch.randn(200, dtype=DT)
    modules = [make_activation(name) for name in ACTIVATION_NAMES] + [
        nn.ReLU(),
        nn.LeakyReLU(0.1),
        nn.ReLU6(),
        nn.Tanh(),
    ]
    for module in modules:
        homogeneous = all(
            torch.allclose(module(a * x), a * module(x), rtol=1e-14, atol=0)
            for a in (0.3, 2.0, 7.0)
        )
        assert is_positively_homogeneous(module) == homogeneous, module
    assert is_positively_homogeneous(make_activation("relu"))
    assert is_positively_homogeneous(make_activation("augmented-relu:beta=2"))
    for name in ("gelu", "beta-gelu:beta=5", "diminished-gelu"):
        assert not is_positively_homogeneous(make_activation(name))
