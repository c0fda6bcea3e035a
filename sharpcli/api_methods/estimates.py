"""The curvature estimates of ``Curvature``: eigenvalues, traces, the diagonal, the density.

:class:`CurvatureEstimates` is the base of :class:`sharpcli.api.Curvature` whose methods ask
the curvature engine for products and estimators, as ``sharp eigen``, ``trace``,
``diagonal``, ``density`` and ``gn-nme`` do (:mod:`sharpcli.analyses.spectrum`,
:mod:`sharpcli.analyses.blocks`, :mod:`sharpcli.analyses.diagonal`), each from fresh
first-order graphs and with the model in eval mode (:mod:`.products`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from sharpcli.analyses.blocks import density_blocks, eigen_blocks, trace_blocks
from sharpcli.analyses.diagonal import diagonal_result
from sharpcli.analyses.spectrum import eigen_result, gn_nme_result, trace_result
from sharpcli.api_methods.arguments import integer_argument, seed_argument
from sharpcli.api_methods.products import CurvatureProducts
from sharpcli.curvature import EigenResult, SpectralDensity, TraceResult, spectral_density
from sharpcli.curvature.diagonal import DEFAULT_DIAGONAL_ESTIMATOR, DiagonalResult
from sharpcli.curvature.operators.registry import HESSIAN
from sharpcli.curvature.trace.estimators import DEFAULT_ESTIMATOR
from sharpcli.errors import UsageError


class CurvatureEstimates(CurvatureProducts):
    """Eigenvalues, traces, the diagonal, the spectral density and the GN/NME split."""

    def eigenvalues(
        self,
        top_k: int = 1,
        which: str = "largest",
        operator: str = HESSIAN,
        *,
        method: str = "lanczos",
        tol: float = 1e-3,
        max_matvecs: int | None = None,
        seed: int = 0,
        return_eigenvectors: bool = False,
        blocks: str | Mapping[str, str] | None = None,
        k: int | None = None,
    ) -> EigenResult | list[dict[str, Any]]:
        r"""The ``top_k`` extreme eigenvalues of ``operator``, each certified by its residual.

        A Ritz pair :math:`(\theta, u)` is converged when
        :math:`\lVert A u - \theta u \rVert \le \mathrm{tol}\,|\theta|`.

        Args:
            top_k: How many eigenvalues (per end with ``which="both"``); ``sharp eigen
                --top-k``.
            which: ``"largest"``, ``"smallest"`` or ``"both"``.
            operator: ``"hessian"``, ``"ggn"``, ``"nme"`` or any registered operator.
            method: ``"lanczos"`` ([Lanczos1950], full reorthogonalisation [Parlett1998])
                or ``"power"`` (the largest ``|eigenvalue|`` only, as [PyHessian]).
            tol: The relative residual each pair must reach.
            max_matvecs: The most products (Lanczos default ``min(P, 100)``).
            seed: Seeds the start vector.
            return_eigenvectors: Keep the Ritz vectors (P floats each) in the result.
            blocks: Per parameter block instead (:meth:`blocks_of`): the extreme eigenvalues
                of each principal sub-block ``A_bb``.
            k: The former name of ``top_k``, still accepted with a DeprecationWarning.

        Returns:
            An :class:`~sharpcli.curvature.EigenResult`: eigenvalues descending, their
            residuals and converged flags, the products spent. With ``blocks``: a list, per
            block, of ``{name, parameters, numel, eigenvalues, residuals, converged,
            matvecs}`` (``results.blocks`` of ``sharp eigen --blocks``; a block smaller than
            ``top_k`` gives all its eigenvalues).

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        if k is not None:
            warnings.warn(
                "Curvature.eigenvalues(k=...) is deprecated; use top_k=...",
                DeprecationWarning,
                stacklevel=2,
            )
            top_k = k
        integer_argument(top_k, "top_k")
        seed_argument(seed)
        self.refresh()
        if blocks is not None and return_eigenvectors:
            raise UsageError("not with `blocks`", source="return_eigenvectors")
        settings: dict[str, Any] = dict(
            which=which, method=method, tol=tol, max_matvecs=max_matvecs, seed=seed
        )
        with self._analysis_mode():
            if blocks is not None:
                return eigen_blocks(
                    self.blocks_of(blocks), operator=operator, top_k=top_k, **settings
                )
            return eigen_result(
                self.engine,
                operator,
                top_k=top_k,
                return_eigenvectors=return_eigenvectors,
                **settings,
            )

    def trace(
        self,
        operator: str = HESSIAN,
        *,
        estimator: str = DEFAULT_ESTIMATOR,
        square: bool = False,
        tol: float = 1e-2,
        max_matvecs: int = 1000,
        seed: int = 0,
        blocks: str | Mapping[str, str] | None = None,
    ) -> TraceResult | list[dict[str, Any]]:
        r"""``tr(A)`` of ``operator`` (or ``Tr(A^2)``), with standard error and per-layer traces.

        The per-layer traces are those of the diagonal blocks.

        .. math::

            \mathrm{tr}(A) \approx \frac{1}{n} \sum_{j=1}^n g_j^\top A g_j, \qquad
            \mathrm{Tr}(A^2) \approx \frac{1}{n} \sum_{j=1}^n \lVert A g_j \rVert^2

        for Rademacher probes :math:`g_j`, the number of probes sized by a pilot so that the
        standard error reaches ``tol`` ([Stein1945]).

        Args:
            operator: ``"hessian"``, ``"ggn"``, ``"nme"`` or any registered operator.
            estimator: ``"hutchpp"`` ([Hutch++]), ``"hutchinson"`` ([Hutchinson1989]),
                ``"exact"`` (any operator: per-sample squared gradient norms for ``ggn``,
                ``ef`` and ``fisher``; ``tr(H) - tr(G)`` for ``nme``; one product per
                parameter for the Hessian, other operators and ``square``, refused above
                :data:`~sharpcli.curvature.trace.exact.EXACT_MAX_PARAMS` parameters) or
                ``"gn-split"`` (tr(H) as exact tr(G) plus an estimated tr(N)).
            square: Estimate ``Tr(A^2)`` instead of ``tr(A)``.
            tol: The relative standard error wanted.
            max_matvecs: The most products.
            seed: Seeds the probes.
            blocks: Per parameter block instead (:meth:`blocks_of`): the trace of each
                principal sub-block ``A_bb`` (their sum over a partition is ``tr(A)``).

        Returns:
            A :class:`~sharpcli.curvature.TraceResult` (``estimate``, ``stderr``,
            ``by_layer``, ``matvecs``, ``samples``, ``converged``). With ``blocks``: a list,
            per block, of ``{name, parameters, numel, estimate, stderr, data_stderr,
            data_method, matvecs, converged}``
            (``results.blocks`` of ``sharp trace --blocks``).

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        seed_argument(seed)
        self.refresh()
        settings: dict[str, Any] = dict(
            estimator=estimator, square=square, tol=tol, max_matvecs=max_matvecs
        )
        with self._analysis_mode():
            if blocks is not None:
                passes = self.blocks_of(blocks)
                return trace_blocks(passes, operator=operator, seed=seed, summed=False, **settings)[
                    0
                ]
            return trace_result(self.engine, operator, seed=seed, **settings)

    def diagonal(
        self,
        operator: str | None = None,
        *,
        estimator: str = DEFAULT_DIAGONAL_ESTIMATOR,
        probes: int = 100,
        max_products: int = 10000,
        seed: int = 0,
    ) -> DiagonalResult:
        r"""``diag(A)`` of ``operator`` per parameter, as ``sharp diagonal`` computes it.

        Args:
            operator: any registered operator; None: ``"hessian"`` for ``exact`` and
                ``hutchinson``, ``"ggn"`` for ``gnb`` and ``per-sample``.
            estimator: ``"hutchinson"`` (mean of :math:`v \odot A v` over Rademacher probes,
                [Bekas2007]), ``"exact"`` (one product per parameter), ``"gnb"`` (Sophia's
                Gauss-Newton-Bartlett estimator of diag(G), [Sophia]) or ``"per-sample"``
                (the exact ggn diagonal as BackPACK's DiagGGN, [BackPACK], the ef's or the
                fisher's at its own label draws).
            probes: Rademacher probes or label draws (at least 2).
            max_products: the products ``exact`` may spend, or the backward passes per sample
                ``per-sample`` may.
            seed: seeds the probes or draws.

        Returns:
            A :class:`~sharpcli.curvature.diagonal.DiagonalResult`: ``diagonal`` and
            ``stderr`` flat, ``tensors()`` by parameter name and shape.

        Raises:
            UsageError: an argument out of range or an estimator that does not give
                ``operator``'s diagonal, named by its keyword.
        """
        seed_argument(seed)
        self.refresh()
        with self._analysis_mode():
            return diagonal_result(
                self.engine,
                operator,
                estimator=estimator,
                probes=probes,
                max_products=max_products,
                seed=seed,
            )[1]

    def density(
        self,
        operator: str = HESSIAN,
        *,
        probes: int = 4,
        steps: int = 64,
        grid_points: int = 512,
        broadening: float | None = None,
        seed: int = 0,
        blocks: str | Mapping[str, str] | None = None,
    ) -> SpectralDensity | list[dict[str, Any]]:
        r"""Spectral density of ``operator`` by stochastic Lanczos quadrature.

        As in [Ubaru2017] and [Ghorbani2019].

        .. math::

            \phi(t) \approx \frac{1}{n_v} \sum_{l=1}^{n_v} \sum_{i=1}^{m}
            \tau_i^{(l)} \, g_\sigma\bigl(t - \theta_i^{(l)}\bigr)

        with the nodes :math:`\theta_i` and weights :math:`\tau_i` of each probe's
        ``steps``-step Lanczos tridiagonal and :math:`g_\sigma` a Gaussian of width
        ``broadening``.

        Args:
            operator: ``"hessian"``, ``"ggn"``, ``"nme"`` or any registered operator.
            probes: Rademacher probes :math:`n_v`.
            steps: Lanczos steps :math:`m` per probe.
            grid_points: Points of the evaluation grid (at least 2).
            broadening: :math:`\sigma`; None: 1% of the node range.
            seed: Seeds the probes.
            blocks: Per parameter block instead (:meth:`blocks_of`): the density of each
                principal sub-block ``A_bb`` ([Zhang2024]), ``steps`` at most its size.

        Returns:
            A :class:`~sharpcli.curvature.SpectralDensity` (``grid``, ``density``,
            ``nodes``, ``weights``, ``trace_estimate``, ``trace_stderr``). With ``blocks``: a
            list, per block, of ``{name, parameters, numel, grid, density, nodes, weights,
            sigma, lambda_min, lambda_max, trace_estimate, trace_stderr, matvecs}``
            (``results.blocks`` of ``sharp density --blocks``).

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        integer_argument(probes, "probes")
        integer_argument(steps, "steps")
        integer_argument(grid_points, "grid_points", minimum=2)
        seed_argument(seed)
        if blocks is not None:
            self.refresh()
            with self._analysis_mode():
                return density_blocks(
                    self.blocks_of(blocks),
                    operator=operator,
                    probes=probes,
                    steps=steps,
                    grid_points=grid_points,
                    broadening=broadening,
                    seed=seed,
                )
        op = self.operator(operator)
        with self._analysis_mode():
            return spectral_density(
                op,
                probes=probes,
                steps=steps,
                grid_points=grid_points,
                broadening=broadening,
                seed=seed,
            )

    def gn_nme(
        self,
        *,
        tol: float = 1e-2,
        eig_tol: float = 1e-3,
        max_matvecs: int = 1000,
        seed: int = 0,
        label_samples: int = 4,
        ggn_estimator: str = "auto",
    ) -> dict[str, Any]:
        r"""The split of the Hessian into Gauss-Newton and nonlinear-modeling-error parts.

        [NME] eq. 2:

        .. math::

            H = G + N, \qquad G = \frac{1}{N} \sum_i J_i^\top H_{z,i} J_i.

        For each of ``hessian``, ``ggn`` and ``nme``: the trace with its standard error
        (shared probes, so the identity holds for the estimates), ``frobenius_sq``,
        ``lambda_max`` and ``lambda_min``; ``nme_share = tr(N)/tr(H)``,
        ``nme_frobenius_ratio``, per-layer rows (``layers``) and tr(G) cross-checked by other
        estimators (``ggn_trace_check``).

        Args:
            tol: The relative standard error wanted of tr(H) and tr(G).
            eig_tol: The relative residual of the extreme eigenvalues.
            max_matvecs: The most joint products for the traces.
            seed: Seeds the probes.
            label_samples: Label draws per sample of the sampled-label tr(G).
            ggn_estimator: ``"auto"``, ``"exact"``, ``"sampled"`` or ``"hutchinson"``: which
                tr(G) cross-checks run (:func:`sharpcli.analyses.spectrum.ggn_check_plan`).

        Returns:
            The dict that is the ``results`` of ``sharp gn-nme --json``.

        Raises:
            UsageError: an argument out of range, named by its keyword.
        """
        seed_argument(seed)
        self.refresh()
        with self._analysis_mode():
            return gn_nme_result(
                self.engine,
                loss=self.loss,
                num_outputs=self.num_outputs,
                labels=self.data.y,
                seed=seed,
                tol=tol,
                eig_tol=eig_tol,
                max_matvecs=max_matvecs,
                label_samples=label_samples,
                ggn_estimator=ggn_estimator,
            )
