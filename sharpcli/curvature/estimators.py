"""The trace estimators of ``sharp trace --estimator NAME``, each declared where it is defined.

A trace estimator is a function ``estimate(request) -> TraceResult``: the
:class:`TraceRequest` holds the analysis's pass (model, data, scope, cached graphs), the
registered operator to estimate (``request.build()`` makes it), whether ``Tr(A^2)`` is asked
instead of ``tr(A)``, and the budget (``tol``, ``max_matvecs``, ``seed``). Each is declared with
:func:`sharpcli.registry.declare` (kind ``"estimator"``); ``python -m sharpcli.catalogue.generate``
writes the declarations into the catalogue's index, and :data:`ESTIMATORS` (the catalogue's
registry) imports an estimator when it is first asked for, so ``sharp trace --estimator NAME``
and :meth:`sharpcli.api.Curvature.trace` reach a built-in and an extension
(``ESTIMATORS.add(fn)``) alike. The declaration order is the help's order; the first is the
default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, cast

from sharpcli import catalogue
from sharpcli.curvature.engine import CurvatureEngine
from sharpcli.curvature.ggn_trace import exact_ggn_trace, gn_split_trace
from sharpcli.curvature.hutchpp import hutchpp
from sharpcli.curvature.operators import CurvatureOperator
from sharpcli.curvature.probes import TraceResult
from sharpcli.curvature.registry import GGN, HESSIAN, build_operator
from sharpcli.curvature.trace import frobenius_sq, hutchinson
from sharpcli.errors import UsageError
from sharpcli.registry import declare

__all__ = [
    "DEFAULT_ESTIMATOR",
    "ESTIMATORS",
    "TraceEstimator",
    "TraceRequest",
    "exact_trace",
    "gn_split",
    "hutchinson_trace",
    "hutchpp_trace",
    "trace_estimator",
]

ESTIMATORS = catalogue.ESTIMATORS


@dataclass(frozen=True)
class TraceRequest:
    """What ``--estimator NAME`` is asked: ``tr(A)`` (or ``Tr(A^2)``) of a registered operator.

    Attributes:
        curvature_pass: the analysis's pass (model, data, scope, cached graphs).
        operator: a registered operator name.
        square: estimate ``Tr(A^2)`` instead of ``tr(A)``.
        tol: the relative standard error to stop at.
        max_matvecs: the products allowed.
        seed: seeds the probes.
    """

    curvature_pass: CurvatureEngine
    operator: str
    square: bool = False
    tol: float = 1e-2
    max_matvecs: int = 1000
    seed: int = 0

    def build(self) -> CurvatureOperator:
        """The operator on the pass (:func:`~sharpcli.curvature.registry.build_operator`).

        Returns:
            The operator, sharing the pass's cached graphs.
        """
        return build_operator(self.operator, self.curvature_pass)


# a trace estimator: the request -> the estimate with its standard error and per-layer traces
TraceEstimator = Callable[[TraceRequest], TraceResult]


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


def _probed(estimate: Callable[..., TraceResult], request: TraceRequest) -> TraceResult:
    """``estimate`` on the operator, or ``Tr(A^2)`` by Hutchinson on ``A^2`` ([FA] eq. 1)."""
    op, r = request.build(), request
    if r.square:
        return frobenius_sq(op, tol=r.tol, max_matvecs=r.max_matvecs, seed=r.seed)
    return estimate(op, tol=r.tol, max_matvecs=r.max_matvecs, seed=r.seed)


def _require(request: TraceRequest, operator: str, message: str) -> None:
    """A UsageError (``message``) unless ``request`` asks for tr(``operator``), not squared."""
    if request.operator != operator or request.square:
        raise UsageError(f"{message} (`operator={operator}`, no `square`)", source="estimator")


# the default of ``--estimator`` and ``Curvature.trace``, declared first
DEFAULT_ESTIMATOR = "hutchpp"


@declare(
    "estimator",
    DEFAULT_ESTIMATOR,
    "top subspace exactly, Hutchinson on the rest",
    paper="Hutch++",
)
def hutchpp_trace(request: TraceRequest) -> TraceResult:
    """``tr(A)`` by Hutch++ ([Hutch++]); ``Tr(A^2)`` by Hutchinson on ``A^2`` ([FA] eq. 1)."""
    return _probed(hutchpp, request)


@declare(
    "estimator",
    "hutchinson",
    "Rademacher probes until the stderr meets tol",
    paper="Hutchinson1989",
)
def hutchinson_trace(request: TraceRequest) -> TraceResult:
    """``tr(A) = E[g^T A g]`` over Rademacher probes ([Hutchinson1989]); ``Tr(A^2)`` likewise."""
    return _probed(hutchinson, request)


@declare(
    "estimator", "gn-split", "tr(G) and tr(N) from shared probes, tr(H) their sum", paper="NME"
)
def gn_split(request: TraceRequest) -> TraceResult:
    """``tr(H) = tr(G) + tr(N)``: exact ``tr(G)`` plus Hutch++ on ``N`` ([NME] eq. 2).

    Args:
        request: the operator and the budget (:class:`TraceRequest`).

    Returns:
        The estimate (:func:`~sharpcli.curvature.ggn_trace.gn_split_trace`).

    Raises:
        UsageError: another operator, or ``square``.
    """
    _require(request, HESSIAN, "the gn-split estimator is for the Hessian trace")
    r = request
    return gn_split_trace(r.curvature_pass, tol=r.tol, max_matvecs=r.max_matvecs, seed=r.seed)


@declare("estimator", "exact", "tr(G) exactly (small models)")
def exact_trace(request: TraceRequest) -> TraceResult:
    """The exact Gauss-Newton trace, C backward passes per batch (:func:`exact_ggn_trace`).

    Args:
        request: the operator and the budget (:class:`TraceRequest`).

    Returns:
        The trace, with zero standard error.

    Raises:
        UsageError: another operator, or ``square``.
    """
    _require(request, GGN, "the exact estimator is for the Gauss-Newton trace")
    cpass = request.curvature_pass
    return exact_ggn_trace(cpass.model, cpass.data, cpass.scope)
