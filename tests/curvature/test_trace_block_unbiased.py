"""Per-layer (diagonal block) trace estimates are unbiased, seed over seed.

For each estimator, ``SEEDS`` seeded runs on a dense 60 x 60 symmetric matrix with unequal
blocks give per block (and for the total) ``z = (mean - exact) / (std / sqrt(SEEDS))``, which
must satisfy ``|z| <= 3.5``. The matrix has a few dominant eigen-directions spread over all
blocks, so that a Hutch++ sketch ``Q`` is far from block-aligned: ``tr((Pi A P)_bb)``
(``Pi = Q Q^T``, ``P = I - Pi``), the gap a mismatched layer split would leave, is large.
Fixed seeds: the z-scores are deterministic.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sharpcli.curvature import (
    MatrixOperator,
    TraceResult,
    frobenius_sq,
    gn_split_trace,
    hutchinson,
    hutchpp,
)
from sharpcli.curvature.trace import ggn as ggn_module

SEEDS = 300
Z_MAX = 3.5
SIZES = (7, 13, 25, 15)  # unequal layer sizes, 60 in all


def _blocks() -> dict:
    blocks, start = {}, 0
    for i, size in enumerate(SIZES):
        blocks[f"layer{i}"] = slice(start, start + size)
        start += size
    return blocks


def _matrix(spikes, seed: int) -> torch.Tensor:
    """``W + diag(ramp) + U diag(spikes) U^T``: Wigner-like bulk, a ramp so block traces differ,
    and dominant directions ``U`` (random orthonormal, so they mix all blocks)."""
    dim = sum(SIZES)
    gen = torch.Generator().manual_seed(seed)
    B = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    U, _ = torch.linalg.qr(torch.randn(dim, len(spikes), generator=gen, dtype=torch.float64))
    A = (B + B.T) / (2 * math.sqrt(dim)) + torch.diag(torch.linspace(-1, 3, dim).double())
    return A + U @ torch.diag(torch.tensor(spikes, dtype=torch.float64)) @ U.T


def _exact(A: torch.Tensor, blocks: dict) -> dict:
    return {"total": float(A.trace()), **{k: float(A[sl, sl].trace()) for k, sl in blocks.items()}}


def _z_scores(results: list[TraceResult], exact: dict) -> dict:
    """Per block (and total): (mean over seeds - exact) / (std over seeds / sqrt(seeds))."""
    for r in results:  # layer estimates partition the total, run by run
        assert sum(v["estimate"] for v in r.by_layer.values()) == pytest.approx(
            r.estimate, rel=1e-12, abs=1e-9
        )
    values = torch.tensor(
        [[r.estimate] + [r.by_layer[k]["estimate"] for k in list(exact)[1:]] for r in results],
        dtype=torch.float64,
    )
    mean, std = values.mean(0), values.std(0)
    z = (mean - torch.tensor(list(exact.values()))) / (std / math.sqrt(len(results)))
    return {k: round(float(v), 2) for k, v in zip(exact, z)}


def _assert_unbiased(results, exact):
    z = _z_scores(results, exact)
    assert all(abs(v) <= Z_MAX for v in z.values()), f"biased per-block estimates, z = {z}"


A = _matrix(spikes=(40.0, -25.0, 15.0), seed=0)
BLOCKS = _blocks()
EXACT = _exact(A, BLOCKS)


@pytest.mark.parametrize(
    "initial_sketch,max_sketch,max_matvecs",
    [
        (8, 8, 48),  # a fixed 8-column sketch, 40 residual probes
        (4, 512, 100),  # a sketch that doubles: stored probes re-evaluated for each new Q
        (0, 512, 100),  # plain Hutchinson until the probes say a sketch pays (as gn-split)
    ],
)
def test_hutchpp_layer_traces_unbiased(initial_sketch, max_sketch, max_matvecs):
    results = [
        hutchpp(
            MatrixOperator(A),
            tol=1e-9,  # never converges: a fixed budget, no stopping-rule effects
            max_matvecs=max_matvecs,
            seed=seed,
            block_size=8,
            initial_sketch=initial_sketch,
            max_sketch=max_sketch,
            blocks=BLOCKS,
        )
        for seed in range(SEEDS)
    ]
    sizes = {r.sketch_size for r in results}
    assert 0 < min(sizes) and max(sizes) < A.shape[0]  # a sketch, and a residual left to probe
    if initial_sketch != max_sketch:
        assert max(sizes) > max(initial_sketch, 1)  # the sketch grew
    _assert_unbiased(results, EXACT)


def test_hutchinson_layer_traces_unbiased():
    results = [
        hutchinson(MatrixOperator(A), tol=1e-9, max_matvecs=40, seed=s, blocks=BLOCKS)
        for s in range(SEEDS)
    ]
    _assert_unbiased(results, EXACT)


def test_frobenius_sq_layer_values_unbiased():
    # ||(A g)_b||^2 has mean tr((A^2)_bb), the sum of block b's squared rows
    results = [
        frobenius_sq(MatrixOperator(A), tol=1e-9, max_matvecs=40, seed=s, blocks=BLOCKS)
        for s in range(SEEDS)
    ]
    _assert_unbiased(results, _exact(A @ A, BLOCKS))


class _ScopedMatrix(MatrixOperator):
    """A dense matrix with layer blocks of its own (``blocks()``), as the NME operator's."""

    def __init__(self, matrix, blocks):
        super().__init__(matrix)
        self._blocks = dict(blocks)

    def blocks(self):
        return dict(self._blocks)


def test_gn_split_layer_traces_unbiased(monkeypatch):
    # H = G + N with G PSD (exact part, known per block) and N indefinite with dominant
    # block-mixing directions, so Hutch++ sketches N
    gen = torch.Generator().manual_seed(1)
    J = torch.randn(A.shape[0], 20, generator=gen, dtype=torch.float64)
    G = J @ J.T / 20
    N = _matrix(spikes=(30.0, -20.0, 10.0), seed=2)
    H = G + N

    def exact_ggn(model, data, scope):
        by_layer = {
            k: {"estimate": float(G[sl, sl].trace()), "stderr": 0.0} for k, sl in BLOCKS.items()
        }
        return TraceResult(float(G.trace()), 0.0, 0, 1, "exact", by_layer=by_layer)

    monkeypatch.setattr(ggn_module, "exact_ggn_trace", exact_ggn)
    engine = SimpleNamespace(
        model=None,
        data=SimpleNamespace(loss="cross-entropy"),
        scope=None,
        nme=lambda: _ScopedMatrix(N, BLOCKS),
    )
    results = [
        gn_split_trace(engine, tol=1e-9, max_matvecs=100, seed=s, block_size=8)
        for s in range(SEEDS)
    ]
    assert min(r.sketch_size for r in results) > 0  # the sketch (and its layer split) is used
    _assert_unbiased(results, _exact(H, BLOCKS))
