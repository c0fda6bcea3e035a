"""Lanczos with full reorthogonalisation for extreme eigenvalues of a symmetric operator.

The method is [Lanczos1950]; the reorthogonalisation and the Ritz residual below follow
[Parlett1998]. User guide: docs/commands/eigen.md.

After m steps from a unit start vector q_1 the Lanczos relation reads

    A Q_m = Q_m T_m + beta_m q_{m+1} e_m^T,

with ``T_m`` tridiagonal (alphas on the diagonal, betas beside it). For an eigenpair
``T_m s = theta s`` the Ritz pair ``(theta, u = Q_m s)`` has residual

    ||A u - theta u|| = beta_m |e_m^T s|,

which costs nothing to evaluate and is exact as long as Q_m stays orthonormal; full
reorthogonalisation (classical Gram-Schmidt applied twice, "CGS2") keeps it so, which is
why the residuals reported are honest (``ritz_residuals`` recomputes them explicitly).
A Ritz value is *converged* when ``||A u - theta u|| <= tol * |theta|`` (default tol 1e-3,
docs/commands/eigen.md), or when the residual is at rounding level (``100 eps ||T_m||``),
which covers zero eigenvalues. The iteration stops when all requested Ritz values have
converged or the matvec budget is spent. A breakdown (``beta_m`` at rounding level) means an invariant
subspace was found: its Ritz values are exact eigenvalues. When the whole space fits the
budget (P <= max_matvecs, tiny problems) the iteration restarts with a fresh random vector
orthogonal to Q and runs to dimension P, so multiplicities are found and every eigenvalue
is exact; otherwise it stops and says so in ``breakdown``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sharpcli.curvature.scope import gaussian_like
from sharpcli.errors import NumericalError, UsageError

__all__ = ["DEFAULT_MAX_MATVECS", "EigenResult", "lanczos", "lanczos_tridiagonal", "ritz_residuals"]

DEFAULT_MAX_MATVECS = 100
WHICH = ("largest", "smallest", "both")


@dataclass
class EigenResult:
    """Eigenvalues (descending) of a curvature operator with their Ritz residuals.

    ``residuals[i] = ||A u_i - lambda_i u_i||`` (2-norm, ``u_i`` unit); ``converged[i]`` is
    ``residuals[i] <= tol * |lambda_i|`` (or at rounding level). ``eigenvectors`` is a
    ``(P, m)`` tensor whose columns match ``eigenvalues`` when asked for.
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
        raise UsageError(
            f"which must be one of {', '.join(WHICH)}, got {which!r}", source="--which"
        )
    if int(k) < 1:
        raise UsageError(f"top-k must be >= 1, got {k}", source="--top-k")
    if not tol > 0:
        raise UsageError(f"tolerance must be > 0, got {tol}", source="--tol")
    if op.shape[0] < 1:
        raise UsageError("the operator has no parameters in scope", source="--params")


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


def _tridiagonal(alphas, betas) -> np.ndarray:
    m = len(alphas)
    T = np.diag(np.asarray(alphas, dtype=np.float64))
    if m > 1:
        off = np.asarray(betas[: m - 1], dtype=np.float64)
        T += np.diag(off, 1) + np.diag(off, -1)
    return T


def _eigh(T: np.ndarray):
    """Eigen-decomposition of the small tridiagonal matrix (torch LAPACK on CPU, float64)."""
    theta, S = torch.linalg.eigh(torch.from_numpy(T))
    return theta.numpy(), S.numpy()


def _unit_random(dim, generator, dtype, device, basis=None):
    q = gaussian_like(dim, generator, dtype, device)
    if basis is not None and basis.shape[1] > 0:
        for _ in range(2):
            q = q - basis @ (basis.T @ q)
    return q / torch.linalg.vector_norm(q)


