"""Lanczos with full reorthogonalisation for extreme eigenvalues of a symmetric operator.

The method is [Lanczos1950]; the reorthogonalisation and the Ritz residual below follow
[Parlett1998]. User guide: docs/commands/eigen.md.

After m steps from a unit start vector q_1 the Lanczos relation reads

    A Q_m = Q_m T_m + beta_m q_{m+1} e_m^T,

with ``T_m`` tridiagonal (alphas on the diagonal, betas beside it). For an eigenpair
``T_m s = theta s`` the Ritz pair ``(theta, u = Q_m s)`` has residual

    ||A u - theta u|| = beta_m |e_m^T s|,

which costs nothing to evaluate and is exact as long as Q_m stays orthonormal and the products
``A q_j`` are exact; full reorthogonalisation (classical Gram-Schmidt applied twice, "CGS2")
keeps Q_m orthonormal.

Precision. The Krylov basis Q_m and every scalar of the recurrence (alpha, beta, the
reorthogonalisation coefficients, the norms) are float64 whatever the operator's dtype; only
the products ``A q_j`` are computed in the operator's dtype (a float32 model multiplies in
float32: ``q_j`` is rounded to it and ``A q_j`` cast back). A float32 recurrence is not good
enough: a float32 dot product or norm over P ~ 1e5-1e6 entries has a relative error of a few
1e-6, which moved the Ritz values by that much and broke the Lanczos relation, so the free
residual estimate above came out 1e3 times smaller than the true one. With a float64
recurrence the relation holds up to the products' own rounding,

    A Q_m = Q_m T_m + beta_m q_{m+1} e_m^T + F_m,   ||F_m e_j|| ~ eps(dtype) ||A||,

so Ritz values are accurate to ~eps(dtype) ||A||, but the estimate ``beta_m |e_m^T s|`` cannot
see ``F_m`` and keeps falling below that floor. It is what the iteration stops on; the
*reported* residual is the explicit ``||A u - theta u||`` (one more product per returned Ritz
pair, in one block) whenever the operator multiplies in less than float64
(``explicit_residuals=None``, the default) or when asked (``explicit_residuals=True``). For a
float64 operator the estimate agrees with the explicit residual to rounding (pinned by the
tests), so no product is spent on it unless asked.

A Ritz value is *converged* when its reported residual satisfies
``||A u - theta u|| <= tol * |theta|`` (default tol 1e-3, docs/commands/eigen.md), or is at the products'
rounding level (``100 eps(dtype) ||T_m||``), which covers zero eigenvalues. The iteration
stops when the estimates of all requested Ritz values have converged or the matvec budget is
spent; a pair whose explicit residual then fails the test is reported as not converged.
A breakdown (``beta_m`` at rounding level) means an invariant subspace was found: its Ritz
values are exact eigenvalues. When the whole space fits the budget (P <= max_matvecs, tiny
problems) the iteration restarts with a fresh random vector orthogonal to Q and runs to
dimension P, so multiplicities are found and every eigenvalue is exact; otherwise it stops
and says so in ``breakdown``.

Memory: the basis holds up to ``max_matvecs`` float64 P-vectors, ``8 P max_matvecs`` bytes
(twice a float32 basis: 100 vectors of 10M parameters take 8 GB).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sharpcli.curvature.scope import gaussian_like
from sharpcli.errors import NumericalError, UsageError

__all__ = [
    "DEFAULT_MAX_MATVECS",
    "EigenResult",
    "apply_operator",
    "lanczos",
    "lanczos_tridiagonal",
    "ritz_residuals",
    "tridiagonal_eigh",
]

DEFAULT_MAX_MATVECS = 100
WHICH = ("largest", "smallest", "both")
_F64 = torch.float64


@dataclass
class EigenResult:
    """Eigenvalues (descending) of a curvature operator with their Ritz residuals.

    ``residuals[i] = ||A u_i - lambda_i u_i||`` (2-norm, ``u_i`` unit); ``converged[i]`` is
    ``residuals[i] <= tol * |lambda_i|`` (or at rounding level). ``eigenvectors`` is a
    float64 ``(P, m)`` tensor whose columns match ``eigenvalues`` when asked for.
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

    def to_dict(self) -> dict:
        """JSON-ready dict (eigenvectors left out)."""
        return {
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
        }


