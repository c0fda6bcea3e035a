r"""The Lanczos recurrence and its Ritz pairs: one step, the eigenvalue result, the wanted Ritz
values and their residuals, and a plain tridiagonalisation for quadrature.

After m steps from a unit start vector ``q_1`` the Lanczos relation [Lanczos1950] reads

.. math::

    A Q_m = Q_m T_m + \beta_m q_{m+1} e_m^T,

with ``T_m`` tridiagonal (alphas on the diagonal, betas beside it). Reorthogonalisation
(classical Gram-Schmidt applied twice, "CGS2", [Parlett1998]) keeps ``Q_m`` orthonormal; it
reads the whole basis twice, so a step whose new vector is provably semi-orthogonal to the
basis without it skips it (:func:`semiorthogonal`: Paige's relation, [Paige1980]; semi-
orthogonality keeps ``T_m`` the projection of ``A`` to rounding, [Simon1984]).

An eigenpair ``T_m s = theta s`` of the projection gives the Ritz pair
``(theta, u = Q_m s)``, whose residual ([Parlett1998]) ``||A u - theta u|| = beta_m |e_m^T s|``
is free as long as ``Q_m`` is orthonormal and the products are exact. When the products are
rounded (float32 models) the relation holds only up to the products' own rounding,
``||F_m e_j|| ~ eps(dtype) ||A||`` added to its right side, so the estimate keeps falling
below that floor while the true residual does not: the residuals reported for such
operators are measured explicitly (:func:`ritz_residuals`, one product per pair).

Precision: every scalar of the recurrence (alpha, beta, the reorthogonalisation coefficients,
the norms) is a float64 sum whatever the operator's dtype; the products ``A q_j`` run in the
operator's dtype, and the basis and the work vector are stored in it (float32 for a float32
model: ``q_j`` is rounded to float32 before its product anyway, and each update of ``w`` adds a
rounding of the order of the product's own). A float32 dot product or norm accumulated over
P entries carries a relative error that moves the Ritz values and breaks the Lanczos
relation (docs/benchmarks.md, "Float32 Lanczos"); the scalars are float64 sums of chunks
widened in cache (:mod:`~sharpcli.curvature.products.totals`), at about the cost of a float32
pass.

:func:`lanczos_tridiagonal` serves stochastic Lanczos quadrature
(:mod:`sharpcli.curvature.density`); :func:`sharpcli.curvature.eigen.lanczos.lanczos` runs
:func:`lanczos_step` with thick restarts.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from sharpcli import memory, progress
from sharpcli.curvature.eigen.krylov import (
    SLICE_BYTES,
    KrylovBasis,
    basis_room,
    krylov_work_bytes,
    storage_dtype,
)
from sharpcli.curvature.products.batch_forms import can_record, recording
from sharpcli.curvature.products.scope import gaussian_like
from sharpcli.curvature.products.totals import norm64
from sharpcli.errors import NumericalError

__all__ = [
    "QUANTITY",
    "SEMIORTHOGONAL_MARGIN",
    "apply_operator",
    "EigenResult",
    "lanczos_step",
    "lanczos_tridiagonal",
    "measured_residuals",
    "report_step",
    "reported_numbers",
    "ritz_residuals",
    "select_ritz",
    "semiorthogonal",
    "skip_when_semiorthogonal",
    "tridiagonal_eigh",
    "tridiagonal_matrix",
    "unit_random",
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
            :func:`~sharpcli.curvature.eigen.ritz.semiorthogonal`); ``None`` for power
            iteration.
        max_basis: the most basis vectors the run kept.
        multiplicity: how repeated eigenvalues were counted (Lanczos,
            :func:`~sharpcli.curvature.eigen.lanczos.multiplicity_record`): ``resolved`` (the
            values are the k extreme ones counted with multiplicity, as far as the run shows),
            ``unresolved_because``, ``deflated_restarts``, ``copies_found``,
            ``more_copies_of``; ``None`` when not checked.
        data_stderr: each eigenvalue's standard error over the analysis set's samples
            (:mod:`sharpcli.curvature.eigen.data_error`), None where not computed.
        data_method: how ``data_stderr`` was computed.
        data_matvecs: the products it took (not in ``matvecs``).
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
    data_stderr: list[float | None] | None = None
    data_method: str | None = None
    data_matvecs: int = 0

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
            "data_stderr": None if self.data_stderr is None else list(self.data_stderr),
            "data_method": self.data_method,
            "data_matvecs": self.data_matvecs,
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


def ritz_residuals(
    op, eigenvalues, eigenvectors: torch.Tensor, batch_forms: list | None = None
) -> list[float]:
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
        batch_forms: when given, the product's per-batch forms ``u_i^T A_b u_j``
            (:func:`~sharpcli.curvature.products.batch_forms.recording`, ``(values, sizes)``)
            are appended to it where the operator records them: the data error of the
            eigenvalues (:func:`~sharpcli.curvature.eigen.data_error.eigen_data_error`) is the
            same product of the same rounded vectors, so it needs no product of its own.

    Returns:
        ``r_i`` for each pair.

    Raises:
        NumericalError: a product is not finite.
    """
    if eigenvectors.dim() == 1:
        eigenvectors = eigenvectors[:, None]
    U = eigenvectors.to(dtype=op.dtype, device=op.device)
    with contextlib.ExitStack() as stack:
        forms = None
        if batch_forms is not None and can_record(op):
            forms = stack.enter_context(recording(op, U))
        R = apply_operator(op, U, source="lanczos", where=" in the residual check", widen=False)
    taken = None if forms is None else forms.take()
    if batch_forms is not None and taken is not None:
        batch_forms.append(taken)
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


