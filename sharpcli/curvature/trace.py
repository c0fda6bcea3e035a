"""Trace estimators with standard errors and per-layer (diagonal block) traces (``sharp trace``).

- :func:`hutchinson`: ``tr(A) = E[g^T A g]`` for Rademacher ``g`` [Hutchinson1989]; per layer
  ``tr(A_bb) = E[g_b^T (A g)_b]`` from the same probes, so layer traces sum to the total
  probe by probe.
- :func:`hutchpp`: [Hutch++] (Meyer, Musco, Musco, Woodruff 2021) with an adaptive sketch:
  ``tr(A) = tr(Q^T A Q) + tr(P A P)``, ``P = I - Q Q^T``, the first term exact from the
  sketch, the second by Hutchinson with its sample standard error; per layer
  ``tr(A_bb) = tr((Pi A + A Pi - Pi A Pi)_bb) + E[g_b^T (P A P g)_b]``, ``Pi = Q Q^T``.
- :func:`frobenius_sq`: ``Tr(A^2) = ||A||_F^2 = E||A g||^2`` (the flatness of [FA] eq. 1);
  per layer ``E||(A g)_b||^2 = Tr((A^2)_bb)``.
- :func:`exact_ggn_trace`: ``tr(G)`` exactly, C backward passes per batch (vmapped per-sample
  Jacobians), cross-entropy and mse.
- :func:`sampled_label_ggn_trace`: [NME] eq. 20, ``tr(G) = E_{y^ ~ Cat(softmax z)} ||grad l(y^)||^2``
  with per-sample gradients.

Standard errors are sample standard deviations over probes divided by sqrt(#probes);
stopping at relative standard error ``tol`` or at ``max_matvecs``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from sharpcli import memory, progress
from sharpcli.curvature.data import AnalysisData, all_reduce_sum, to_model_batch
from sharpcli.curvature.differentiable import twice_differentiable
from sharpcli.curvature.operators import CurvatureOperator
from sharpcli.curvature.scope import ParamScope, rademacher_like
from sharpcli.errors import NumericalError, UsageError
from sharpcli.losses import get_loss

__all__ = [
    "TraceResult",
    "exact_ggn_trace",
    "frobenius_sq",
    "gn_split_trace",
    "hutchinson",
    "hutchpp",
    "sampled_label_ggn_trace",
]

_CHUNK_BYTES = 64 << 20  # memory for one chunk of per-sample Jacobians / gradients


@dataclass
class TraceResult:
    """A trace (or ``Tr(A^2)``) estimate with standard error and per-layer breakdown.

    ``by_layer`` maps a layer (module) name to ``{"estimate", "stderr"}``; layer estimates
    sum to ``estimate``. ``stderr`` is ``None`` when the engine gives none.
    """

    estimate: float
    stderr: float | None
    matvecs: int
    samples: int
    estimator: str
    quantity: str = "trace"
    converged: bool = True
    tol: float | None = None
    by_layer: dict = field(default_factory=dict)
    engine: str = "native"
    sketch_size: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def relative_stderr(self) -> float | None:
        """``|stderr / estimate|``, or None without a stderr or for a zero estimate."""
        if self.stderr is None or self.estimate == 0:
            return None
        return abs(self.stderr / self.estimate)

    def to_dict(self) -> dict:
        """The result as a JSON-serialisable dict."""
        return {
            "estimate": self.estimate,
            "stderr": self.stderr,
            "matvecs": self.matvecs,
            "samples": self.samples,
            "estimator": self.estimator,
            "quantity": self.quantity,
            "converged": self.converged,
            "tol": self.tol,
            "by_layer": {k: dict(v) for k, v in self.by_layer.items()},
            "engine": self.engine,
            "sketch_size": self.sketch_size,
            "notes": list(self.notes),
        }


def _blocks_of(op, blocks) -> dict:
    """``blocks`` as a dict, else the operator's own per-layer blocks (none for other objects)."""
    if blocks is not None:
        return dict(blocks)
    return op.blocks() if isinstance(op, CurvatureOperator) else {}


def _segment_sums(values: torch.Tensor, blocks: dict) -> torch.Tensor:
    """``values`` (P, k) -> (1 + L, k): total, then the sum over each layer's slice, in float64."""
    values = values.to(torch.float64)
    rows = [values.sum(0)] + [values[sl].sum(0) for sl in blocks.values()]
    return torch.stack(rows)


def _mean_stderr(samples: torch.Tensor):
    """Column-wise mean and standard error of the mean over rows (n, m)."""
    n = samples.shape[0]
    mean = samples.mean(0)
    if n < 2:
        return mean, torch.full_like(mean, float("inf"))
    return mean, samples.std(0, unbiased=True) / math.sqrt(n)


def _check_budget(tol, max_matvecs, block_size):
    if not tol > 0:
        raise UsageError(f"tolerance must be > 0, got {tol}", source="tol")
    if int(max_matvecs) < 2:
        raise UsageError(f"max matvecs must be >= 2, got {max_matvecs}", source="max_matvecs")
    if int(block_size) < 1:
        raise ValueError("block_size must be >= 1")


def probe_block(op, block_size: int, *, vectors: int, what: str) -> tuple[int, int]:
    """``(columns, bytes)``: the probe block the run's memory plan allows, at most
    ``block_size`` columns, each holding ``vectors`` P-vectors in the operator's dtype (probe,
    product, their elementwise product) and one float64 P-vector (the per-layer sums);
    UsageError on ``max_memory`` when not even one column fits.

    Args:
        op: the operator (``shape``, ``dtype``).
        block_size: the columns wanted.
        vectors: P-vectors in the operator's dtype per column.
        what: names the estimator in the plan's notes and errors.

    Returns:
        ``(columns, bytes)`` of the block.
    """
    dim = op.shape[0]
    itemsize = torch.empty((), dtype=op.dtype).element_size()
    per_column = dim * (itemsize * int(vectors) + 8)
    plan = memory.current()
    fit = plan.count_that_fit(per_column)
    if fit < 1:
        plan.require(
            f"{what}: one probe and its product", per_column, "lower `batch_size` or `cache_mb`"
        )
    columns = min(int(block_size), fit)
    if columns < int(block_size):
        plan.note(f"{what}: blocks of {columns} probes (not {block_size}) to fit the memory budget")
    return columns, columns * per_column