def _check_args(op, k: int, which: str, tol: float):
    if which not in WHICH:
        raise UsageError(f"which must be one of {', '.join(WHICH)}, got {which!r}", source="which")
    if int(k) < 1:
        raise UsageError(f"top-k must be >= 1, got {k}", source="k")
    if not tol > 0:
        raise UsageError(f"tolerance must be > 0, got {tol}", source="tol")
    if op.shape[0] < 1:
        raise UsageError("the operator has no parameters in scope", source="params")


def _select(theta: np.ndarray, which: str, count: int) -> np.ndarray:
    """Indices (into ascending ``theta``) of the wanted Ritz values, ordered by descending value."""
    m = len(theta)
    count = min(count, m)
    if which == "largest":
        idx = np.arange(m - count, m)
    elif which == "smallest":
        idx = np.arange(0, count)
    else:
        idx = np.union1d(np.arange(0, count), np.arange(m - count, m))
    return idx[::-1].copy()


def tridiagonal_eigh(alphas, betas) -> tuple[np.ndarray, np.ndarray]:
    """``(theta, S)`` with ``T = S diag(theta) S^T`` ascending, ``T = tridiag(betas[:m-1], alphas,
    betas[:m-1])`` (m = len(alphas)); float64, torch LAPACK on CPU (T is tiny)."""
    m = len(alphas)
    T = np.diag(np.asarray(alphas, dtype=np.float64))
    if m > 1:
        off = np.asarray(betas[: m - 1], dtype=np.float64)
        T += np.diag(off, 1) + np.diag(off, -1)
    theta, S = torch.linalg.eigh(torch.from_numpy(T))
    return theta.numpy(), S.numpy()


def apply_operator(op, V: torch.Tensor, *, source: str, where: str = "") -> torch.Tensor:
    """``A V`` for float64 ``V`` (a P-vector or a ``(P, k)`` block), returned in float64.

    The product itself runs in the operator's dtype (``V`` is rounded to it), as the model
    computes it; only the vectors around it are float64. A block goes through ``matmat``
    (one pass over the data for all columns). Raises :class:`NumericalError` naming
    ``source`` when the product is not finite.
    """
    X = V.to(dtype=op.dtype, device=op.device)
    out = op.matvec(X) if X.dim() == 1 else op.matmat(X)
    if not torch.isfinite(out).all():
        raise NumericalError(
            f"{getattr(op, 'name', 'operator')} product is not finite{where}", source=source
        )
    return out.to(_F64)


def _unit_random(dim, generator, device, basis_rows=None):
    """Seeded Gaussian unit vector (float64), orthogonal (CGS2) to the rows of ``basis_rows``."""
    q = gaussian_like(dim, generator, _F64, device)
    if basis_rows is not None and basis_rows.shape[0] > 0:
        for _ in range(2):
            q = q - basis_rows.T @ (basis_rows @ q)
    return q / torch.linalg.vector_norm(q)


def _lanczos_step(op, basis: torch.Tensor, j: int, beta_prev: float):
    """Step j of the recurrence on the float64 basis (rows ``q_0..q_j`` of ``basis`` filled).

    ``w = A q_j - alpha_j q_j - beta_{j-1} q_{j-1}`` with ``alpha_j = q_j^T A q_j``, then
    ``w <- w - Q (Q^T w)`` twice (CGS2, ``Q = [q_0..q_j]``) and ``beta_j = ||w||``; the next
    vector is ``w / beta_j``. ``beta_prev = 0`` (first step, or a restart) drops the
    three-term part. Returns ``(alpha_j, beta_j, w)``.
    """
    q = basis[j]
    w = apply_operator(op, q, source="lanczos", where=f" at Lanczos step {j}")
    alpha = float(q @ w)
    w = w - alpha * q
    if j > 0 and beta_prev != 0.0:
        w = w - beta_prev * basis[j - 1]
    Q = basis[: j + 1]
    for _ in range(2):
        w = w - Q.T @ (Q @ w)
    return alpha, float(torch.linalg.vector_norm(w)), w


