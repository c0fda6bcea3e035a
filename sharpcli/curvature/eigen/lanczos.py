r"""Lanczos with full reorthogonalisation for extreme eigenvalues of a symmetric operator.

The method is [Lanczos1950]; the reorthogonalisation and the Ritz residual follow
[Parlett1998]. User guide: docs/commands/eigen.md. This module runs the iteration, its thick
restarts and its deflated rounds (:class:`LanczosRounds`, each round's :class:`LanczosState`);
the recurrence's step, Ritz values and residuals are in :mod:`~sharpcli.curvature.eigen.ritz`,
the basis and where it lives in :mod:`~sharpcli.curvature.eigen.krylov`, warm starts in
:mod:`~sharpcli.curvature.eigen.warm_start`.

A Ritz pair ``(theta, u)`` is *converged* when its reported residual satisfies

.. math::

    \|A u - \theta u\| \le \mathrm{tol}\, |\theta|

(default tol 1e-3) or is at the products' rounding level (``100 eps(dtype) ||T_m||``), which
covers zero eigenvalues. The iteration stops on the free estimate ``beta_m |e_m^T s|`` once all
requested Ritz values have converged, or when the matvec budget is spent; the *reported*
residual is the explicit ``||A u - theta u||`` (one more product per returned Ritz pair, in one
block) whenever the operator multiplies in less than float64 (``explicit_residuals=None``, the
default) or when asked (``explicit_residuals=True``); a pair whose explicit residual then fails
the test is reported as not converged. For a float64 operator the estimate agrees with the
explicit residual to rounding, so no product is spent on it unless asked.

A breakdown (``beta_m`` at rounding level) means an invariant subspace was found: its Ritz
values are exact eigenvalues. When the whole space fits the budget (P <= max_matvecs, tiny
problems) the iteration restarts with a fresh random vector orthogonal to Q and runs to
dimension P, so multiplicities are found and every eigenvalue is exact (for k >= 2 it runs to
dimension P whatever converges first); otherwise it stops and says so in ``breakdown``.

Repeated eigenvalues are counted by deflated restarts (below); ``result.multiplicity`` says
whether the k values are counted with multiplicity or the budget ran out first.

When the basis is full (memory plan, disk space or ``max_basis``) the iteration is
thick-restarted [Wu2000]: it keeps the wanted Ritz vectors (about half the basis), continues
from the last residual direction, and its Lanczos relation, Ritz estimates and explicit
residuals keep their meaning, so a restarted result carries the same certificate as an
unrestarted one.

Deflated restarts. A Krylov space ``K_m(A, q)`` holds one direction of each eigenspace (``q``'s projection onto
it), so Lanczos from one start vector finds each distinct eigenvalue once in exact arithmetic;
in floating point further copies of a repeated eigenvalue appear only where rounding has fed
them, haphazardly. :func:`lanczos` therefore *locks*
([Parlett1998], [ARPACK]): once the wanted Ritz pairs of a round have converged, they stay in
the basis as locked rows ``Y`` and Lanczos restarts from a fresh random vector orthogonal to
them. Every new vector is orthogonalised against the locked rows, so the next round iterates
on the deflated operator

.. math::

    (I - Y Y^T) A (I - Y Y^T),

whose spectrum on ``Y``'s complement is ``A``'s with one copy of each locked eigenvalue
removed: a repeated eigenvalue comes back in the next round and is locked again. A round's
converged Ritz value *enters* the k extreme values when it lies beyond the current k-th one by
more than both residuals (:func:`merge_round`); a value within them is another copy of the
k-th eigenvalue, which leaves the k values as they are. Rounds go on while one brings an entry;
the round that brings none verifies the count. Such a round stops as soon as its extreme Ritz
value lies on the inner side of the k-th value by more than both residuals with a residual of
``sqrt(tol) |theta|`` (:func:`round_is_enough`): on a spectrum without repeats the check costs a
few products. When the whole space fits the product budget, Lanczos spans it instead (every
eigenvalue exact, no round needed). A run that stops at its product budget before such a round
has converged cannot exclude further copies, and says so (:func:`multiplicity_record`).

Residuals. A round's Ritz pair ``(theta, u = Q s)`` with ``u`` orthogonal to the locked rows
satisfies ``A u - theta u = beta_m s_m q_{m+1} + Y F^T u`` with ``F = A Y - Y Theta`` (the
locked pairs' residuals, ``Y^T u = 0``), two orthogonal terms, so

.. math::

    \|A u - \theta u\| \le \sqrt{(\beta_m s_m)^2 + \textstyle\sum_i \|f_i\|^2},

which :func:`deflated_residual` reports: the certificate of a locked round is a bound, as
tight as the locked pairs' own residuals; a pair whose bound fails ``tol`` has its residual
measured with one product (:func:`bounded_residuals`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sharpcli import catalogue, memory, progress
from sharpcli.curvature.eigen.krylov import (
    KrylovBasis,
    plan_basis,
    ritz_end_bytes,
    storage_dtype,
)
from sharpcli.curvature.eigen.ritz import (
    QUANTITY,
    EigenResult,
    lanczos_step,
    measured_residuals,
    report_step,
    reported_numbers,
    ritz_residuals,
    select_ritz,
    skip_when_semiorthogonal,
    unit_random,
)
from sharpcli.curvature.eigen.warm_start import (
    DEFAULT_WARM_FRACTION,
    DEFAULT_WARM_STEPS,
    WARM_STARTS,
    WARM_TOL,
    gradient_start,
    warm_note,
    warm_operator,
)
from sharpcli.errors import UsageError

__all__ = [
    "DEFAULT_MAX_MATVECS",
    "WHICH",
    "bounded_residuals",
    "deflated_residual",
    "deflated_rounds",
    "first_breakdown",
    "LanczosRounds",
    "LanczosState",
    "lanczos",
    "merge_round",
    "multiplicity_note",
    "multiplicity_record",
    "Pair",
    "pair_coefficients",
    "round_is_enough",
]

DEFAULT_MAX_MATVECS = 100
WHICH = catalogue.WHICH
_F64 = torch.float64


def _check_args(op, top_k: int, which: str, tol: float) -> None:
    """Check the arguments of :func:`lanczos` that need no product.

    Args:
        op: the operator.
        top_k: the eigenvalues wanted.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        tol: the relative residual tolerance.

    Raises:
        UsageError: an unknown ``which``, ``top_k < 1``, ``tol <= 0`` or an empty scope.
    """
    if which not in WHICH:
        raise UsageError(f"which must be one of {', '.join(WHICH)}, got {which!r}", source="which")
    if int(top_k) < 1:
        raise UsageError(f"top-k must be >= 1, got {top_k}", source="top_k")
    if not tol > 0:
        raise UsageError(f"tolerance must be > 0, got {tol}", source="tol")
    if op.shape[0] < 1:
        raise UsageError("the operator has no parameters in scope", source="params")


def _budget(max_matvecs: int | None) -> int:
    """The product budget: ``max_matvecs`` or :data:`DEFAULT_MAX_MATVECS`.

    Args:
        max_matvecs: the user's bound, if any.

    Returns:
        The budget.

    Raises:
        UsageError: ``max_matvecs`` below 1.
    """
    if max_matvecs is not None and int(max_matvecs) < 1:
        raise UsageError(f"max matvecs must be >= 1, got {max_matvecs}", source="max_matvecs")
    return int(max_matvecs) if max_matvecs is not None else DEFAULT_MAX_MATVECS


def _warm_start_vector(op, warm_start, k: int, which: str, *, fraction, steps, seed):
    """The start vector of a warm start (:mod:`~sharpcli.curvature.eigen.warm_start`).

    ``"subsample"`` and operators: a few Lanczos steps on the warm operator, the start being
    the sum of its wanted Ritz vectors; ``"gradient"``: the loss gradient.

    Args:
        op: the full operator.
        warm_start: ``"subsample"``, ``"gradient"`` or an operator of ``op``'s shape.
        k: the wanted eigenvalues of each end.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        fraction: the subsample's fraction.
        steps: the warm phase's products (default ``max(4, wanted + 2)``).
        seed: seeds the subsample and the warm phase's start.

    Returns:
        ``(q_1, info)``: the float64 start vector and the warm-start record (what it cost).

    Raises:
        UsageError: an unknown warm start, ``steps < 1`` or a warm operator that cannot be built.
    """
    if isinstance(warm_start, str) and warm_start not in WARM_STARTS:
        raise UsageError(
            f"warm start must be one of {', '.join(WARM_STARTS)} or an operator, got "
            f"{warm_start!r}",
            source="warm_start",
        )
    if warm_start == "gradient":
        return gradient_start(op, which)
    if steps is None:
        steps = max(DEFAULT_WARM_STEPS, k * (2 if which == "both" else 1) + 2)
    if int(steps) < 1:
        raise UsageError(f"warm-start steps must be >= 1, got {steps}", source="warm_steps")
    warm_op, info, relative_cost = warm_operator(op, warm_start, fraction, seed)
    with progress.phase("warm start"):
        warm = lanczos(
            warm_op,
            k,
            which,
            tol=WARM_TOL,
            max_matvecs=int(steps),
            seed=seed,
            return_eigenvectors=True,
            explicit_residuals=False,
            multiplicity=False,
        )
    info.update(
        matvecs=int(warm.matvecs),
        ritz_values=list(warm.eigenvalues),
        full_product_equivalents=None if relative_cost is None else warm.matvecs * relative_cost,
    )
    assert warm.eigenvectors is not None  # return_eigenvectors=True
    q = warm.eigenvectors.sum(dim=1)  # orthonormal Ritz vectors: each gets weight 1
    return q.to(device=op.device), info


def _start_vector(op, start, warm_start, k, which, generator, fraction, steps, seed):
    """The unit float64 start vector: given, warm or a seeded Gaussian.

    A warm start vector that is zero or not finite falls back to the Gaussian, and its record
    says so.

    Args:
        op: the operator.
        start: a given start vector, if any.
        warm_start: the warm start, if any.
        k: the wanted eigenvalues of each end.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        generator: seeds the Gaussian start.
        fraction: the warm subsample's fraction.
        steps: the warm phase's products.
        seed: seeds the warm phase.

    Returns:
        ``(q_1, warm_info)``, ``warm_info`` ``None`` without a warm start.

    Raises:
        UsageError: both ``start`` and ``warm_start`` given, or a bad warm start.
    """
    warm_info = None
    if warm_start is not None:
        if start is not None:
            raise UsageError("give a start vector or a warm start, not both", source="warm_start")
        start, warm_info = _warm_start_vector(
            op, warm_start, k, which, fraction=fraction, steps=steps, seed=seed
        )
        norm = float(torch.linalg.vector_norm(start))
        if not (math.isfinite(norm) and norm > 0):  # a zero gradient, say: start cold
            start = None
            warm_info["fallback"] = "the warm start vector was zero or not finite: started cold"
    if start is None:
        return unit_random(op.shape[0], generator, op.device), warm_info
    q = start.to(dtype=_F64, device=op.device).reshape(-1)
    return q / torch.linalg.vector_norm(q), warm_info


def _stop_notes(rounds: LanczosRounds, converged: np.ndarray, complete: bool) -> list[str]:
    """The notes on how a run stopped: its product budget spent, its restarts.

    Args:
        rounds: the run's rounds (what they spent).
        converged: whether each returned pair converged.
        complete: whether the basis spans the whole space.

    Returns:
        The notes, possibly none.
    """
    notes = []
    if not converged.all() and rounds.matvecs >= rounds.limit and not complete:
        notes.append(
            f"stopped at the matvec budget ({rounds.limit}) before all requested eigenvalues "
            "converged"
        )
    if rounds.restarts:
        notes.append(
            f"thick-restarted Lanczos: a basis of at most {rounds.room} vectors (memory plan), "
            f"{rounds.restarts} restart(s)"
        )
    return notes


def lanczos(
    op,
    top_k: int = 1,
    which: str = "largest",
    *,
    tol: float = 1e-3,
    max_matvecs: int | None = None,
    seed: int = 0,
    start: torch.Tensor | None = None,
    return_eigenvectors: bool = False,
    explicit_residuals: bool | None = None,
    warm_start=None,
    warm_fraction: float = DEFAULT_WARM_FRACTION,
    warm_steps: int | None = None,
    max_basis: int | None = None,
    multiplicity: bool = True,
    batch_forms: list | None = None,
) -> EigenResult:
    """The ``top_k`` largest, smallest or both (``top_k`` of each end) eigenvalues of symmetric ``op``.

    The basis grows one vector per product in the products' dtype
    (:class:`~sharpcli.curvature.eigen.krylov.KrylovBasis`) up to what the run's memory plan
    (:mod:`sharpcli.memory`) allows, or ``max_basis`` when given; a basis that reaches that
    size is thick-restarted ([Wu2000]) keeping the wanted Ritz vectors, with the same residual
    certificate. When P < top_k all P eigenvalues are returned.

    Args:
        op: a symmetric operator with ``shape``, ``dtype``, ``device``, ``matvec`` (and
            ``matmat`` for explicit residuals).
        top_k: the eigenvalues wanted (of each end for ``"both"``).
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        tol: a Ritz pair converges at ``||A u - theta u|| <= tol |theta|``.
        max_matvecs: the most products (default :data:`DEFAULT_MAX_MATVECS`).
        seed: seeds the Gaussian start vector (and the warm start).
        start: a start vector instead of the seeded Gaussian.
        return_eigenvectors: return the Ritz vectors (float64 ``(P, m)``).
        explicit_residuals: report ``||A u - theta u||`` computed with one more product per
            returned pair (counted in ``matvecs``, beyond ``max_matvecs``; ``krylov_dim``
            stays the Krylov dimension) instead of the Ritz estimate ``beta_m |e_m^T s|``;
            ``None`` does so when ``op.dtype`` is not float64, where the estimate cannot see
            the products' rounding.
        warm_start: ``None`` (a seeded Gaussian start), ``"subsample"`` (``warm_steps``
            Lanczos steps on the same curvature over a seeded ``warm_fraction`` of the
            analysis set), ``"gradient"`` (the loss gradient, ``which="largest"``) or an
            operator approximating ``op`` (:mod:`~sharpcli.curvature.eigen.warm_start`). The warm
            phase's products are reported in ``result.warm_start``, not in ``matvecs``;
            everything that certifies the result runs on ``op``.
        warm_fraction: the subsample's fraction of the analysis set.
        warm_steps: the warm phase's products (default ``max(4, wanted + 2)``).
        max_basis: the most basis vectors kept before a thick restart.
        multiplicity: count repeated eigenvalues: once the wanted Ritz pairs converge, lock
            them and restart orthogonal to them until a round finds no further copy
            (:func:`deflated_rounds`; ``result.multiplicity`` says how it went).
            ``False`` returns the first round's values, each distinct eigenvalue about once.
        batch_forms: when given, the explicit residuals' product records its per-batch
            forms ``u_i^T A_b u_j`` into it (:func:`~sharpcli.curvature.eigen.ritz.ritz_residuals`):
            the eigenvalues' data error reads them instead of a product of its own.

    Returns:
        The :class:`~sharpcli.curvature.eigen.ritz.EigenResult`, eigenvalues descending.

    Raises:
        UsageError: bad arguments, or a basis that does not fit the memory plan.
        NumericalError: a product is not finite.

    Example:
        >>> from sharpcli.curvature.operators.hessian import MatrixOperator
        >>> A = MatrixOperator(torch.diag(torch.arange(1.0, 6.0, dtype=torch.float64)))
        >>> [round(v, 6) for v in lanczos(A, 2, tol=1e-10).eigenvalues]
        [5.0, 4.0]
    """
    _check_args(op, top_k, which, tol)
    dim = op.shape[0]
    if explicit_residuals is None:
        explicit_residuals = op.dtype != _F64
    want = min(int(top_k), dim)
    wanted = min(dim, want * (2 if which == "both" else 1))
    keep_vectors = bool(return_eigenvectors or explicit_residuals)
    returned = wanted if keep_vectors else 0
    # the vectors an explicit check multiplies stay in the storage dtype through its product;
    # float64 copies are made after it, when the caller wants them (ritz_end_bytes)
    widened = bool(return_eigenvectors and explicit_residuals)
    room, held, scratch, limit = plan_basis(
        op, wanted, returned, _budget(max_matvecs), max_basis, widened
    )
    plan = memory.current()
    generator = torch.Generator().manual_seed(int(seed))
    q, warm_info = _start_vector(
        op, start, warm_start, want, which, generator, warm_fraction, warm_steps, seed
    )
    run = progress.start("lanczos", total=limit, quantity=QUANTITY[which], capped=True)
    with plan.hold("krylov basis", held):
        basis = KrylovBasis(dim, storage_dtype(op.dtype), op.device, scratch=scratch)
        basis.append(q)
        del q  # the basis holds it (in the products' dtype)
        rounds = LanczosRounds(op, basis, want, which, tol, limit, room, generator, run)
        # when the whole space fits the budget (P <= max_matvecs), copies are counted by
        # spanning it: every eigenvalue exact, no deflated round needed
        first = rounds.first_round(whole=multiplicity and want >= 2 and rounds.exhaustive)
        if multiplicity:
            pairs, last, locked, record = deflated_rounds(first, rounds)
        else:
            pairs, last, locked, record = _ritz_pairs(first, 0.0, 0), first, 0, None
        values, reported, converged, vectors, extra = _returned_pairs(
            rounds, pairs, last, locked, explicit_residuals, return_eigenvectors
        )
        basis.close()
    matvecs = rounds.matvecs + extra
    notes = _stop_notes(rounds, converged, last.complete)
    if record is not None and (note := multiplicity_note(record, wanted, limit)):
        notes.append(note)
    if explicit_residuals:
        # the end's vectors and their product, held in the plan now that the basis is gone
        end = ritz_end_bytes(dim, op.dtype, len(values), widened)
        with plan.hold("krylov basis", end):
            reported, converged = measured_residuals(
                op, values, vectors, converged, tol, rounds.exact_level, notes, batch_forms
            )
            if return_eigenvectors:
                vectors = vectors.to(_F64)
        matvecs += len(values)
    at_rounding = int((converged & (reported > tol * np.abs(values))).sum())
    if at_rounding:
        notes.append(
            f"{at_rounding} eigenvalue(s) converged at the products' rounding level "
            f"(residual <= 100 eps ||T|| = {rounds.exact_level:.3g}), not at tol |eigenvalue|"
        )
    notes += [warm_note(warm_info)] if warm_info is not None else []
    result = EigenResult(
        eigenvalues=[float(t) for t in values],
        residuals=[float(r) for r in reported],
        converged=[bool(c) for c in converged],
        matvecs=matvecs,
        method="lanczos",
        which=which,
        tol=float(tol),
        krylov_dim=rounds.matvecs,  # the Lanczos steps of every round
        breakdown=first_breakdown(first.breakdown, record, last.complete),
        restarts=int(rounds.restarts),
        reorthogonalized=int(rounds.reorthogonalized),
        max_basis=int(room),
        notes=notes,
        warm_start=warm_info,
        multiplicity=record,
    )
    if return_eigenvectors:
        result.eigenvectors = vectors
    run.finish(matvecs, **reported_numbers(result.eigenvalues, result.residuals, which))
    return result


def _returned_pairs(rounds, pairs, last, locked, explicit_residuals, return_eigenvectors):
    """The returned pairs' values, residuals, flags and (when needed) vectors.

    A deflated round's residual is a bound; without explicit residuals the pairs whose bound
    fails the test have their residual measured (:func:`bounded_residuals`).

    Args:
        rounds: the run's rounds (the operator, the basis, what they spent).
        pairs: the returned pairs, descending.
        last: the last round's state (its Ritz coefficients).
        locked: the locked rows before the last round's.
        explicit_residuals: whether every residual is measured afterwards.
        return_eigenvectors: whether the caller wants the float64 Ritz vectors.

    Returns:
        ``(values, residuals, converged, vectors, products spent)``; ``vectors`` ``None``
        unless asked for or needed by explicit residuals.
    """
    values = np.array([p.value for p in pairs])
    reported = np.array([p.residual for p in pairs])
    converged = np.array([p.converged for p in pairs], dtype=bool)
    coefficients = torch.from_numpy(pair_coefficients(pairs, last.S, locked))
    extra = 0
    if not explicit_residuals:  # deflated rounds' bounds: measure those that fail the test
        reported, converged, extra = bounded_residuals(
            rounds, coefficients, values, reported, converged
        )
    vectors = None
    if return_eigenvectors or explicit_residuals:
        # the residual is checked on the vector the operator multiplies (rounded to its
        # dtype), widened to float64 after its product when the caller wants the
        # eigenvectors: a float64 copy held through that product was two P-vectors of float32
        # beyond the plan (GPT-2 large: 5.8 GiB, past a 20 GiB budget); float64 sums only for
        # returned vectors nobody multiplies
        narrow = explicit_residuals or not return_eigenvectors
        keep = storage_dtype(rounds.op.dtype) if narrow else _F64
        vectors = rounds.basis.combine(coefficients, dtype=keep)
    return values, reported, converged, vectors, extra


def _keep_after_restart(theta: np.ndarray, which: str, want: int, size: int) -> np.ndarray:
    """Indices (into ascending ``theta``) of the Ritz vectors a thick restart keeps: the wanted
    end(s) of the spectrum, about half the basis and at least the wanted ones, leaving room
    for two new vectors ([Wu2000] keep about half).

    Args:
        theta: the Ritz values, ascending.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        want: the wanted values of each end.
        size: the basis rows.

    Returns:
        The indices kept, ascending.
    """
    keep = min(size - 2, max(want * (2 if which == "both" else 1), size // 2))
    if which == "largest":
        return np.arange(size - keep, size)
    if which == "smallest":
        return np.arange(0, keep)
    low = max(want, keep // 2)
    high = max(want, keep - low)
    return np.union1d(np.arange(0, low), np.arange(size - high, size))


def _extend_projection(T: np.ndarray, alpha: float, coupling) -> np.ndarray:
    """The projected matrix with a new last row/column: ``alpha`` on the diagonal and the
    couplings ``T_ij`` of the new vector to earlier rows.

    Args:
        T: the ``(m, m)`` projected matrix.
        alpha: the new diagonal entry.
        coupling: ``(i, T_im)`` for the earlier rows the new vector is coupled to.

    Returns:
        The ``(m + 1, m + 1)`` projected matrix.
    """
    m = T.shape[0]
    out = np.zeros((m + 1, m + 1))
    out[:m, :m] = T
    out[m, m] = alpha
    for i, value in coupling:
        out[i, m] = out[m, i] = value
    return out


def _beside_locked(locked: int, S: np.ndarray) -> torch.Tensor:
    """The coefficients of a rotation of the basis that keeps its first ``locked`` rows as
    they are and replaces the rest by the combinations ``S`` of them.

    Args:
        locked: the rows kept as they are.
        S: ``(rows after the locked ones, k)`` coefficients.

    Returns:
        The ``(locked + S.shape[0], locked + k)`` block-diagonal ``diag(I, S)``.
    """
    out = torch.zeros(locked + S.shape[0], locked + S.shape[1], dtype=_F64)
    out[:locked, :locked] = torch.eye(locked, dtype=_F64)
    out[locked:, locked:] = torch.from_numpy(np.ascontiguousarray(S))
    return out


@dataclass
class LanczosState:
    """Where a Lanczos round stopped: its projection's Ritz pairs and what it spent.

    Attributes:
        theta: the Ritz values of the round's projected matrix, ascending.
        S: their coefficients in the round's basis rows (a column each).
        idx: the wanted Ritz values, indices into ``theta`` (:func:`select_ritz`).
        converged: whether each wanted one passed the residual test.
        residuals: the Ritz estimates ``beta_m |s_m|`` of every Ritz value.
        exact_level: the products' rounding level ``100 eps ||T||``.
        matvecs: the round's products.
        restarts: the round's thick restarts.
        reorthogonalized: the round's steps that ran Gram-Schmidt.
        breakdown: the round's breakdown, if any.
        complete: whether the basis spans the whole space.
    """

    theta: np.ndarray
    S: np.ndarray
    idx: np.ndarray
    converged: np.ndarray
    residuals: np.ndarray
    exact_level: float
    matvecs: int
    restarts: int
    reorthogonalized: int
    breakdown: str | None
    complete: bool


class LanczosRounds:
    """The Lanczos rounds of one :func:`lanczos` run, on one basis and product budget.

    The first round runs from the start vector the basis holds; each deflated round
    (:func:`deflated_rounds`) from a fresh random vector orthogonal to the locked rows. Each
    is thick-restarted at ``room`` rows ([Wu2000]). The attributes ``matvecs``, ``restarts``,
    ``reorthogonalized`` and ``exact_level`` sum (or take the largest of) every round's.

    Args:
        op: the operator.
        basis: the Krylov basis holding the start vector.
        want: the wanted values of each end.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        tol: the relative residual tolerance.
        limit: the product budget of all rounds.
        room: the most basis rows before a restart.
        generator: draws fresh vectors (after a breakdown, for a deflated round).
        run: the progress run.
    """

    def __init__(self, op, basis, want, which, tol, limit, room, generator, run):
        self.op, self.basis, self.want, self.which, self.tol = op, basis, want, which, tol
        self.limit, self.room, self.generator, self.run = limit, room, generator, run
        self.dim = op.shape[0]
        self.eps = torch.finfo(op.dtype).eps  # rounding of the products, not of the recurrence
        # the whole space fits the budget: after a breakdown, run on to dimension P
        self.exhaustive = room >= self.dim and limit == self.dim
        self.matvecs = self.restarts = self.reorthogonalized = 0
        self.exact_level = 0.0

    def first_round(self, whole: bool) -> LanczosState:
        """The first round, from the basis's start vector.

        Args:
            whole: run to dimension P (restarting after breakdowns) whatever converges.

        Returns:
            Its state.
        """
        return self._spent(self._iterate(self.limit, whole=whole))

    def next_round(self, locked: int, enough: Callable) -> LanczosState | None:
        """A round on the deflated operator, orthogonal to the first ``locked`` basis rows.

        Args:
            locked: the locked rows, left as they are.
            enough: ``enough(values_desc, residuals, converged)``, the round's stop test.

        Returns:
            Its state, or ``None`` when the product budget is spent.
        """
        if self.matvecs >= self.limit:
            return None
        self.basis.append(unit_random(self.dim, self.generator, self.op.device, self.basis))
        return self._spent(self._iterate(self.limit - self.matvecs, locked=locked, enough=enough))

    def lock(self, S_full: np.ndarray) -> None:
        """Keep the basis combinations ``S_full`` (the locked Ritz vectors) as its rows."""
        self.basis.rotate(torch.from_numpy(np.ascontiguousarray(S_full)))

    def _spent(self, state: LanczosState) -> LanczosState:
        self.matvecs += state.matvecs
        self.restarts += state.restarts
        self.reorthogonalized += state.reorthogonalized
        self.exact_level = max(self.exact_level, state.exact_level)
        return state

    def _restart(self, theta, S, beta: float, m: int, locked: int):
        """A thick restart: keep the wanted Ritz vectors, continue from ``w / beta``.

        Returns:
            ``(T, coupling)``: the kept Ritz values' diagonal and the new vector's couplings
            ``beta s_{m,i}`` to the kept rows.
        """
        keep = _keep_after_restart(theta, self.which, self.want, m)
        self.basis.rotate(_beside_locked(locked, S[:, keep]))
        coupling = [(locked + i, float(beta * S[-1, j])) for i, j in enumerate(keep)]
        return np.diag(theta[keep]), coupling

    def _iterate(self, limit, *, locked=0, enough=None, whole=False) -> LanczosState:
        """One round of the iteration, thick-restarted at ``room`` rows ([Wu2000]).

        Plain steps keep ``T`` tridiagonal. A restart keeps the Ritz pairs
        ``(theta_i, y_i = Q s_i)`` of the wanted end(s) (:func:`_keep_after_restart`), continues
        from ``q_{m+1} = w / beta_m`` and couples it to each kept vector by ``beta_m s_{m,i}``:
        ``A Y = Y diag(theta) + beta_m q_{m+1} s_m^T`` holds exactly as the Lanczos relation did,
        so the Ritz estimate ``beta |e_m^T s|`` and the explicit residuals mean the same after a
        restart. The projected matrix is then arrowhead plus tridiagonal, kept dense (it is
        tiny).

        Args:
            limit: the round's product budget.
            locked: the locked rows ahead of the round's (a deflated round), left as they are.
            enough: a deflated round's stop test (``None``: every wanted value converged).
            whole: run to dimension P (restarting after breakdowns) whatever converges.

        Returns:
            The round's final state.

        Raises:
            NumericalError: a product is not finite.
        """
        op, basis, dim, done = self.op, self.basis, self.dim, self.matvecs
        which, tol = self.which, self.tol
        T = np.zeros((0, 0))
        coupling: list[tuple[int, float]] = []
        history: list[float] = []  # worst residual / (tol |theta|) of each step, for the projection
        matvecs = restarts = reorthogonalized = 0
        breakdown = None
        exhaust = whole  # after a breakdown on a problem that fits: run to dimension P
        complete = False
        scale = 0.0
        while True:
            # Gram-Schmidt may be skipped only in a plain recurrence (tridiagonal T, no locked or
            # restarted rows, not spanning the whole space), where Paige's relation holds as stated
            plain = enough is None and restarts == 0 and not (exhaust or self.exhaustive)
            settled = _settled(T, coupling, scale, self.eps) if plain else None
            alpha, beta, w, full = lanczos_step(op, basis, coupling, done + matvecs, settled)
            reorthogonalized += full
            matvecs += 1
            T = _extend_projection(T, alpha, [(i - locked, value) for i, value in coupling])
            theta, S = (a.numpy() for a in torch.linalg.eigh(torch.from_numpy(T)))
            scale = max(scale, float(np.abs(theta).max()), abs(alpha))
            exact_level = 100 * self.eps * max(scale, np.finfo(np.float64).tiny)
            residuals = beta * np.abs(S[-1, :])
            idx = select_ritz(theta, which, self.want)
            converged = (residuals[idx] <= tol * np.abs(theta[idx])) | (
                residuals[idx] <= exact_level
            )
            m = len(basis) - locked
            if not self.run.finished:
                report_step(
                    self.run,
                    done + matvecs,
                    theta[idx],
                    residuals[idx],
                    which,
                    tol,
                    history,
                    done + limit,
                )
            if len(basis) == dim:
                complete = True
                break
            if beta <= exact_level:
                if not self.exhaustive:
                    breakdown = (
                        f"invariant subspace after {m} steps: Ritz values are exact eigenvalues"
                    )
                    break
                exhaust = True
                if breakdown is None:
                    breakdown = (
                        f"invariant subspace after {m} steps; restarted to reach dimension {dim}"
                    )
                coupling = []
                basis.append(unit_random(dim, self.generator, op.device, basis))
                continue
            stop = (
                converged.all() if enough is None else enough(theta[idx], residuals[idx], converged)
            )
            if (stop and not exhaust) or matvecs >= limit:
                break
            if len(basis) == self.room:
                T, coupling = self._restart(theta, S, beta, m, locked)
                restarts += 1
            else:
                coupling = [(len(basis) - 1, beta)]
            basis.append(w, divisor=beta)  # q_{j+1} = w / beta_j, divided as it is stored
        return LanczosState(
            theta,
            S,
            idx,
            converged,
            residuals,
            exact_level,
            matvecs,
            restarts,
            reorthogonalized,
            breakdown,
            complete,
        )


def _settled(T: np.ndarray, coupling, scale: float, eps: float):
    """Whether a plain step may skip Gram-Schmidt (:func:`skip_when_semiorthogonal`)."""
    return skip_when_semiorthogonal(lambda a: _extend_projection(T, a, coupling), scale, eps)


_ENDS = {"largest": ("largest",), "smallest": ("smallest",), "both": ("largest", "smallest")}


@dataclass
class Pair:
    """A Ritz pair kept for the result: its value, residual and where its vector is.

    Attributes:
        value: the Ritz value.
        residual: its residual (Ritz estimate, bound or measured).
        converged: whether the residual passed the test.
        row: the locked basis row holding its vector, or ``None``.
        column: the column of the current round's Ritz coefficients, or ``None``.
        found_in: the round that found it (``0``: the first, before any deflated restart).
    """

    value: float
    residual: float
    converged: bool
    row: int | None = None
    column: int | None = None
    found_in: int = 0


def deflated_residual(estimate: float, locked_squares: float) -> float:
    """The residual bound of a Ritz pair of a round run orthogonal to locked pairs.

    Args:
        estimate: the round's Ritz estimate ``beta_m |s_m|``.
        locked_squares: ``sum_i ||f_i||^2`` over the locked pairs' residuals.

    Returns:
        ``sqrt(estimate^2 + locked_squares)`` (module docstring).

    Example:
        >>> deflated_residual(3.0, 16.0)
        5.0
    """
    return math.sqrt(estimate * estimate + locked_squares)


def _ordered(pairs: list[Pair], end: str) -> list[Pair]:
    """``pairs`` from the extreme of ``end`` inwards."""
    return sorted(pairs, key=lambda p: -p.value if end == "largest" else p.value)


def _beyond(a: float, b: float, end: str) -> bool:
    """Whether ``a`` lies further towards ``end`` than ``b``."""
    return a > b if end == "largest" else a < b


def _end_values(values_desc: np.ndarray, end: str, want: int) -> np.ndarray:
    """Positions of the ``want`` values of ``end`` among the wanted values (descending),
    from the extreme inwards."""
    n = len(values_desc)
    count = min(want, n)
    return np.arange(count) if end == "largest" else np.arange(n - 1, n - 1 - count, -1)


def round_is_enough(values_desc, residuals, converged, which, want, kept, tol) -> bool:
    """Whether a deflated round has seen enough to stop.

    At each wanted end, walking from the extreme inwards, every Ritz value beyond the k-th
    kept value must have converged (it enters and is returned), up to the first value on the
    inner side of the k-th one: the values past it cannot enter (the Ritz values interlace).
    That first value need not converge to ``tol``: what matters is its value, not its vector,
    and a Ritz value's error is about ``residual^2 / gap`` ([Parlett1998]), so a residual of
    ``sqrt(tol) |theta|`` gives the value to about ``tol`` relative; it must also lie on the
    inner side by more than both residuals. All ``want`` values of an end converged is
    enough too.

    Args:
        values_desc: the round's wanted Ritz values, descending.
        residuals: their residuals.
        converged: whether each converged.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        want: the wanted values of each end.
        kept: the pairs kept so far, by end.
        tol: the relative residual tolerance.

    Returns:
        Whether the round may stop.
    """
    for end in _ENDS[which]:
        threshold = _threshold(kept[end], want)
        for position in _end_values(values_desc, end, want):
            value, residual = values_desc[position], residuals[position]
            if threshold is None or _beyond(value, threshold.value, end):
                if not converged[position]:  # it enters: it must converge
                    return False
                continue
            settled = residual <= math.sqrt(tol) * abs(value) and (
                abs(value - threshold.value) > residual + threshold.residual
            )
            if converged[position] or settled:
                break
            return False
    return True


def _threshold(pairs: list[Pair], want: int) -> Pair | None:
    """The k-th kept pair of an end (``None`` while fewer than ``want`` are kept)."""
    return pairs[want - 1] if len(pairs) >= want else None


def merge_round(kept: dict, candidates: list[Pair], which: str, want: int) -> tuple[int, list]:
    """Merge a round's converged Ritz pairs into the k kept values of each end.

    A candidate *enters* when it lies beyond the k-th kept value by more than both residuals
    (an eigenvalue lies within its residual of each Ritz value); one within them is another
    copy of the k-th value (a *tie*); one on the inner side stops the walk.

    Args:
        kept: the kept pairs of each end, from the extreme inwards (updated in place).
        candidates: the round's converged wanted pairs.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        want: the wanted values of each end.

    Returns:
        ``(entries, ties)``: how many pairs entered, and the candidates that tied.
    """
    entries = 0
    ties: list[Pair] = []
    for end in _ENDS[which]:
        for pair in _ordered(candidates, end):
            threshold = _threshold(kept[end], want)
            if (
                threshold is None
                or _beyond(pair.value, threshold.value, end)
                and abs(pair.value - threshold.value) > pair.residual + threshold.residual
            ):
                kept[end] = _ordered(kept[end] + [pair], end)[:want]
                entries += 1
                continue
            if abs(pair.value - threshold.value) <= pair.residual + threshold.residual:
                ties.append(pair)
            break
    return entries, ties


def multiplicity_record(resolved, restarts: int, copies: int, ties: list, why=None) -> dict:
    """The ``multiplicity`` record of an eigenvalue result.

    Args:
        resolved: whether the k values are counted with multiplicity (a round verified them,
            or the basis spanned the whole space); ``False`` when the run could not exclude
            further copies; ``None`` when not checked.
        restarts: deflated restarts run.
        copies: repeated copies the restarts found among the returned values.
        ties: k-th values a round found again past the k asked for.
        why: why not resolved: ``"budget"`` (the product budget ran out before a round
            verified the values), ``"basis room"`` (no room for a round beside the locked
            rows) or ``"not converged"`` (the first round did not converge).

    Returns:
        ``{"resolved", "unresolved_because", "deflated_restarts", "copies_found",
        "more_copies_of"}``.
    """
    return {
        "resolved": resolved,
        "unresolved_because": why,
        "deflated_restarts": int(restarts),
        "copies_found": int(copies),
        "more_copies_of": sorted({float(t) for t in ties}) or None,
    }


def multiplicity_note(record: dict, wanted: int, limit: int) -> str | None:
    """The note a result carries about multiplicity, if any.

    Args:
        record: the :func:`multiplicity_record`.
        wanted: the eigenvalues asked for (both ends counted).
        limit: the product budget.

    Returns:
        One line, or ``None`` when there is nothing to say (no repeat found, or none looked
        for).
    """
    restarts = record["deflated_restarts"]
    why = {
        "budget": f"the matvec budget ({limit}) ran out before a deflated restart could",
        "basis room": "the basis has no room beside the locked Ritz vectors for a deflated "
        "restart to",
        "not converged": "the eigenvalues did not converge, so no deflated restart could",
    }.get(record["unresolved_because"])
    if record["resolved"] is False and why is not None:
        return (
            f"multiplicity not resolved: {why} exclude further copies of the returned "
            "eigenvalues (a repeated eigenvalue may be counted too few times, and the "
            f"{wanted} values may not be the extreme ones); raise `max_matvecs`"
        )
    if not (record["copies_found"] or record["more_copies_of"]):
        return None  # checked, nothing repeated: results.multiplicity records the check
    text = (
        f"{restarts} deflated restart(s) orthogonal to the locked Ritz vectors checked the "
        f"{wanted} eigenvalue(s) for repeats"
    )
    if record["copies_found"]:
        copies = record["copies_found"]
        text += f": found {copies} further cop{'y' if copies == 1 else 'ies'} of repeated values"
    if record["more_copies_of"]:
        values = ", ".join(f"{v:.6g}" for v in record["more_copies_of"])
        text += f"; {values} has more copies than fit in the values asked for"
    return text


def _ritz_pairs(state: LanczosState, locked_squares: float, found_in: int) -> list[Pair]:
    """A round's wanted Ritz pairs, residuals bounded for the locked rows (module docstring)."""
    return [
        Pair(
            float(state.theta[j]),
            deflated_residual(float(state.residuals[j]), locked_squares),
            bool(c),
            column=int(j),
            found_in=found_in,
        )
        for j, c in zip(state.idx, state.converged)
    ]


