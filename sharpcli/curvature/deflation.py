r"""Deflated restarts: the k extreme eigenvalues of a symmetric operator counted with multiplicity.

A Krylov space ``K_m(A, q)`` holds one direction of each eigenspace (``q``'s projection onto
it), so Lanczos from one start vector finds each distinct eigenvalue once in exact arithmetic;
in floating point further copies of a repeated eigenvalue appear only where rounding has fed
them, haphazardly. :func:`sharpcli.curvature.lanczos.lanczos` therefore *locks*
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

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from sharpcli.curvature.ritz import ritz_residuals
from sharpcli.curvature.tridiagonal import unit_random

__all__ = [
    "DeflatedRounds",
    "Pair",
    "bounded_residuals",
    "deflated_residual",
    "deflated_rounds",
    "first_breakdown",
    "first_round_pairs",
    "merge_round",
    "multiplicity_note",
    "multiplicity_record",
    "pair_coefficients",
    "round_is_enough",
]

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


def _ritz_pairs(state: dict, locked_squares: float, found_in: int) -> list[Pair]:
    """A round's wanted Ritz pairs, residuals bounded for the locked rows (module docstring)."""
    theta, idx, converged, residuals = (
        state["theta"],
        state["idx"],
        state["converged"],
        state["residuals"],
    )
    return [
        Pair(
            float(theta[j]),
            deflated_residual(float(residuals[j]), locked_squares),
            bool(c),
            column=int(j),
            found_in=found_in,
        )
        for j, c in zip(idx, converged)
    ]


def _returned(kept: dict, which: str) -> list[Pair]:
    """The kept pairs of every end once each, by descending value."""
    unique = {id(p): p for end in _ENDS[which] for p in kept[end]}
    return sorted(unique.values(), key=lambda p: -p.value)


def first_round_pairs(state: dict) -> list[Pair]:
    """The first round's wanted Ritz pairs, descending, when multiplicity is not checked.

    Args:
        state: the round's state.

    Returns:
        The pairs.
    """
    return _ritz_pairs(state, 0.0, 0)


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


def deflated_rounds(first: dict, next_round, lock, *, which: str, want: int, room: int, tol):
    """Lanczos rounds with locking until the k values of each end are verified.

    Args:
        first: the first round's state (:func:`sharpcli.curvature.lanczos._run_lanczos`).
        next_round: ``next_round(locked, enough)`` appends a fresh vector orthogonal to the
            ``locked`` rows, runs a round on the deflated operator that stops at
            ``enough(values_desc, residuals, converged)`` or its budget, and returns its state, or
            returns ``None`` when the product budget is spent.
        lock: ``lock(S_full)`` rotates the basis to the columns of ``S_full`` (the locked rows).
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        want: the wanted values of each end.
        room: the most basis rows.
        tol: the relative residual tolerance.

    Returns:
        ``(pairs, state, locked, record)``: the returned pairs (descending), the last round's
        state, the locked rows before that round's, and the multiplicity record
        (:func:`multiplicity_record`).
    """
    kept: dict = {end: [] for end in _ENDS[which]}
    ties: list = []
    why: str | None = "budget"
    state, locked, restarts, locked_squares = first, 0, 0, 0.0
    wanted = want * len(_ENDS[which])
    while True:
        pairs = _ritz_pairs(state, locked_squares, restarts)
        values = np.array([p.value for p in pairs])
        bounds = np.array([p.residual for p in pairs])
        flags = np.array([p.converged for p in pairs])
        if not restarts and not flags.all():  # not converged: nothing to verify
            resolved = want == 1 or state["complete"]
            why = None if resolved else "not converged"
            return pairs, state, locked, multiplicity_record(resolved, 0, 0, [], why)
        enough = bool(
            restarts == 0 or round_is_enough(values, bounds, flags, which, want, kept, tol)
        )
        entries, found = merge_round(kept, [p for p in pairs if p.converged], which, want)
        ties += found
        verified = enough and (restarts > 0 and entries == 0 or want == 1)
        if verified or state["complete"] or not enough:
            break
        returned = _returned(kept, which)
        S_full = pair_coefficients(returned, state["S"], locked)
        if len(returned) + wanted + 2 > room:
            enough, why = False, "basis room"  # no room for a round beside the locked rows
            break
        lock(S_full)
        for row, pair in enumerate(returned):
            pair.row, pair.column = row, None
        locked = len(returned)
        locked_squares = sum(p.residual**2 for p in returned)
        checked = functools.partial(round_is_enough, which=which, want=want, kept=kept, tol=tol)
        following = next_round(locked, checked)
        if following is None:  # the budget is spent: every returned pair is a locked row
            state, enough = {**state, "S": np.zeros((0, 0)), "complete": False}, False
            break
        state = following
        restarts += 1
    returned = _returned(kept, which)
    copies = sum(1 for p in returned if p.found_in > 0)
    ties = _tied_with_last(kept, ties, want)
    resolved = bool(enough or state["complete"])
    record = multiplicity_record(resolved, restarts, copies, ties, None if resolved else why)
    return returned, state, locked, record


