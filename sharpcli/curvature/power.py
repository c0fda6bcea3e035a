"""Power iteration with deflation, as [PyHessian] does it (kept for parity with it).

For each of the top ``k`` eigenvalues: a seeded Gaussian unit vector ``v`` is repeatedly
orthogonalised against the eigenvectors already found (projection deflation), multiplied,
``lambda = v^T A v`` (Rayleigh quotient), ``v <- A v / ||A v||``; the iteration stops when
``|lambda_t - lambda_{t-1}| / (|lambda_{t-1}| + 1e-6) < tol`` (PyHessian's rule) or after
``max_iter`` products. It converges to the eigenvalue of largest *magnitude* (not the
largest algebraic one) and stalls when the spectral gap is small; the Ritz residual
``||A v - lambda v||`` of the last iterate is reported (free: ``A v`` was computed) and the
``converged`` flag uses the residual criterion ``<= tol |lambda|`` (docs/commands/eigen.md), which
the relative-change rule does not guarantee.

The iterates, the deflation projections, the Rayleigh quotients and the norms are float64
whatever the operator's dtype; only the products run in ``op.dtype`` (the iterate rounded to
it, the product cast back), so a float32 model's eigenvalue and residual carry the products'
rounding only, not that of float32 dot products over P entries (a few 1e-6 relative at
P ~ 1e5-1e6). The reported residual is explicit, hence true for the vector returned. The
eigenvectors are float64 (2x the memory of float32 ones).
"""

from __future__ import annotations

import torch

from sharpcli import progress
from sharpcli.curvature.lanczos import EigenResult, apply_operator
from sharpcli.curvature.scope import gaussian_like
from sharpcli.errors import UsageError

__all__ = ["power_iteration"]


def power_iteration(
    op,
    k: int = 1,
    *,
    tol: float = 1e-3,
    max_iter: int = 100,
    seed: int = 0,
    return_eigenvectors: bool = False,
) -> EigenResult:
    """Top-``k`` largest-magnitude eigenvalues of symmetric ``op`` by deflated power iteration."""
    if int(k) < 1:
        raise UsageError(f"top-k must be >= 1, got {k}", source="k")
    if not tol > 0:
        raise UsageError(f"tolerance must be > 0, got {tol}", source="tol")
    if int(max_iter) < 1:
        raise UsageError(f"max iterations must be >= 1, got {max_iter}", source="max_iter")
    dim = op.shape[0]
    k = min(int(k), dim)
    generator = torch.Generator().manual_seed(int(seed))
    found: list[torch.Tensor] = []
    values, residuals = [], []
    matvecs = 0
    stalled = 0
    run = progress.start("power", total=k * int(max_iter), quantity="lambda")
    for _ in range(k):
        v = gaussian_like(dim, generator, torch.float64, op.device)
        v = v / torch.linalg.vector_norm(v)
        previous = None
        for iteration in range(int(max_iter)):
            for u in found:
                v = v - (u @ v) * u
            v = v / torch.linalg.vector_norm(v)
            Av = apply_operator(op, v, source="power", where=" in power iteration")
            matvecs += 1
            lam = float(v @ Av)
            residual = float(torch.linalg.vector_norm(Av - lam * v))
            norm = torch.linalg.vector_norm(Av)
            run.update(matvecs, estimate=lam, residual=residual)
            done = previous is not None and abs(lam - previous) / (abs(previous) + 1e-6) < tol
            if done or norm == 0 or iteration == int(max_iter) - 1:
                if not done and norm != 0:
                    stalled += 1
                break
            previous = lam
            v = Av / norm
        found.append(v)
        values.append(lam)
        residuals.append(residual)
    order = sorted(range(len(values)), key=lambda i: -values[i])
    eps = torch.finfo(op.dtype).eps
    scale = max(abs(x) for x in values) if values else 0.0
    result = EigenResult(
        eigenvalues=[values[i] for i in order],
        residuals=[residuals[i] for i in order],
        converged=[
            residuals[i] <= tol * abs(values[i]) or residuals[i] <= 100 * eps * scale for i in order
        ],
        matvecs=matvecs,
        method="power",
        which="largest-magnitude",
        tol=float(tol),
        notes=["power iteration: largest |eigenvalue| first, relative-change stop rule (PyHessian)"]
        + ([f"{stalled} eigenvalue(s) hit max_iter={max_iter}"] if stalled else []),
    )
    if return_eigenvectors:
        result.eigenvectors = torch.stack([found[i] for i in order], dim=1)
    run.finish(
        matvecs,
        estimate=result.eigenvalues[0],
        residual=max(r for r in result.residuals if r is not None),
    )
    return result
