r"""Lanczos with full reorthogonalisation for extreme eigenvalues of a symmetric operator.

The method is [Lanczos1950]; the reorthogonalisation and the Ritz residual follow
[Parlett1998]. User guide: docs/commands/eigen.md. The pieces: the recurrence
(:mod:`~sharpcli.curvature.tridiagonal`), Ritz values and residuals
(:mod:`~sharpcli.curvature.ritz`), where the basis lives (:mod:`~sharpcli.curvature.krylov_plan`)
and warm starts (:mod:`~sharpcli.curvature.warm_start`); this module runs the iteration.

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

Repeated eigenvalues. One start vector gives one direction of each eigenspace, so the first
round finds each distinct eigenvalue about once; for k >= 2 the converged wanted Ritz pairs are
then locked and Lanczos restarts orthogonal to them until a round finds no further copy
(:mod:`~sharpcli.curvature.deflation`), and ``result.multiplicity`` says whether the k values
are counted with multiplicity or the budget ran out first.

When the basis is full (memory plan, disk space or ``max_basis``) the iteration is
thick-restarted [Wu2000]: it keeps the wanted Ritz vectors (about half the basis), continues
from the last residual direction, and its Lanczos relation, Ritz estimates and explicit
residuals keep their meaning, so a restarted result carries the same certificate as an
unrestarted one.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sharpcli import catalogue, memory, progress
from sharpcli.curvature.deflation import (
    DeflatedRounds,
    bounded_residuals,
    deflated_rounds,
    first_breakdown,
    first_round_pairs,
    multiplicity_note,
    pair_coefficients,
)
from sharpcli.curvature.krylov import KrylovBasis
from sharpcli.curvature.krylov_plan import plan_basis, storage_dtype
from sharpcli.curvature.ritz import (
    QUANTITY,
    EigenResult,
    measured_residuals,
    report_step,
    reported_numbers,
    select_ritz,
)
from sharpcli.curvature.tridiagonal import lanczos_step, skip_when_semiorthogonal, unit_random
from sharpcli.curvature.warm_start import (
    DEFAULT_WARM_FRACTION,
    DEFAULT_WARM_STEPS,
    WARM_STARTS,
    WARM_TOL,
    gradient_start,
    warm_note,
    warm_operator,
)
from sharpcli.errors import UsageError

__all__ = ["DEFAULT_MAX_MATVECS", "WHICH", "lanczos"]

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
    """The start vector of a warm start (:mod:`~sharpcli.curvature.warm_start`).

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


