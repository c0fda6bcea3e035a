r"""Hutchinson's trace estimator and the squared Frobenius norm, with per-layer parts.

- :func:`hutchinson`: :math:`\mathrm{tr}(A) = \mathbb{E}[g^\top A g]` for Rademacher
  :math:`g` [Hutchinson1989]; per layer :math:`\mathrm{tr}(A_{bb}) = \mathbb{E}[g_b^\top (A g)_b]`
  from the same probes, so layer traces sum to the total probe by probe.
- :func:`frobenius_sq`: :math:`\mathrm{Tr}(A^2) = \lVert A \rVert_F^2 = \mathbb{E}\lVert A g
  \rVert^2` (the flatness of [FA] eq. 1); per layer
  :math:`\mathbb{E}\lVert (A g)_b \rVert^2 = \mathrm{Tr}((A^2)_{bb})`.
- :func:`hutchinson_trace`: the trace estimator ``hutchinson`` of ``sharp trace --estimator``
  (:mod:`sharpcli.curvature.trace.estimators`), declared here; :func:`probed` runs an estimator of
  ``tr(A)`` or :func:`frobenius_sq` as a request asks.

Both size their sample in two stages (:mod:`sharpcli.curvature.trace.probes`): a pilot of
``min_samples`` probes, then the probes it says ``tol`` needs (at most ``max_matvecs`` in
all), whose mean and standard error are reported. Hutch++, the exact and the sampled-label
Gauss-Newton traces live in :mod:`~sharpcli.curvature.trace.hutchpp`,
:mod:`~sharpcli.curvature.trace.ggn` and :mod:`~sharpcli.curvature.trace.sampled_ggn`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from sharpcli import memory, progress
from sharpcli.catalogue.values import TRACE_KEY
from sharpcli.curvature.products.batch_forms import can_record, recording, square_error
from sharpcli.curvature.products.scope import RademacherColumns, rademacher_bits_bytes
from sharpcli.curvature.trace.probes import (
    PerBatchTrace,
    TraceResult,
    blocks_of,
    check_budget,
    layer_dict,
    mean_stderr,
    pilot_size,
    planned_probes,
    probe_block,
    product_segment_sums,
    report_probes,
)
from sharpcli.registry import declare

if TYPE_CHECKING:
    from sharpcli.curvature.trace.estimators import TraceRequest

__all__ = ["HUTCHINSON", "frobenius_sq", "hutchinson", "hutchinson_trace", "probed"]

# the trace estimator's name (``--estimator``), declared by :func:`hutchinson_trace`; the label
# of the results and of the progress of :func:`hutchinson`
HUTCHINSON = "hutchinson"


class _Probes:
    """Rademacher probes of ``op`` drawn in blocks: per probe the (1 + L) row of
    ``g^T A g`` (``quantity="trace"``) or ``||A g||^2`` values, total then per layer."""

    def __init__(
        self,
        op,
        quantity: str,
        blocks: dict,
        seed: int,
        block_size: int,
        columns: int,
        data_error: bool = True,
    ):
        self.op, self.quantity, self.blocks = op, quantity, blocks
        generator = torch.Generator().manual_seed(int(seed))
        self.probes = RademacherColumns(op.shape[0], generator, op.dtype, op.device, columns)
        self.block_size = int(block_size)
        self.matvecs = 0
        self.expected: int | None = None  # the products planned, once the pilot has run
        # the main sample's per-batch values g^T A_b g (the trace's data error)
        self.per_batch = PerBatchTrace()
        # Tr(A^2)'s data error: the main sample's first block (G, A G), multiplied once more
        # with its per-batch forms (A G)^T A_b G recorded (square_data_error)
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None
        self.keep = quantity != TRACE_KEY and data_error and can_record(op)
        self.data_matvecs = 0

    def draw(self, count: int, run, tol: float) -> torch.Tensor:
        """``count`` probes' rows, reported to ``run`` block by block.

        Each probe is expanded from the next bits of the generator
        (:class:`~sharpcli.curvature.products.scope.RademacherColumns`), so the same seed gives the
        same probes whatever the block size and the memory budget.

        Args:
            count: the probes.
            run: the progress run.
            tol: the relative standard error wanted (for the projected stop).

        Returns:
            ``(count, 1 + L)`` float64 rows.
        """
        op = self.op
        rows: list[torch.Tensor] = []
        drawn = 0
        while drawn < count:
            k = min(self.block_size, count - drawn)
            for G in self.probes.blocks(k):
                if self.expected is None or self.quantity != TRACE_KEY:
                    AG = op.matmat(G)
                else:  # the main sample: its per-batch quadratic forms, at no product
                    with recording(op, G) as forms:
                        AG = op.matmat(G)
                    taken = None if forms is None else forms.take()
                    self.per_batch.add(
                        None if taken is None else (taken[0].diagonal(dim1=1, dim2=2), taken[1])
                    )
                left = G if self.quantity == TRACE_KEY else AG
                rows.append(product_segment_sums(left, AG, self.blocks).T)
                if self.keep and self.expected is not None and self.kept is None:
                    self.kept = (G.clone(), AG)  # G is a view the next block overwrites
                del G, AG, left
            drawn += k
            self.matvecs += k
            mean, stderr = mean_stderr(torch.cat(rows))
            if self.expected is None:  # the pilot: project the stop from its probes
                report_probes(run, self.matvecs, drawn, mean[0], stderr[0], tol, 0)
            else:
                run.update(
                    self.matvecs,
                    probes=drawn,
                    estimate=float(mean[0]),
                    stderr=float(stderr[0]),
                    expected=self.expected,
                )
        return torch.cat(rows)

    def square_data_error(self):
        """``Tr(A^2)``'s data error from the kept block: one more product of its probes ``G``
        with the per-batch forms ``(A G)^T A_b G`` recorded
        (:func:`~sharpcli.curvature.products.batch_forms.square_error`); None without a kept
        block."""
        if self.kept is None:
            return None
        G, AG = self.kept
        self.kept = None
        with recording(self.op, AG) as forms:
            self.op.matmat(G)
        self.data_matvecs = int(G.shape[1])
        taken = None if forms is None else forms.take()
        if taken is None:
            return None
        return square_error(taken[0].diagonal(dim1=1, dim2=2), taken[1])


def _probe_loop(
    op, quantity, *, tol, max_matvecs, seed, block_size, min_samples, blocks, data_error=True
) -> TraceResult:
    """Shared Hutchinson-type loop, the sample sized in two stages
    (:mod:`sharpcli.curvature.trace.probes`), ``blocks`` resolved by
    :func:`~sharpcli.curvature.trace.probes.blocks_of`.

    Returns:
        The main sample's :class:`TraceResult`: ``converged`` says whether its standard error
        reached ``tol`` relative to its mean, ``data`` is the batch-means data error (None for
        an operator without batches, and for ``Tr(A^2)`` without ``data_error``): the trace's
        from the probes' own products, ``Tr(A^2)``'s to first order from ``data_matvecs`` more
        products (one block).
    """
    blocks = blocks_of(op, blocks)
    check_budget(tol, max_matvecs, block_size)
    budget = int(max_matvecs)
    name = "tr" if quantity == TRACE_KEY else "Tr(A^2)"
    # a block's probes are drawn together, as bits (rademacher_bits)
    signs = rademacher_bits_bytes(op.shape[0], block_size)
    # per column: the probe, its product and the product's per-parameter pieces while it is
    # assembled (autograd's results); the per-layer sums are taken a chunk at a time
    columns, held = probe_block(
        op, block_size, vectors=3, what="Hutchinson", float64_sums=False, reserve=signs
    )
    probes = _Probes(op, quantity, blocks, seed, block_size, columns, data_error)
    with (
        memory.current().hold("probe block", held + signs),
        progress.start(HUTCHINSON, total=budget, quantity=name, capped=True) as run,
    ):
        pilot = pilot_size(min_samples, budget)
        count = budget
        if not pilot:
            probes.expected = budget
        if pilot:
            mean, stderr = mean_stderr(probes.draw(pilot, run, tol))
            count = planned_probes(
                float(mean[0]),
                float(stderr[0]),
                pilot,
                tol=tol,
                least=max(2, int(min_samples)),
                room=budget - pilot,
            )
            probes.expected = pilot + count
        samples = probes.draw(count, run, tol)
        mean, stderr = mean_stderr(samples)
        data = probes.per_batch.error() if quantity == TRACE_KEY else probes.square_data_error()
        run.finish(
            probes.matvecs,
            probes=samples.shape[0],
            estimate=float(mean[0]),
            stderr=float(stderr[0]),
        )
    return TraceResult(
        estimate=float(mean[0]),
        stderr=float(stderr[0]),
        matvecs=probes.matvecs,
        samples=samples.shape[0],
        estimator=HUTCHINSON,
        quantity=TRACE_KEY if quantity == TRACE_KEY else "trace_of_square",
        converged=bool(stderr[0] <= tol * abs(mean[0])),
        tol=tol,
        by_layer=layer_dict(list(blocks), mean, stderr),
        data=data,
        data_matvecs=probes.data_matvecs,
    )


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
        tol: the relative standard error the main sample is sized for.
        max_matvecs: the most products.
        seed: seeds the probes.
        block_size: probes per product block (fewer when the memory plan says so).
        min_samples: the pilot's probes, and the fewest main probes.
        blocks: ``{layer: slice}`` of the per-layer traces; default the operator's own
            (:meth:`~sharpcli.curvature.operators.hessian.CurvatureOperator.blocks`).

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
    return _probe_loop(
        op,
        TRACE_KEY,
        tol=tol,
        max_matvecs=max_matvecs,
        seed=seed,
        block_size=block_size,
        min_samples=min_samples,
        blocks=blocks,
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
    data_error: bool = True,
) -> TraceResult:
    r"""The squared Frobenius norm, the flatness of [FA] eq. 1, with per-layer parts.

    .. math::

        \mathrm{Tr}(A^2) = \lVert A \rVert_F^2 = \mathbb{E}_g \lVert A g \rVert^2, \qquad
        \mathrm{Tr}((A^2)_{bb}) = \mathbb{E}_g \lVert (A g)_b \rVert^2

    for Rademacher :math:`g` (the per-layer part is the squared norm of block b's rows).
    Its data error (``data_error``, an operator with batches) is first order: batch means of
    :math:`2 (A g)^\top A_b g` over the main sample's first block of probes, multiplied once
    more (``data_matvecs``: ``block_size`` products at most, beyond ``max_matvecs``;
    :func:`~sharpcli.curvature.products.batch_forms.square_error`).

    Args:
        op: a symmetric operator (``shape``, ``dtype``, ``device``, ``matmat``).
        tol: the relative standard error the main sample is sized for.
        max_matvecs: the most products.
        seed: seeds the probes.
        block_size: probes per product block.
        min_samples: the pilot's probes, and the fewest main probes.
        blocks: ``{layer: slice}``; default the operator's own.
        data_error: compute the data error (one more block of products).

    Returns:
        A :class:`TraceResult` with ``quantity="trace_of_square"``.

    Example:
        >>> import torch
        >>> from sharpcli.curvature import MatrixOperator
        >>> A = MatrixOperator(torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64)))
        >>> frobenius_sq(A, max_matvecs=16).estimate  # |g_i| = 1: exact per probe
        5.0
    """
    return _probe_loop(
        op,
        "square",
        tol=tol,
        max_matvecs=max_matvecs,
        seed=seed,
        block_size=block_size,
        min_samples=min_samples,
        blocks=blocks,
        data_error=data_error,
    )


def probed(estimate: Callable[..., TraceResult], request: TraceRequest) -> TraceResult:
    """``estimate`` on the request's operator, or ``Tr(A^2)`` by Hutchinson on ``A^2`` ([FA] eq. 1).

    Args:
        estimate: an estimator of ``tr(A)`` taking the operator, ``tol``, ``max_matvecs`` and
            ``seed`` (:func:`hutchinson`, :func:`~sharpcli.curvature.trace.hutchpp.hutchpp`).
        request: the operator and the budget.
    """
    op, r = request.build(), request
    if r.square:
        return frobenius_sq(op, tol=r.tol, max_matvecs=r.max_matvecs, seed=r.seed)
    return estimate(op, tol=r.tol, max_matvecs=r.max_matvecs, seed=r.seed)


@declare(
    "estimator",
    HUTCHINSON,
    "Rademacher probes until the stderr meets tol",
    paper="Hutchinson1989",
    info={"order": 2},
)
def hutchinson_trace(request: TraceRequest) -> TraceResult:
    """``tr(A) = E[g^T A g]`` over Rademacher probes ([Hutchinson1989]); ``Tr(A^2)`` likewise.

    The probes are counted in two stages, a pilot then what ``tol`` asks (:func:`hutchinson`).

    Args:
        request: the operator and the budget.
    """
    return probed(hutchinson, request)