def measured_residuals(
    op, values, vectors, estimated, tol, exact_level, notes, batch_forms: list | None = None
):
    """The residuals of returned Ritz pairs, measured with one product per pair.

    Args:
        op: the operator.
        values: the Ritz values (numpy array).
        vectors: the Ritz vectors as columns.
        estimated: whether each pair converged by its Ritz estimate.
        tol: the relative tolerance.
        exact_level: the products' rounding level, below which a residual is converged.
        notes: the run's notes; this appends what it measured (and any pair it lost).
        batch_forms: collects the product's per-batch forms (:func:`ritz_residuals`).

    Returns:
        ``(residuals, converged)``, numpy arrays.
    """
    reported = np.asarray(ritz_residuals(op, values.tolist(), vectors, batch_forms))
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
    (the Kaniel-Paige-Saad bound, :mod:`~sharpcli.curvature.eigen.warm_start`); with its rate over
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


# the predicted loss of orthogonality allowed without Gram-Schmidt, in units of sqrt(eps)
# (semi-orthogonality, [Simon1984]); the actual loss stays at 0.01-0.17 of the prediction
# (tests/curvature/test_semiorthogonal.py, float32 and float64), so a margin of 1 keeps the
# basis a factor of five or more inside semi-orthogonality
SEMIORTHOGONAL_MARGIN = 1.0


def tridiagonal_matrix(alphas, betas) -> np.ndarray:
    """``tridiag(betas[:m-1], alphas, betas[:m-1])`` as a dense float64 matrix, ``m =
    len(alphas)``.

    Args:
        alphas: the diagonal.
        betas: the off-diagonal (entries past ``m - 1`` are ignored).

    Returns:
        The ``(m, m)`` matrix.
    """
    m = len(alphas)
    T = np.diag(np.asarray(alphas, dtype=np.float64))
    if m > 1:
        off = np.asarray(betas[: m - 1], dtype=np.float64)
        T += np.diag(off, 1) + np.diag(off, -1)
    return T