def _stop_notes(state: dict, limit: int, room: int) -> list[str]:
    """The notes on how a run stopped: its product budget spent, its restarts.

    Args:
        state: the iteration's final state (:func:`_run_lanczos`).
        limit: the product budget.
        room: the most basis rows.

    Returns:
        The notes, possibly none.
    """
    notes = []
    if not state["converged"].all() and state["matvecs"] >= limit and not state["complete"]:
        notes.append(
            f"stopped at the matvec budget ({limit}) before all requested eigenvalues converged"
        )
    if state["restarts"]:
        notes.append(
            f"thick-restarted Lanczos: a basis of at most {room} vectors (memory plan), "
            f"{state['restarts']} restart(s)"
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
) -> EigenResult:
    """The ``top_k`` largest, smallest or both (``top_k`` of each end) eigenvalues of symmetric ``op``.

    The basis grows one vector per product in the products' dtype
    (:class:`~sharpcli.curvature.krylov.KrylovBasis`) up to what the run's memory plan
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
            operator approximating ``op`` (:mod:`~sharpcli.curvature.warm_start`). The warm
            phase's products are reported in ``result.warm_start``, not in ``matvecs``;
            everything that certifies the result runs on ``op``.
        warm_fraction: the subsample's fraction of the analysis set.
        warm_steps: the warm phase's products (default ``max(4, wanted + 2)``).
        max_basis: the most basis vectors kept before a thick restart.
        multiplicity: count repeated eigenvalues: once the wanted Ritz pairs converge, lock
            them and restart orthogonal to them until a round finds no further copy
            (:mod:`~sharpcli.curvature.deflation`; ``result.multiplicity`` says how it went).
            ``False`` returns the first round's values, each distinct eigenvalue about once.

    Returns:
        The :class:`~sharpcli.curvature.ritz.EigenResult`, eigenvalues descending.

    Raises:
        UsageError: bad arguments, or a basis that does not fit the memory plan.
        NumericalError: a product is not finite.

    Example:
        >>> from sharpcli.curvature.operators import MatrixOperator
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
    returned = wanted if (return_eigenvectors or explicit_residuals) else 0
    budget = _budget(max_matvecs)
    room, held, scratch, limit = plan_basis(op, wanted, returned, budget, max_basis)
    plan = memory.current()
    generator = torch.Generator().manual_seed(int(seed))
    eps = torch.finfo(op.dtype).eps  # rounding level of the products, not of the recurrence
    q, warm_info = _start_vector(
        op, start, warm_start, want, which, generator, warm_fraction, warm_steps, seed
    )
    run = progress.start("lanczos", total=limit, quantity=QUANTITY[which], capped=True)
    with plan.hold("krylov basis", held):
        basis = KrylovBasis(dim, storage_dtype(op.dtype), op.device, scratch=scratch)
        basis.append(q)
        del q  # the basis holds it (in the products' dtype)
        # when the whole space fits the budget (P <= max_matvecs), copies are counted by
        # spanning it: every eigenvalue exact, no deflated round needed
        whole = multiplicity and want >= 2 and room >= dim and limit == dim
        state = _run_lanczos(
            op, basis, want, which, tol, limit, room, generator, eps, run, whole=whole
        )
        spent = {k: state[k] for k in ("matvecs", "restarts", "exact_level", "reorthogonalized")}
        if multiplicity:
            rounds = DeflatedRounds(
                _run_lanczos, op, basis, (want, which, tol, limit, room), generator, eps, run, spent
            )
            pairs, last, locked, record = deflated_rounds(
                state, rounds.next_round, rounds.lock, which=which, want=want, room=room, tol=tol
            )
        else:
            pairs, last, locked, record = first_round_pairs(state), state, 0, None
        notes: list[str] = []
        values = np.array([p.value for p in pairs])
        reported = np.array([p.residual for p in pairs])
        converged = np.array([p.converged for p in pairs], dtype=bool)
        matvecs, exact_level = spent["matvecs"], spent["exact_level"]
        coefficients = torch.from_numpy(pair_coefficients(pairs, last["S"], locked))
        if not explicit_residuals:  # deflated rounds' bounds: measure those that fail the test
            reported, converged, extra = bounded_residuals(
                op, basis, coefficients, values, reported, converged, tol, exact_level
            )
            matvecs += extra
        vectors = None
        if return_eigenvectors or explicit_residuals:
            # the residual is checked on the vector the operator multiplies (rounded to its
            # dtype); float64 copies only when the caller asked for the eigenvectors
            keep = _F64 if return_eigenvectors else storage_dtype(op.dtype)
            vectors = basis.combine(coefficients, dtype=keep)
        m = spent["matvecs"]  # the Lanczos steps of every round
        basis.close()
    breakdown = first_breakdown(state["breakdown"], record, last["complete"])
    del basis, state
    notes += _stop_notes(
        {**spent, "converged": converged, "complete": last["complete"]}, limit, room
    )
    if record is not None and (note := multiplicity_note(record, wanted, limit)):
        notes.append(note)
    if explicit_residuals:
        reported, converged = measured_residuals(
            op, values, vectors, converged, tol, exact_level, notes
        )
        matvecs += len(values)
    at_rounding = int((converged & (reported > tol * np.abs(values))).sum())
    if at_rounding:
        notes.append(
            f"{at_rounding} eigenvalue(s) converged at the products' rounding level "
            f"(residual <= 100 eps ||T|| = {exact_level:.3g}), not at tol |eigenvalue|"
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
        krylov_dim=m,
        breakdown=breakdown,
        restarts=int(spent["restarts"]),
        reorthogonalized=int(spent["reorthogonalized"]),
        max_basis=int(room),
        notes=notes,
        warm_start=warm_info,
        multiplicity=record,
    )
    if return_eigenvectors:
        result.eigenvectors = vectors
    run.finish(matvecs, **reported_numbers(result.eigenvalues, result.residuals, which))
    return result


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


def _run_lanczos(
    op, basis, want, which, tol, limit, room, generator, eps, run, *, round_=None, whole=False
) -> dict:
    """The Lanczos iteration of :func:`lanczos`, thick-restarted at ``room`` rows ([Wu2000]).

    Plain steps keep ``T`` tridiagonal. A restart keeps the Ritz pairs
    ``(theta_i, y_i = Q s_i)`` of the wanted end(s) (:func:`_keep_after_restart`), continues
    from ``q_{m+1} = w / beta_m`` and couples it to each kept vector by ``beta_m s_{m,i}``:
    ``A Y = Y diag(theta) + beta_m q_{m+1} s_m^T`` holds exactly as the Lanczos relation did,
    so the Ritz estimate ``beta |e_m^T s|`` and the explicit residuals mean the same after a
    restart. The projected matrix is then arrowhead plus tridiagonal, kept dense (it is tiny).

    Args:
        op: the operator.
        basis: the Krylov basis holding the start vector.
        want: the wanted values of each end.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        tol: the relative residual tolerance.
        limit: the product budget.
        room: the most basis rows before a restart.
        generator: draws fresh vectors after a breakdown.
        eps: the products' rounding unit.
        run: the progress run.
        round_: a deflated round (:mod:`~sharpcli.curvature.deflation`): ``locked`` (the
            locked rows ahead of the round's, left as they are), ``enough`` (the stop test of
            the wanted values, descending, and their converged flags), ``done`` (products
            spent before it), ``exhaustive`` (the first round's rule after a breakdown).
        whole: run to dimension P (restarting after breakdowns) whatever converges.

    Returns:
        The final state: ``theta``, ``S``, ``idx``, ``converged``, ``residuals``,
        ``exact_level``, ``matvecs``, ``basis``, ``restarts``, ``reorthogonalized`` (steps
        that ran Gram-Schmidt), ``breakdown``, ``complete``.

    Raises:
        NumericalError: a product is not finite.
    """
    dim = op.shape[0]
    locked, enough, done = 0, None, 0
    exhaustive = room >= dim and limit == dim
    if round_ is not None:
        locked, enough, done, exhaustive = (
            round_["locked"],
            round_["enough"],
            round_["done"],
            round_["exhaustive"],
        )
    T = np.zeros((0, 0))
    coupling: list[tuple[int, float]] = []
    history: list[float] = []  # worst residual / (tol |theta|) of each step, for the projection
    matvecs = restarts = 0
    breakdown = None
    exhaust = whole  # after a breakdown on a problem that fits: run to dimension P
    complete = False
    scale = 0.0
    reorthogonalized = 0
    while True:
        # Gram-Schmidt may be skipped only in a plain recurrence (tridiagonal T, no locked or
        # restarted rows, not spanning the whole space), where Paige's relation holds as stated
        plain = round_ is None and restarts == 0 and not (exhaust or exhaustive)
        settled = None
        if plain:
            coupled = [(i - locked, value) for i, value in coupling]
            settled = skip_when_semiorthogonal(
                lambda a, T=T, c=coupled: _extend_projection(T, a, c), scale, eps
            )
        alpha, beta, w, full = lanczos_step(op, basis, coupling, done + matvecs, settled)
        reorthogonalized += full
        matvecs += 1
        T = _extend_projection(T, alpha, [(i - locked, value) for i, value in coupling])
        theta, S = torch.linalg.eigh(torch.from_numpy(T))
        theta, S = theta.numpy(), S.numpy()
        scale = max(scale, float(np.abs(theta).max()), abs(alpha))
        exact_level = 100 * eps * max(scale, np.finfo(np.float64).tiny)
        residuals = beta * np.abs(S[-1, :])
        idx = select_ritz(theta, which, want)
        converged = (residuals[idx] <= tol * np.abs(theta[idx])) | (residuals[idx] <= exact_level)
        m = len(basis) - locked
        if not run.finished:
            report_step(
                run, done + matvecs, theta[idx], residuals[idx], which, tol, history, done + limit
            )
        if len(basis) == dim:
            complete = True
            break
        if beta <= exact_level:
            if exhaustive:
                exhaust = True
                if breakdown is None:
                    breakdown = (
                        f"invariant subspace after {m} steps; restarted to reach dimension {dim}"
                    )
                coupling = []
                basis.append(unit_random(dim, generator, op.device, basis))
                continue
            breakdown = f"invariant subspace after {m} steps: Ritz values are exact eigenvalues"
            break
        stop = converged.all() if enough is None else enough(theta[idx], residuals[idx], converged)
        if (stop and not exhaust) or matvecs >= limit:
            break
        if (
            len(basis) == room
        ):  # thick restart: keep the wanted Ritz vectors, continue from w / beta
            keep = _keep_after_restart(theta, which, want, m)
            basis.rotate(_beside_locked(locked, S[:, keep]))
            T = np.diag(theta[keep])
            coupling = [(locked + i, float(beta * S[-1, j])) for i, j in enumerate(keep)]
            restarts += 1
        else:
            coupling = [(len(basis) - 1, beta)]
        basis.append(w, divisor=beta)  # q_{j+1} = w / beta_j, divided as it is stored
    return {
        "theta": theta,
        "S": S,
        "idx": idx,
        "converged": converged,
        "residuals": residuals,
        "exact_level": exact_level,
        "matvecs": matvecs,
        "basis": basis,
        "restarts": restarts,
        "reorthogonalized": reorthogonalized,
        "breakdown": breakdown,
        "complete": complete,
    }
