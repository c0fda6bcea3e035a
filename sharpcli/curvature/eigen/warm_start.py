r"""Warm starts of Lanczos: start vectors closer to the wanted eigenvectors than a Gaussian.

How fast the top Ritz value converges depends on the start vector ``q_1`` through its angle
``phi_0`` with the top eigenvector ``u_1``; the Kaniel-Paige-Saad bound (as in [Parlett1998])
reads

.. math::

    0 \le \lambda_1 - \theta_1^{(m)} \le (\lambda_1 - \lambda_n)
    \left(\frac{\tan \phi_0}{T_{m-1}(1 + 2\gamma)}\right)^2, \qquad
    \gamma = \frac{\lambda_1 - \lambda_2}{\lambda_2 - \lambda_n},

with ``T_{m-1}`` the Chebyshev polynomial of degree ``m - 1``. A Gaussian start has
``tan phi_0 ~ sqrt(P)``, which the first few steps only work off; a start closer to ``u_1``
saves them. Sources:

- ``"subsample"``: the same curvature on a seeded random fraction ``f`` of the analysis set,
  ``A_S = (1/|S|) sum_{i in S} A_i`` (:func:`subsample_operator`). A few Lanczos steps on
  ``A_S`` (each about ``f`` of a full product) give its Ritz vectors; the start is the sum of
  the wanted ones. Its angle with ``u_1`` is then set by the sampling perturbation, about
  ``||(A_S - A) u_1|| / (lambda_1 - lambda_2)``, not by the step count: it helps where the top
  eigenvalue is well separated and not where the top is a cluster that the subsample orders
  differently (docs/benchmarks.md, "Time to accuracy").
- ``"gradient"``: the gradient of the analysis loss (one gradient pass, no second-order graph;
  ``which="largest"`` only). Gradients of trained networks lie mostly in the span of the top
  Hessian eigenvectors [GurAri2018], so its Rayleigh quotient is already near ``lambda_1``.
- any operator of the same shape (a cheaper approximation the caller has): as ``"subsample"``.

Only ``q_1`` changes: the recurrence, the residuals and the convergence test run on the full
operator, so the returned values carry the same certificate as from a cold start. As for any
start, the certificate says the values are eigenvalues, not that no larger one was missed: a
Gaussian start makes that improbable by giving every eigenvector a comparable share; a warm
start gives the top directions most of its weight, which is the point, and could in principle
give ``u_1`` a much smaller share than a close ``lambda_2`` (a tight cluster mis-ordered by the
subsample). Summing the k wanted Ritz vectors, not taking the first alone, limits that;
``sharp eigen`` starts cold.
"""

from __future__ import annotations

import torch

from sharpcli.curvature.operators.hessian import CurvatureOperator
from sharpcli.errors import UsageError

__all__ = [
    "DEFAULT_WARM_FRACTION",
    "DEFAULT_WARM_STEPS",
    "WARM_STARTS",
    "WARM_TOL",
    "gradient_start",
    "subsample_operator",
    "warm_note",
    "warm_operator",
]

WARM_STARTS = ("subsample", "gradient")
DEFAULT_WARM_FRACTION = 0.1
DEFAULT_WARM_STEPS = 4
WARM_TOL = 1e-2  # the warm phase's own stop: beyond this the sampling error dominates
_F64 = torch.float64


def _curvature_operator(op, what: str) -> CurvatureOperator:
    """``op`` itself, checked to be a curvature operator over an analysis set.

    Args:
        op: the operator.
        what: the warm start that needs it, for the message.

    Returns:
        ``op``.

    Raises:
        UsageError: ``op`` is not a :class:`CurvatureOperator` (source ``warm_start``).
    """
    if isinstance(op, CurvatureOperator):
        return op
    raise UsageError(
        f"warm_start={what!r} needs a curvature operator over an analysis set; "
        f"{type(op).__name__} has none: pass an approximating operator as warm_start instead",
        source="warm_start",
    )