def bounded_residuals(op, basis, coefficients, values, residuals, converged, tol, exact_level):
    """The reported residuals: a deflated round's bound, or measured where the bound fails.

    A pair that converged by its round's Ritz estimate but whose bound
    (:func:`deflated_residual`) fails the test gets its residual measured,
    ``||A u - theta u||`` with one product (:func:`~sharpcli.curvature.ritz.ritz_residuals`).

    Args:
        op: the operator.
        basis: the Krylov basis.
        coefficients: the pairs' basis coefficients (``(rows, pairs)`` float64 tensor).
        values: the Ritz values.
        residuals: their residuals (estimates or bounds).
        converged: whether each converged by its round's estimate.
        tol: the relative tolerance.
        exact_level: the products' rounding level.

    Returns:
        ``(residuals, converged, products spent)``.
    """
    passes = (residuals <= tol * np.abs(values)) | (residuals <= exact_level)
    measure = np.flatnonzero(converged & ~passes)
    residuals = residuals.copy()
    if len(measure):
        vectors = basis.combine(coefficients[:, torch.from_numpy(measure)], dtype=basis.dtype)
        residuals[measure] = ritz_residuals(op, values[measure].tolist(), vectors)
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


class DeflatedRounds:
    """The rounds of :func:`deflated_rounds` for :func:`~sharpcli.curvature.lanczos.lanczos`:
    each a Lanczos run from a fresh random vector orthogonal to the locked rows, on the same
    basis and product budget.

    Args:
        run_round: the thick-restarted iteration (``lanczos._run_lanczos``).
        op: the operator.
        basis: the Krylov basis (locked rows first).
        wanted: ``(want, which, tol, limit, room)``: the wanted values of each end, which
            end(s), the tolerance, the product budget of all rounds, the most basis rows.
        generator: draws the fresh start vectors.
        eps: the products' rounding unit.
        run: the progress run.
        spent: ``matvecs``, ``restarts`` and ``exact_level`` so far, updated by each round.
    """

    def __init__(self, run_round, op, basis, wanted, generator, eps, run, spent):
        self.run_round, self.op, self.basis = run_round, op, basis
        self.want, self.which, self.tol, self.limit, self.room = wanted
        self.generator, self.eps, self.run, self.spent = generator, eps, run, spent
        self.exhaustive = self.room >= op.shape[0] and self.limit == op.shape[0]

    def lock(self, S_full: np.ndarray) -> None:
        """Keep the basis combinations ``S_full`` (the locked Ritz vectors) as its rows."""
        self.basis.rotate(torch.from_numpy(np.ascontiguousarray(S_full)))

    def next_round(self, locked: int, enough):
        """A round on the deflated operator, or ``None`` when the budget is spent."""
        spent = self.spent
        if spent["matvecs"] >= self.limit:
            return None
        op = self.op
        self.basis.append(unit_random(op.shape[0], self.generator, op.device, self.basis))
        round_ = {
            "locked": locked,
            "enough": enough,
            "done": spent["matvecs"],
            "exhaustive": self.exhaustive,
        }
        state = self.run_round(
            op,
            self.basis,
            self.want,
            self.which,
            self.tol,
            self.limit - spent["matvecs"],
            self.room,
            self.generator,
            self.eps,
            self.run,
            round_=round_,
        )
        spent["matvecs"] += state["matvecs"]
        spent["restarts"] += state["restarts"]
        spent["reorthogonalized"] += state["reorthogonalized"]
        spent["exact_level"] = max(spent["exact_level"], state["exact_level"])
        return state
