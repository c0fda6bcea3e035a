r"""Adaptive Hutch++ [Hutch++]: an exact trace on a sketched top subspace plus Hutchinson.

.. math::

    \mathrm{tr}(A) = \mathrm{tr}(Q^\top A Q) + \mathrm{tr}(P A P), \qquad
    Q = \mathrm{orth}(A S), \quad P = I - Q Q^\top,

the first term exact, the second by Rademacher probes :math:`g^\top P A P g`. Per layer b,
with :math:`\Pi = Q Q^\top`,
:math:`\mathrm{tr}(A_{bb}) = \mathrm{tr}((\Pi A + A \Pi - \Pi A \Pi)_{bb})
+ \mathbb{E}[g_b^\top (P A P g)_b]`. The sketch grows while its probes say it pays; the
residual is then sampled in two stages (:mod:`sharpcli.curvature.trace.probes`): the probes seen
while the sketch grew are the pilot, and fresh probes under the final sketch give the
reported estimate.

The standard error. For ANY orthonormal ``Q`` the split is an identity,
:math:`\mathrm{tr}(Q^\top A Q) + \mathrm{tr}(P A P) = \mathrm{tr}(A)`, so given the sketch the
estimate is unbiased and its whole error is the residual probes' mean: the sketch's
randomness adds no variance term, only a different residual per sketch, and the probes'
spread under that sketch is the error to report. Two things keep that error honest. The
identity needs an orthonormal ``Q`` (one that has lost orthogonality biases the estimate by
more than any probe count removes), so :class:`RangeSketch` keeps it orthonormal and checks
it. And a variance from the main sample alone would rest on as few as ``min_samples``
probes when the sketch holds most of the trace, too few degrees of freedom for a skewed
quadratic form, so it is pooled with the pilot's probes re-valued under the final sketch
(each group about its own mean, :func:`~sharpcli.curvature.trace.probes.pooled_stderr`):
30 + 10 probes give 38 degrees of freedom, at no product. The mean stays the main
sample's. The exact part's rounding
(:meth:`RangeSketch.rounding_stderr`) is added in quadrature: it
is all that is left when the sketch spans the operator's range.

:func:`hutchpp_trace` is the trace estimator ``hutchpp`` of ``sharp trace --estimator``
(:mod:`sharpcli.curvature.trace.estimators`), the default, declared here.

The range sketch (:class:`RangeSketch`): ``Q`` spans :math:`A S` for a Gaussian :math:`S`,
with :math:`A = (\Pi A + A \Pi - \Pi A \Pi) + P A P`. With a ``Q`` that is not orthonormal,
:math:`\mathrm{tr}(Q^\top A Q) + \mathrm{E}[g^\top P A P g]` is no longer
:math:`\mathrm{tr}(A)`, whatever the number of probes; hence the sketch keeps its basis
orthonormal:

- the new columns of :math:`A S` are orthogonalised against the basis by classical
  Gram-Schmidt applied twice ("twice is enough", [Parlett1998] section 6.9), as a block, then
  against each other one column at a time;
- a column whose norm after the second pass is at most :data:`RANK_RTOL` times the operator's
  scale (the largest column of :math:`A S` seen, not the block's own largest pivot), or that
  the second pass shrank by more than :math:`1/\sqrt 2`, lies in the basis's span to rounding
  and is dropped. Dropping a direction biases nothing: it stays in :math:`P A P`, which the
  probes sample without bias. Fewer columns kept than drawn means :math:`A S` brought nothing
  new: the sketch spans the operator's range (to that tolerance) and stops growing there,
  instead of filling up with rounding noise past the operator's rank;
- every extension's orthogonality is measured (:math:`\lVert [Q\ Q_n]^\top Q_n - [0; I] \rVert`)
  and an extension above :data:`ORTH_TOL` is discarded, never used.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from sharpcli import memory, progress
from sharpcli.curvature.products.batch_forms import recording
from sharpcli.curvature.products.scope import gaussian_like, rademacher_like
from sharpcli.curvature.trace.hutchinson import hutchinson, probed
from sharpcli.curvature.trace.probes import (
    PerBatchTrace,
    TraceResult,
    blocks_of,
    check_budget,
    mean_stderr,
    pilot_size,
    planned_probes,
    pooled_stderr,
    probe_block,
    report_probes,
    segment_sums,
)
from sharpcli.registry import declare

if TYPE_CHECKING:
    from sharpcli.curvature.trace.estimators import TraceRequest

__all__ = ["HUTCHPP", "ORTH_TOL", "RANK_RTOL", "RangeSketch", "hutchpp", "hutchpp_trace"]

# the trace estimator's name (``--estimator``, its default), declared by :func:`hutchpp_trace`;
# the label of the results of :func:`hutchpp`
HUTCHPP = "hutchpp"


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

    for Gaussian ``S``, the second term by Rademacher probes ``g`` as ``g^T P A P g = (Pg)^T (A g - AQ Q^T g)``
    (one matvec per probe). Per layer b, ``tr(A_bb) = tr((Pi A + A Pi - Pi A Pi)_bb)``
    (exact, :class:`~sharpcli.curvature.trace.hutchpp.RangeSketch`) ``+ E[g_b^T (P A P g)_b]``, with
    ``P A P g = A P g - Q (Q^T A P g)`` from the same product. The standard error is that of
    the residual probes' mean (the sketch part is exact given an orthonormal Q), with the
    variance pooled from the pilot's probes, plus the exact part's rounding (the module
    docstring). Adaptivity:
    starting from ``initial_sketch`` columns, once ``min_samples`` residual probes exist, the
    sketch is doubled (``2 s`` matvecs) while the estimated remaining probes exceed ``3 s`` and
    the previous doubling reduced the estimated number of probes still needed by at least its
    own cost; stored residual probes are re-evaluated for the new Q at no matvec cost (from
    the stored ``A g``, as above).
    ``initial_sketch=0`` starts as plain Hutchinson and sketches (16 columns, then doubling)
    only when the first probes say it pays. ``known`` (total, then per block) is an exactly
    known part of the trace added to the estimate, so ``tol`` is relative to the sum (the
    control variate of :func:`~sharpcli.curvature.trace.ggn.gn_split_trace`).
    Memory: ``2 s`` P-vectors plus the probes stored until the sketch stops growing.

    Args:
        op: a symmetric operator (``shape``, ``dtype``, ``device``, ``matmat``).
        tol: the relative standard error the residual's main sample is sized for.
        max_matvecs: the most products (sketch and probes).
        seed: seeds the sketch and the probes.
        block_size: probes per product block.
        min_samples: the pilot's residual probes before the first doubling, and the fewest
            main probes.
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
    check_budget(tol, max_matvecs, block_size)
    with progress.start("hutch++", total=max_matvecs, quantity="tr", capped=True) as run:
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

    blocks = blocks_of(op, blocks)
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
        self.sketch = RangeSketch(op.shape[0], op.dtype, op.device)
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
        self.pilot_rows: torch.Tensor | None = None
        # the main sample's per-batch residual values (the data error); None while piloting
        self.per_batch: PerBatchTrace | None = None

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
        if self.per_batch is None:
            AG = op.matmat(G)
        else:  # the main sample: [G Q]^T A_b G per batch, at no product
            with recording(op, torch.cat([G, self.sketch.Q], 1)) as forms:
                AG = op.matmat(G)
            self.per_batch.add(self.sketch.batch_residuals(G, forms))
        self.matvecs += k
        if self.growing:
            self.stored.append((G, AG))
        self.rows.append(self.sketch.residual_values(G, AG, self.blocks))
        samples = torch.cat(self.rows)
        mean, stderr = mean_stderr(samples)
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
            new_mean, new_stderr = mean_stderr(torch.cat(self.rows))
            new_target = _probes_needed(new_stderr[0], n, self.exact[0] + new_mean[0], tol)
            self.growing = not (
                target - new_target < 2 * step
                or self.sketch.size >= self.cap
                or self.sketch.exhausted
            )
        else:
            self.growing = False
        if not self.growing:
            self.stored = []

    def result(self, converged: bool, tol: float) -> TraceResult:
        """The estimate: the sketch's exact part plus the residual probes' mean.

        Args:
            converged: whether the standard error reached ``tol``.
            tol: the tolerance, recorded.

        Returns:
            The :class:`TraceResult`.
        """
        notes = []
        if self.rows:
            mean, stderr = mean_stderr(torch.cat(self.rows))
            if self.pilot_rows is not None:  # the variance from the pilot's probes too
                stderr = pooled_stderr(torch.cat(self.rows), self.pilot_rows)
        else:
            mean = torch.zeros(1 + len(self.blocks), dtype=torch.float64)
            stderr = torch.zeros_like(mean)
        sketch = self.sketch
        if sketch.size == self.op.shape[0]:  # orthonormal and square: P = 0
            stderr = torch.zeros_like(stderr)
            mean = torch.zeros_like(mean)
            notes.append("the sketch spans the whole space: the trace is exact up to rounding")
        elif sketch.exhausted and sketch.lost is None:
            notes.append(
                f"the sketch spans the operator's range (rank {sketch.size}): it stopped "
                "growing there, and the probes sample what is left"
            )
        if sketch.lost is not None:
            notes.append(
                f"a sketch extension lost orthogonality (|Q^T Q - I| = {sketch.lost:.2g}) and "
                f"was discarded: the estimate uses the {sketch.size} orthonormal directions"
            )
        # the exact part's rounding, which the probes cannot see (:meth:`rounding_stderr`)
        stderr = torch.sqrt(stderr**2 + sketch.rounding_stderr() ** 2)
        converged = converged and bool(stderr[0] <= tol * abs(self.exact[0] + mean[0]))
        total = self.exact + mean
        by_layer = {
            name: {"estimate": float(total[i + 1]), "stderr": float(stderr[i + 1])}
            for i, name in enumerate(self.blocks)
        }
        data = None
        exact_per_batch = self.sketch.batch_exact_part()
        if exact_per_batch is not None and not bool(self.offset.any()):  # no known part
            data = (
                self.per_batch.error(exact_per_batch)
                if self.per_batch is not None and self.rows
                else PerBatchTrace.exact(exact_per_batch, self.sketch.batch_sizes)
            )
        return TraceResult(
            estimate=float(total[0]),
            stderr=float(stderr[0]),
            matvecs=self.matvecs,
            samples=sum(r.shape[0] for r in self.rows),
            estimator=HUTCHPP,
            converged=converged,
            tol=tol,
            by_layer=by_layer,
            sketch_size=self.sketch.size,
            notes=notes,
            data=data,
        )


def _probes_needed(stderr, n: int, estimate, tol: float):
    """The probes that would bring the standard error to ``tol |estimate|``."""
    return (stderr * math.sqrt(n) / (tol * abs(estimate) + 1e-300)) ** 2


def _pilot(state: _AdaptiveSketch, budget: int, block_size: int, pilot: int, least: int, tol):
    """The pilot of :func:`_hutchpp_loop`: residual probes while the sketch may grow (at least
    ``pilot``), leaving ``least`` products for the main sample unless the sketch may come to
    span the space.

    Args:
        state: the loop's state.
        budget: the most products.
        block_size: probes per product block.
        pilot: the fewest pilot probes.
        least: the fewest main probes.
        tol: the relative standard error wanted.

    Returns:
        The pilot's probe count (its rows in ``state.rows``, under the final sketch).
    """
    dim = state.op.shape[0]
    reserve = 0 if state.cap >= dim else least
    n = 0
    while state.matvecs + least < budget:
        n, estimate, stderr = state.probe(min(int(block_size), budget - least - state.matvecs))
        report_probes(state.run, state.matvecs, n, estimate, stderr, tol, state.matvecs - n)
        if n < pilot:
            continue
        if state.growing:
            state.consider_growing(n, estimate, stderr, tol, budget - reserve)
        if not state.growing or state.sketch.size == dim:
            break
    return n


def _hutchpp_loop(
    op, run, tol, budget, seed, block_size, min_samples, initial_sketch, cap, blocks, known
) -> TraceResult:
    """The adaptive Hutch++ iteration of :func:`hutchpp` with a sketch of at most ``cap``.

    The residual probes drawn while the sketch may still grow are the pilot (re-evaluated
    under the final sketch); fresh probes, as many as the pilot says ``tol`` needs, give the
    estimate (:mod:`sharpcli.curvature.trace.probes`).
    """
    dim = op.shape[0]
    state = _AdaptiveSketch(op, run, blocks, cap, torch.Generator().manual_seed(int(seed)), known)
    first = min(int(initial_sketch), cap)
    if first > 0:
        state.extend(first)
    state.growing = state.sketch.size < cap
    least = max(2, int(min_samples))
    pilot = pilot_size(min_samples, budget - state.matvecs) if state.sketch.size < dim else 0
    if pilot:
        pilot = _pilot(state, budget, block_size, pilot, least, tol)
    if state.sketch.size == dim:
        return state.result(True, tol)
    count = budget - state.matvecs
    if pilot:
        mean, stderr = mean_stderr(torch.cat(state.rows))
        # probes cannot bring the error below the exact part's rounding: a trace near 0 (an
        # NME's) is sized for that, not for a tolerance relative to 0
        reachable = max(abs(float(state.exact[0] + mean[0])), state.sketch.rounding_stderr() / tol)
        count = planned_probes(
            reachable,
            float(stderr[0]),
            pilot,
            tol=tol,
            least=least,
            room=count,
        )
    state.pilot_rows = torch.cat(state.rows) if state.rows else None
    state.growing, state.stored, state.rows = False, [], []
    state.per_batch = PerBatchTrace()
    expected = state.matvecs + count
    drawn, estimate, stderr = 0, state.exact[0], torch.tensor(float("inf"))
    while drawn < count:
        drawn, estimate, stderr = state.probe(min(int(block_size), count - drawn))
        run.update(
            state.matvecs,
            probes=drawn,
            estimate=float(estimate),
            stderr=float(stderr),
            expected=expected,
        )
    return state.result(bool(stderr <= tol * abs(estimate)), tol)


@declare(
    "estimator",
    HUTCHPP,
    "top subspace exactly, Hutchinson on the rest",
    paper="Hutch++",
    info={"default": True, "order": 1},
)
def hutchpp_trace(request: TraceRequest) -> TraceResult:
    """``tr(A)`` by Hutch++ ([Hutch++]); ``Tr(A^2)`` by Hutchinson on ``A^2`` ([FA] eq. 1).

    Args:
        request: the operator and the budget.
    """
    return probed(hutchpp, request)


def _sqrt_eps(dtype: torch.dtype) -> float:
    return math.sqrt(torch.finfo(dtype).eps)


#: Columns whose part outside the basis is below this fraction (times sqrt(eps) of the
#: products' dtype) of the operator's scale are rounding, not range: 1.5e-8 in float64.
RANK_RTOL = 1.0
#: The largest ``|Q^T Q - I|`` entry an extension may leave, times sqrt(eps) of the dtype.
ORTH_TOL = 1.0


#: The most bytes of the per-batch sketch matrices ``Q^T A_b Q`` (K s^2 float64) kept for the
#: data error; beyond it (thousands of batches with a large sketch) the data error is not given.
BATCH_SKETCH_BYTES = 256 << 20


class RangeSketch:
    """Orthonormal ``Q`` (P, s) spanning ``A S`` for Gaussian ``S``, with ``AQ``; the exact part
    ``tr(Q^T A Q)`` and its layer split, and the residual's per-probe values (module docstring).

    ``exhausted`` turns true once an extension brings fewer new directions than it drew
    (the range is spanned); ``lost`` holds the orthogonality error of a discarded extension.
    """

    def __init__(self, dim: int, dtype: torch.dtype, device):
        self.Q = torch.zeros(dim, 0, dtype=dtype, device=device)
        self.AQ = torch.zeros(dim, 0, dtype=dtype, device=device)
        self.scale = 0.0
        self.exhausted = False
        self.lost: float | None = None
        # per batch Q^T A_b Q, (K, s, s), recorded with A Q (the data error); None if lost
        self.batch_M: torch.Tensor | None = torch.zeros(0, 0, 0, dtype=torch.float64)
        self.batch_sizes: list[int] = []

    @property
    def size(self) -> int:
        """The basis's columns."""
        return self.Q.shape[1]

    def extend(self, op, columns: int, generator) -> int:
        """Draw ``columns`` Gaussian ``S``, add the new directions of ``A S`` to the basis.

        Args:
            op: the symmetric operator (``shape``, ``dtype``, ``device``, ``matmat``).
            columns: the columns of ``S``.
            generator: the random generator of ``S``.

        Returns:
            The products used: ``columns`` for ``A S``, one per kept column for ``A Q_n``.
        """
        # Gaussian, not Rademacher: a Gaussian S has full rank with probability 1, so fewer
        # new directions than columns means the range is spanned (two Rademacher columns of a
        # 2-vector are parallel half the time)
        S = gaussian_like(op.shape[0], generator, op.dtype, op.device, columns)
        Y = op.matmat(S)
        del S
        self.scale = max(self.scale, float(torch.linalg.vector_norm(Y, dim=0).max()))
        new = self._orthonormal_columns(Y)
        del Y
        if new.shape[1] < columns:
            self.exhausted = True
        if new.shape[1] == 0:
            return columns
        error = self._orthogonality_error(new)
        if error > ORTH_TOL * _sqrt_eps(new.dtype):
            self.lost = error
            self.exhausted = True
            return columns
        with recording(op, torch.cat([self.Q, new], 1)) as forms:
            self.AQ = torch.cat([self.AQ, op.matmat(new)], 1)
        self._add_batch_forms(forms)
        self.Q = torch.cat([self.Q, new], 1)
        return columns + new.shape[1]

    def _add_batch_forms(self, forms) -> None:
        """Grow the per-batch ``Q^T A_b Q`` by the new columns' ``[Q new]^T A_b new``."""
        taken = None if forms is None else forms.take()
        if taken is None or self.batch_M is None:
            self.batch_M = None
            return
        block, self.batch_sizes = taken  # (K, s + n, n)
        if block.shape[0] * block.shape[1] ** 2 * 8 > BATCH_SKETCH_BYTES:
            self.batch_M = None  # too many batches times too large a sketch: no data error
            return
        old = self.size
        if self.batch_M.shape[0] == 0:
            self.batch_M = torch.zeros(block.shape[0], 0, 0, dtype=torch.float64)
        M = torch.zeros(block.shape[0], block.shape[1], block.shape[1], dtype=torch.float64)
        M[:, :old, :old] = self.batch_M
        M[:, :, old:] = block
        M[:, old:, :old] = block[:, :old].transpose(1, 2)
        self.batch_M = M

    def batch_exact_part(self) -> torch.Tensor | None:
        """``(K,)``: the sketch's exact trace per batch, ``tr(Q^T A_b Q)`` (None if unknown)."""
        if self.batch_M is None:
            return None
        if self.size == 0:
            return torch.zeros(0, dtype=torch.float64) if not self.batch_sizes else None
        return self.batch_M.diagonal(dim1=1, dim2=2).sum(1)

    def batch_residuals(self, G: torch.Tensor, forms) -> tuple[torch.Tensor, list[int]] | None:
        r"""``(K, k)`` per-batch residual values :math:`(P g)^\top A_b (P g)` of probes ``G``.

        With :math:`c = Q^\top g`: :math:`g^\top A_b g - 2 c^\top Q^\top A_b g +
        c^\top (Q^\top A_b Q) c`, from the recorded :math:`[G\ Q]^\top A_b G`; summed over the
        batches, the residual value of :meth:`residual_values`.

        Args:
            G: ``(P, k)`` probes.
            forms: the recorder of their product (None: not recorded).

        Returns:
            ``(values, batch sizes)``, or None.
        """
        taken = None if forms is None else forms.take()
        if taken is None or self.batch_M is None:
            return None
        block, sizes = taken
        k = G.shape[1]
        plain = block[:, :k].diagonal(dim1=1, dim2=2)  # g^T A_b g
        if self.size == 0:
            return plain, sizes
        c = (self.Q.T @ G).to(torch.float64).cpu()  # (s, k)
        cross = (c[None] * block[:, k:]).sum(1)  # c^T Q^T A_b g
        quad = (c[None] * (self.batch_M @ c[None])).sum(1)  # c^T M_b c
        return plain - 2 * cross + quad, sizes

    def _orthonormal_columns(self, Y: torch.Tensor) -> torch.Tensor:
        """The columns of ``Y`` that add a direction, orthonormal and orthogonal to ``Q``.

        CGS2 against ``Q`` as a block (two matrix products: the basis is read twice per
        extension, not per column), then CGS2 one column at a time within the block with the
        rank test of the module docstring, and one more block pass against ``Q``: a kept
        column's norm is above ``sqrt(eps)`` of the scale, so what rounding left of ``Q`` in
        it is at most ``sqrt(eps)`` after normalising, and that pass takes it to ``eps``.
        """
        for _ in range(2):
            Y -= self.Q @ (self.Q.T @ Y)
        floor = RANK_RTOL * _sqrt_eps(Y.dtype) * self.scale
        out = torch.empty_like(Y)
        kept = 0
        for j in range(Y.shape[1]):
            y = Y[:, j]
            norms = [float(torch.linalg.vector_norm(y))]
            for _ in range(2):
                if kept:
                    y -= out[:, :kept] @ (out[:, :kept].T @ y)
                norms.append(float(torch.linalg.vector_norm(y)))
            # in the span to rounding: below the operator's scale, or the second pass still
            # cancelled most of what the first left ("twice is enough")
            if norms[2] <= floor or norms[2] < norms[1] / math.sqrt(2):
                continue
            out[:, kept] = y / norms[2]
            kept += 1
        out = out[:, :kept]
        if kept and self.size:
            out -= self.Q @ (self.Q.T @ out)
        return out

    def _orthogonality_error(self, new: torch.Tensor) -> float:
        """``max |[Q new]^T new - [0; I]|``: how far the extended basis is from orthonormal."""
        inner = new.T @ new
        inner.diagonal().sub_(1)
        error = float(inner.abs().max())
        if self.size:
            error = max(error, float((self.Q.T @ new).abs().max()))
        return error

    def exact_part(self, blocks: dict) -> torch.Tensor:
        """``(1 + L,)``: the exact ``tr((Pi A + A Pi - Pi A Pi)_bb)`` per layer b, the total first.

        Per row ``i`` of ``Q``, ``2 <Q_i, (AQ)_i> - <Q_i M, Q_i>`` with ``M = Q^T A Q``
        (symmetrised): summed over all rows this is ``tr M`` for an orthonormal ``Q``. The
        total is the sum over the rows, so the layers sum to it wherever the blocks cover the
        parameters.

        Args:
            blocks: ``{layer: slice}``.

        Returns:
            ``(1 + L,)`` float64.
        """
        if self.size == 0:
            return torch.zeros(1 + len(blocks), dtype=torch.float64)
        M = self.Q.T @ self.AQ
        M = (M + M.T) / 2
        per_row = 2 * (self.Q * self.AQ).sum(1) - ((self.Q @ M) * self.Q).sum(1)
        return segment_sums(per_row[:, None], blocks)[:, 0]

    def rounding_stderr(self) -> float:
        r"""The rounding error that probes cannot see, as a standard error.

        Two parts, in quadrature: the asymmetry :math:`\lVert M - M^\top \rVert_F / \sqrt 2`
        of :math:`M = Q^\top (A Q)` as computed (``A`` is symmetric, so that is the products'
        rounding; with independent entry errors of standard deviation :math:`\sigma` it is
        about :math:`\sigma s`, the trace's :math:`\sigma \sqrt s` to a factor
        :math:`\sqrt s`), and :math:`\epsilon \sqrt P\, c` with :math:`c` the operator's
        scale (the largest :math:`\lVert A s \rVert`, about :math:`\lVert A \rVert_F`): the
        residual ``g^T P A P g`` is a difference of terms of that size, each rounded, and
        what the operator holds below the rank test's floor is of that order. Both matter
        only when the residual ``P A P`` vanishes (the sketch spans the range, or the whole
        space), where the probes' spread is 0 and rounding is the whole error.

        Returns:
            The standard error (0 without a sketch).
        """
        if self.size == 0:
            return 0.0
        M = (self.Q.T @ self.AQ).to(torch.float64)
        asymmetry = float(torch.linalg.matrix_norm(M - M.T)) / math.sqrt(2)
        residual = torch.finfo(self.Q.dtype).eps * math.sqrt(self.Q.shape[0]) * self.scale
        return math.hypot(asymmetry, residual)

    def residual_values(self, G, AG, blocks: dict) -> torch.Tensor:
        """``(k, 1 + L)`` Hutchinson values of ``P A P`` from probes ``G`` and products ``AG``.

        Per probe and layer ``g_b^T (P A P g)_b``, whose mean is ``tr((P A P)_bb)`` exactly,
        from the stored ``A g`` (no new product): ``A P g = A g - AQ (Q^T g)`` and
        ``P A P g = A P g - Q (Q^T A P g)``. Summed over the layers this is
        ``g^T P A P g = (P g)^T A (P g)``, the total's usual value.

        Args:
            G: ``(P, k)`` probes.
            AG: ``(P, k)`` their products.
            blocks: ``{layer: slice}``.

        Returns:
            ``(k, 1 + L)`` float64.
        """
        # (Pg)_b . (APg)_b would be cheaper but has mean tr(P E_b A P) = tr((A P)_bb), which
        # differs from tr((P A P)_bb) by tr((Pi A P)_bb): it sums to the right total but is
        # biased per layer against the exact part's tr((Pi A + A Pi - Pi A Pi)_bb).
        APG = AG - self.AQ @ (self.Q.T @ G)
        PAPG = APG - self.Q @ (self.Q.T @ APG)
        return segment_sums(G * PAPG, blocks).T
