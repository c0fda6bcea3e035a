"""Which measure predicts generalization: Kendall's tau against the generalization gap
([Jiang2019] section 3).

For runs r = 1..n with a measure ``mu_r`` and a gap ``g_r`` (test error minus train error, or
test loss minus train loss), Kendall's tau-b ([Kendall1945]) is
``(C - D) / sqrt((n0 - n1)(n0 - n2))`` over the ``n0 = n(n-1)/2`` pairs (C concordant, D
discordant, n1 and n2 the pairs tied in mu and in g). Its two-sided permutation p-value is the
share of relabellings of the gaps whose |tau| reaches the observed one: all n! of them for
n <= 8, else 10,000 seeded random ones (the observed labelling counted, so p >= 1/(count + 1)).

[Jiang2019]'s granulated tau: for each hyper-parameter axis i, the mean over the groups of runs
that share every other axis of the tau within the group (along axis i), ``psi_i``; their mean
over the axes is ``Psi``. A group of fewer than two runs, or whose tau is undefined, is left out.

The measures are estimates: where a run's record carries a measure's standard errors
(``{measure}_stderr``, the probes', and ``{measure}_data_stderr``, the data's), tau is
recomputed over ``NOISE_DRAWS`` seeded redraws of every run's measure within its combined error
``mu_r + sqrt(se_r^2 + de_r^2) z_r``, ``z_r ~ N(0, 1)`` independent; the standard deviation of
those taus, ``tau_noise_sd``, is how far the ranking would move on other probes and another
sample of the data. A tau within about two of them of another measure's does not rank above it.
"""

from __future__ import annotations

import itertools
import math
import random

__all__ = [
    "granulated_tau",
    "kendall_tau",
    "measure_correlations",
    "measure_error",
    "permutation_p_value",
    "tau_noise_sd",
]

EXACT_UP_TO = 8
PERMUTATIONS = 10_000
NOISE_DRAWS = 200
# the columns of a measure's standard errors: the probes' and the data's (not measures themselves)
ERROR_SUFFIXES = ("_stderr", "_data_stderr")
# columns that are not measures: identity, the gap's inputs, the hyper-parameters
NOT_MEASURES = (
    "run",
    "command",
    "regularizers",
    "seed",
    "train_accuracy",
    "test_accuracy",
    "train_loss",
    "test_loss",
)


def kendall_tau(x: list[float], y: list[float]) -> float | None:
    """Kendall's tau-b of two equally long sequences (module docstring); None when one of
    them is constant or there are fewer than two points.

    Args:
        x: the first sequence.
        y: the second.

    Returns:
        tau in [-1, 1], or None.
    """
    n = len(x)
    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                ties_x += 1
                ties_y += 1
            elif dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    pairs = n * (n - 1) // 2
    denominator = math.sqrt((pairs - ties_x) * (pairs - ties_y)) if pairs else 0.0
    return None if denominator == 0 else (concordant - discordant) / denominator


def permutation_p_value(x: list[float], y: list[float], *, seed: int = 0) -> float | None:
    """Two-sided permutation p-value of Kendall's tau (module docstring).

    Args:
        x: the measure.
        y: the gap.
        seed: seeds the random permutations (n > 8).

    Returns:
        The p-value, or None where tau is undefined.
    """
    observed = kendall_tau(x, y)
    if observed is None:
        return None
    level = abs(observed) - 1e-12
    if len(y) <= EXACT_UP_TO:
        taus = [kendall_tau(x, list(p)) for p in itertools.permutations(y)]
        return sum(1 for t in taus if t is not None and abs(t) >= level) / len(taus)
    rng = random.Random(seed)
    shuffled, hits = list(y), 1  # the observed labelling
    for _ in range(PERMUTATIONS):
        rng.shuffle(shuffled)
        tau = kendall_tau(x, shuffled)
        hits += tau is not None and abs(tau) >= level
    return hits / (PERMUTATIONS + 1)


def granulated_tau(
    records: list[dict], measure: str, gap: list[float], axes: list[str]
) -> dict | None:
    """[Jiang2019]'s granulated tau of ``measure`` over ``axes`` (module docstring).

    Args:
        records: the runs (their ``measure`` and axis values).
        measure: the column.
        gap: the gap of each record.
        axes: the hyper-parameter columns.

    Returns:
        ``{"per_axis": {axis: psi_i}, "mean": Psi}`` or None when no axis has a group.
    """
    per_axis = {}
    for axis in axes:
        others = [a for a in axes if a != axis]
        groups: dict = {}
        for record, g in zip(records, gap):
            key = tuple(repr(record.get(a)) for a in others)
            groups.setdefault(key, []).append((record[measure], g))
        taus = []
        for members in groups.values():
            if len(members) >= 2:
                tau = kendall_tau([m for m, _ in members], [g for _, g in members])
                if tau is not None:
                    taus.append(tau)
        if taus:
            per_axis[axis] = sum(taus) / len(taus)
    if not per_axis:
        return None
    return {"per_axis": per_axis, "mean": sum(per_axis.values()) / len(per_axis)}


