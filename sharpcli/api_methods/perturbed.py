"""The loss at moved weights, from ``Curvature``: sharpness and the loss landscape.

:class:`PerturbedLoss` is the base of :class:`sharpcli.api.Curvature` whose methods evaluate
the loss at ``w + delta`` over the analysis set, as ``sharp sharpness`` and
``sharp landscape`` do (:mod:`sharpcli.analyses.sharpness`,
:mod:`sharpcli.analyses.landscape`).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from sharpcli.analyses.landscape import LandscapeConfig, loss_landscape
from sharpcli.analyses.sharpness import SharpnessConfig, sharpness
from sharpcli.api_methods.arguments import seed_argument
from sharpcli.api_methods.modes import unwrap
from sharpcli.api_methods.products import CurvatureProducts


class PerturbedLoss(CurvatureProducts):
    """Worst-case and average-case sharpness, the loss on a line or plane through the weights."""

    def sharpness(
        self,
        *,
        kind: str = "worst-case",
        norm: str = "l2",
        rho: float | tuple[float, ...] = 0.05,
        adaptive: bool = True,
        m: int | None = None,
        steps: int = 20,
        restarts: int = 1,
        noise_draws: int = 100,
        seed: int = 0,
    ) -> dict[str, Any]:
        r"""Worst-case or average-case sharpness, adaptive or standard [Andriushchenko2023].

        Adaptive: c = |w|; standard: c = 1.

        .. math::

            \max_{\|\delta / c\|_p \le \rho} L_S(w + \delta) - L_S(w), \qquad
            \mathbb{E}_{\delta \sim N(0, \rho^2 \mathrm{diag}(c^2))} L_S(w + \delta) - L_S(w),

        averaged over batches S of ``m`` samples (:mod:`sharpcli.analyses.sharpness`).

        Args:
            kind: ``"worst-case"`` (Auto-PGD) or ``"average"``.
            norm: ``"l2"`` or ``"linf"``.
            rho: one radius or several.
            adaptive: c = |w| rather than 1.
            m: samples per sharpness batch (None: the whole set).
            steps: Auto-PGD steps per restart.
            restarts: Auto-PGD restarts.
            noise_draws: draws per batch (average case).
            seed: seeds the restarts and the noise.

        Returns:
            The dict that is the ``results`` of ``sharp sharpness --json``.

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        rhos = tuple(rho) if isinstance(rho, (list, tuple)) else (rho,)
        config = SharpnessConfig(
            kind=kind, norm=norm, rhos=tuple(float(r) for r in rhos), adaptive=adaptive, m=m,
            params=self.scope.spec, steps=steps, restarts=restarts, noise_draws=noise_draws,
            seed=seed_argument(seed),
        )  # fmt: skip
        with self._analysis_mode():
            return sharpness(self._view, self.data, config).to_dict()

    def landscape(
        self,
        *,
        along: str = "random",
        other: nn.Module | None = None,
        dims: int = 2,
        steps: int = 21,
        span: float | None = None,
        bias_bn: str = "zero",
        seed: int = 0,
    ) -> dict[str, Any]:
        """The loss and accuracy on a line or plane through the weights [Li2018].

        Along filter-normalized random directions, the top Hessian eigenvectors, or the line to
        ``other`` (a model of the same architecture); :mod:`sharpcli.analyses.landscape`.

        Args:
            along: ``"random"``, ``"eigen"`` or ``"checkpoint"`` (with ``other``).
            other: the second model of ``along="checkpoint"``.
            dims: 1 (a line) or 2 (a plane).
            steps: grid points per axis.
            span: the grid's half-width (default 1; along a checkpoint the extrapolation, 0.5).
            bias_bn: random directions on 1-D parameters: ``"zero"`` or ``"weights"``.
            seed: seeds the random directions.

        Returns:
            The dict that is the ``results`` of ``sharp landscape --json``.

        Raises:
            UsageError: an argument out of range, or ``other`` of another architecture.
        """
        config = LandscapeConfig(
            along=along, dims=dims, steps=steps, span=span, bias_bn=bias_bn,
            params=self.scope.spec, seed=seed_argument(seed),
        )  # fmt: skip
        if other is not None:
            other = copy.deepcopy(unwrap(other)).to(device=self.device, dtype=self.dtype)
        with self._analysis_mode():
            result, _, _ = loss_landscape(self._view, self.data, config, other=other)
        return result.to_dict()
