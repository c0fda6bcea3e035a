r"""The step and the error bound of finite-difference Hessian products, measured per run.

For the central difference :math:`D_s(u) = (\nabla L(\theta + s u) - \nabla L(\theta - s u)) / 2s`
of a unit vector ``u`` (:mod:`sharpcli.curvature.finite_difference`), the error is a
truncation :math:`c\,s^2` plus a rounding :math:`r_s` of size about :math:`\epsilon \|g\| / s`.
Comparing two steps,

.. math::

    R_s(u) = \|D_{2s}(u) - D_s(u)\| = \|3 c\,s^2 + r_{2s} - r_s\|,

is 3 times the truncation where it dominates and about 1.1 times the rounding where that
does (``|r_{2s}| ~ |r_s| / 2``, uncorrelated), so :math:`R_s(u) \ge \|D_s(u) - H u\|` on
either side of the optimum: Richardson's comparison of two steps used as an error estimate,
and, minimised over a ladder of steps, a choice of the step from estimated truncation and
rounding errors as [GillMurraySaundersWright1983] choose forward-difference intervals.

The truncation is largest along the directions of large curvature (100 to 1000 times a
random direction's on the test models), so :func:`calibrate` measures where they are: it
runs :data:`LANCZOS_STEPS` Lanczos steps of ``D`` from a seeded random unit vector, takes
the largest and the smallest Ritz vectors, walks the step down from the a priori
:math:`s_0 = \epsilon^{1/3} (1 + \|\theta\|)` by factors of 4 while the larger of their two
``R`` falls (at most :data:`RUNGS` steps), and states

.. math::

    \beta = 2 \max\big(R_{s}(u_{\max}), R_{s}(u_{\min}), R_{s}(u_0)\big), \qquad
    \|D_s(v) - H v\| \le \beta \|v\|

at the chosen step ``s`` (``u_0`` the random start). On the test models the largest error
over the Hessian's extreme eigenvectors and random directions is 1.8 to 3.3 times below
``beta`` (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["BOUND_FACTOR", "LANCZOS_STEPS", "RUNGS", "Calibration", "calibrate"]

BOUND_FACTOR = 2.0  # beta: this times the largest two-step difference (module docstring)
CALIBRATION_SEED = 0x5EED  # the seeded unit vector the Lanczos steps start from
LANCZOS_STEPS = 6  # to the extreme Ritz vectors, where the curvature is
RUNGS = 4  # steps s0, s0/4, s0/16, s0/64 at most
RUNG_RATIO = 4.0


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured.

    Attributes:
        step: the chosen step ``s`` (the norm of every perturbation ``h v``).
        step_factor: ``s / s0``, a power of 1/4.
        error_bound: ``beta``.
        scale: the largest ``||D u||`` of the Lanczos steps (about ``||H||_2``).
        gradients: the gradients over the analysis set it took.
    """

    step: float
    step_factor: float
    error_bound: float
    scale: float
    gradients: int


def calibrate(
    difference: Callable[[torch.Tensor, float], torch.Tensor], numel: int, device, s0: float
) -> Calibration:
    """Choose the step and measure the error bound (module docstring).

    Args:
        difference: ``(u, s) -> D_s(u)`` in float64 for a float64 vector ``u`` (two gradients).
        numel: the number of parameters P.
        device: where the vectors live.
        s0: the a priori step ``eps^(1/3) (1 + ||theta||)``.

    Returns:
        The :class:`Calibration`.
    """
    gradients = 0

    def product(u: torch.Tensor, s: float) -> torch.Tensor:
        nonlocal gradients
        gradients += 2
        return difference(u, s)

    def two_steps(u: torch.Tensor, s: float, near: torch.Tensor | None = None) -> float:
        near = product(u, s) if near is None else near
        return float(torch.linalg.vector_norm(product(u, 2.0 * s) - near))

    basis, products, ritz = _short_lanczos(lambda u: product(u, s0), numel, device)
    best: tuple[float, float] | None = None  # (step factor, its largest R at the Ritz vectors)
    factor = 1.0
    for _ in range(RUNGS):
        largest = max(two_steps(u, s0 * factor) for u in ritz)
        if best is not None and largest >= best[1]:
            break
        best = (factor, largest)
        factor /= RUNG_RATIO
    assert best is not None
    factor, largest = best
    near = products[:, 0] if factor == 1.0 else None
    largest = max(largest, two_steps(basis[:, 0], s0 * factor, near))
    scale = float(torch.linalg.vector_norm(products, dim=0).max())
    return Calibration(s0 * factor, factor, BOUND_FACTOR * largest, scale, gradients)


def _short_lanczos(product: Callable[[torch.Tensor], torch.Tensor], numel: int, device):
    """:data:`LANCZOS_STEPS` Lanczos steps (full reorthogonalisation, float64) of ``product``
    from a seeded unit vector: the basis, its products, and the Ritz vectors of the largest
    and the smallest Ritz value."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    start = torch.randn(numel, generator=generator, dtype=torch.float64)
    steps = max(1, min(LANCZOS_STEPS, numel))
    basis = torch.zeros(numel, steps, dtype=torch.float64, device=device)
    products = torch.zeros_like(basis)
    basis[:, 0] = (start / start.norm()).to(device)
    taken = steps
    for j in range(steps):
        products[:, j] = product(basis[:, j])
        if j + 1 == steps:
            break
        kept = basis[:, : j + 1]
        residual = products[:, j] - kept @ (kept.T @ products[:, j])
        residual -= kept @ (kept.T @ residual)  # twice is enough ([Parlett1998])
        norm = float(residual.norm())
        if norm <= 1e-12 * float(products[:, j].norm()):  # an invariant subspace
            taken = j + 1
            break
        basis[:, j + 1] = residual / norm
    basis, products = basis[:, :taken], products[:, :taken]
    projected = basis.T @ products
    _, vectors = torch.linalg.eigh((projected + projected.T) / 2)
    ritz = [basis @ vectors[:, -1]] + ([basis @ vectors[:, 0]] if taken > 1 else [])
    return basis, products, ritz
