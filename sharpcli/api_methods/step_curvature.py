"""The curvature along a training step, from ``Curvature``.

Batch sharpness, critical sharpness and the gradient's share in the top eigenspace.

:class:`StepCurvature` is the base of :class:`sharpcli.api.Curvature` whose methods run
:mod:`sharpcli.analyses.step_curvature` on its analysis set, from fresh first-order graphs
and with the model in eval mode (:mod:`.products`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from sharpcli.analyses.step_curvature import (
    BatchSharpness,
    CriticalSharpness,
    GradientShare,
    batch_sharpness,
    critical_sharpness,
    gradient_share,
)
from sharpcli.api_methods.arguments import integer_argument, seed_argument
from sharpcli.api_methods.products import CurvatureProducts
from sharpcli.curvature import AnalysisData
from sharpcli.errors import UsageError
from sharpcli.losses import token_reduction


class StepCurvature(CurvatureProducts):
    """Batch sharpness, critical sharpness and the gradient's share in the top-k eigenspace."""

    def batch_sharpness(
        self, batch_size: int, *, max_batches: int | None = None, seed: int = 0
    ) -> BatchSharpness:
        r"""Batch sharpness [Andreyev2024], with its standard error over the mini-batches.

        The mean over mini-batches B of :math:`g_B^\top H_B g_B / \lVert g_B \rVert^2`. The
        mini-batches are drawn without replacement from the analysis set (a seeded
        permutation cut into ``N // batch_size`` batches); each costs one gradient and one
        Hessian product of its own loss. Mini-batch SGD at learning rate lr holds it near
        2/lr (the edge of stochastic stability).

        Args:
            batch_size: The mini-batch size (the training batch size); above N: the whole
                set, once.
            max_batches: The most mini-batches (None: all ``N // batch_size``).
            seed: Seeds the draw.

        Returns:
            A :class:`~sharpcli.analyses.step_curvature.BatchSharpness`.

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        integer_argument(batch_size, "batch_size")
        if max_batches is not None:
            integer_argument(max_batches, "max_batches")
        seed_argument(seed)
        self.refresh()
        reduction = self.token_reduction

        def own_tokens(data: AnalysisData) -> contextlib.AbstractContextManager[Any]:
            # a token loss averaged over the mini-batch's own labelled tokens
            if reduction is None:
                return contextlib.nullcontext()
            return token_reduction(reduction, data.y)

        with self._analysis_mode():
            return batch_sharpness(
                self.engine,
                batch_size,
                seed=seed,
                max_batches=max_batches,
                batch_context=own_tokens,
            )

    def critical_sharpness(
        self,
        optimizer: Any = None,
        *,
        direction: torch.Tensor | None = None,
        start: float | None = None,
        tol: float = 0.05,
        max_passes: int = 30,
    ) -> CriticalSharpness:
        r"""Critical sharpness [Kalra2026], by a line search in forward passes.

        :math:`2/\eta_c`, :math:`\eta_c` the learning rate at which one step along the update
        direction d starts to raise the loss (no Hessian product).

        Equal to :math:`d^\top H d / (-g^\top d)` on a quadratic loss (the Rayleigh quotient of
        H along g for gradient descent); in general the mean curvature along the step over the
        slope (:mod:`sharpcli.analyses.step_curvature`).

        Args:
            optimizer: A ``torch.optim`` SGD (momentum, Nesterov), Adam, AdamW or RMSprop over
                this Curvature's model: d is its next step per unit learning rate, from its
                state and the gradient on the analysis set (neither it nor the model is
                changed). None: gradient descent, ``d = -g``.
            direction: d itself, a flat tensor of :attr:`num_params` values (the scope's
                layout), instead of an optimizer's.
            start: The first rate tried (None: the optimizer's learning rate, else |L| / |g.d|).
            tol: The relative width of the bracket on the rate, in (0, 1).
            max_passes: The most forward passes of the search.

        Returns:
            A :class:`~sharpcli.analyses.step_curvature.CriticalSharpness` (its ``threshold``:
            2/lr, above which the optimizer's next step raises the loss).

        Raises:
            UsageError: an argument out of range or an optimizer not supported, named by its
                keyword.
        """
        if not isinstance(tol, (int, float)) or not (0.0 < float(tol) < 1.0):
            raise UsageError(f"must be in (0, 1), got {tol!r}", source="tol")
        integer_argument(max_passes, "max_passes")
        if start is not None and not (
            isinstance(start, (int, float)) and math.isfinite(start) and start > 0
        ):
            raise UsageError(f"must be a positive number, got {start!r}", source="start")
        self.refresh()
        with self._analysis_mode():
            return critical_sharpness(
                self.engine,
                optimizer,
                direction=direction,
                start=start,
                tol=float(tol),
                max_passes=max_passes,
            )

    def gradient_share(
        self,
        k: int | None = None,
        *,
        tol: float = 1e-3,
        max_matvecs: int | None = None,
        seed: int = 0,
    ) -> GradientShare:
        r"""The gradient's share in the top-k Hessian eigenspace [GurAri2018].

        :math:`\lVert V_k^\top g \rVert^2 / \lVert g \rVert^2`, :math:`V_k` the top-k
        eigenvectors (Lanczos).

        Args:
            k: The top eigenvectors (None: the number of classes, the model's outputs per
                sample, as in the paper).
            tol: The Lanczos relative residual.
            max_matvecs: The most Hessian products (default ``min(P, 100)``).
            seed: Seeds the Lanczos start vector.

        Returns:
            A :class:`~sharpcli.analyses.step_curvature.GradientShare`.

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        if k is not None:
            integer_argument(k, "k")
        if max_matvecs is not None:
            integer_argument(max_matvecs, "max_matvecs")
        seed_argument(seed)
        self.refresh()
        with self._analysis_mode():
            return gradient_share(self.engine, k, tol=tol, max_matvecs=max_matvecs, seed=seed)