def tridiagonal_eigh(alphas, betas) -> tuple[np.ndarray, np.ndarray]:
    """The eigendecomposition of a symmetric tridiagonal matrix.

    ``T = tridiag(betas[:m-1], alphas, betas[:m-1])`` with ``m = len(alphas)``, in float64
    (torch LAPACK on the CPU: ``T`` is tiny).

    Args:
        alphas: the diagonal.
        betas: the off-diagonal (entries past ``m - 1`` are ignored).

    Returns:
        ``(theta, S)`` with ``T = S diag(theta) S^T``, ``theta`` ascending.

    Example:
        >>> theta, S = tridiagonal_eigh([2.0, 2.0], [1.0])
        >>> theta.tolist()
        [1.0, 3.0]
    """
    T = tridiagonal_matrix(alphas, betas)
    theta, S = torch.linalg.eigh(torch.from_numpy(T))
    return theta.numpy(), S.numpy()


def unit_random(dim, generator, device, basis: KrylovBasis | None = None):
    """A seeded Gaussian unit vector.

    Args:
        dim: its length P.
        generator: the seeded generator drawn from.
        device: where it lives.
        basis: rows the vector is made orthogonal to (CGS2), if any.

    Returns:
        A float64 unit P-vector.
    """
    q = gaussian_like(dim, generator, _F64, device)
    if basis is not None and len(basis) > 0:
        basis.orthogonalize(q)
    # in place (the same IEEE quotients): a second float64 P-vector was 1 GB of fresh pages
    # at GPT-2 small
    return q.div_(torch.linalg.vector_norm(q))


def semiorthogonal(last_row: np.ndarray, beta: float, error: float, eps: float) -> bool:
    r"""Whether ``q_{j+1} = w / beta_j`` from the three-term recurrence alone is semi-orthogonal
    to the basis, so that a Gram-Schmidt pass can be skipped.

    Paige's relation [Paige1980]: for every Ritz pair ``(theta_i, y_i = Q_j s_i)`` of ``T_j``,

    .. math::

        |y_i^T q_{j+1}| \approx \frac{\gamma}{\beta_j |s_{ji}|},

    with ``gamma`` the local error of the recurrence (``eps ||A||`` in exact products; the
    products' own error when it is larger), so the new vector loses orthogonality only towards
    Ritz vectors that have converged (``beta_j |s_ji|`` is pair i's residual), and, through
    ``i`` with ``s_ji`` of order one, towards the newest rows when ``beta_j`` is tiny. The
    ``y_i`` span the basis, so when ``gamma / min_i beta_j |s_ji| <= margin sqrt(eps)`` every
    ``|q_k^T q_{j+1}|`` is below semi-orthogonality, which keeps ``T_j`` the projection of
    ``A`` onto the basis to ``O(eps ||A||)`` and its Ritz values as accurate as with full
    reorthogonalisation ([Simon1984]; selective orthogonalisation, [ParlettScott1979], rests
    on the same relation).

    Args:
        last_row: ``s_{j,:}``, the last components of ``T_j``'s eigenvectors.
        beta: ``beta_j = ||w||`` after the three-term recurrence.
        error: ``gamma``, the local error level (at least ``eps ||A||``).
        eps: the rounding unit of the stored vectors.

    Returns:
        ``True`` when the prediction is within :data:`SEMIORTHOGONAL_MARGIN` ``sqrt(eps)``.

    Example:
        >>> semiorthogonal(np.array([0.6, 0.8]), 1.0, 2.0 * 2.0**-23, 2.0**-23)
        True
        >>> semiorthogonal(np.array([1e-6, 1.0]), 1.0, 2.0 * 2.0**-23, 2.0**-23)  # converged
        False
    """
    smallest = beta * float(np.abs(last_row).min()) if len(last_row) else beta
    return error <= SEMIORTHOGONAL_MARGIN * eps**0.5 * smallest


