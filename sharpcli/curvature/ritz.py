r"""Ritz pairs: the eigenvalue result, the choice of wanted Ritz values and their residuals.

A Lanczos run (:mod:`sharpcli.curvature.lanczos`, [Lanczos1950]) projects a symmetric operator
``A`` onto an orthonormal basis ``Q_m``; an eigenpair ``T_m s = theta s`` of the projection gives
the Ritz pair ``(theta, u = Q_m s)``, whose residual ([Parlett1998])

.. math::

    \|A u - \theta u\| = \beta_m |e_m^T s|

is free as long as ``Q_m`` is orthonormal and the products are exact. When the products are
rounded (float32 models) the relation holds only up to the products' own rounding,

.. math::

    A Q_m = Q_m T_m + \beta_m q_{m+1} e_m^T + F_m, \qquad
    \|F_m e_j\| \sim \epsilon(\mathrm{dtype}) \|A\|,

so the estimate keeps falling below that floor while the true residual does not: the
residuals reported for such operators are measured explicitly (:func:`ritz_residuals`, one
product per pair).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from sharpcli.curvature.krylov import SLICE_BYTES
from sharpcli.curvature.totals import norm64
from sharpcli.errors import NumericalError

__all__ = [
    "QUANTITY",
    "EigenResult",
    "apply_operator",
    "measured_residuals",
    "report_step",
    "reported_numbers",
    "ritz_residuals",
    "select_ritz",
]

_F64 = torch.float64


@dataclass
class EigenResult:
    """Eigenvalues (descending) of a curvature operator with their Ritz residuals.

    Attributes:
        eigenvalues: the Ritz values, descending.
        residuals: ``||A u_i - lambda_i u_i||`` (2-norm, ``u_i`` unit) of each.
        converged: whether ``residuals[i] <= tol * |lambda_i|`` (or at rounding level).
        matvecs: full-operator products spent (the warm phase's are not among them).
        method: the estimator, ``"lanczos"`` or ``"power"``.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        tol: the relative residual tolerance.
        engine: ``"native"`` or ``"pyhessian"``.
        krylov_dim: the Krylov dimension reached: the Lanczos steps of every round (the
            products before explicit residuals; thick restarts keep at most ``max_basis`` of
            the vectors).
        breakdown: why the iteration found an invariant subspace, when it did.
        notes: how the run stopped, what it measured explicitly.
        eigenvectors: a float64 ``(P, m)`` tensor whose columns match ``eigenvalues`` when asked.
        warm_start: the warm-start phase, when there was one (its products and cost).
        restarts: thick restarts ([Wu2000]).
        reorthogonalized: Lanczos steps that ran Gram-Schmidt against the whole basis (the
            others were semi-orthogonal without it,
            :func:`~sharpcli.curvature.tridiagonal.semiorthogonal`); ``None`` for power
            iteration.
        max_basis: the most basis vectors the run kept.
        multiplicity: how repeated eigenvalues were counted (Lanczos,
            :func:`~sharpcli.curvature.deflation.multiplicity_record`): ``resolved`` (the
            values are the k extreme ones counted with multiplicity, as far as the run shows),
            ``unresolved_because``, ``deflated_restarts``, ``copies_found``,
            ``more_copies_of``; ``None`` when not checked.
    """

    eigenvalues: list[float]
    residuals: list[float | None]
    converged: list[bool]
    matvecs: int
    method: str
    which: str
    tol: float
    engine: str = "native"
    krylov_dim: int | None = None
    breakdown: str | None = None
    notes: list[str] = field(default_factory=list)
    eigenvectors: torch.Tensor | None = None
    warm_start: dict | None = None
    restarts: int = 0
    reorthogonalized: int | None = None
    max_basis: int | None = None
    multiplicity: dict | None = None

    def to_dict(self) -> dict:
        """The result as JSON-ready data.

        Returns:
            Every field but ``eigenvectors``; ``warm_start`` and ``multiplicity`` only when
            there is one.
        """
        out = {
            "eigenvalues": list(self.eigenvalues),
            "residuals": list(self.residuals),
            "converged": list(self.converged),
            "matvecs": self.matvecs,
            "method": self.method,
            "which": self.which,
            "tol": self.tol,
            "engine": self.engine,
            "krylov_dim": self.krylov_dim,
            "breakdown": self.breakdown,
            "notes": list(self.notes),
            "restarts": self.restarts,
            "reorthogonalized": self.reorthogonalized,
            "max_basis": self.max_basis,
        }
        if self.warm_start is not None:
            out["warm_start"] = dict(self.warm_start)
        if self.multiplicity is not None:
            out["multiplicity"] = dict(self.multiplicity)
        return out


def select_ritz(theta: np.ndarray, which: str, count: int) -> np.ndarray:
    """The wanted Ritz values among all of them.

    Args:
        theta: the Ritz values, ascending.
        which: ``"largest"``, ``"smallest"`` or ``"both"`` (``count`` of each end).
        count: how many of each wanted end (at most ``len(theta)``).

    Returns:
        Indices into ``theta``, ordered by descending value.

    Example:
        >>> select_ritz(np.array([1.0, 2.0, 3.0, 4.0]), "both", 1).tolist()
        [3, 0]
    """
    m = len(theta)
    count = min(count, m)
    if which == "largest":
        idx = np.arange(m - count, m)
    elif which == "smallest":
        idx = np.arange(0, count)
    else:
        idx = np.union1d(np.arange(0, count), np.arange(m - count, m))
    return idx[::-1].copy()


def product_not_finite(op, source: str, where: str = "") -> NumericalError:
    """The error of a product with a NaN or Inf entry.

    Args:
        op: the operator (its ``name`` is in the message).
        source: the parameter the product is blamed on.
        where: appended to the message (``" at Lanczos step 3"``).

    Returns:
        The :class:`~sharpcli.errors.NumericalError` to raise.
    """
    name = getattr(op, "name", "operator")
    return NumericalError(f"{name} product is not finite{where}", source=source)


def apply_operator(
    op,
    V: torch.Tensor,
    *,
    source: str,
    where: str = "",
    widen: bool = True,
    checked: bool = True,
) -> torch.Tensor:
    """The product ``A V``, checked finite.

    The product itself runs in the operator's dtype (``V`` is rounded to it), as the model
    computes it. A block goes through ``matmat`` (one pass over the data for all columns).

    Args:
        op: the operator (``dtype``, ``device``, ``matvec``, ``matmat``).
        V: a P-vector or a ``(P, k)`` block.
        source: the parameter a non-finite product is blamed on.
        where: appended to the error message (``" at Lanczos step 3"``).
        widen: return float64 rather than the operator's dtype.
        checked: check the product here; ``False`` when the caller checks it in a pass of its
            own (:func:`product_not_finite` gives its error).

    Returns:
        ``A V``, float64 when ``widen``, else in the operator's dtype.

    Raises:
        NumericalError: the product is not finite.
    """
    X = V.to(dtype=op.dtype, device=op.device)
    out = op.matvec(X) if X.dim() == 1 else op.matmat(X)
    del X
    # a float64 norm is finite exactly when every entry is (no P-sized mask at 124M params)
    if checked and not math.isfinite(norm64(out)):
        raise product_not_finite(op, source, where)
    return out.to(_F64) if widen else out


def ritz_residuals(op, eigenvalues, eigenvectors: torch.Tensor) -> list[float]:
    r"""Explicit relative residuals of eigenpairs.

    .. math::

        r_i = \frac{\|A u_i - \lambda_i u_i\|}{\|u_i\|}

    One product per pair, all in one ``matmat`` block, in the operator's dtype; the
    subtraction and the norms are float64 (a slice of rows widened at a time), so the result
    is the residual of the vector the operator actually multiplied (``u_i`` rounded to
    ``op.dtype``) up to float64 rounding.

    Args:
        op: the operator.
        eigenvalues: ``lambda_i``.
        eigenvectors: a P-vector or a ``(P, m)`` tensor of columns ``u_i``.

    Returns:
        ``r_i`` for each pair.

    Raises:
        NumericalError: a product is not finite.
    """
    if eigenvectors.dim() == 1:
        eigenvectors = eigenvectors[:, None]
    U = eigenvectors.to(dtype=op.dtype, device=op.device)
    R = apply_operator(op, U, source="lanczos", where=" in the residual check", widen=False)
    lam = torch.as_tensor(list(eigenvalues), dtype=_F64, device=U.device)
    R = R.reshape(U.shape)
    squares = torch.zeros(U.shape[1], dtype=_F64, device=U.device)
    norms = torch.zeros_like(squares)
    rows = max(1, SLICE_BYTES // (16 * max(1, squares.numel())))
    for a in range(0, U.shape[0], rows):
        u = U[a : a + rows].to(_F64).reshape(-1, squares.numel())
        r = R[a : a + rows].to(_F64).reshape(-1, squares.numel())
        squares += ((r - u * lam).square()).sum(dim=0)
        norms += u.square().sum(dim=0)
    return (squares.sqrt() / norms.sqrt()).tolist()


def measured_residuals(op, values, vectors, estimated, tol, exact_level, notes):
    """The residuals of returned Ritz pairs, measured with one product per pair.

    Args:
        op: the operator.
        values: the Ritz values (numpy array).
        vectors: the Ritz vectors as columns.
        estimated: whether each pair converged by its Ritz estimate.
        tol: the relative tolerance.
        exact_level: the products' rounding level, below which a residual is converged.
        notes: the run's notes; this appends what it measured (and any pair it lost).

    Returns:
        ``(residuals, converged)``, numpy arrays.
    """
    reported = np.asarray(ritz_residuals(op, values.tolist(), vectors))
    converged = (reported <= tol * np.abs(values)) | (reported <= exact_level)
    notes.append(
        f"residuals are explicit: ||A u - lambda u|| measured with {len(values)} more "
        f"product{'s' if len(values) != 1 else ''}, since the model multiplies in "
        f"{str(op.dtype).replace('torch.', '')} (Lanczos keeps its scalars in float64)"
    )
    lost = int((estimated & ~converged).sum())
    if lost:
        notes.append(
            f"{lost} eigenvalue(s) converged by the Ritz estimate but not by the explicit "
            "residual: the products' own errors (rounding) bound the attainable residual; "
            "raise `tol` or use `dtype=float64`"
        )
    return reported, converged


QUANTITY = {"largest": "lambda_max", "smallest": "lambda_min", "both": "lambda_max"}


def reported_numbers(values, residuals, which: str) -> dict:
    """The progress numbers of wanted Ritz values (descending): the extreme one the run is
    named after (``QUANTITY``) and the worst residual.

    Args:
        values: the wanted Ritz values, descending.
        residuals: their residuals.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.

    Returns:
        ``{"estimate", "residual"}``.
    """
    return {
        "estimate": float(values[-1] if which == "smallest" else values[0]),
        "residual": float(max(residuals)),
    }


def report_step(run, matvecs, values, residuals, which, tol, history, limit) -> None:
    """Report a step: the Ritz estimates and the step at which they project to converge.

    The worst ratio ``r_j = max_i residual_i / (tol |theta_i|)`` falls roughly geometrically
    (the Kaniel-Paige-Saad bound, :mod:`~sharpcli.curvature.warm_start`); with its rate over
    the last two steps ``rho = (r_j / r_{j-2})^(1/2) < 1`` the run projects
    ``log(r_j) / -log(rho)`` more steps (capped by the budget ``limit``); none while it is not
    falling.

    Args:
        run: the progress run.
        matvecs: products so far.
        values: the wanted Ritz values.
        residuals: their estimated residuals.
        which: ``"largest"``, ``"smallest"`` or ``"both"``.
        tol: the relative residual tolerance.
        history: the worst ratio of each step so far (appended to).
        limit: the product budget.
    """
    ratio = float(np.max(residuals / (tol * np.maximum(np.abs(values), 1e-300))))
    history.append(ratio)
    expected = None
    if len(history) >= 3 and ratio > 1 and 0 < ratio < history[-3]:
        rate = math.sqrt(ratio / history[-3])
        expected = min(limit, matvecs + math.ceil(math.log(ratio) / -math.log(rate)))
    run.update(matvecs, expected=expected, **reported_numbers(values, residuals, which))
