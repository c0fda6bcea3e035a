r"""The Lanczos recurrence: one step, and a plain tridiagonalisation for quadrature.

After m steps from a unit start vector ``q_1`` the Lanczos relation [Lanczos1950] reads

.. math::

    A Q_m = Q_m T_m + \beta_m q_{m+1} e_m^T,

with ``T_m`` tridiagonal (alphas on the diagonal, betas beside it). Full reorthogonalisation
(classical Gram-Schmidt applied twice, "CGS2", [Parlett1998]) keeps ``Q_m`` orthonormal.

Precision: every scalar of the recurrence (alpha, beta, the reorthogonalisation coefficients,
the norms) is a float64 sum whatever the operator's dtype; the products ``A q_j`` run in the
operator's dtype, and the basis and the work vector are stored in it (float32 for a float32
model: ``q_j`` is rounded to float32 before its product anyway, and each update of ``w`` adds a
rounding of the order of the product's own). A float32 recurrence is not good enough: a
float32 dot product or norm over P entries carries a relative error that moves the Ritz values
and breaks the Lanczos relation (the measurements: docs/benchmarks.md, "Float32 Lanczos").

:func:`lanczos_tridiagonal` serves stochastic Lanczos quadrature
(:mod:`sharpcli.curvature.density`); :func:`sharpcli.curvature.lanczos.lanczos` runs
:func:`lanczos_step` with thick restarts.
"""

from __future__ import annotations

import numpy as np
import torch

from sharpcli import memory, progress
from sharpcli.curvature.krylov import KrylovBasis, norm64
from sharpcli.curvature.krylov_plan import basis_room, krylov_work_bytes, storage_dtype
from sharpcli.curvature.ritz import apply_operator
from sharpcli.curvature.scope import gaussian_like

__all__ = ["lanczos_step", "lanczos_tridiagonal", "tridiagonal_eigh", "unit_random"]

_F64 = torch.float64


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
    m = len(alphas)
    T = np.diag(np.asarray(alphas, dtype=np.float64))
    if m > 1:
        off = np.asarray(betas[: m - 1], dtype=np.float64)
        T += np.diag(off, 1) + np.diag(off, -1)
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


def lanczos_step(op, basis: KrylovBasis, coupling: list[tuple[int, float]], step: int):
    r"""One step of the recurrence from the basis's last row ``q_j``.

    .. math::

        w = A q_j - \alpha_j q_j - \sum_{i<j} T_{ij} q_i, \qquad \alpha_j = q_j^T A q_j,

    with the couplings ``T_ij`` of ``q_j`` to earlier rows (``beta_{j-1}`` alone in plain
    Lanczos; every kept Ritz vector right after a thick restart), then
    ``w <- w - Q (Q^T w)`` twice (CGS2) and ``beta_j = ||w||``; the next vector is
    ``w / beta_j``. ``w`` stays in the basis's storage dtype (the product's own: updating it in
    place rounds each term to the products' precision, the order of their own rounding, while
    every coefficient is a float64 sum, so no float64 P-vector is ever made).

    Args:
        op: the operator.
        basis: the Krylov basis, ``q_j`` its last row.
        coupling: ``(i, T_ij)`` for the earlier rows ``q_j`` is coupled to.
        step: the step's number, for the error message.

    Returns:
        ``(alpha_j, beta_j, w)``: the scalars float64, ``w`` in the basis's dtype.

    Raises:
        NumericalError: the product is not finite.
    """
    j = len(basis) - 1
    w = apply_operator(
        op, basis.row(j), source="lanczos", where=f" at Lanczos step {step}", widen=False
    ).to(basis.dtype)
    alpha = basis.dot(j, w)
    basis.axpy(w, j, alpha)
    for i, value in coupling:
        if value != 0.0:
            basis.axpy(w, i, value)
    return alpha, basis.orthogonalize(w), w


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
    q = start.reshape(-1).to(dtype=storage_dtype(op.dtype), device=op.device) / norm
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
            basis.append(q)
            coupling = [(len(basis) - 2, betas[-1])] if j and len(basis) > 1 else []
            alpha, beta, w = lanczos_step(op, basis, coupling, j)
            alphas.append(alpha)
            betas.append(beta)
            if run is not None:
                run.update(done + j + 1)
            scale = max(scale, abs(alpha), beta)
            if beta <= 100 * eps * scale:
                break
            q = w.div_(beta)  # in place: a new P-vector here was held beside w and the kept row
        kept = None
        if keep_basis:
            kept = basis.combine(torch.eye(len(basis), dtype=_F64))
        basis.close()
    return alphas, betas, kept