def _layer_dict(names, mean, stderr, offset=None):
    out = {}
    for i, name in enumerate(names):
        est = float(mean[i + 1]) + (float(offset[i + 1]) if offset is not None else 0.0)
        out[name] = {"estimate": est, "stderr": float(stderr[i + 1])}
    return out


def _probe_loop(op, quantity, *, tol, max_matvecs, seed, block_size, min_samples, blocks):
    """Shared Hutchinson-type loop: per probe a (1+L) vector of (total, per-layer) values."""
    _check_budget(tol, max_matvecs, block_size)
    dim = op.shape[0]
    generator = torch.Generator().manual_seed(int(seed))
    rows = []
    matvecs = 0
    converged = False
    name = "tr" if quantity == "trace" else "Tr(A^2)"
    columns, held = probe_block(op, block_size, vectors=3, what="Hutchinson")
    with (
        memory.current().hold("probe block", held + dim * int(block_size)),
        progress.start("hutchinson", total=max_matvecs, quantity=name) as run,
    ):
        while matvecs < int(max_matvecs):
            k = min(int(block_size), int(max_matvecs) - matvecs)
            # the probes of a block are drawn together whatever the memory budget, so the
            # same seed gives the same probes when the block is multiplied in smaller pieces
            signs = rademacher_like(dim, generator, torch.int8, "cpu", k)
            for first in range(0, k, columns):
                G = signs[:, first : first + columns].to(dtype=op.dtype, device=op.device)
                AG = op.matmat(G)
                values = G * AG if quantity == "trace" else AG * AG
                rows.append(_segment_sums(values, blocks).T)
                del G, AG, values
            del signs
            matvecs += k
            samples = torch.cat(rows)
            mean, stderr = _mean_stderr(samples)
            if samples.shape[0] >= min_samples and stderr[0] <= tol * abs(mean[0]):
                converged = True
                break
            _report_probes(run, matvecs, samples.shape[0], mean[0], stderr[0], tol, 0)
        samples = torch.cat(rows)
        mean, stderr = _mean_stderr(samples)
        run.finish(
            matvecs, probes=samples.shape[0], estimate=float(mean[0]), stderr=float(stderr[0])
        )
    return mean, stderr, matvecs, samples.shape[0], converged


def _report_probes(run, matvecs: int, probes: int, estimate, stderr, tol: float, spent: int):
    """Report a trace estimate after ``probes`` probes (one matvec each, ``spent`` matvecs on
    other things) and the matvecs at which it projects to stop: the standard error falls as
    ``1/sqrt(n)``, so ``n_stop = n (stderr / (tol |estimate|))^2`` probes, capped by the budget.
    Costs two scalar copies to the host per block of probes (the stop test makes one anyway)
    and nothing without a listener.
    """
    if run.finished:
        return
    estimate, stderr = float(estimate), float(stderr)
    expected = None
    if math.isfinite(stderr) and estimate != 0:
        needed = probes * (stderr / (tol * abs(estimate))) ** 2
        expected = min(run.total or matvecs, spent + max(matvecs - spent, math.ceil(needed)))
    run.update(matvecs, probes=probes, estimate=estimate, stderr=stderr, expected=expected)


def hutchinson(
    op,
    *,
    tol: float = 1e-2,
    max_matvecs: int = 1000,
    seed: int = 0,
    block_size: int = 8,
    min_samples: int = 10,
    blocks: dict | None = None,
) -> TraceResult:
    r"""Hutchinson's estimator of the trace [Hutchinson1989], with per-layer traces.

    .. math::

        \mathrm{tr}(A) \approx \frac{1}{n} \sum_{j=1}^n g_j^\top A g_j, \qquad
        \mathrm{tr}(A_{bb}) \approx \frac{1}{n} \sum_{j=1}^n g_{j,b}^\top (A g_j)_b

    for seeded Rademacher probes :math:`g_j`; the variance per probe is
    :math:`2 (\lVert A \rVert_F^2 - \sum_i A_{ii}^2)`.

    Args:
        op: a symmetric operator (``shape``, ``dtype``, ``device``, ``matmat``).
        tol: stop at this relative standard error (after ``min_samples`` probes).
        max_matvecs: the most products.
        seed: seeds the probes.
        block_size: probes per product block (fewer when the memory plan says so).
        min_samples: probes before the stop rule applies.
        blocks: ``{layer: slice}`` of the per-layer traces; default the operator's own
            (:meth:`~sharpcli.curvature.operators.CurvatureOperator.blocks`).

    Returns:
        A :class:`TraceResult` with the standard error and the per-layer traces.

    Example:
        >>> import torch
        >>> from sharpcli.curvature import MatrixOperator
        >>> A = MatrixOperator(torch.diag(torch.arange(1.0, 5.0, dtype=torch.float64)))
        >>> result = hutchinson(A, max_matvecs=16, blocks={"a": slice(0, 2), "b": slice(2, 4)})
        >>> result.estimate, result.by_layer["b"]["estimate"]  # a diagonal A: exact per probe
        (10.0, 7.0)
    """
    blocks = _blocks_of(op, blocks)
    mean, stderr, matvecs, n, converged = _probe_loop(
        op,
        "trace",
        tol=tol,
        max_matvecs=max_matvecs,
        seed=seed,
        block_size=block_size,
        min_samples=min_samples,
        blocks=blocks,
    )
    return TraceResult(
        estimate=float(mean[0]),
        stderr=float(stderr[0]),
        matvecs=matvecs,
        samples=n,
        estimator="hutchinson",
        converged=converged,
        tol=tol,
        by_layer=_layer_dict(list(blocks), mean, stderr),
    )


