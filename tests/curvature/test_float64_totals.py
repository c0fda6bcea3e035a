"""Inner products and norms of float32 vectors with float64 totals (``krylov.dot64``/``norm64``).

Lanczos's ``alpha``, ``beta`` and every finite check are sums over P entries; a float32
accumulation over 1e8 entries is percent-level wrong (``torch.linalg.vector_norm`` on one
thread). The chunked float32 BLAS products summed in float64 must stay below float32's unit
roundoff against a float64 reference, see NaN/Inf, and not overflow where float64 would not.
"""

from __future__ import annotations

import math

import pytest
import torch

from sharpcli.curvature.krylov import DOT_CHUNK, KrylovBasis, dot64, norm64

UNIT_ROUNDOFF_32 = 2.0**-24


@pytest.mark.parametrize("n", [1000, 3 * DOT_CHUNK + 17, 2_000_003])
def test_dot64_and_norm64_are_below_float32_rounding(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 3 + 1  # a mean: squares and products do not cancel
    y = torch.randn(n, generator=gen) + 0.5
    xd, yd = x.double(), y.double()
    exact_norm = float(torch.linalg.vector_norm(xd))
    assert abs(norm64(x) - exact_norm) <= UNIT_ROUNDOFF_32 * exact_norm
    exact_dot = float(xd @ yd)
    scale = exact_norm * float(torch.linalg.vector_norm(yd))
    assert abs(dot64(x, y) - exact_dot) <= UNIT_ROUNDOFF_32 * scale
    # float64 operands are summed in float64 directly
    assert dot64(xd, yd) == pytest.approx(exact_dot, rel=1e-13)


def test_float32_vector_norm_is_not_good_enough_at_scale():
    """Why the chunks: float32 ``vector_norm`` over 2e7 entries errs far beyond the rounding."""
    x = torch.randn(20_000_000, generator=torch.Generator().manual_seed(0)) + 1
    exact = float(torch.linalg.vector_norm(x.double()))
    torch.set_num_threads(1)
    naive = float(torch.linalg.vector_norm(x))
    assert abs(naive - exact) > 100 * UNIT_ROUNDOFF_32 * exact
    assert abs(norm64(x) - exact) <= UNIT_ROUNDOFF_32 * exact


def test_norm64_sees_non_finite_entries_and_does_not_overflow():
    x = torch.ones(5 * DOT_CHUNK)
    x[3] = float("nan")
    assert math.isnan(norm64(x))
    x[3] = float("inf")
    assert norm64(x) == math.inf
    big = torch.full((4,), 3e20)  # finite float32 entries whose squares overflow float32
    assert norm64(big) == pytest.approx(float(big.double().norm()), rel=1e-12)


def test_krylov_dot_matches_float64_for_rows_in_memory_and_on_disk(tmp_path):
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(3, 50_000, generator=gen)
    w = torch.randn(50_000, generator=gen)
    for scratch in (None, str(tmp_path)):
        basis = KrylovBasis(50_000, torch.float32, "cpu", scratch=scratch)
        for r in rows:
            basis.append(r)
        for i in range(3):
            exact = float(rows[i].double() @ w.double())
            bound = UNIT_ROUNDOFF_32 * float(rows[i].double().norm() * w.double().norm())
            assert abs(basis.dot(i, w) - exact) <= bound
            assert abs(basis.dot(i, w.double()) - exact) <= 1e-12 * abs(exact) + 1e-9
        basis.close()