def subsample_operator(op, fraction: float = DEFAULT_WARM_FRACTION, seed: int = 0):
    """The same curvature operator as ``op`` over a seeded ``fraction`` of its analysis set.

    Args:
        op: a :class:`~sharpcli.curvature.operators.hessian.CurvatureOperator` over an analysis set.
        fraction: the fraction of samples kept (:func:`~sharpcli.curvature.products.data.subsample_data`).
        seed: seeds the choice of samples.

    Returns:
        ``op.on_subsample(fraction, seed)``'s operator, on its own engine.

    Raises:
        UsageError: ``op`` has no analysis set, or its class cannot rebuild on a subsample.
    """
    return _subsample(op, fraction, seed)[0]


def _subsample(op, fraction, seed) -> tuple[CurvatureOperator, int, int]:
    """The subsample operator with its sample counts.

    Args:
        op: a curvature operator over an analysis set.
        fraction: the fraction of samples kept.
        seed: seeds the choice of samples.

    Returns:
        ``(operator on the subsample, samples kept, samples of the whole set)``.

    Raises:
        UsageError: as :func:`subsample_operator` (source ``warm_start``).
    """
    op = _curvature_operator(op, "subsample")
    try:
        return op.on_subsample(fraction, seed)
    except UsageError as error:
        if error.source != "operator":
            raise
        raise UsageError(
            f"warm_start='subsample': {error}; pass an approximating operator as warm_start instead",
            source="warm_start",
        ) from error


def gradient_start(op, which: str):
    """The loss gradient over the analysis set as a start vector (one gradient pass).

    Args:
        op: a curvature operator over an analysis set.
        which: must be ``"largest"``: the gradient leans towards the top of the spectrum.

    Returns:
        ``(start, info)``: the float64 gradient as a P-vector and the warm-start record.

    Raises:
        UsageError: ``which`` is not ``"largest"`` or ``op`` has no analysis set.
    """
    if which != "largest":
        raise UsageError(
            f"warm_start='gradient' finds the top of the spectrum; use 'subsample' for "
            f"which={which!r}",
            source="warm_start",
        )
    try:
        _, grad = _curvature_operator(op, "gradient").loss_and_gradient()
    except UsageError as error:
        if error.source != "operator":
            raise
        raise UsageError(
            f"warm_start='gradient': {error}; pass an approximating operator as warm_start instead",
            source="warm_start",
        ) from error
    info = {"method": "gradient", "gradient_passes": 1, "full_product_equivalents": None}
    return grad.to(dtype=_F64, device=op.device).reshape(-1), info


def warm_operator(op, warm_start, fraction, seed):
    """The operator the warm phase iterates on.

    Args:
        op: the full operator.
        warm_start: ``"subsample"`` or an operator of ``op``'s shape.
        fraction: the subsample's fraction of the analysis set.
        seed: seeds the subsample.

    Returns:
        ``(warm operator, info, cost of one of its products in full products or None)``.

    Raises:
        UsageError: the subsample cannot be built or the operator's shape differs.
    """
    if isinstance(warm_start, str):
        warm_op, samples, of_samples = _subsample(op, fraction, seed)
        info = {
            "method": "subsample",
            "fraction": float(fraction),
            "samples": samples,
            "of_samples": of_samples,
        }
        return warm_op, info, samples / of_samples
    if tuple(warm_start.shape) != tuple(op.shape):
        raise UsageError(
            f"the warm-start operator has shape {tuple(warm_start.shape)}, the operator "
            f"{tuple(op.shape)}",
            source="warm_start",
        )
    name = getattr(warm_start, "name", type(warm_start).__name__)
    return warm_start, {"method": "operator", "name": name}, None


def warm_note(info: dict) -> str:
    """The note a result carries about its warm start.

    Args:
        info: the warm-start record (``method``, ``matvecs``, sample counts, ``fallback``).

    Returns:
        One line saying where the start came from and what it cost.

    Example:
        >>> warm_note({"method": "operator", "matvecs": 4, "name": "GGN"})
        'warm start: 4 products of GGN, not in matvecs'
    """
    if info["method"] == "gradient":
        text = "warm start: the loss gradient (one gradient pass)"
    elif info["method"] == "subsample":
        cost = info["full_product_equivalents"]
        text = (
            f"warm start: {info['matvecs']} products on a subsample of {info['samples']} of "
            f"{info['of_samples']} samples (about {cost:.2g} full products), not in matvecs"
        )
    else:
        text = f"warm start: {info['matvecs']} products of {info['name']}, not in matvecs"
    return text + (f"; {info['fallback']}" if "fallback" in info else "")
