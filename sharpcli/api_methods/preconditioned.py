"""The preconditioned eigenvalues of ``Curvature``: the sharpness an adaptive optimizer sees.

:class:`PreconditionedEstimates` is a base of :class:`sharpcli.api.Curvature`: the extreme
eigenvalues of ``P^-1 A`` (as those of the symmetric ``P^-1/2 A P^-1/2``,
:class:`~sharpcli.curvature.operators.preconditioned.PreconditionedOperator`) for a diagonal
``P`` given or read from an optimizer's state ([Cohen2022]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sharpcli.analyses.spectrum import check_choice, operator_of
from sharpcli.api_methods.arguments import integer_argument, seed_argument
from sharpcli.api_methods.products import CurvatureProducts
from sharpcli.catalogue import WHICH
from sharpcli.curvature import EigenResult, lanczos
from sharpcli.curvature.operators.preconditioned import (
    PreconditionedOperator,
    diagonal_preconditioner,
)
from sharpcli.curvature.operators.registry import HESSIAN
from sharpcli.errors import UsageError


class PreconditionedEstimates(CurvatureProducts):
    """The eigenvalues of the preconditioned curvature ``P^-1 A``."""

    def preconditioned_eigenvalues(
        self,
        preconditioner: torch.optim.Optimizer | torch.Tensor | Sequence[torch.Tensor],
        top_k: int = 1,
        which: str = "largest",
        operator: str = HESSIAN,
        *,
        tol: float = 1e-3,
        max_matvecs: int | None = None,
        seed: int = 0,
        start: torch.Tensor | None = None,
        return_eigenvectors: bool = False,
    ) -> EigenResult:
        r"""The ``top_k`` extreme eigenvalues of :math:`P^{-1} A`, each certified by its residual.

        They are those of the symmetric :math:`\tilde A = P^{-1/2} A P^{-1/2}`, on which Lanczos
        ([Lanczos1950]) runs; a Ritz pair is converged when
        :math:`\lVert \tilde A u - \theta u \rVert \le \mathrm{tol}\,|\theta|`. With an Adam
        optimizer's ``P = diag(sqrt(v_hat) + eps)`` the largest is the preconditioned sharpness
        of [Cohen2022], which training holds near ``(2 + 2 beta1)/((1 - beta1) lr)``
        (:func:`sharpcli.analyses.stability.stability_threshold`).

        Args:
            preconditioner: an optimizer whose state gives ``P`` now (``Adam``, ``AdamW``:
                ``sqrt(v / (1 - beta2^t)) + eps``; ``RMSprop``: ``sqrt(v) + eps``), or ``P``
                itself: one flat positive tensor of length P, or one per parameter in scope.
            top_k: How many eigenvalues (per end with ``which="both"``).
            which: ``"largest"``, ``"smallest"`` or ``"both"``.
            operator: ``"hessian"``, ``"ggn"``, ``"nme"`` or any registered operator.
            tol: The relative residual each pair must reach.
            max_matvecs: The most products (default ``min(P, 100)``).
            seed: Seeds the start vector.
            start: A start vector (length P, in the preconditioned coordinates: an earlier
                result's eigenvector warm-starts the next), instead of the seeded Gaussian.
            return_eigenvectors: Keep the Ritz vectors :math:`u` of :math:`\tilde A` (an
                eigenvector of :math:`P^{-1} A` is :math:`P^{-1/2} u`).

        Returns:
            An :class:`~sharpcli.curvature.EigenResult`, eigenvalues descending.

        Raises:
            UsageError: an argument out of range, named by its keyword; an optimizer that has
                no diagonal preconditioner or has taken no step (``preconditioner``).
        """
        integer_argument(top_k, "top_k")
        seed_argument(seed)
        check_choice(which, WHICH, "which")
        if start is not None and (
            not isinstance(start, torch.Tensor) or start.numel() != self.num_params
        ):
            raise UsageError(f"a vector of length {self.num_params} expected", source="start")
        diagonal = diagonal_preconditioner(preconditioner, self.scope)
        self.refresh()
        with self._analysis_mode():
            op = PreconditionedOperator(operator_of(self.engine, operator), diagonal)
            return lanczos(
                op,
                top_k=top_k,
                which=which,
                tol=tol,
                max_matvecs=max_matvecs,
                seed=seed,
                start=start,
                return_eigenvectors=return_eigenvectors,
            )
