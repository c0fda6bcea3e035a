r"""The Lanczos recurrence: one step, and a plain tridiagonalisation for quadrature.

After m steps from a unit start vector ``q_1`` the Lanczos relation [Lanczos1950] reads

.. math::

    A Q_m = Q_m T_m + \beta_m q_{m+1} e_m^T,

with ``T_m`` tridiagonal (alphas on the diagonal, betas beside it). Reorthogonalisation
(classical Gram-Schmidt applied twice, "CGS2", [Parlett1998]) keeps ``Q_m`` orthonormal; it
reads the whole basis twice, so a step whose new vector is provably semi-orthogonal to the
basis without it skips it (:func:`semiorthogonal`: Paige's relation, [Paige1980]; semi-
orthogonality keeps ``T_m`` the projection of ``A`` to rounding, [Simon1984]).

Precision: every scalar of the recurrence (alpha, beta, the reorthogonalisation coefficients,
the norms) is a float64 sum whatever the operator's dtype; the products ``A q_j`` run in the
operator's dtype, and the basis and the work vector are stored in it (float32 for a float32
model: ``q_j`` is rounded to float32 before its product anyway, and each update of ``w`` adds a
rounding of the order of the product's own). A float32 recurrence is not good enough: a
float32 dot product or norm accumulated over P entries carries a relative error that moves the
Ritz values and breaks the Lanczos relation (the measurements: docs/benchmarks.md, "Float32
Lanczos"); the scalars are float64 sums of chunks widened in cache
(:mod:`~sharpcli.curvature.totals`), at about the cost of a float32 pass.

:func:`lanczos_tridiagonal` serves stochastic Lanczos quadrature
(:mod:`sharpcli.curvature.density`); :func:`sharpcli.curvature.lanczos.lanczos` runs
:func:`lanczos_step` with thick restarts.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sharpcli import memory, progress
from sharpcli.curvature.krylov import KrylovBasis
from sharpcli.curvature.krylov_plan import basis_room, krylov_work_bytes, storage_dtype
from sharpcli.curvature.ritz import apply_operator, product_not_finite
from sharpcli.curvature.scope import gaussian_like
from sharpcli.curvature.totals import norm64

__all__ = [
    "SEMIORTHOGONAL_MARGIN",
    "lanczos_step",
    "lanczos_tridiagonal",
    "semiorthogonal",
    "skip_when_semiorthogonal",
    "tridiagonal_eigh",
    "tridiagonal_matrix",
    "unit_random",
]

_F64 = torch.float64
# the predicted loss of orthogonality allowed without Gram-Schmidt, in units of sqrt(eps)
# (semi-orthogonality, [Simon1984]); the loss measured against this prediction was 0.01-0.17
# of it (tests/curvature/test_semiorthogonal.py, float32 and float64): the basis stays a
# factor of five or more inside semi-orthogonality
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
    return q / torch.linalg.vector_norm(q)


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