def _returned(kept: dict, which: str) -> list[Pair]:
    """The kept pairs of every end once each, by descending value."""
    unique = {id(p): p for end in _ENDS[which] for p in kept[end]}
    return sorted(unique.values(), key=lambda p: -p.value)


def pair_coefficients(pairs: list[Pair], S: np.ndarray, locked: int) -> np.ndarray:
    """The basis coefficients of ``pairs``' vectors: a unit column for a locked row, the
    round's Ritz coefficients ``S[:, column]`` below the ``locked`` rows otherwise.

    Args:
        pairs: the pairs.
        S: the current round's Ritz coefficients (round rows x Ritz values).
        locked: the locked rows before the round's.

    Returns:
        A ``(locked + round rows, len(pairs))`` float64 array.
    """
    out = np.zeros((locked + S.shape[0], len(pairs)))
    for c, pair in enumerate(pairs):
        if pair.row is not None:
            out[pair.row, c] = 1.0
        else:
            out[locked:, c] = S[:, pair.column]
    return out


def _tied_with_last(kept: dict, ties: list[Pair], want: int) -> list[float]:
    """The k-th values of the ends that a round found again (copies past the k asked for).

    Args:
        kept: the kept pairs of each end.
        ties: the candidates that tied a k-th value when they were merged.
        want: the wanted values of each end.

    Returns:
        The final k-th values some tie matches within both residuals.
    """
    out = []
    for pairs in kept.values():
        last = _threshold(pairs, want)
        if last is not None and any(
            abs(t.value - last.value) <= t.residual + last.residual for t in ties
        ):
            out.append(last.value)
    return out