def lanczos_tridiagonal(op, start: torch.Tensor, steps: int, *, keep_basis: bool = False):
    """``steps`` Lanczos steps with full reorthogonalisation from ``start`` (normalised here).

    Returns ``(alphas, betas, basis)``: ``T = tridiag(betas[:-1], alphas, betas[:-1])`` and
    ``basis`` (float64 ``(P, m)`` or ``None``). The recurrence is float64 whatever
    ``op.dtype`` (module docstring). Stops early at a breakdown (invariant subspace).
    Used by stochastic Lanczos quadrature (:mod:`sharpcli.curvature.density`).
    """
    dim = op.shape[0]
    steps = min(steps, dim)
    basis = torch.zeros(steps, dim, dtype=_F64, device=op.device)  # rows q_j: contiguous
    q = start.to(dtype=_F64, device=op.device).reshape(-1)
    q = q / torch.linalg.vector_norm(q)
    alphas, betas = [], []
    scale = 0.0
    eps = torch.finfo(op.dtype).eps  # breakdown is judged at the products' rounding level
    for j in range(steps):
        basis[j] = q
        alpha, beta, w = _lanczos_step(op, basis, j, betas[-1] if j else 0.0)
        alphas.append(alpha)
        betas.append(beta)
        scale = max(scale, abs(alpha), beta)
        if beta <= 100 * eps * scale:
            break
        q = w / beta
    return alphas, betas, (basis[: len(alphas)].T if keep_basis else None)


def _explicit_residuals(op, values, vectors, estimated, tol, exact_level, notes):
    """``(||A u - theta u||, converged)`` measured with one product per pair; notes say so."""
    reported = np.asarray(ritz_residuals(op, values.tolist(), vectors))
    converged = (reported <= tol * np.abs(values)) | (reported <= exact_level)
    notes.append(
        f"residuals are explicit ||A u - theta u|| ({len(values)} extra products; "
        f"products in {str(op.dtype).replace('torch.', '')}, recurrence in float64)"
    )
    lost = int((estimated & ~converged).sum())
    if lost:
        notes.append(
            f"{lost} eigenvalue(s) converged by the Ritz estimate but not by the explicit "
            "residual: the products' own errors (rounding) bound the attainable residual; "
            "raise `tol` or use `dtype=float64`"
        )
    return reported, converged