def skip_when_semiorthogonal(project, scale: float, eps: float):
    """The ``skip_gram_schmidt`` test of :func:`lanczos_step` for a plain recurrence.

    The local error ``gamma`` of :func:`semiorthogonal` is the larger of ``eps ||A||`` and
    the step's measured ``|q_{j-1}^T A q_j - beta_{j-1}|`` (zero in exact arithmetic with
    exact orthogonality; the products' asymmetric rounding and the loss so far otherwise).

    Args:
        project: ``alpha -> T_j`` (dense), the projected matrix with the step's ``alpha``.
        scale: ``||A||`` as far as known before the step.
        eps: the rounding unit of the products.

    Returns:
        ``(alpha, beta, local) -> bool``: :func:`semiorthogonal` for ``T_j``'s last
        eigenvector row.
    """

    def settled(alpha: float, beta: float, local: float) -> bool:
        theta, S = np.linalg.eigh(project(alpha))
        known = max(scale, abs(alpha), float(np.abs(theta).max()))
        return semiorthogonal(S[-1], beta, max(eps * known, local), eps)

    return settled


def lanczos_step(
    op,
    basis: KrylovBasis,
    coupling: list[tuple[int, float]],
    step: int,
    skip_gram_schmidt=None,
):
    r"""One step of the recurrence from the basis's last row ``q_j``.

    .. math::

        w = A q_j - \alpha_j q_j - \sum_{i<j} T_{ij} q_i, \qquad \alpha_j = q_j^T A q_j,

    with the couplings ``T_ij`` of ``q_j`` to earlier rows (``beta_{j-1}`` alone in plain
    Lanczos; every kept Ritz vector right after a thick restart), then
    ``w <- w - Q (Q^T w)`` twice (CGS2) and ``beta_j = ||w||``; the next vector is
    ``w / beta_j``. With ``skip_gram_schmidt`` the Gram-Schmidt passes run only when it returns
    ``False`` for ``(alpha_j, ||w||, local)`` (:func:`skip_when_semiorthogonal`). ``w`` stays in the basis's storage dtype (the product's own: updating it in
    place rounds each term to the products' precision, the order of their own rounding, while
    every coefficient is a float64 sum, so no float64 P-vector is ever made).

    Args:
        op: the operator.
        basis: the Krylov basis, ``q_j`` its last row.
        coupling: ``(i, T_ij)`` for the earlier rows ``q_j`` is coupled to.
        step: the step's number, for the error message.
        skip_gram_schmidt: ``(alpha, beta, local) -> bool``, ``True`` when ``w`` needs no
            Gram-Schmidt pass (``local``: the largest ``|q_i^T A q_j - T_ij|`` over the
            couplings); ``None`` always runs it.

    Returns:
        ``(alpha_j, beta_j, w, reorthogonalized)``: the scalars float64, ``w`` in the basis's
        dtype, and whether Gram-Schmidt ran.

    Raises:
        NumericalError: the product is not finite.
    """
    j = len(basis) - 1
    where = f" at Lanczos step {step}"
    w = apply_operator(
        op, basis.row(j), source="lanczos", where=where, widen=False, checked=False
    ).to(basis.dtype)
    coupled = [(i, value) for i, value in coupling if value != 0.0]
    # alpha_j, the couplings as the product measures them (only where they decide a skip:
    # a step that always reorthogonalises reads those rows in Gram-Schmidt), and the finite
    # check: one pass
    measured = coupled if skip_gram_schmidt is not None else []
    products, squares = basis.dots([j] + [i for i, _ in measured], w)
    if not math.isfinite(squares):
        raise product_not_finite(op, "lanczos", where)
    alpha = products[0]
    # |q_i^T A q_j - T_ij|: the local error of the products and the recurrence, which drives
    # the loss of orthogonality (Paige's relation), measured rather than assumed to be eps
    local = max((abs(p - value) for p, (_, value) in zip(products[1:], measured)), default=0.0)
    norm = basis.subtract_rows(w, [(j, alpha), *coupled])
    if skip_gram_schmidt is not None and skip_gram_schmidt(alpha, norm, local):
        return alpha, norm, w, False
    return alpha, basis.orthogonalize(w, norm=norm), w, True