def deflated_rounds(first: LanczosState, rounds: LanczosRounds):
    """Lanczos rounds with locking until the k values of each end are verified.

    Args:
        first: the first round's state.
        rounds: the run's rounds: :meth:`LanczosRounds.next_round` runs a round on the
            deflated operator, :meth:`LanczosRounds.lock` rotates the basis to the locked rows.

    Returns:
        ``(pairs, state, locked, record)``: the returned pairs (descending), the last round's
        state, the locked rows before that round's, and the multiplicity record
        (:func:`multiplicity_record`).
    """
    which, want, tol = rounds.which, rounds.want, rounds.tol
    pairs = _ritz_pairs(first, 0.0, 0)
    if not all(p.converged for p in pairs):  # not converged: nothing to verify
        resolved = want == 1 or first.complete
        reason = None if resolved else "not converged"
        return pairs, first, 0, multiplicity_record(resolved, 0, 0, [], reason)
    kept: dict = {end: [] for end in _ENDS[which]}
    ties: list = []
    why: str | None = "budget"
    state, locked, restarts = first, 0, 0
    wanted = want * len(_ENDS[which])
    while True:
        enough = restarts == 0 or round_is_enough(*_arrays(pairs), which, want, kept, tol)
        entries, found = merge_round(kept, [p for p in pairs if p.converged], which, want)
        ties += found
        verified = enough and (restarts > 0 and entries == 0 or want == 1)
        if verified or state.complete or not enough:
            break
        returned = _returned(kept, which)
        if len(returned) + wanted + 2 > rounds.room:
            enough, why = False, "basis room"  # no room for a round beside the locked rows
            break
        locked = _lock(rounds, returned, state, locked)
        checked = functools.partial(round_is_enough, which=which, want=want, kept=kept, tol=tol)
        following = rounds.next_round(locked, checked)
        if following is None:  # the budget is spent: every returned pair is a locked row
            state, enough = dataclasses.replace(state, S=np.zeros((0, 0)), complete=False), False
            break
        state = following
        restarts += 1
        pairs = _ritz_pairs(state, sum(p.residual**2 for p in returned), restarts)
    returned = _returned(kept, which)
    resolved = bool(enough or state.complete)
    return returned, state, locked, _record(returned, kept, ties, want, restarts, resolved, why)


