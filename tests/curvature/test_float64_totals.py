"""Inner products and norms of float32 vectors to float64 accuracy (``sharpcli.curvature.products.totals``).

Lanczos's ``alpha``, ``beta`` and every finite check are sums over P entries; a float32
accumulation over 1e8 entries is percent-level wrong (``torch.linalg.vector_norm`` on one
thread), and float32 dot products of 32K entries are 2e-6 off on equal entries. The chunks
widened in cache must agree with a whole float64 computation to float64 rounding, see NaN/Inf,
and not overflow where float64 would not.
"""

from __future__ import annotations

import math

import pytest
import torch

from sharpcli.curvature.eigen.krylov import KrylovBasis
from sharpcli.curvature.products.totals import DOT_CHUNK, dot64, norm64

UNIT_ROUNDOFF_32 = 2.0**-24


@pytest.mark.parametrize("n", [1000, 3 * DOT_CHUNK + 17, 2_000_003])
def test_dot64_and_norm64_have_float64_accuracy(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 3 + 1  # a mean: squares and products do not cancel
    y = torch.randn(n, generator=gen) + 0.5
    xd, yd = x.double(), y.double()
    # exactly rounded references (products of float32 numbers are exact in float64)
    exact_norm = math.fsum((xd * xd).tolist()) ** 0.5
    assert norm64(x) == pytest.approx(exact_norm, rel=1e-13)
    exact_dot = math.fsum((xd * yd).tolist())
    scale = exact_norm * float(torch.linalg.vector_norm(yd))
    assert abs(dot64(x, y) - exact_dot) <= 1e-13 * scale
    # float64 operands are summed in float64 directly
    assert dot64(xd, yd) == pytest.approx(exact_dot, rel=1e-13)


def test_equal_entries_where_float32_chunks_fail():
    """Equal entries round every partial sum the same way: float32 BLAS chunks of 32K entries
    are 2e-6 off; the widened chunks are exact to float64 rounding."""
    ones, tenth = torch.ones(100_000), torch.full((100_000,), 0.1)
    exact = float(ones.double() @ tenth.double())
    float32_chunks = sum(
        float(torch.dot(ones[a : a + DOT_CHUNK], tenth[a : a + DOT_CHUNK]))
        for a in range(0, 100_000, DOT_CHUNK)
    )
    assert abs(float32_chunks - exact) > 10 * UNIT_ROUNDOFF_32 * exact
    assert dot64(ones, tenth) == pytest.approx(exact, rel=1e-14)
    probe = torch.full((1_000_001,), 1.0 / 1_000_001**0.5)  # a normalised Rademacher probe
    entry = float(probe[0])  # its square is exact in float64; times n, one rounding
    assert norm64(probe) == pytest.approx((probe.numel() * entry * entry) ** 0.5, rel=1e-14)


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
            bound = 1e-13 * float(rows[i].double().norm() * w.double().norm())
            assert abs(basis.dot(i, w) - exact) <= bound
            assert abs(basis.dot(i, w.double()) - exact) <= 1e-12 * abs(exact) + 1e-9
        basis.close()


def test_dots_and_subtract_rows_match_float64():
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(3, 3 * DOT_CHUNK + 5, generator=gen)
    w = torch.randn(rows.shape[1], generator=gen)
    basis = KrylovBasis(rows.shape[1], torch.float32, "cpu")
    for r in rows:
        basis.append(r)
    products, squares = basis.dots([2, 0], w)
    wd, rd = w.double(), rows.double()
    assert products == pytest.approx([float(rd[2] @ wd), float(rd[0] @ wd)], rel=1e-12)
    assert squares == pytest.approx(float(wd @ wd), rel=1e-13)
    expected = w - 0.5 * rows[2] - 0.25 * rows[0]  # float32, in the same order
    norm = basis.subtract_rows(w, [(2, 0.5), (0, 0.25)])
    assert torch.equal(w, expected)
    assert norm == pytest.approx(float(expected.double().norm()), rel=1e-13)