def frobenius_sq(
    op,
    *,
    tol: float = 1e-2,
    max_matvecs: int = 1000,
    seed: int = 0,
    block_size: int = 8,
    min_samples: int = 10,
    blocks: dict | None = None,
) -> TraceResult:
    r"""The squared Frobenius norm, the flatness of [FA] eq. 1, with per-layer parts.

    .. math::

        \mathrm{Tr}(A^2) = \lVert A \rVert_F^2 = \mathbb{E}_g \lVert A g \rVert^2, \qquad
        \mathrm{Tr}((A^2)_{bb}) = \mathbb{E}_g \lVert (A g)_b \rVert^2

    for Rademacher :math:`g` (the per-layer part is the squared norm of block b's rows).

    Args:
        op: a symmetric operator (``shape``, ``dtype``, ``device``, ``matmat``).
        tol: stop at this relative standard error (after ``min_samples`` probes).
        max_matvecs: the most products.
        seed: seeds the probes.
        block_size: probes per product block.
        min_samples: probes before the stop rule applies.
        blocks: ``{layer: slice}``; default the operator's own.

    Returns:
        A :class:`TraceResult` with ``quantity="trace_of_square"``.

    Example:
        >>> import torch
        >>> from sharpcli.curvature import MatrixOperator
        >>> A = MatrixOperator(torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64)))
        >>> frobenius_sq(A, max_matvecs=16).estimate  # |g_i| = 1: exact per probe
        5.0
    """
    blocks = _blocks_of(op, blocks)
    mean, stderr, matvecs, n, converged = _probe_loop(
        op,
        "square",
        tol=tol,
        max_matvecs=max_matvecs,
        seed=seed,
        block_size=block_size,
        min_samples=min_samples,
        blocks=blocks,
    )
    return TraceResult(
        estimate=float(mean[0]),
        stderr=float(stderr[0]),
        matvecs=matvecs,
        samples=n,
        estimator="hutchinson",
        quantity="trace_of_square",
        converged=converged,
        tol=tol,
        by_layer=_layer_dict(list(blocks), mean, stderr),
    )


class _Sketch:
    """Orthonormal ``Q`` (P, s) with ``AQ``; the exact part ``tr(Q^T A Q)`` and its layer split.

    With ``Pi = Q Q^T``, ``P = I - Pi`` and ``A`` symmetric,
    ``A = (Pi A + A Pi - Pi A Pi) + P A P``. The trace of the first term's diagonal block b
    is exact, ``sum_{i in b} [2 <Q_i, (AQ)_i> - <Q_i M, Q_i>]`` with rows ``Q_i`` and
    ``M = Q^T A Q`` (total ``tr M``); that of ``P A P`` is left to Hutchinson,
    ``E[g_b^T (P A P g)_b] = tr((P A P)_bb)`` (:meth:`residual_values`). Both terms are block
    traces of the same split, so layer estimates are unbiased and sum to the total.
    """

    def __init__(self, dim, dtype, device):
        self.Q = torch.zeros(dim, 0, dtype=dtype, device=device)
        self.AQ = torch.zeros(dim, 0, dtype=dtype, device=device)

    @property
    def size(self):
        return self.Q.shape[1]

    def extend(self, op, columns, generator) -> int:
        dim = op.shape[0]
        S = rademacher_like(dim, generator, op.dtype, op.device, columns)
        Y = op.matmat(S)
        used = columns
        for _ in range(2):
            Y = Y - self.Q @ (self.Q.T @ Y)
        Qn, R = torch.linalg.qr(Y)
        diag = R.diagonal().abs()
        keep = diag > (torch.finfo(op.dtype).eps * 100 * max(float(diag.max()), 1e-300))
        Qn = Qn[:, keep]
        if Qn.shape[1]:
            Qn = Qn - self.Q @ (self.Q.T @ Qn)
            Qn, _ = torch.linalg.qr(Qn)
            AQn = op.matmat(Qn)
            used += Qn.shape[1]
            self.Q = torch.cat([self.Q, Qn], 1)
            self.AQ = torch.cat([self.AQ, AQn], 1)
        return used

    def exact_part(self, blocks) -> torch.Tensor:
        """(1 + L,) exact contribution: total ``tr(Q^T A Q)`` then per layer."""
        if self.size == 0:
            return torch.zeros(1 + len(blocks), dtype=torch.float64)
        M = self.Q.T @ self.AQ
        M = (M + M.T) / 2
        per_row = 2 * (self.Q * self.AQ).sum(1) - ((self.Q @ M) * self.Q).sum(1)
        out = _segment_sums(per_row[:, None], blocks)[:, 0]
        out[0] = torch.trace(M).to(torch.float64)
        return out

    def residual_values(self, G, AG, blocks) -> torch.Tensor:
        """(k, 1 + L) Hutchinson values of ``P A P`` from probes ``G`` and products ``AG``.

        Per probe and layer ``g_b^T (P A P g)_b``, whose mean is ``tr((P A P)_bb)`` exactly,
        from the stored ``A g`` (no new product): ``A P g = A g - AQ (Q^T g)`` and
        ``P A P g = A P g - Q (Q^T A P g)``. Summed over the layers this is
        ``g^T P A P g = (P g)^T A (P g)``, the total's usual value.
        """
        # (Pg)_b . (APg)_b would be cheaper but has mean tr(P E_b A P) = tr((A P)_bb), which
        # differs from tr((P A P)_bb) by tr((Pi A P)_bb): it sums to the right total but is
        # biased per layer against the exact part's tr((Pi A + A Pi - Pi A Pi)_bb).
        APG = AG - self.AQ @ (self.Q.T @ G)
        PAPG = APG - self.Q @ (self.Q.T @ APG)
        return _segment_sums(G * PAPG, blocks).T


_FIRST_SKETCH = 16  # columns of a sketch started lazily (initial_sketch=0)