def _lock(rounds: LanczosRounds, returned: list[Pair], state: LanczosState, locked: int) -> int:
    """Rotate the basis to the vectors of ``returned`` (of ``state``'s round or locked rows
    before its ``locked``), which become its first rows: the locked rows now."""
    rounds.lock(pair_coefficients(returned, state.S, locked))
    for row, pair in enumerate(returned):
        pair.row, pair.column = row, None
    return len(returned)


def _record(returned, kept, ties, want, restarts, resolved, why) -> dict:
    """:func:`multiplicity_record` of :func:`deflated_rounds`'s ``returned`` pairs, ``kept`` by end,
    ``ties`` with the k-th values, ``restarts``, ``resolved`` and, when not, ``why``."""
    copies = sum(1 for p in returned if p.found_in > 0)
    ties = _tied_with_last(kept, ties, want)
    return multiplicity_record(resolved, restarts, copies, ties, None if resolved else why)


def _arrays(pairs: list[Pair]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pairs' values, residuals and converged flags."""
    values = np.array([p.value for p in pairs])
    bounds = np.array([p.residual for p in pairs])
    return values, bounds, np.array([p.converged for p in pairs])


def bounded_residuals(rounds: LanczosRounds, coefficients, values, residuals, converged):
    """The reported residuals: a deflated round's bound, or measured where the bound fails.

    A pair that converged by its round's Ritz estimate but whose bound
    (:func:`deflated_residual`) fails the test gets its residual measured,
    ``||A u - theta u||`` with one product (:func:`~sharpcli.curvature.eigen.ritz.ritz_residuals`).

    Args:
        rounds: the run's rounds (the operator, the basis, the tolerance, the rounding level).
        coefficients: the pairs' basis coefficients (``(rows, pairs)`` float64 tensor).
        values: the Ritz values.
        residuals: their residuals (estimates or bounds).
        converged: whether each converged by its round's estimate.

    Returns:
        ``(residuals, converged, products spent)``.
    """
    tol, exact_level, basis = rounds.tol, rounds.exact_level, rounds.basis
    passes = (residuals <= tol * np.abs(values)) | (residuals <= exact_level)
    measure = np.flatnonzero(converged & ~passes)
    residuals = residuals.copy()
    if len(measure):
        vectors = basis.combine(coefficients[:, torch.from_numpy(measure)], dtype=basis.dtype)
        residuals[measure] = ritz_residuals(rounds.op, values[measure].tolist(), vectors)
    passes = (residuals <= tol * np.abs(values)) | (residuals <= exact_level)
    return residuals, converged & passes, len(measure)


def first_breakdown(text: str | None, record: dict | None, complete: bool) -> str | None:
    """The first round's breakdown, saying when repeated eigenvalues may appear once.

    Args:
        text: the first round's breakdown, if any.
        record: the multiplicity record (``None``: not checked).
        complete: whether the basis spans the whole space.

    Returns:
        The breakdown to report.
    """
    if text is None or complete or (record is not None and record["resolved"]):
        return text
    return text + ", repeated eigenvalues may appear once"
