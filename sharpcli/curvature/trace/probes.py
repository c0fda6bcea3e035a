r"""Probe estimators' common parts: results, standard errors and the two-stage probe count.

A Hutchinson-type estimator averages i.i.d. per-probe rows :math:`x_j \in \mathbb{R}^{1+L}`
(the total, then one value per layer block) and reports

.. math::

    \bar x = \frac1n \sum_{j=1}^n x_j, \qquad
    \mathrm{se} = \frac{s}{\sqrt n}, \quad s^2 = \frac{1}{n-1} \sum_j (x_j - \bar x)^2 .

Stopping at the first :math:`n` with :math:`\mathrm{se}_n \le \mathrm{tol}\,|\bar x_n|`
(optional stopping) picks the sample paths whose :math:`s_n` happens to be small, so the
reported standard error is biased low, and more so the more skewed the per-probe values are
(:math:`\lVert A g \rVert^2` for ``Tr(A^2)``). The estimators here size their sample in two
stages instead [Stein1945]: a pilot of :math:`n_0` probes gives :math:`\bar x_0, s_0`, and

.. math::

    N = \min\Bigl(R,\ \max\bigl(n_{\min},
        \bigl\lceil m \, (s_0 / (\mathrm{tol}\, |\bar x_0|))^2 \bigr\rceil\bigr)\Bigr)

fresh probes (:math:`R` the products left, :math:`m` a margin for the pilot's error in
:math:`s_0`) give the reported mean and standard error. Given :math:`N` those probes are
i.i.d. and independent of the pilot, so the mean is unbiased and its standard error is the
ordinary fixed-:math:`n` one; the pilot's products count in ``matvecs``, not in ``samples``.
Where the budget cannot hold a pilot and a main sample of :math:`n_{\min}` each, the whole
budget is one fixed sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sharpcli import memory
from sharpcli.catalogue.values import TRACE_KEY
from sharpcli.curvature.operators.hessian import CurvatureOperator
from sharpcli.curvature.products.batch_forms import DataError, batch_means_stderr
from sharpcli.curvature.products.totals import DOT_CHUNK, chunk_bounds, chunked_dots
from sharpcli.errors import UsageError

__all__ = [
    "PILOT_MARGIN",
    "PILOT_PROBES",
    "PerBatchTrace",
    "TraceResult",
    "blocks_of",
    "check_budget",
    "layer_dict",
    "mean_stderr",
    "pilot_size",
    "planned_probes",
    "pooled_stderr",
    "probe_block",
    "report_probes",
    "segment_sums",
]

#: The margin m on the pilot's projected probe count: the pilot's s_0 from ~10 probes is
#: uncertain, and a main sample sized exactly would miss ``tol`` about half the time.
PILOT_MARGIN = 1.5
# A pilot of n0 probes knows s0^2 to a relative sd of about sqrt(2 / (n0 - 1)): 0.47 at 10
# probes, so a 1.5 margin fell short in a third of the runs ("converged: no" at the default
# tolerance); at 30 it is 0.26 and the margin covers ~95 %. A tenth of the budget at most.
PILOT_PROBES = 30


@dataclass
class TraceResult:
    """A trace (or ``Tr(A^2)``) estimate with standard error and per-layer breakdown.

    ``by_layer`` maps a layer (module) name to ``{"estimate", "stderr"}``; layer estimates
    sum to ``estimate``. ``stderr`` is ``None`` when the engine gives none; it is the probes'
    error given the analysis set. ``data`` is the error over the set's samples (batch means,
    :mod:`sharpcli.curvature.products.batch_forms`), None where it was not computed;
    ``data_matvecs`` the products it took beyond ``matvecs`` (none for a trace, one block of
    probes for ``Tr(A^2)``).
    """

    estimate: float
    stderr: float | None
    matvecs: int
    samples: int
    estimator: str
    quantity: str = TRACE_KEY
    converged: bool = True
    tol: float | None = None
    by_layer: dict = field(default_factory=dict)
    engine: str = "native"
    sketch_size: int = 0
    notes: list[str] = field(default_factory=list)
    data: DataError | None = None
    data_matvecs: int = 0

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
            "data_stderr": None if self.data is None else self.data.stderr,
            "data_method": None if self.data is None else self.data.method,
            "data_batches": None if self.data is None else self.data.batches,
            "data_samples": None if self.data is None else self.data.samples,
            "data_matvecs": self.data_matvecs,
        }


class PerBatchTrace:
    """The per-batch parts of a probe estimate, collected block by block of probes.

    Each block adds a ``(K, k)`` matrix of per-batch, per-probe values whose sum over the
    batches is the probes' values; :meth:`error` averages over the probes and gives the
    batch-means standard error of the estimate (plus ``constant`` per batch, the exact part
    of Hutch++). Lost (None) when any block could not be recorded.
    """

    def __init__(self):
        self.values: list[torch.Tensor] | None = []
        self.sizes: list[int] = []

    def add(self, recorded) -> None:
        """Add a block's ``(forms, sizes)`` values (None: the recording failed)."""
        if recorded is None or self.values is None:
            self.values = None
            return
        values, self.sizes = recorded
        self.values.append(values)

    @staticmethod
    def exact(per_batch: torch.Tensor, sizes: list[int]) -> DataError | None:
        """The batch-means error of an exact per-batch split (no probes), None without one."""
        if per_batch.numel() == 0:
            return None
        return batch_means_stderr(per_batch, sizes)

    def error(self, constant: torch.Tensor | None = None) -> DataError | None:
        """The batch-means error of ``constant_b + mean_j values_bj`` (None if lost)."""
        if not self.values:
            return None
        per_batch = torch.cat(self.values, 1).mean(1)
        if constant is not None and constant.numel():
            per_batch = per_batch + constant
        return batch_means_stderr(per_batch, self.sizes)


