"""The per-batch product check of sharpcli.curvature.products.graphs: one norm pass, both failures named."""

from __future__ import annotations

import pytest
import torch

from sharpcli.curvature.products.graphs import check_finite
from sharpcli.errors import NumericalError


def test_a_finite_block_passes_even_with_entries_near_the_dtype_limit() -> None:
    block = torch.full((1000, 2), 1e17, dtype=torch.float32)  # sum of squares 1e37: in range
    check_finite(block, "Hessian", "hessian", 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_entry_is_named_with_its_batch(bad: float) -> None:
    block = torch.ones(500, 3)
    block[123, 2] = bad
    with pytest.raises(
        NumericalError, match="hessian product \\(Hessian part\\) is not finite on batch 7"
    ):
        check_finite(block, "Hessian", "hessian", 7)


def test_finite_entries_whose_norm_overflows_the_dtype_are_refused_as_too_large() -> None:
    block = torch.ones(100, 1)
    block[0, 0] = 3e19  # finite in float32, its square is not
    assert torch.isfinite(block).all()
    with pytest.raises(NumericalError, match="on batch 2 is too large for float32"):
        check_finite(block, "Gauss-Newton", "ggn", 2)
    check_finite(block.double(), "Gauss-Newton", "ggn", 2)  # float64 holds it


def test_vjp_through_grad_outputs_equals_the_dot_product_path(monkeypatch) -> None:
    """Large outputs take ``grad_outputs`` (no P-sized dot-product temporaries): the same
    Hessian-vector product, to the last bit in float64, as the dot-product path."""
    from sharpcli.curvature.products import graphs

    torch.manual_seed(0)
    w = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(11, 7, dtype=torch.float64)
    loss = torch.tanh(x @ w + b).pow(3).sum()
    grads = torch.autograd.grad(loss, [w, b], create_graph=True)
    v = [torch.randn_like(w), torch.randn_like(b)]
    by_dot = graphs.vjp(grads, [w, b], v, retain_graph=True)
    monkeypatch.setattr(graphs, "GRAD_OUTPUTS_FROM", 0)
    by_grad_outputs = graphs.vjp(grads, [w, b], v, retain_graph=True)
    for a, c in zip(by_dot, by_grad_outputs):
        torch.testing.assert_close(a, c, rtol=1e-14, atol=1e-14)


def test_grad_with_outputs_is_torchs_grad_bit_for_bit_and_keeps_its_errors() -> None:
    """The engine call without torch's shape check gives torch.autograd.grad's tensors exactly
    (a double backward through a tanh net, against float64 central differences of the
    gradient), and a misshapen vector still gets torch's own error."""
    from sharpcli.curvature.products.graphs import grad_with_outputs

    torch.manual_seed(0)
    w1 = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(7, 4, dtype=torch.float64)

    def gradient(a, b, create_graph):
        loss = (torch.tanh(x @ a.T) @ b.T).pow(2).sum()
        return torch.autograd.grad(loss, [a, b], create_graph=create_graph)

    grads = gradient(w1, w2, True)
    v = [torch.randn_like(w1), torch.randn_like(w2)]
    ours = grad_with_outputs(grads, [w1, w2], v, retain_graph=True)
    theirs = torch.autograd.grad(grads, [w1, w2], grad_outputs=v, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    h = 1e-5  # H v by central differences of the gradient, float64

    def shifted(sign):
        return [(p + sign * h * d).detach().requires_grad_() for p, d in zip((w1, w2), v)]

    plus, minus = gradient(*shifted(1), False), gradient(*shifted(-1), False)
    for got, p, m in zip(ours, plus, minus):
        torch.testing.assert_close(got, (p - m) / (2 * h), rtol=1e-6, atol=1e-8)
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        grad_with_outputs(grads, [w1, w2], [v[0][:, :2], v[1]], retain_graph=True)


def test_a_large_products_vector_jacobian_product_does_not_import_sympy(tmp_path) -> None:
    """torch's grad_outputs shape check imports sympy (about 1 CPU s of a process); the
    products' vector-Jacobian product at the grad_outputs size does not."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from sharpcli.curvature.products.graphs import GRAD_OUTPUTS_FROM, vjp\n"
        "w = torch.randn(GRAD_OUTPUTS_FROM, requires_grad=True)\n"
        "out = w * w\n"
        "(g,) = vjp([out], [w], [torch.ones_like(out)])\n"
        "assert torch.equal(g, 2 * w.detach())\n"
        "print('sympy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