def lanczos(
    op,
    k: int = 1,
    which: str = "largest",
    *,
    tol: float = 1e-3,
    max_matvecs: int | None = None,
    seed: int = 0,
    start: torch.Tensor | None = None,
    return_eigenvectors: bool = False,
    explicit_residuals: bool | None = None,
) -> EigenResult:
    """Top-``k`` ``largest``, ``smallest`` or ``both`` (k of each end) eigenvalues of symmetric ``op``.

    ``op`` needs ``shape``, ``dtype``, ``device``, ``matvec`` (and ``matmat`` for explicit
    residuals). The start vector is a seeded Gaussian (``seed``) unless ``start`` is given.
    The Krylov dimension is at most ``min(P, max_matvecs)`` (default ``min(P, 100)``); memory
    is that many float64 P-vectors (2x a float32 basis). When P < k all P eigenvalues are
    returned.

    ``explicit_residuals``: report ``||A u - theta u||`` computed with one more product per
    returned pair (counted in ``matvecs``, beyond ``max_matvecs``; ``krylov_dim`` stays the
    Krylov dimension) instead of the Ritz estimate ``beta_m |e_m^T s|``; ``None`` does so
    when ``op.dtype`` is not float64, where the estimate cannot see the products' rounding.
    """
    _check_args(op, k, which, tol)
    dim = op.shape[0]
    if max_matvecs is not None and int(max_matvecs) < 1:
        raise UsageError(f"max matvecs must be >= 1, got {max_matvecs}", source="max_matvecs")
    if explicit_residuals is None:
        explicit_residuals = op.dtype != _F64
    limit = min(dim, int(max_matvecs) if max_matvecs is not None else DEFAULT_MAX_MATVECS)
    want = min(int(k), dim)
    generator = torch.Generator().manual_seed(int(seed))
    eps = torch.finfo(op.dtype).eps  # rounding level of the products, not of the recurrence
    basis = torch.zeros(limit, dim, dtype=_F64, device=op.device)  # rows q_j: contiguous
    if start is None:
        q = _unit_random(dim, generator, op.device)
    else:
        q = start.to(dtype=_F64, device=op.device).reshape(-1)
        q = q / torch.linalg.vector_norm(q)
    alphas: list[float] = []
    betas: list[float] = []  # betas[j] couples step j and j+1; 0 after a restart
    matvecs = 0
    breakdown = None
    exhaust = False  # after a breakdown on a problem that fits: run to dimension P
    scale = 0.0
    notes: list[str] = []
    for j in range(limit):
        basis[j] = q
        alpha, beta, w = _lanczos_step(op, basis, j, betas[-1] if j else 0.0)
        matvecs += 1
        alphas.append(alpha)
        theta, S = tridiagonal_eigh(alphas, betas)
        scale = max(scale, float(np.abs(theta).max()), abs(alpha))
        exact_level = 100 * eps * max(scale, np.finfo(np.float64).tiny)
        residuals = beta * np.abs(S[-1, :])
        idx = _select(theta, which, want)
        converged = (residuals[idx] <= tol * np.abs(theta[idx])) | (residuals[idx] <= exact_level)
        m = j + 1
        if m == dim:
            break
        broke = beta <= exact_level
        if broke:
            if limit == dim:
                exhaust = True
                if breakdown is None:
                    breakdown = (
                        f"invariant subspace after {m} steps; restarted to reach dimension {dim}"
                    )
                betas.append(0.0)
                q = _unit_random(dim, generator, op.device, basis[:m])
                continue
            breakdown = (
                f"invariant subspace after {m} steps: Ritz values are exact eigenvalues, "
                "repeated eigenvalues may appear once"
            )
            break
        if converged.all() and not exhaust:
            break
        betas.append(beta)
        q = w / beta
    m = len(alphas)
    if m < dim and m == limit and not converged.all():
        notes.append(
            f"stopped at the matvec budget ({limit}) before all requested eigenvalues converged"
        )
    values = theta[idx]
    vectors = None
    if return_eigenvectors or explicit_residuals:
        vectors = basis[:m].T @ torch.as_tensor(S[:, idx].copy(), dtype=_F64, device=op.device)
    reported = residuals[idx]
    if explicit_residuals:
        reported, converged = _explicit_residuals(
            op, values, vectors, converged, tol, exact_level, notes
        )
        matvecs += len(idx)
    at_rounding = int((converged & (reported > tol * np.abs(values))).sum())
    if at_rounding:
        notes.append(
            f"{at_rounding} eigenvalue(s) converged at the products' rounding level "
            f"(residual <= 100 eps ||T|| = {exact_level:.3g}), not at tol |eigenvalue|"
        )
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
        notes=notes,
    )
    if return_eigenvectors:
        result.eigenvectors = vectors
    return result


def ritz_residuals(op, eigenvalues, eigenvectors: torch.Tensor) -> list[float]:
    """Explicit ``||A u_i - lambda_i u_i|| / ||u_i||`` for the columns ``u_i`` of ``eigenvectors``.

    One product per pair, all in one ``matmat`` block, in the operator's dtype; the
    subtraction and the norms are float64, so the result is the residual of the vector the
    operator actually multiplied (``u_i`` rounded to ``op.dtype``) up to float64 rounding.
    """
    U = eigenvectors.to(dtype=op.dtype, device=op.device).to(_F64)
    AU = apply_operator(op, U, source="lanczos", where=" in the residual check")
    lam = torch.as_tensor(list(eigenvalues), dtype=_F64, device=U.device)
    R = AU - U * lam
    return (torch.linalg.vector_norm(R, dim=0) / torch.linalg.vector_norm(U, dim=0)).tolist()
