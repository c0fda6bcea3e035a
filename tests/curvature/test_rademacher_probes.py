"""The Rademacher probes drawn from random bits, and the chunked per-layer sums of ``v * Av``."""

from __future__ import annotations

import pytest
import torch

from sharpcli.curvature import MatrixOperator
from sharpcli.curvature.products.scope import (
    RademacherColumns,
    rademacher_bits,
    rademacher_bits_bytes,
    rademacher_like,
    rademacher_signs,
)
from sharpcli.curvature.products.totals import chunked_dots
from sharpcli.curvature.trace import probes as probes_module
from sharpcli.curvature.trace.hutchinson import frobenius_sq, hutchinson
from sharpcli.curvature.trace.probes import product_segment_sums, segment_sums


def _signs_bit_by_bit(seed: int, dim: int, count: int) -> torch.Tensor:
    """``count`` probes of length ``dim`` from the generator's full-range int64 words, read
    one bit at a time: entry ``i`` of a probe is ``1 - 2 * bit (i mod 64)`` of its word
    ``i // 64`` (an independent reading of the draw)."""
    words = -(-dim // 64)
    drawn = torch.empty(count, words, dtype=torch.int64)
    drawn.random_(-(1 << 63), None, generator=torch.Generator().manual_seed(seed))
    out = torch.empty(dim, count, dtype=torch.float64)
    for j in range(count):
        for i in range(dim):
            word = int(drawn[j, i // 64])
            out[i, j] = 1 - 2 * ((word >> (i % 64)) & 1)
    return out


@pytest.mark.parametrize("dim", [1, 7, 64, 93, 200])
def test_probes_are_the_generator_bits(dim):
    """Every entry is 1 - 2 b for its own bit b of the drawn words, in every dtype."""
    expected = _signs_bit_by_bit(5, dim, 3)
    for dtype in (torch.float64, torch.float32, torch.int8):
        got = rademacher_like(dim, torch.Generator().manual_seed(5), dtype, "cpu", 3)
        assert got.dtype == dtype and got.shape == (dim, 3)
        assert torch.equal(got.double(), expected)
    one = rademacher_like(dim, torch.Generator().manual_seed(5), torch.float64, "cpu")
    assert one.shape == (dim,) and torch.equal(one, expected[:, 0])


def test_probes_are_the_same_whatever_the_block_size():
    """The m-th probe of a seed is the same drawn alone or in blocks of any size."""
    dim, seed = 1000, 11
    whole = rademacher_like(dim, torch.Generator().manual_seed(seed), torch.float32, "cpu", 12)
    for block in (1, 5, 12):
        generator = torch.Generator().manual_seed(seed)
        parts, drawn = [], 0
        while drawn < 12:
            k = min(block, 12 - drawn)
            parts.append(rademacher_like(dim, generator, torch.float32, "cpu", k))
            drawn += k
        assert torch.equal(torch.cat(parts, 1), whole)
    # the columns are contiguous: a product reads each probe without a gather
    assert whole[:, 3].is_contiguous()


def test_signs_are_fair_and_independent():
    """Over 2000 probes of 64 entries each entry's mean is 0 within 4.5 standard errors and
    the correlation of any two entries is 0 within 4.5 (the 64 bits of one word included)."""
    n, dim = 2000, 64
    signs = rademacher_like(dim, torch.Generator().manual_seed(0), torch.float64, "cpu", n)
    assert set(signs.unique().tolist()) == {-1.0, 1.0}
    se = 1 / n**0.5
    assert signs.mean(1).abs().max() <= 4.5 * se
    corr = signs @ signs.T / n
    off = corr - torch.diag(torch.diag(corr))
    assert torch.allclose(torch.diag(corr), torch.ones(dim, dtype=torch.float64))
    assert off.abs().max() <= 4.5 * se


def test_bits_hold_one_byte_per_eight_entries():
    bits = rademacher_bits(130, torch.Generator().manual_seed(0), 3)
    assert bits.dtype == torch.uint8 and bits.shape == (3, 24)
    assert bits.numel() == rademacher_bits_bytes(130, 3)
    out = torch.empty(130, dtype=torch.float32)
    assert rademacher_signs(bits[1], out) is out
    assert torch.equal(
        out, rademacher_like(130, torch.Generator().manual_seed(0), torch.float32, "cpu", 3)[:, 1]
    )


def test_chunked_dots_against_a_float64_reference(monkeypatch):
    """float32 dot products of 2^15 entries summed in float64: within 1e-7 of sum |a_i b_i|
    (under two float32 roundings of it) of the float64 sum at 3M entries, for signed (trace)
    and squared (Tr(A^2)) sums; the signed sums of a probe, within 1e-9."""
    gen = torch.Generator().manual_seed(1)
    dim = 3_000_000
    a = torch.randn(dim, generator=gen) + 0.3
    signs = rademacher_like(dim, gen, torch.float32, "cpu")
    blocks = {
        "a": slice(0, 1_234_567),
        "b": slice(1_234_567, 2_000_000),
        "c": slice(2_000_000, dim),
    }
    for left, rel in ((signs, 1e-9), (a, 1e-7)):
        got = product_segment_sums(left[:, None], a[:, None], blocks)[:, 0]
        exact = segment_sums((left.double() * a.double())[:, None], blocks)[:, 0]
        scale = segment_sums((left.double() * a.double()).abs()[:, None], blocks)[:, 0]
        assert got.dtype == torch.float64
        assert ((got - exact).abs() <= rel * scale).all(), (got - exact) / scale


def test_segment_sums_over_any_blocks():
    """Blocks that overlap, leave gaps, are empty or end past P, and chunks that cross no
    block bound: the sums equal the float64 reference (small integers: exact)."""
    gen = torch.Generator().manual_seed(2)
    dim = 1000
    a = torch.randint(-3, 4, (dim, 3), generator=gen).float()
    b = torch.randint(-3, 4, (dim, 3), generator=gen).float()
    blocks = {
        "x": slice(0, 300),
        "y": slice(250, 700),  # overlaps x
        "z": slice(900, 2000),  # a gap before it, and past P
        "e": slice(500, 500),  # empty
    }
    expected = segment_sums(a.double() * b.double(), blocks)
    for chunk in (7, 64, 4096):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(probes_module, "SUM_CHUNK", chunk)
            assert torch.equal(product_segment_sums(a, b, blocks), expected)
    # column-major and strided columns read alike
    assert torch.equal(product_segment_sums(a.T.contiguous().T, b, blocks), expected)
    bounds = [(0, 3), (3, 10)]
    assert torch.equal(
        chunked_dots(a[:, 0], b[:, 0], bounds),
        torch.stack([(a[s:e, 0] * b[s:e, 0]).sum() for s, e in bounds]).double(),
    )


def test_hutchinson_is_the_same_whatever_the_block_size():
    """The seeded estimate and its per-layer parts do not depend on the block size: the
    probes do not (and a symmetric matrix's per-probe rows are exact sums)."""
    gen = torch.Generator().manual_seed(3)
    M = torch.randn(40, 40, generator=gen, dtype=torch.float64)
    op = MatrixOperator(M + M.T)
    blocks = {"a": slice(0, 15), "b": slice(15, 40)}
    results = [
        hutchinson(op, tol=1e-9, max_matvecs=24, seed=4, block_size=b, blocks=blocks)
        for b in (1, 5, 8)
    ]
    for result in results[1:]:
        assert result.estimate == pytest.approx(results[0].estimate, rel=1e-12)
        for layer, value in result.by_layer.items():
            assert value == pytest.approx(results[0].by_layer[layer], rel=1e-12)
    # and the layers' parts sum to the total, probe by probe (so in the mean)
    total = sum(v["estimate"] for v in results[0].by_layer.values())
    assert total == pytest.approx(results[0].estimate, rel=1e-12)
    square = frobenius_sq(op, tol=1e-9, max_matvecs=400, seed=4, blocks=blocks)
    exact = float(((M + M.T) ** 2).sum())
    assert abs(square.estimate - exact) <= 4 * square.stderr


def test_half_precision_sums_accumulate_in_float64():
    """bfloat16 columns: each chunk's dot product is taken in float64, so the sums match the
    float64 sums of the same (bfloat16) values to 1e-6 of their magnitude whatever BLAS kernel
    runs (a float32 dot drifted to 3e-6 with OpenBLAS's Haswell kernel)."""
    gen = torch.Generator().manual_seed(4)
    a = (torch.randn(100_000, 1, generator=gen) + 1).to(torch.bfloat16)
    signs = rademacher_like(100_000, gen, torch.bfloat16, "cpu", 1)
    blocks = {"a": slice(0, 40_000), "b": slice(40_000, 100_000)}
    for left in (signs, a):
        got = product_segment_sums(left, a, blocks)
        exact = segment_sums(left.double() * a.double(), blocks)
        scale = segment_sums((left.double() * a.double()).abs(), blocks)
        assert ((got - exact).abs() <= 1e-6 * scale).all(), (got - exact) / scale


@pytest.mark.parametrize("block, columns", [(8, 8), (8, 3), (5, 2), (1, 1)])
def test_probe_columns_hand_out_the_seeds_probes(block, columns):
    """Blocks of ``block`` probes, ``columns`` a product, from one reused buffer: the same
    probes as one draw, each block contiguous by column, never wider than ``columns``."""
    dim, count, seed = 77, 13, 9
    expected = rademacher_like(
        dim, torch.Generator().manual_seed(seed), torch.float64, "cpu", count
    )
    probes = RademacherColumns(
        dim, torch.Generator().manual_seed(seed), torch.float64, "cpu", columns
    )
    got, drawn = [], 0
    while drawn < count:
        k = min(block, count - drawn)
        for G in probes.blocks(k):
            assert G.shape[0] == dim and G.shape[1] <= columns and G[:, 0].is_contiguous()
            got.append(G.clone())  # the buffer is refilled by the next block
        drawn += k
    assert torch.equal(torch.cat(got, 1), expected)
