"""The trace estimators of ``sharp trace --estimator NAME``, each declared where it is defined.

A trace estimator is a function ``estimate(request) -> TraceResult``: the
:class:`TraceRequest` holds the analysis's engine (model, data, scope, cached graphs), the
registered operator to estimate (``request.build()`` makes it), whether ``Tr(A^2)`` is asked
instead of ``tr(A)``, and the budget (``tol``, ``max_matvecs``, ``seed``). Each is declared with
:func:`sharpcli.registry.declare` (kind ``"estimator"``) beside its implementation:
``hutchpp`` (the default) in :mod:`sharpcli.curvature.trace.hutchpp`, ``hutchinson`` in
:mod:`sharpcli.curvature.trace.hutchinson`, ``gn-split`` in :mod:`sharpcli.curvature.trace.ggn`,
``exact`` in :mod:`sharpcli.curvature.trace.exact`. ``python -m sharpcli.catalogue.generate`` writes the
declarations into the catalogue's index, and :data:`ESTIMATORS` (the catalogue's registry)
imports an estimator when it is first asked for, so ``sharp trace --estimator NAME`` and
:meth:`sharpcli.api.Curvature.trace` reach a built-in and an extension (``ESTIMATORS.add(fn)``)
alike. The index's order (each declares its place, ``info={"order": n}``) is the help's
order; the first is the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, cast

from sharpcli import catalogue
from sharpcli.curvature.operators.registry import OperatorRequest
from sharpcli.curvature.trace.hutchpp import HUTCHPP
from sharpcli.curvature.trace.probes import TraceResult

__all__ = [
    "DEFAULT_ESTIMATOR",
    "ESTIMATORS",
    "TraceEstimator",
    "TraceRequest",
    "trace_estimator",
]

ESTIMATORS = catalogue.ESTIMATORS
# the default of ``--estimator`` and ``Curvature.trace``, declared first
DEFAULT_ESTIMATOR = HUTCHPP


@dataclass(frozen=True)
class TraceRequest(OperatorRequest):
    """What ``--estimator NAME`` is asked: ``tr(A)`` (or ``Tr(A^2)``) of a registered operator.

    Attributes:
        square: estimate ``Tr(A^2)`` instead of ``tr(A)``.
        tol: the relative standard error to stop at.
        max_matvecs: the products allowed.
        seed: seeds the probes.
    """

    square: bool = False
    tol: float = 1e-2
    max_matvecs: int = 1000
    seed: int = 0


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