def lanczos_tridiagonal(
    op,
    start: torch.Tensor,
    steps: int,
    *,
    keep_basis: bool = False,
    run: progress.Run | None = None,
    done: int = 0,
    window: int | None = None,
):
    """``steps`` Lanczos steps with reorthogonalisation from ``start`` (normalised here).

    The recurrence is float64 whatever ``op.dtype`` (module docstring); it stops early at a
    breakdown (invariant subspace). With a ``window`` shorter than ``steps`` the quadrature's
    nodes and weights stay accurate without full orthogonality ([GolubMeurant2010] on Gauss
    quadrature from the Lanczos recurrence); copies of converged Ritz values appear as nodes
    that share their weight.

    Args:
        op: the symmetric operator.
        start: the start vector (any norm).
        steps: the most steps (at most P).
        keep_basis: return the basis (it then needs the whole basis).
        run: a progress run; each step reports ``done`` + the steps so far as its matvecs.
        done: products spent before this call, for ``run``.
        window: reorthogonalise against the last ``window`` vectors only (default: as many as
            the memory plan allows, all ``steps`` when they fit).

    Returns:
        ``(alphas, betas, basis)``: ``T = tridiag(betas[:-1], alphas, betas[:-1])`` and the
        basis (float64 ``(P, m)``) or ``None``.

    Raises:
        UsageError: the basis does not fit the memory plan.
        NumericalError: a product is not finite.
    """
    dim = op.shape[0]
    steps = min(steps, dim)
    lower = "lower `steps` (Lanczos steps per probe)"
    scratch = None
    if window is None:
        window, held, scratch = basis_room(
            op, steps, minimum=1 if not keep_basis else steps, lower=lower
        )
    else:
        window = max(1, min(int(window), steps))
        held = KrylovBasis.bytes_for(dim, storage_dtype(op.dtype), window)
        held += krylov_work_bytes(dim, op.dtype)
    # the start in the basis's dtype, normalised there: no float64 copy of a P-vector is held
    # through the products (a caller passing its probe inline holds none either)
    norm = norm64(start)
    q = start.reshape(-1).to(dtype=storage_dtype(op.dtype), device=op.device)
    divisor = norm
    del start
    alphas: list[float] = []
    betas: list[float] = []
    scale = 0.0
    eps = torch.finfo(op.dtype).eps  # breakdown is judged at the products' rounding level
    basis = KrylovBasis(dim, storage_dtype(op.dtype), op.device, scratch=scratch)
    with memory.current().hold("lanczos basis", held):
        for j in range(steps):
            if len(basis) == window:  # keep the newest window - 1 rows, in order
                keep = torch.eye(window, dtype=_F64)[:, 1:]
                basis.rotate(keep)
            basis.append(q, divisor=divisor)
            coupling = [(len(basis) - 2, betas[-1])] if j and len(basis) > 1 else []
            # a kept basis is returned to the caller: orthonormal to rounding, every step
            settled = None
            if not keep_basis:
                settled = skip_when_semiorthogonal(
                    lambda a: tridiagonal_matrix([*alphas, a], betas), scale, eps
                )
            alpha, beta, w, _ = lanczos_step(op, basis, coupling, j, settled)
            alphas.append(alpha)
            betas.append(beta)
            if run is not None:
                run.update(done + j + 1)
            scale = max(scale, abs(alpha), beta)
            if beta <= 100 * eps * scale:
                break
            q, divisor = w, beta  # divided as it is stored: no new P-vector beside w and the row
        kept = None
        if keep_basis:
            kept = basis.combine(torch.eye(len(basis), dtype=_F64))
        basis.close()
    return alphas, betas, kept