def measure_error(record: dict, measure: str) -> float | None:
    """The combined standard error of ``record[measure]``: the root sum of squares of its
    ``{measure}_stderr`` and ``{measure}_data_stderr`` (module docstring); None with neither.

    Args:
        record: one run.
        measure: the column.

    Returns:
        The error, or None.
    """
    parts = [record.get(measure + suffix) for suffix in ERROR_SUFFIXES]
    known = [float(p) for p in parts if p is not None and _is_number(p)]
    return math.sqrt(sum(p * p for p in known)) if known else None


def tau_noise_sd(
    x: list[float], errors: list[float], y: list[float], *, seed: int = 0
) -> float | None:
    """The standard deviation of Kendall's tau over ``NOISE_DRAWS`` seeded redraws of ``x``
    within its standard errors (module docstring).

    Args:
        x: the measure.
        errors: each run's combined standard error of it (0 where exact).
        y: the gap.
        seed: seeds the redraws.

    Returns:
        The standard deviation, or None where fewer than two redraws give a tau.
    """
    rng = random.Random(seed)
    taus = []
    for _ in range(NOISE_DRAWS):
        drawn = [v + e * rng.gauss(0.0, 1.0) for v, e in zip(x, errors)]
        tau = kendall_tau(drawn, y)
        if tau is not None:
            taus.append(tau)
    if len(taus) < 2:
        return None
    mean = sum(taus) / len(taus)
    return math.sqrt(sum((t - mean) ** 2 for t in taus) / (len(taus) - 1))


def _gap(record: dict, kind: str) -> float | None:
    if kind == "error":
        train, test = record.get("train_accuracy"), record.get("test_accuracy")
        # test error - train error = train accuracy - test accuracy
        return None if train is None or test is None else float(train) - float(test)
    train, test = record.get("train_loss"), record.get("test_loss")
    return None if train is None or test is None else float(test) - float(train)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _measure_row(column: str, usable: list, axes: list[str], seed: int) -> dict | None:
    """The tau row of one measure over the runs that give a gap and a number for it (None
    with fewer than three, or where tau is undefined): :func:`measure_correlations`."""
    pairs = [(r[column], g, r) for r, g in usable if _is_number(r.get(column))]
    if len(pairs) < 3:
        return None
    xs, gs = [float(p[0]) for p in pairs], [p[1] for p in pairs]
    tau = kendall_tau(xs, gs)
    if tau is None:
        return None
    row = {
        "measure": column,
        "tau": tau,
        "p_value": permutation_p_value(xs, gs, seed=seed),
        "runs": len(pairs),
    }
    errors = [measure_error(p[2], column) for p in pairs]
    if any(e is not None for e in errors):
        row["tau_noise_sd"] = tau_noise_sd(xs, [e or 0.0 for e in errors], gs, seed=seed)
    if axes:
        found = granulated_tau([p[2] for p in pairs], column, gs, axes)
        row["granulated"] = None if found is None else found["mean"]
        row["granulated_per_axis"] = None if found is None else found["per_axis"]
    return row


def measure_correlations(
    records: list[dict], *, gap: str = "error", axes: list[str] | None = None, seed: int = 0
) -> dict:
    """Kendall's tau of every numeric column of ``records`` against the generalization gap.

    Args:
        records: one dict per run (columns: measures, ``train_accuracy``, ``test_accuracy``,
            ``train_loss``, ``test_loss``, hyper-parameters).
        gap: ``"error"`` (test error - train error) or ``"loss"`` (test loss - train loss).
        axes: the hyper-parameter columns (left out of the measures; the granulated tau's axes).
        seed: seeds the permutation p-values.

    Returns:
        ``{"gap", "runs", "rows": [{"measure", "tau", "p_value", "runs", "tau_noise_sd",
        "granulated", "granulated_per_axis"}], "notes"}``; rows sorted by |tau|, largest
        first; ``tau_noise_sd`` (module docstring) only for a measure whose runs carry
        standard errors.
    """
    axes = list(axes or [])
    gaps = [(r, _gap(r, gap)) for r in records]
    usable = [(r, g) for r, g in gaps if g is not None]
    columns = list(dict.fromkeys(k for r, _ in usable for k in r))
    skip = set(NOT_MEASURES) | set(axes)
    rows = []
    for column in columns:
        if column in skip or column.endswith(ERROR_SUFFIXES):
            continue
        row = _measure_row(column, usable, axes, seed)
        if row is not None:
            rows.append(row)
    rows.sort(key=lambda r: -abs(r["tau"]))
    notes = []
    if len(usable) < 10:
        notes.append(
            f"{len(usable)} runs: Kendall's tau of so few runs is coarse (steps of "
            f"{2 / max(1, len(usable) * (len(usable) - 1) / 2):.2g}); read the p-values"
        )
    return {"gap": gap, "runs": len(usable), "rows": rows, "notes": notes}