def blocks_of(op, blocks) -> dict:
    """The layer blocks of a per-layer estimate.

    Args:
        op: the operator.
        blocks: ``{layer: slice}``, or None for the operator's own
            (:meth:`~sharpcli.curvature.operators.hessian.CurvatureOperator.blocks`; none for other
            objects).

    Returns:
        ``{layer: slice}``.
    """
    if blocks is not None:
        return dict(blocks)
    return op.blocks() if isinstance(op, CurvatureOperator) else {}


def segment_sums(values: torch.Tensor, blocks: dict) -> torch.Tensor:
    r"""Per-probe rows: the total and each layer's part, in float64.

    .. math:: r_0 = \sum_i v_i, \qquad r_b = \sum_{i \in b} v_i

    Args:
        values: ``(P, k)``, one column per probe.
        blocks: ``{layer: slice}``.

    Returns:
        ``(1 + L, k)``.
    """
    values = values.to(torch.float64)
    rows = [values.sum(0)] + [values[sl].sum(0) for sl in blocks.values()]
    return torch.stack(rows)


# Entries of one float32 (BLAS) dot product of :func:`product_segment_sums`
# (:func:`~sharpcli.curvature.products.totals.chunked_dots`); the chunks' dot products are summed in
# float64: within 4e-11 (a probe's signed sum, 124M entries) and 6e-9 (a sum of squares) of
# sum |a_i b_i|, far below a probe's spread, each chunk read at memory speed.
SUM_CHUNK = DOT_CHUNK


def product_segment_sums(a: torch.Tensor, b: torch.Tensor, blocks: dict) -> torch.Tensor:
    r""":func:`segment_sums` of ``a * b`` without its ``(P, k)`` product or a float64 copy.

    The layers' boundaries cut ``[0, P)`` into segments, tiled by chunks of at most
    :data:`SUM_CHUNK` entries; per column each chunk's :math:`\sum_i a_i b_i` is one dot
    product in ``a``'s dtype (:func:`chunked_dots`), and the total and each layer's part are
    float64 sums of chunks. One read of each column, no P-sized temporaries (an elementwise
    product and its float64 widening would cost several times the dot products).

    Args:
        a: ``(P, k)``.
        b: ``(P, k)``, like ``a``.
        blocks: ``{layer: slice}``.

    Returns:
        ``(1 + L, k)`` float64: the total and each layer's part.
    """
    dim = a.shape[0]
    spans = [sl.indices(dim)[:2] for sl in blocks.values()]
    cuts = sorted({0, dim, *(bound for span in spans for bound in span)})
    bounds = chunk_bounds(cuts, SUM_CHUNK)
    # every cut is where a chunk starts, P where none does
    first_chunk = {start: i for i, (start, _) in enumerate(bounds)}
    first_chunk[dim] = len(bounds)
    columns = []
    for j in range(a.shape[1]):
        dots = chunked_dots(a[:, j], b[:, j], bounds)
        rows = [dots.sum()]
        rows += [dots[first_chunk[lo] : first_chunk[hi]].sum() for lo, hi in spans]
        columns.append(torch.stack(rows))
    return torch.stack(columns, 1)


