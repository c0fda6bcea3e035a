"""The per-batch product check of sharpcli.curvature.graphs: one norm pass, both failures named."""

from __future__ import annotations

import pytest
import torch

from sharpcli.curvature.graphs import check_finite
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
