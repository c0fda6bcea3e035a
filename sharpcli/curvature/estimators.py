"""The trace estimators of ``sharp trace --estimator NAME``, each declared where it is defined.

A trace estimator is a function ``estimate(curvature_pass, operator, *, square, tol,
max_matvecs, seed) -> TraceResult``: the pass gives the model, data, scope and the registered
operators (:func:`~sharpcli.curvature.registry.build_operator`), ``operator`` names the one to
estimate, ``square`` asks for ``Tr(A^2)`` instead of ``tr(A)``. Each is declared with
:func:`sharpcli.registry.declare` (kind ``"estimator"``); ``python -m sharpcli.catalogue.generate``
writes the declarations into the catalogue's index, and :data:`ESTIMATORS` (the catalogue's
registry) imports an estimator when it is first asked for, so ``sharp trace --estimator NAME``
and :meth:`sharpcli.api.Curvature.trace` reach a built-in and an extension
(``ESTIMATORS.add(fn)``) alike. The declaration order is the help's order; the first is the
default.
"""

from __future__ import annotations

from typing import Protocol, cast

from sharpcli import catalogue
from sharpcli.curvature.engine import CurvatureEngine
from sharpcli.curvature.ggn_trace import exact_ggn_trace, gn_split_trace
from sharpcli.curvature.hutchpp import hutchpp
from sharpcli.curvature.probes import TraceResult
from sharpcli.curvature.registry import GGN, HESSIAN, build_operator
from sharpcli.curvature.trace import frobenius_sq, hutchinson
from sharpcli.errors import UsageError
from sharpcli.registry import declare

__all__ = [
    "DEFAULT_ESTIMATOR",
    "ESTIMATORS",
    "TraceEstimator",
    "exact_trace",
    "gn_split",
    "hutchinson_trace",
    "hutchpp_trace",
    "trace_estimator",
]

ESTIMATORS = catalogue.ESTIMATORS


class TraceEstimator(Protocol):
    """What ``--estimator NAME`` calls: ``tr(A)`` (or ``Tr(A^2)``) of a registered operator."""

    def __call__(
        self,
        curvature_pass: CurvatureEngine,
        operator: str,
        *,
        square: bool,
        tol: float,
        max_matvecs: int,
        seed: int,
    ) -> TraceResult:
        """Estimate the trace.

        Args:
            curvature_pass: the analysis's pass (model, data, scope, cached graphs).
            operator: a registered operator name.
            square: estimate ``Tr(A^2)`` instead of ``tr(A)``.
            tol: the relative standard error to stop at.
            max_matvecs: the products allowed.
            seed: seeds the probes.

        Returns:
            The estimate with its standard error and per-layer traces.
        """
        ...


def trace_estimator(name: str) -> TraceEstimator:
    """The registered estimator ``name`` (a built-in's module is imported on first use).

    Args:
        name: the estimator.

    Returns:
        Its function.

    Raises:
        RegistryError: (a UsageError) an unknown name, listing the accepted ones.
    """
    return cast(TraceEstimator, ESTIMATORS.get(name, source="estimator"))


# the default of ``--estimator`` and ``Curvature.trace``, declared first
DEFAULT_ESTIMATOR = "hutchpp"


@declare(
    "estimator",
    DEFAULT_ESTIMATOR,
    "Hutch++: the top subspace exactly, Hutchinson on the rest",
    paper="Hutch++",
)
def hutchpp_trace(
    curvature_pass: CurvatureEngine,
    operator: str,
    *,
    square: bool,
    tol: float,
    max_matvecs: int,
    seed: int,
) -> TraceResult:
    """``tr(A)`` by Hutch++ ([Hutch++]); ``Tr(A^2)`` by Hutchinson on ``A^2`` ([FA] eq. 1).

    Args:
        curvature_pass: the analysis's pass.
        operator: a registered operator name.
        square: estimate ``Tr(A^2)`` instead.
        tol: the relative standard error to stop at.
        max_matvecs: the products allowed.
        seed: seeds the probes.

    Returns:
        The estimate.
    """
    op = build_operator(operator, curvature_pass)
    if square:
        return frobenius_sq(op, tol=tol, max_matvecs=max_matvecs, seed=seed)
    return hutchpp(op, tol=tol, max_matvecs=max_matvecs, seed=seed)


@declare(
    "estimator",
    "hutchinson",
    "Rademacher probes averaged until the standard error meets tol",
    paper="Hutchinson1989",
)
def hutchinson_trace(
    curvature_pass: CurvatureEngine,
    operator: str,
    *,
    square: bool,
    tol: float,
    max_matvecs: int,
    seed: int,
) -> TraceResult:
    """``tr(A) = E[g^T A g]`` over Rademacher probes ([Hutchinson1989]); ``Tr(A^2)`` likewise.

    Args:
        curvature_pass: the analysis's pass.
        operator: a registered operator name.
        square: estimate ``Tr(A^2) = E||A g||^2`` instead ([FA] eq. 1).
        tol: the relative standard error to stop at.
        max_matvecs: the products allowed.
        seed: seeds the probes.

    Returns:
        The estimate.
    """
    op = build_operator(operator, curvature_pass)
    if square:
        return frobenius_sq(op, tol=tol, max_matvecs=max_matvecs, seed=seed)
    return hutchinson(op, tol=tol, max_matvecs=max_matvecs, seed=seed)


@declare(
    "estimator",
    "gn-split",
    "tr(G) and tr(N) from shared probes, tr(H) their sum",
    paper="NME",
)
def gn_split(
    curvature_pass: CurvatureEngine,
    operator: str,
    *,
    square: bool,
    tol: float,
    max_matvecs: int,
    seed: int,
) -> TraceResult:
    """``tr(H) = tr(G) + tr(N)``: exact ``tr(G)`` plus Hutch++ on ``N`` ([NME] eq. 2).

    Args:
        curvature_pass: the analysis's pass.
        operator: the Hessian's name only.
        square: refused.
        tol: the standard error relative to ``tr(H)``.
        max_matvecs: the most NME products.
        seed: seeds the probes.

    Returns:
        The estimate (:func:`~sharpcli.curvature.ggn_trace.gn_split_trace`).

    Raises:
        UsageError: another operator, or ``square``.
    """
    if operator != HESSIAN or square:
        raise UsageError(
            "the gn-split estimator is for the Hessian trace (`operator=hessian`, no `square`)",
            source="estimator",
        )
    return gn_split_trace(curvature_pass, tol=tol, max_matvecs=max_matvecs, seed=seed)


@declare("estimator", "exact", "the trace of the Gauss-Newton matrix, exactly (small models)")
def exact_trace(
    curvature_pass: CurvatureEngine,
    operator: str,
    *,
    square: bool,
    tol: float,
    max_matvecs: int,
    seed: int,
) -> TraceResult:
    """The exact Gauss-Newton trace, C backward passes per batch (:func:`exact_ggn_trace`).

    Args:
        curvature_pass: the analysis's pass.
        operator: the Gauss-Newton matrix's name only.
        square: refused.
        tol: unused (the result is exact).
        max_matvecs: unused.
        seed: unused.

    Returns:
        The trace, with zero standard error.

    Raises:
        UsageError: another operator, or ``square``.
    """
    if operator != GGN or square:
        raise UsageError(
            "the exact estimator is for the Gauss-Newton trace (`operator=ggn`, no `square`)",
            source="estimator",
        )
    return exact_ggn_trace(curvature_pass.model, curvature_pass.data, curvature_pass.scope)
