"""Power iteration with deflation, as [PyHessian] does it (kept for parity with it).

For each of the top ``top_k`` eigenvalues: a seeded Gaussian unit vector ``v`` is repeatedly
orthogonalised against the eigenvectors already found (projection deflation), multiplied,
``lambda = v^T A v`` (Rayleigh quotient), ``v <- A v / ||A v||``; the iteration stops when
``|lambda_t - lambda_{t-1}| / (|lambda_{t-1}| + 1e-6) < tol`` (PyHessian's rule) or after
``max_matvecs`` products. It converges to the eigenvalue of largest *magnitude* (not the
largest algebraic one) and stalls when the spectral gap is small; the Ritz residual
``||A v - lambda v||`` of the last iterate is reported (free: ``A v`` was computed) and the
``converged`` flag uses the residual criterion ``<= tol |lambda|`` (as Lanczos does), which
the relative-change rule does not guarantee.

The iterates, the deflation projections, the Rayleigh quotients and the norms are float64
whatever the operator's dtype; only the products run in ``op.dtype`` (the iterate rounded to
it, the product cast back), so a float32 model's eigenvalue and residual carry the products'
rounding only, not that of float32 dot products over P entries (a few 1e-6 relative at
P ~ 1e5-1e6). The reported residual is explicit, hence true for the vector returned. The
eigenvectors are float64 (2x the memory of float32 ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharpcli import progress
from sharpcli.curvature.eigen.ritz import EigenResult, apply_operator
from sharpcli.curvature.products.scope import gaussian_like
from sharpcli.errors import UsageError

__all__ = ["power_iteration"]


def _check_args(top_k, tol, max_matvecs) -> None:
    """Raise UsageError on ``top_k < 1``, ``tol <= 0`` or ``max_matvecs < 1``."""
    if int(top_k) < 1:
        raise UsageError(f"top-k must be >= 1, got {top_k}", source="top_k")
    if not tol > 0:
        raise UsageError(f"tolerance must be > 0, got {tol}", source="tol")
    if int(max_matvecs) < 1:
        raise UsageError(f"max iterations must be >= 1, got {max_matvecs}", source="max_matvecs")


@dataclass
class _Pair:
    """One eigenpair's iteration: its last iterate, Rayleigh quotient and residual."""

    vector: torch.Tensor
    value: float = 0.0
    residual: float = 0.0
    matvecs: int = 0
    stalled: bool = False


def _iterate(
    op, v: torch.Tensor, found: list[torch.Tensor], tol: float, max_matvecs: int, run, done: int
):
    """Power iteration from ``v``, deflated against ``found``, until the stop rule or ``max_matvecs``.

    Args:
        op: the operator.
        v: the unit float64 start vector.
        found: the unit eigenvectors already found (projected out before every product).
        tol: the relative-change stop rule's tolerance.
        max_matvecs: the most products.
        run: the progress run (``run.update`` after every product).
        done: the products made before this one's, for the progress count.

    Returns:
        The :class:`_Pair` reached.
    """
    pair = _Pair(v)
    previous = None
    for iteration in range(max_matvecs):
        for u in found:
            v = v - (u @ v) * u
        v = v / torch.linalg.vector_norm(v)
        Av = apply_operator(op, v, source="power", where=" in power iteration")
        pair.matvecs += 1
        lam = float(v @ Av)
        pair.vector, pair.value = v, lam
        pair.residual = float(torch.linalg.vector_norm(Av - lam * v))
        norm = torch.linalg.vector_norm(Av)
        run.update(done + pair.matvecs, estimate=lam, residual=pair.residual)
        stop = previous is not None and abs(lam - previous) / (abs(previous) + 1e-6) < tol
        if stop or norm == 0:
            return pair
        previous = lam
        v = Av / norm
    pair.stalled = True  # iteration == max_matvecs - 1 without the stop rule
    return pair


def power_iteration(
    op,
    top_k: int = 1,
    *,
    tol: float = 1e-3,
    max_matvecs: int = 100,
    seed: int = 0,
    return_eigenvectors: bool = False,
) -> EigenResult:
    r"""Top-``top_k`` largest-magnitude eigenvalues of symmetric ``op`` by deflated power iteration.

    Each step is the Rayleigh quotient of the deflated iterate,

    .. math::

        \lambda_t = v_t^\top A v_t, \qquad
        v_{t+1} = \frac{A v_t}{\lVert A v_t \rVert}, \qquad
        v \leftarrow v - \sum_{u \in \text{found}} (u^\top v)\, u .

    Args:
        op: a symmetric operator (``shape``, ``dtype``, ``device``, ``@``).
        top_k: how many eigenvalues (at most P).
        tol: the stop rule's relative change, and the residual test ``<= tol |lambda|``.
        max_matvecs: the most products per eigenvalue.
        seed: seeds the Gaussian start vectors.
        return_eigenvectors: keep the unit float64 eigenvectors as columns.

    Returns:
        An :class:`~sharpcli.curvature.eigen.ritz.EigenResult`, eigenvalues descending.

    Example:
        >>> import torch
        >>> from sharpcli.curvature import MatrixOperator
        >>> A = MatrixOperator(torch.diag(torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64)))
        >>> round(power_iteration(A, tol=1e-10, max_matvecs=200).eigenvalues[0], 6)
        3.0
    """
    _check_args(top_k, tol, max_matvecs)
    dim = op.shape[0]
    k = min(int(top_k), dim)
    generator = torch.Generator().manual_seed(int(seed))
    pairs: list[_Pair] = []
    run = progress.start("power", total=k * int(max_matvecs), quantity="lambda", capped=True)
    for _ in range(k):
        v = gaussian_like(dim, generator, torch.float64, op.device)
        v = v / torch.linalg.vector_norm(v)
        found = [p.vector for p in pairs]
        done = sum(p.matvecs for p in pairs)
        pairs.append(_iterate(op, v, found, tol, int(max_matvecs), run, done))
    matvecs = sum(p.matvecs for p in pairs)
    stalled = sum(p.stalled for p in pairs)
    pairs.sort(key=lambda p: -p.value)
    eps = torch.finfo(op.dtype).eps
    scale = max(abs(p.value) for p in pairs)
    result = EigenResult(
        eigenvalues=[p.value for p in pairs],
        residuals=[p.residual for p in pairs],
        converged=[
            p.residual <= tol * abs(p.value) or p.residual <= 100 * eps * scale for p in pairs
        ],
        matvecs=matvecs,
        method="power",
        which="largest-magnitude",
        tol=float(tol),
        notes=["power iteration: largest |eigenvalue| first, relative-change stop rule (PyHessian)"]
        + ([f"{stalled} eigenvalue(s) hit max_matvecs={max_matvecs}"] if stalled else []),
    )
    if return_eigenvectors:
        result.eigenvectors = torch.stack([p.vector for p in pairs], dim=1)
    run.finish(matvecs, estimate=result.eigenvalues[0], residual=max(p.residual for p in pairs))
    return result