def lanczos_tridiagonal(op, start: torch.Tensor, steps: int, *, keep_basis: bool = False):
    """``steps`` Lanczos steps with full reorthogonalisation from ``start`` (normalised here).

    Returns ``(alphas, betas, basis)``: ``T = tridiag(betas[:-1], alphas, betas[:-1])`` and
    ``basis`` (``(P, m)`` or ``None``). Stops early at a breakdown (invariant subspace).
    Used by stochastic Lanczos quadrature (:mod:`sharpcli.curvature.density`).
    """
    dim = op.shape[0]
    steps = min(steps, dim)
    basis = torch.zeros(dim, steps, dtype=op.dtype, device=op.device)
    q = start.to(dtype=op.dtype, device=op.device)
    q = q / torch.linalg.vector_norm(q)
    alphas, betas = [], []
    scale = 0.0
    eps = torch.finfo(op.dtype).eps
    for j in range(steps):
        basis[:, j] = q
        w = op.matvec(q)
        if not torch.isfinite(w).all():
            raise NumericalError(
                f"{getattr(op, 'name', 'operator')} product is not finite", source="lanczos"
            )
        alpha = float(q @ w)
        w = w - alpha * q
        if j > 0:
            w = w - betas[-1] * basis[:, j - 1]
        B = basis[:, : j + 1]
        for _ in range(2):
            w = w - B @ (B.T @ w)
        beta = float(torch.linalg.vector_norm(w))
        alphas.append(alpha)
        betas.append(beta)
        scale = max(scale, abs(alpha), beta)
        if beta <= 100 * eps * scale:
            basis = basis[:, : j + 1]
            break
        q = w / beta
    else:
        basis = basis[:, : len(alphas)]
    return alphas, betas, (basis if keep_basis else None)


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
) -> EigenResult:
    """Top-``k`` ``largest``, ``smallest`` or ``both`` (k of each end) eigenvalues of symmetric ``op``.

    ``op`` needs ``shape``, ``dtype``, ``device`` and ``matvec``. The start vector is a
    seeded Gaussian (``seed``) unless ``start`` is given. The Krylov dimension is at most
    ``min(P, max_matvecs)`` (default ``min(P, 100)``); memory is that many P-vectors.
    When P < k all P eigenvalues are returned.
    """
    _check_args(op, k, which, tol)
    dim = op.shape[0]
    if max_matvecs is not None and int(max_matvecs) < 1:
        raise UsageError(f"max matvecs must be >= 1, got {max_matvecs}", source="--max-matvecs")
    limit = min(dim, int(max_matvecs) if max_matvecs is not None else DEFAULT_MAX_MATVECS)
    want = min(int(k), dim)
    generator = torch.Generator().manual_seed(int(seed))
    eps = torch.finfo(op.dtype).eps
    basis = torch.zeros(dim, limit, dtype=op.dtype, device=op.device)
    if start is None:
        q = _unit_random(dim, generator, op.dtype, op.device)
    else:
        q = start.to(dtype=op.dtype, device=op.device).reshape(-1)
        q = q / torch.linalg.vector_norm(q)
    alphas: list[float] = []
    betas: list[float] = []  # betas[j] couples step j and j+1; 0 after a restart
    matvecs = 0
    breakdown = None
    exhaust = False  # after a breakdown on a problem that fits: run to dimension P
    scale = 0.0
    notes: list[str] = []
    for j in range(limit):
        basis[:, j] = q
        w = op.matvec(q)
        matvecs += 1
        if not torch.isfinite(w).all():
            raise NumericalError(
                f"{getattr(op, 'name', 'operator')} product is not finite at Lanczos step {j}",
                source="lanczos",
            )
        alpha = float(q @ w)
        w = w - alpha * q
        if j > 0 and betas[-1] != 0.0:
            w = w - betas[-1] * basis[:, j - 1]
        B = basis[:, : j + 1]
        for _ in range(2):
            w = w - B @ (B.T @ w)
        beta = float(torch.linalg.vector_norm(w))
        alphas.append(alpha)
        theta, S = _eigh(_tridiagonal(alphas, betas))
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
                q = _unit_random(dim, generator, op.dtype, op.device, basis[:, :m])
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
    result = EigenResult(
        eigenvalues=[float(t) for t in theta[idx]],
        residuals=[float(r) for r in residuals[idx]],
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
        S_sel = torch.as_tensor(S[:, idx].copy(), dtype=op.dtype, device=op.device)
        result.eigenvectors = basis[:, :m] @ S_sel
    return result


def ritz_residuals(op, eigenvalues, eigenvectors: torch.Tensor) -> list[float]:
    """Explicit ``||A u_i - lambda_i u_i|| / ||u_i||`` (one matvec per pair), to verify a result."""
    out = []
    for i, lam in enumerate(eigenvalues):
        u = eigenvectors[:, i]
        norm = torch.linalg.vector_norm(u)
        out.append(float(torch.linalg.vector_norm(op.matvec(u) - lam * u) / norm))
    return out