def hutchpp(
    op,
    *,
    tol: float = 1e-2,
    max_matvecs: int = 1000,
    seed: int = 0,
    block_size: int = 8,
    min_samples: int = 10,
    initial_sketch: int = 16,
    max_sketch: int = 512,
    blocks: dict | None = None,
    known: torch.Tensor | None = None,
) -> TraceResult:
    r"""Adaptive Hutch++ [Hutch++]: exact trace on a sketched top subspace + Hutchinson.

    .. math::

        \mathrm{tr}(A) = \mathrm{tr}(Q^\top A Q) + \mathrm{tr}(P A P), \qquad
        Q = \mathrm{orth}(A S), \quad P = I - Q Q^\top

    for Rademacher ``S``, the second term by Rademacher probes ``g`` as ``g^T P A P g = (Pg)^T (A g - AQ Q^T g)``
    (one matvec per probe). Per layer b, ``tr(A_bb) = tr((Pi A + A Pi - Pi A Pi)_bb)``
    (exact, :class:`_Sketch`) ``+ E[g_b^T (P A P g)_b]``, with
    ``P A P g = A P g - Q (Q^T A P g)`` from the same product. The standard error is the
    residual probes' sample standard error (the sketch part is exact given Q). Adaptivity:
    starting from ``initial_sketch`` columns, once ``min_samples`` residual probes exist, the
    sketch is doubled (``2 s`` matvecs) while the estimated remaining probes exceed ``3 s`` and
    the previous doubling reduced the estimated number of probes still needed by at least its
    own cost; stored residual probes are re-evaluated for the new Q at no matvec cost (from
    the stored ``A g``, as above).
    ``initial_sketch=0`` starts as plain Hutchinson and sketches (16 columns, then doubling)
    only when the first probes say it pays. ``known`` (total, then per block) is an exactly
    known part of the trace added to the estimate, so ``tol`` is relative to the sum (the
    control variate of :func:`gn_split_trace`).
    Memory: ``2 s`` P-vectors plus the probes stored until the sketch stops growing.

    Args:
        op: a symmetric operator (``shape``, ``dtype``, ``device``, ``matmat``).
        tol: stop at this relative standard error (after ``min_samples`` residual probes).
        max_matvecs: the most products (sketch and probes).
        seed: seeds the sketch and the probes.
        block_size: probes per product block.
        min_samples: residual probes before the stop rule and the first doubling.
        initial_sketch: the sketch's first columns (0: start unsketched).
        max_sketch: the most sketch columns (also at most a third of ``max_matvecs``).
        blocks: ``{layer: slice}``; default the operator's own.
        known: an exactly known part, ``(1 + layers,)`` (total, then per block), added.

    Returns:
        A :class:`TraceResult` (``sketch_size`` the final sketch's columns).

    Example:
        >>> import torch
        >>> from sharpcli.curvature import MatrixOperator
        >>> A = MatrixOperator(torch.diag(torch.tensor([9.0, 1.0, 1.0, 1.0], dtype=torch.float64)))
        >>> result = hutchpp(A, initial_sketch=4)  # the sketch spans R^4: exact
        >>> round(result.estimate, 10), result.sketch_size
        (12.0, 4)
    """
    _check_budget(tol, max_matvecs, block_size)
    with progress.start("hutch++", total=max_matvecs, quantity="tr") as run:
        result = _hutchpp(
            op,
            run,
            tol=tol,
            max_matvecs=max_matvecs,
            seed=seed,
            block_size=block_size,
            min_samples=min_samples,
            initial_sketch=initial_sketch,
            max_sketch=max_sketch,
            blocks=blocks,
            known=known,
        )
        run.finish(
            result.matvecs,
            probes=result.samples,
            estimate=result.estimate,
            stderr=result.stderr,
            detail=f"sketch {result.sketch_size}",
        )
    return result


