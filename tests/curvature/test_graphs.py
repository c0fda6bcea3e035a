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