def mean_stderr(samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Column-wise mean and standard error of the mean, :math:`s / \sqrt n`.

    Args:
        samples: ``(n, m)``, one row per probe.

    Returns:
        ``(mean, stderr)``, each ``(m,)``; the standard error is infinite for ``n < 2``.
    """
    n = samples.shape[0]
    mean = samples.mean(0)
    if n < 2:
        return mean, torch.full_like(mean, float("inf"))
    return mean, samples.std(0, unbiased=True) / math.sqrt(n)


def pooled_stderr(samples: torch.Tensor, pilot: torch.Tensor) -> torch.Tensor:
    r"""The standard error of ``samples``' mean with the variance pooled from ``pilot``.

    .. math::

        s_p^2 = \frac{\sum_j (x_j - \bar x)^2 + \sum_i (x^0_i - \bar x^0)^2}{n + n_0 - 2},
        \qquad \mathrm{se} = s_p / \sqrt n,

    each sample about its own mean: ``pilot`` holds i.i.d. rows of the same distribution
    (the pilot's probes valued under the final sketch), so the variance has
    :math:`n + n_0 - 2` degrees of freedom instead of :math:`n - 1`.

    Args:
        samples: ``(n, m)``, the rows whose mean is reported.
        pilot: ``(n0, m)``, rows of the same distribution.

    Returns:
        ``(m,)``; infinite where ``n + n0 < 3`` or ``n < 1``.
    """
    n, n0 = samples.shape[0], pilot.shape[0]
    if n < 1 or n + n0 < 3:
        return torch.full((samples.shape[1],), float("inf"), dtype=samples.dtype)
    squares = ((samples - samples.mean(0)) ** 2).sum(0)
    if n0:
        squares = squares + ((pilot - pilot.mean(0)) ** 2).sum(0)
    return (squares / (n + n0 - 2)).sqrt() / math.sqrt(n)


def check_budget(tol, max_matvecs, block_size) -> None:
    """Refuse a tolerance, budget or block size no estimator can run with.

    Args:
        tol: the relative standard error wanted (> 0).
        max_matvecs: the most products (>= 2).
        block_size: probes per product block (>= 1).

    Raises:
        UsageError: ``tol`` or ``max_matvecs`` out of range.
        ValueError: ``block_size`` below 1.
    """
    if not tol > 0:
        raise UsageError(f"tolerance must be > 0, got {tol}", source="tol")
    if int(max_matvecs) < 2:
        raise UsageError(f"max matvecs must be >= 2, got {max_matvecs}", source="max_matvecs")
    if int(block_size) < 1:
        raise ValueError("block_size must be >= 1")


def probe_block(
    op,
    block_size: int,
    *,
    vectors: int,
    what: str,
    float64_sums: bool = True,
    reserve: int = 0,
) -> tuple[int, int]:
    """``(columns, bytes)``: the probe block the run's memory plan allows, at most
    ``block_size`` columns, each holding ``vectors`` P-vectors in the operator's dtype (probe,
    product, their elementwise product) and, with ``float64_sums``, one float64 P-vector (the
    per-layer sums of :func:`segment_sums`); UsageError on ``max_memory`` when not even one
    column fits.

    Args:
        op: the operator (``shape``, ``dtype``).
        block_size: the columns wanted.
        vectors: P-vectors in the operator's dtype per column.
        what: names the estimator in the plan's notes and errors.
        float64_sums: the sums widen whole columns (False: :func:`product_segment_sums`).
        reserve: bytes held beside the block whatever its width (the block's drawn signs).

    Returns:
        ``(columns, bytes)`` of the block.
    """
    dim = op.shape[0]
    itemsize = torch.empty((), dtype=op.dtype).element_size()
    per_column = dim * (itemsize * int(vectors) + (8 if float64_sums else 0))
    plan = memory.current()
    fit = plan.count_that_fit(per_column, reserve=reserve)
    if fit < 1:
        plan.require(
            f"{what}: one probe and its product",
            per_column + int(reserve),
            "lower `batch_size` or `cache_mb`",
        )
    columns = min(int(block_size), fit)
    if columns < int(block_size):
        plan.note(f"{what}: blocks of {columns} probes (not {block_size}) to fit the memory budget")
    return columns, columns * per_column


def layer_dict(names, mean, stderr, offset=None) -> dict:
    """Per-layer estimates from rows ``(total, layer 1, ..., layer L)``.

    Args:
        names: the layers, in block order.
        mean: ``(1 + L,)`` means.
        stderr: ``(1 + L,)`` standard errors.
        offset: ``(1 + L,)`` exactly known parts added to the means (optional).

    Returns:
        ``{layer: {"estimate", "stderr"}}``.
    """
    out = {}
    for i, name in enumerate(names):
        est = float(mean[i + 1]) + (float(offset[i + 1]) if offset is not None else 0.0)
        out[name] = {"estimate": est, "stderr": float(stderr[i + 1])}
    return out


def report_probes(run, matvecs: int, probes: int, estimate, stderr, tol: float, spent: int):
    """Report an estimate after ``probes`` probes and the matvecs at which it projects to stop.

    The standard error falls as ``1/sqrt(n)``, so ``n_stop = n (stderr / (tol |estimate|))^2``
    probes, capped by the budget. Costs two scalar copies to the host per block of probes and
    nothing without a listener.

    Args:
        run: the progress run.
        matvecs: the products so far.
        probes: the probes so far (one product each).
        estimate: the current estimate.
        stderr: its standard error.
        tol: the relative standard error wanted.
        spent: products spent on other things (a sketch).
    """
    if run.finished:
        return
    estimate, stderr = float(estimate), float(stderr)
    expected = None
    if math.isfinite(stderr) and estimate != 0:
        needed = probes * (stderr / (tol * abs(estimate))) ** 2
        expected = min(run.total or matvecs, spent + max(matvecs - spent, math.ceil(needed)))
    run.update(matvecs, probes=probes, estimate=estimate, stderr=stderr, expected=expected)


def pilot_size(min_samples: int, budget: int) -> int:
    """The pilot's probes: :data:`PILOT_PROBES` within a tenth of the budget, at least
    ``max(2, min_samples)``; 0 where the budget cannot hold a pilot and a main sample of that
    least size each (the budget is then one fixed sample).

    Args:
        min_samples: the least probes of a pilot and of a main sample.
        budget: the products left for probes.

    Returns:
        The pilot's probe count (0: no pilot).
    """
    least = max(2, int(min_samples))
    if int(budget) < 2 * least:
        return 0
    return max(least, min(PILOT_PROBES, int(budget) // 10))


def planned_probes(
    estimate: float, stderr: float, n: int, *, tol: float, least: int, room: int
) -> int:
    """The main sample's probes from a pilot's estimate and standard error (module docstring).

    Args:
        estimate: the pilot's estimate of the whole quantity (exact parts included).
        stderr: the pilot's standard error of it (``n`` probes).
        n: the pilot's probes.
        tol: the relative standard error wanted.
        least: the fewest main probes.
        room: the products left.

    Returns:
        ``N``, at least ``min(least, room)`` and at most ``room``.
    """
    estimate, stderr = float(estimate), float(stderr)
    if not (math.isfinite(stderr) and math.isfinite(estimate)) or estimate == 0 or tol <= 0:
        return int(room)
    needed = PILOT_MARGIN * n * (stderr / (tol * abs(estimate))) ** 2
    return int(min(int(room), max(int(least), math.ceil(needed))))