def _hutchpp(
    op,
    run: progress.Run,
    *,
    tol: float,
    max_matvecs: int,
    seed: int,
    block_size: int,
    min_samples: int,
    initial_sketch: int,
    max_sketch: int,
    blocks: dict | None,
    known: torch.Tensor | None,
) -> TraceResult:
    """The loop of :func:`hutchpp` (its arguments, all given), reporting to ``run``."""

    blocks = _blocks_of(op, blocks)
    dim = op.shape[0]
    budget = int(max_matvecs)
    columns, held = probe_block(op, block_size, vectors=3, what="Hutch++")
    per_vector = dim * torch.empty((), dtype=op.dtype).element_size()
    plan = memory.current()
    # half the room for the sketch (Q and AQ), half for the probes stored while it grows
    sketch_room = plan.count_that_fit(2 * per_vector, reserve=held) // 2
    cap = max(0, min(dim, int(max_sketch), budget // 3))
    if columns < int(block_size) or sketch_room < min(cap, max(1, int(initial_sketch))):
        plan.note("Hutch++: the sketch does not fit the memory budget; plain Hutchinson ran")
        return _hutchinson_fallback(
            op, run, tol, budget, seed, block_size, min_samples, blocks, known
        )
    cap = min(cap, sketch_room)
    with plan.hold("hutch++ sketch and stored probes", held + 4 * cap * per_vector):
        return _hutchpp_loop(
            op, run, tol, budget, seed, block_size, min_samples, initial_sketch, cap, blocks, known
        )


def _hutchinson_fallback(op, run, tol, budget, seed, block_size, min_samples, blocks, known):
    """Hutch++'s result computed by plain Hutchinson (the sketch does not fit in memory);
    ``known`` (total, then per block) is added as in Hutch++."""
    run.finish(0)
    result = hutchinson(
        op,
        tol=tol,
        max_matvecs=budget,
        seed=seed,
        block_size=block_size,
        min_samples=min_samples,
        blocks=blocks,
    )
    if known is not None:
        offset = known.to(torch.float64).tolist()
        result.estimate += offset[0]
        for i, layer in enumerate(result.by_layer.values()):
            layer["estimate"] += offset[i + 1]
    result.notes.append("the Hutch++ sketch does not fit the memory budget: plain Hutchinson ran")
    return result


class _AdaptiveSketch:
    """The state of the adaptive Hutch++ loop: the sketch ``Q`` (at most ``cap`` columns), its
    exact part, the residual probes' rows and, while the sketch may still grow, the probes
    ``(G, A G)`` themselves (re-evaluated for a grown ``Q`` at no product cost)."""

    def __init__(self, op, run, blocks: dict, cap: int, generator, known):
        self.op, self.run, self.blocks, self.cap, self.generator = op, run, blocks, cap, generator
        self.sketch = _Sketch(op.shape[0], op.dtype, op.device)
        self.offset = (
            torch.zeros(1 + len(blocks), dtype=torch.float64)
            if known is None
            else known.to(torch.float64)
        )
        self.exact = self.sketch.exact_part(blocks) + self.offset
        self.matvecs = 0
        self.rows: list[torch.Tensor] = []
        self.stored: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.growing = True

    def extend(self, count: int) -> None:
        """Grow the sketch by ``count`` columns (``2 count`` products); its exact part with it.

        Args:
            count: the new columns.
        """
        self.matvecs += self.sketch.extend(self.op, count, self.generator)
        self.run.update(self.matvecs, detail=f"sketch {self.sketch.size}")
        self.exact = self.sketch.exact_part(self.blocks) + self.offset

    def probe(self, k: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``k`` Rademacher probes of the residual ``P A P``: ``(probes, estimate, stderr)``.

        Args:
            k: the probes.

        Returns:
            ``(probes so far, estimate, standard error)`` of the total.
        """
        op = self.op
        G = rademacher_like(op.shape[0], self.generator, op.dtype, op.device, k)
        AG = op.matmat(G)
        self.matvecs += k
        if self.growing:
            self.stored.append((G, AG))
        self.rows.append(self.sketch.residual_values(G, AG, self.blocks))
        samples = torch.cat(self.rows)
        mean, stderr = _mean_stderr(samples)
        return samples.shape[0], self.exact[0] + mean[0], stderr[0]

    def consider_growing(self, n: int, estimate, stderr, tol: float, budget: int) -> None:
        """Double the sketch while the probes still needed exceed ``3 s`` and the last doubling
        saved at least the ``2 s`` products it cost (:func:`hutchpp`); else stop growing.

        Args:
            n: the residual probes so far.
            estimate: the current estimate of the total.
            stderr: its standard error.
            tol: the relative standard error wanted.
            budget: the most products.
        """
        target = _probes_needed(stderr, n, estimate, tol)
        step = min(self.sketch.size or _FIRST_SKETCH, self.cap - self.sketch.size)
        if target - n > 3 * step and step > 0 and self.matvecs + 2 * step < budget:
            self.extend(step)
            self.rows = [self.sketch.residual_values(g, ag, self.blocks) for g, ag in self.stored]
            new_mean, new_stderr = _mean_stderr(torch.cat(self.rows))
            new_target = _probes_needed(new_stderr[0], n, self.exact[0] + new_mean[0], tol)
            self.growing = not (target - new_target < 2 * step or self.sketch.size >= self.cap)
        else:
            self.growing = False
        if not self.growing:
            self.stored = []

    def result(self, converged: bool, tol: float) -> TraceResult:
        """The estimate: the sketch's exact part plus the residual probes' mean.

        Args:
            converged: whether the stop rule was met.
            tol: the tolerance, recorded.

        Returns:
            The :class:`TraceResult`.
        """
        notes = []
        if self.rows:
            mean, stderr = _mean_stderr(torch.cat(self.rows))
        else:
            mean = torch.zeros(1 + len(self.blocks), dtype=torch.float64)
            stderr = torch.zeros_like(mean)
        if self.sketch.size == self.op.shape[0]:
            stderr = torch.zeros_like(stderr)
            mean = torch.zeros_like(mean)
            notes.append("the sketch spans the whole space: the trace is exact")
        total = self.exact + mean
        by_layer = {
            name: {"estimate": float(total[i + 1]), "stderr": float(stderr[i + 1])}
            for i, name in enumerate(self.blocks)
        }
        return TraceResult(
            estimate=float(total[0]),
            stderr=float(stderr[0]),
            matvecs=self.matvecs,
            samples=sum(r.shape[0] for r in self.rows),
            estimator="hutchpp",
            converged=converged,
            tol=tol,
            by_layer=by_layer,
            sketch_size=self.sketch.size,
            notes=notes,
        )


def _probes_needed(stderr, n: int, estimate, tol: float):
    """The probes that would bring the standard error to ``tol |estimate|``."""
    return (stderr * math.sqrt(n) / (tol * abs(estimate) + 1e-300)) ** 2


def _hutchpp_loop(
    op, run, tol, budget, seed, block_size, min_samples, initial_sketch, cap, blocks, known
) -> TraceResult:
    """The adaptive Hutch++ iteration of :func:`hutchpp` with a sketch of at most ``cap``."""
    dim = op.shape[0]
    state = _AdaptiveSketch(op, run, blocks, cap, torch.Generator().manual_seed(int(seed)), known)
    first = min(int(initial_sketch), cap)
    if first > 0:
        state.extend(first)
    state.growing = state.sketch.size < cap
    converged = state.sketch.size == dim
    while not converged and state.matvecs < budget:
        n, estimate, stderr = state.probe(min(int(block_size), budget - state.matvecs))
        if n >= min_samples and stderr <= tol * abs(estimate):
            converged = True
            break
        _report_probes(run, state.matvecs, n, estimate, stderr, tol, state.matvecs - n)
        if state.growing and n >= min_samples:
            state.consider_growing(n, estimate, stderr, tol, budget)
            converged = state.sketch.size == dim
    return state.result(converged, tol)


# --------------------------------------------------------------------------- Gauss-Newton traces
def _functional_logits(model: nn.Module, names: list[str]):
    """``f(params_tuple, x_single) -> z`` for one sample (torch.func); ``params_tuple`` replaces
    the parameters ``names``, the others are the module's own."""
    from torch.func import functional_call

    def logits(params, x_single):
        return functional_call(model, dict(zip(names, params)), (x_single.unsqueeze(0),)).squeeze(0)

    return logits


def _param_to_layer(scope: ParamScope) -> list[int]:
    blocks = scope.blocks()
    index = []
    for start in scope.offsets[:-1]:
        for j, sl in enumerate(blocks.values()):
            if sl.start <= start < sl.stop:
                index.append(j)
                break
    return index


def _ggn_directions(z: torch.Tensor, y: torch.Tensor, loss: str) -> list[torch.Tensor]:
    """Columns ``s`` (each shaped like ``z``) with ``H_z = sum_s s s^T`` per sample.

    The loss's own factor (:attr:`sharpcli.losses.Loss.ggn_factor`): for cross-entropy
    ``s_c = sqrt(p_c) (e_c - p)``, since ``diag(p) - p p^T = S S^T`` (``sum p = 1``); for mse
    ``s_c = sqrt(2/C) e_c``; one column ``sqrt(s(z)(1 - s(z)))`` for binary cross-entropy; one
    per (position, class) for token cross-entropy, whose ``H_z`` is block diagonal.
    """
    return list(get_loss(loss).ggn_factor(z, y))


def _jacobian_ggn_sums(model, scope, indices, x_b, z_b, y_b, loss, per_param) -> None:
    """``per_param[i] += sum_b ||S_b^T J_b,i||_F^2`` for the scope parameters ``indices``, from
    per-sample Jacobians (``vmap(jacrev)``, C backward passes per sample), in memory-bounded chunks.

    Some layers have no vmap batching rule, or one that fails (``nn.LSTM``/``nn.GRU`` on CPU:
    ``mkldnn_rnn_layer`` breaks in its backward under vmap); a chunk where vmap raises is done
    by :func:`_looped_ggn_sums` instead, one sample at a time, and so is the rest of the batch.
    """
    from torch.func import jacrev, vmap

    logits = _functional_logits(model, [scope.names[i] for i in indices])
    jac = vmap(jacrev(logits), in_dims=(None, 0))
    params = tuple(scope.params[i].detach() for i in indices)
    outputs = z_b[0].numel()  # C, or T x V for sequence outputs
    numel = sum(p.numel() for p in params)
    rows = max(1, _CHUNK_BYTES // max(1, outputs * numel * z_b.element_size()))
    vectorised = True
    for start in range(0, x_b.shape[0], rows):
        x_c, z_c = x_b[start : start + rows], z_b[start : start + rows]
        S = torch.stack(_ggn_directions(z_c, y_b[start : start + rows], loss), dim=1)
        S = S.reshape(S.shape[0], S.shape[1], outputs)  # (B, columns, outputs)
        if vectorised:
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    # torch.func differentiates anyway; no graph to the other parameters. The
                    # warning of a missing batching rule is ours to act on, not the user's.
                    warnings.filterwarnings("ignore", message=".*batching rule.*")
                    J = jac(params, x_c)
            except RuntimeError:
                vectorised = False
        if not vectorised:
            _looped_ggn_sums(model, scope, indices, x_c, S, per_param)
            continue
        for i, Ji in zip(indices, J):  # Ji: (B, C, *shape)
            M = S @ Ji.reshape(Ji.shape[0], outputs, -1)  # rows s^T J
            per_param[i] += (M * M).sum().to(torch.float64)


def _vmapped_or_looped(fn, in_dims: tuple):
    """``vmap(fn, in_dims)``, or, once vmap raises (a layer without a working batching rule,
    as ``nn.LSTM``/``nn.GRU`` on CPU), ``fn`` called per sample and its outputs stacked; the
    warning of a missing batching rule is silenced (the fallback is the answer to it)."""
    from torch.func import vmap

    batched = vmap(fn, in_dims=in_dims)
    state = {"vectorised": True}

    def looped(*args):
        n = next(a.shape[0] for a, d in zip(args, in_dims) if d == 0)
        rows = [fn(*(a if d is None else a[i] for a, d in zip(args, in_dims))) for i in range(n)]
        return tuple(torch.stack(parts) for parts in zip(*rows))

    def call(*args):
        if state["vectorised"]:
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*batching rule.*")
                    return batched(*args)
            except RuntimeError:
                state["vectorised"] = False
        return looped(*args)

    return call


def _looped_ggn_sums(model, scope, indices, x_c, S, per_param) -> None:
    """:func:`_jacobian_ggn_sums` for one chunk without vmap: per sample one forward pass and,
    per column ``s`` of ``S`` (``(B, columns, outputs)``), one backward pass of ``<s, z>``
    giving ``J^T s``, whose squared norm is summed per parameter."""
    params = [scope.params[i] for i in indices]
    for b in range(x_c.shape[0]):
        with torch.enable_grad():
            z = model(x_c[b : b + 1]).reshape(-1)
            for column in S[b]:
                grads = torch.autograd.grad(
                    z, params, column.to(z.dtype), retain_graph=True, allow_unused=True
                )
                for i, g in zip(indices, grads):
                    if g is not None:
                        per_param[i] += (g * g).sum().to(torch.float64)


@twice_differentiable()
def exact_ggn_trace(model: nn.Module, data: AnalysisData, scope: ParamScope) -> TraceResult:
    r"""The exact Gauss-Newton trace with per-layer traces.

    With :math:`H_z = \sum_c s_c s_c^\top` (:func:`_ggn_directions`),

    .. math::

        \mathrm{tr}(G) = \frac{1}{N} \sum_i \mathrm{tr}(J_i^\top H_{z,i} J_i)
            = \frac{1}{N} \sum_i \sum_c \lVert J_i^\top s_{c,i} \rVert^2,

    and for cross-entropy ``J^T s_c = sqrt(p_c) grad_theta l(z, c)``, so this is
    ``sum_c p_c ||grad_theta l(z, c)||^2``, the exact expectation of NME eq. 20.
    Each ``||J_i^T s_c||^2`` is a per-sample squared gradient norm: for ``nn.Linear``,
    ``nn.Conv2d`` and eval-mode BatchNorm layers it comes from one backward pass per class and
    batch to the layers' outputs (:class:`~sharpcli.curvature.persample.LayerTaps`, no
    per-sample gradients formed); any other parameter (custom layers, shared weights) from
    per-sample Jacobians (``vmap(jacrev)``).

    Args:
        model: the model.
        data: the analysis set (cross-entropy, mse and the other losses with a ``ggn_factor``).
        scope: the parameters.

    Returns:
        A :class:`TraceResult` with ``stderr`` 0 (exact) and the per-layer traces.
    """
    from sharpcli.curvature.persample import LayerTaps

    layer_of = _param_to_layer(scope)
    blocks = scope.blocks()
    per_param = torch.zeros(len(scope.params), dtype=torch.float64, device=scope.device)
    taps = LayerTaps(model, scope)
    N = data.num_samples
    run = progress.start("exact tr(G)", total=data.num_batches, unit="batches", quantity="tr")
    for batch_index, (x_b, y_b, _) in enumerate(data.batches()):
        run.update(batch_index)
        x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
        with torch.enable_grad(), taps:
            z_b = model(x_b)
        taps.resolve(z_b)
        for direction in _ggn_directions(z_b, y_b, data.loss):
            taps.accumulate(z_b, direction, per_param)
        rest = taps.uncovered
        if rest:
            _jacobian_ggn_sums(model, scope, rest, x_b, z_b.detach(), y_b, data.loss, per_param)
        del z_b
        if not torch.isfinite(per_param).all():
            raise NumericalError(
                f"exact GGN trace is not finite on batch {batch_index}", source="Gauss-Newton"
            )
    all_reduce_sum(per_param)
    per_param /= N
    per_layer = torch.zeros(len(blocks), dtype=torch.float64)
    for i, j in enumerate(layer_of):
        per_layer[j] += float(per_param[i])
    run.finish(data.num_batches, estimate=float(per_param.sum()), stderr=0.0)
    return TraceResult(
        estimate=float(per_param.sum()),
        stderr=0.0,
        matvecs=0,
        samples=N,
        estimator="exact",
        converged=True,
        by_layer={
            name: {"estimate": float(per_layer[j]), "stderr": 0.0} for j, name in enumerate(blocks)
        },
        notes=[f"exact Gauss-Newton trace over {N} samples ({data.loss})"],
    )


def gn_split_trace(
    curvature_pass,
    *,
    tol: float = 1e-2,
    max_matvecs: int = 1000,
    seed: int = 0,
    block_size: int = 8,
    min_samples: int = 10,
) -> TraceResult:
    """``tr(H) = tr(G) + tr(N)``: the exact Gauss-Newton trace plus Hutch++ on the NME (NME eq. 2).

    The Gauss-Newton term is a control variate known exactly (:func:`exact_ggn_trace`, C
    backward passes per batch), so only ``tr(N)`` is estimated, from probes of
    ``N = H - G`` (one NME product each, about the cost of a Hessian product;
    :class:`~sharpcli.curvature.NMEOperator`).
    Per probe the variance drops from ``2 (||H||_F^2 - sum H_ii^2)`` to
    ``2 (||N||_F^2 - sum N_ii^2)``: large savings wherever the Gauss-Newton part dominates
    the Hessian, as it does near a minimum, where ``dl/dz -> 0`` and ``N -> 0``. Hutch++ starts
    unsketched (``initial_sketch=0``) and sketches N only when its probes say it pays. The
    standard error is that of the ``tr(N)`` estimate; ``tol`` is relative to ``tr(H)``; per
    layer, the exact Gauss-Newton block traces plus N's. ``matvecs`` counts the joint H+G
    products; the exact part's cost is in ``notes``.

    Args:
        curvature_pass: the :class:`~sharpcli.curvature.engine.CurvatureEngine` (its model,
            data and scope give the exact part, its NME operator the estimated one).
        tol: stop at this standard error relative to ``tr(H)``.
        max_matvecs: the most NME products.
        seed: seeds the probes.
        block_size: probes per product block.
        min_samples: probes before the stop rule applies.

    Returns:
        A :class:`TraceResult` of ``tr(H)`` (``estimator="gn-split"``).
    """
    data, scope = curvature_pass.data, curvature_pass.scope
    ggn = exact_ggn_trace(curvature_pass.model, data, scope)
    known = torch.tensor(
        [ggn.estimate] + [v["estimate"] for v in ggn.by_layer.values()], dtype=torch.float64
    )
    nme = hutchpp(
        curvature_pass.nme(),
        tol=tol,
        max_matvecs=max_matvecs,
        seed=seed,
        block_size=block_size,
        min_samples=min_samples,
        initial_sketch=0,
        known=known,
    )
    nme.estimator = "gn-split"
    nme.notes = [
        f"tr(H) = tr(G) + tr(N): exact tr(G) = {ggn.estimate:.6g} ({data.loss}, one backward pass per class "
        f"and batch), tr(N) estimated from {nme.matvecs} H+G products",
        *nme.notes,
    ]
    return nme


_DRAW_BLOCK = 1024  # samples per independently seeded block of label draws


def _per_sample_draws(
    base_seed: int, start: int, stop: int, samples: int, kind: str, tail: tuple
) -> torch.Tensor:
    """Random numbers for the global sample indices ``[start, stop)``, shape ``(samples, stop - start, *tail)``.

    Sample ``i`` takes its numbers from block ``i // 1024``, whose CPU generator is seeded with
    ``base_seed * 2**20 + block``: every rank and every batch size sees the same numbers for
    the same sample. ``kind`` is ``"uniform"`` (U[0, 1)) or ``"normal"`` (N(0, 1)), float64.
    """
    draw = torch.rand if kind == "uniform" else torch.randn
    parts = []
    for block in range(
        start // _DRAW_BLOCK,
        (stop - 1) // _DRAW_BLOCK + 1 if stop > start else start // _DRAW_BLOCK,
    ):
        generator = torch.Generator().manual_seed(base_seed * 2**20 + block)
        values = draw((samples, _DRAW_BLOCK, *tail), generator=generator, dtype=torch.float64)
        lo = max(start, block * _DRAW_BLOCK) - block * _DRAW_BLOCK
        hi = min(stop, (block + 1) * _DRAW_BLOCK) - block * _DRAW_BLOCK
        parts.append(values[:, lo:hi])
    if not parts:
        return torch.zeros((samples, 0, *tail), dtype=torch.float64)
    return torch.cat(parts, dim=1)


@twice_differentiable()
def sampled_label_ggn_trace(
    model: nn.Module,
    data: AnalysisData,
    scope: ParamScope,
    samples: int = 1,
    generator: torch.Generator | None = None,
) -> TraceResult:
    """NME eq. 20: ``tr(G) = (1/N) sum_i E_{y^ ~ p(z_i)} ||grad_theta l(z_i, y^)||^2``.

    Labels come from the loss's own sampler (:meth:`sharpcli.losses.Loss.labels_from_noise`):
    cross-entropy ``y^ ~ Cat(softmax z_i)``, binary cross-entropy ``y^ ~ Bernoulli(sigmoid z_i)``,
    mse (``l = (1/C)||z - y||^2``) ``y^ ~ N(z_i, (C/2) I)``, for which
    ``E||J^T (2/C)(z - y^)||^2 = (2/C)||J||_F^2`` as well. ``samples`` labels are drawn
    per data point from random numbers keyed by the point's global index in the analysis set
    (:func:`_per_sample_draws`, base seed from the CPU ``generator``), so the draws, and the
    result, do not depend on the batch size or on how ranks shard the set; per-sample
    gradients come from ``vmap(grad)``. Standard
    error of the mean over the label draws, the data set being fixed: with ``samples >= 2``,
    ``sqrt(sum_i s_i^2 / samples) / N`` from each point's unbiased variance ``s_i^2``; with one
    draw the pooled variance over points is used (conservative: it includes between-point spread).
    """
    from torch.func import grad

    if int(samples) < 1:
        raise UsageError(f"samples must be >= 1, got {samples}", source="samples")
    loss = get_loss(data.loss)
    if loss.sampler is None or loss.per_token:
        raise UsageError(
            "sampled-label GGN trace needs one predictive distribution per sample "
            f"(cross-entropy, mse, binary-cross-entropy), not {data.loss!r}",
            source="loss",
        )
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    logits = _functional_logits(model, list(scope.names))

    def single_loss(params, x_single, label):
        return loss.per_sample(logits(params, x_single)[None], label[None]).sum()

    per_sample_grad = _vmapped_or_looped(grad(single_loss), in_dims=(None, 0, 0))
    params = tuple(p.detach() for p in scope.params)
    layer_of = _param_to_layer(scope)
    blocks = scope.blocks()
    L = len(blocks)
    S = int(samples)
    sums = torch.zeros(1 + L, dtype=torch.float64)  # sum_i mean_s v_is
    var_sums = torch.zeros(1 + L, dtype=torch.float64)  # sum_i s_i^2 / S  (S >= 2)
    sq_sums = torch.zeros(1 + L, dtype=torch.float64)  # sum_i v_i^2      (S == 1)
    N = data.num_samples
    base_seed = int(torch.randint(0, 2**40, (1,), generator=generator))
    first = getattr(data, "shard_start", 0)  # global index of this rank's first sample
    run = progress.start(
        "sampled tr(G)", total=data.num_batches, unit="batches", quantity="tr", probes=S
    )
    for batch_index, (x_b, y_b, _) in enumerate(data.batches()):
        run.update(batch_index)
        x_b, y_b = to_model_batch(x_b, y_b, scope.dtype, scope.device)
        with torch.no_grad():
            z_b = model(x_b)
        tail = tuple(loss.label_noise_shape(z_b)[1:])
        batch_draws = _per_sample_draws(
            base_seed, first, first + x_b.shape[0], S, loss.sampler.noise, tail
        )
        first += x_b.shape[0]
        rows = max(1, _CHUNK_BYTES // max(1, scope.numel * z_b.element_size()))
        for start in range(0, x_b.shape[0], rows):
            x_c, z_c = x_b[start : start + rows], z_b[start : start + rows]
            draws = torch.zeros(S, x_c.shape[0], 1 + L, dtype=torch.float64)
            for s in range(S):
                random_c = batch_draws[s, start : start + x_c.shape[0]]
                labels = loss.labels_from_noise(z_c, random_c)  # y^ ~ p(y | z) (Loss.sample_labels)
                grads = per_sample_grad(params, x_c, labels)
                for i, g in enumerate(grads):
                    sq = (g.reshape(g.shape[0], -1) ** 2).sum(1).to(torch.float64).cpu()
                    draws[s, :, 0] += sq
                    draws[s, :, 1 + layer_of[i]] += sq
            if not torch.isfinite(draws).all():
                raise NumericalError(
                    f"per-sample gradient is not finite on batch {batch_index}",
                    source="Gauss-Newton",
                )
            point_means = draws.mean(0)
            sums += point_means.sum(0)
            if S >= 2:
                var_sums += (draws.var(0, unbiased=True) / S).sum(0)
            else:
                sq_sums += (point_means**2).sum(0)
    all_reduce_sum([sums, var_sums, sq_sums])
    mean = sums / N
    if S >= 2:
        stderr = var_sums.sqrt() / N
    else:
        pooled = (sq_sums - N * mean**2).clamp_min(0) / max(N - 1, 1)
        stderr = (pooled / N).sqrt()
    run.finish(data.num_batches, estimate=float(mean[0]), stderr=float(stderr[0]))
    return TraceResult(
        estimate=float(mean[0]),
        stderr=float(stderr[0]),
        matvecs=0,
        samples=N * S,
        estimator="sampled-label",
        converged=True,
        by_layer={
            name: {"estimate": float(mean[j + 1]), "stderr": float(stderr[j + 1])}
            for j, name in enumerate(blocks)
        },
        notes=[
            f"NME eq. 20 with {S} label draw(s) per sample; per-sample gradients via torch.func"
        ],
    )
