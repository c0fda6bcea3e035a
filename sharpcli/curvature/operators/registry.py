"""The curvature operators by name: ``--operator NAME`` -> :class:`OperatorSpec`.

:data:`OPERATORS` is the catalogue's registry of operators
(:data:`sharpcli.catalogue.OPERATORS`): each name's record there (a one-line description, its
symbol, whether it is positive semi-definite, the paper) is what ``--operator``'s help and the
docs' table list, and its :class:`OperatorSpec` here adds how to build it on a
:class:`~sharpcli.curvature.CurvatureEngine`. The analyses look operators up here
(:func:`build_operator`), so a built-in operator is its module plus its catalogue record, and
an extension ONE class and ONE :func:`register_operator` call (docs/architecture.md, "Adding a
curvature operator", works one through).

Built in, for the analysis loss ``L = (1/N) sum_i l(f(theta, x_i), y_i)``:

- ``hessian`` H = d^2 L / dtheta^2;
- ``ggn``     G = (1/N) sum_i J_i^T H_z,i J_i, the generalised Gauss-Newton matrix [Schraudolph2002];
- ``nme``     N = H - G, the nonlinear modelling error [NME] eq. 2.

``SPLIT`` names the three parts of ``H = G + N``, which ``sharp gn-nme`` estimates together
from shared probes (:mod:`sharpcli.curvature.trace.split`).

Paper keys resolve in docs/references.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from sharpcli import catalogue
from sharpcli.catalogue import operator_help, operator_table
from sharpcli.curvature.operators.hessian import GGNOperator, HessianOperator, NMEOperator
from sharpcli.losses import get_loss
from sharpcli.registry import Entry, declaration, declare

if TYPE_CHECKING:
    from sharpcli.curvature.operators.hessian import CurvatureEngine, CurvatureOperator

__all__ = [
    "GGN",
    "HESSIAN",
    "NME",
    "OPERATORS",
    "SPLIT",
    "OperatorRequest",
    "OperatorSpec",
    "build_operator",
    "operator_help",
    "operator_names",
    "operator_spec",
    "operator_table",
    "register_operator",
    "unregister_operator",
]

# the parts of the split H = G + N ([NME] eq. 2), in that order: the operators every curvature
# engine offers (CurvatureEngine.hessian/ggn/nme build them through OPERATORS), declared below;
# torch-free modules read them from the catalogue (sharpcli.catalogue.HESSIAN, ...)
HESSIAN, GGN, NME = "hessian", "ggn", "nme"
SPLIT = (HESSIAN, GGN, NME)


@dataclass(frozen=True)
class OperatorSpec:
    """What the code knows about one curvature operator.

    ``build(engine)`` returns the operator (a
    :class:`~sharpcli.curvature.CurvatureOperator` of size ``scope.numel``) sharing the engine's
    model, data, scope and cached graphs. ``symbol`` is its letter in tables (``"H"``);
    ``description`` one line for ``--help`` and the docs. ``psd``: positive semi-definite, so
    its smallest eigenvalue is >= 0 (negative Ritz values are rounding). ``rank_bound``, when
    known, maps ``(num_samples, num_outputs, loss)`` to a bound on the rank: below P it makes 0
    an eigenvalue that ``sharp eigen --which smallest|both`` notes.
    """

    name: str
    build: Callable[["CurvatureEngine"], "CurvatureOperator"]
    symbol: str
    description: str
    psd: bool
    rank_bound: Callable[[int, int, str], int] | None = None


OPERATORS = catalogue.OPERATORS


def _as_spec(entry: Entry, obj: object) -> OperatorSpec:
    """The registry's check: an :class:`OperatorSpec` as it is; a declared builder (a class or
    function taking the engine, resolved from the index or added with ``OPERATORS.add``) made
    into one from its record (its ``rank_bound`` attribute, if any, kept)."""
    if isinstance(obj, OperatorSpec):
        return obj
    if not callable(obj) or "symbol" not in entry.info or "psd" not in entry.info:
        raise OPERATORS.error(
            f"operator {entry.name!r}: a builder callable with a CurvatureEngine, declared with "
            "info={'symbol': ..., 'psd': ...}"
        )
    rank_bound = getattr(obj, "rank_bound", None)
    return OperatorSpec(
        entry.name, obj, entry.info["symbol"], entry.summary, bool(entry.info["psd"]), rank_bound
    )


def register_operator(
    name: str,
    build: Callable[["CurvatureEngine"], "CurvatureOperator"],
    *,
    symbol: str | None = None,
    description: str | None = None,
    psd: bool | None = None,
    rank_bound: Callable[[int, int, str], int] | None = None,
    replace: bool = False,
) -> OperatorSpec:
    """Make ``build`` available as ``--operator NAME`` (and to :func:`build_operator`).

    Args:
        name: a CLI value (lower case letters, digits and '-').
        build: called with the :class:`~sharpcli.curvature.CurvatureEngine` of the analysis; a
            class whose constructor takes that engine is a valid ``build``.
        symbol: its letter in tables; a built-in's comes from its catalogue record.
        description: one line for ``--help`` and the docs (whitespace is normalised); a
            built-in's comes from its catalogue record.
        psd: whether it is positive semi-definite; a built-in's comes from its record.
        rank_bound: ``(num_samples, num_outputs, loss) -> bound`` on the rank, if known.
        replace: replace an operator registered as ``name``.

    Returns:
        The operator's record.

    Raises:
        RegistryError: a name that is not a CLI value or is taken (unless ``replace``), a
            ``build`` that is not callable, or a record without symbol, description or psd.
    """
    declared = declaration(build)
    if declared is not None:  # a declared builder: its record gives what is not given
        symbol = declared[1].info["symbol"] if symbol is None else symbol
        description = declared[1].summary if description is None else description
        psd = declared[1].info["psd"] if psd is None else psd
    if symbol is None or description is None or psd is None:
        raise OPERATORS.error(f"operator {name!r}: give its symbol, description and psd")
    if not callable(build):
        raise OPERATORS.error(f"operator {name!r}: build must be callable with a CurvatureEngine")
    description = " ".join(description.split())
    entry = Entry(
        name,
        description,
        f"{build.__module__}:{build.__qualname__}",
        paper=declared[1].paper if declared else "",
        info={**(declared[1].info if declared else {}), "symbol": symbol, "psd": bool(psd)},
    )
    spec = OperatorSpec(name, build, symbol, description, bool(psd), rank_bound)
    return OPERATORS.register(name, spec, entry=entry, replace=replace)


def unregister_operator(name: str) -> OperatorSpec:
    """Remove an operator registered with :func:`register_operator`.

    The parts of ``H = G + N`` stay: ``sharp gn-nme`` and ``analyze`` need them.

    Args:
        name: the operator.

    Returns:
        Its record.

    Raises:
        RegistryError: a part of the split, or a name not registered.
    """
    return OPERATORS.unregister(name)


def operator_names() -> tuple[str, ...]:
    """The registered names, in registration order (the built-ins first)."""
    return OPERATORS.names()


def operator_spec(name: str, parameter: str = "operator") -> OperatorSpec:
    """The record of ``name``.

    Args:
        name: the operator.
        parameter: the caller's parameter that named it (the error's ``source``).

    Returns:
        Its :class:`OperatorSpec`.

    Raises:
        RegistryError: (a UsageError) an unknown name, listing the accepted ones.
    """
    return OPERATORS.get(name, source=parameter)


def build_operator(name: str, engine: "CurvatureEngine") -> "CurvatureOperator":
    """The operator ``name`` on ``engine`` (sharing its cache).

    Args:
        name: the operator.
        engine: the analysis's engine.

    Returns:
        The operator.

    Raises:
        RegistryError: (a UsageError) an unknown name.
    """
    return operator_spec(name).build(engine)


@dataclass(frozen=True)
class OperatorRequest:
    """A registered operator on an analysis's engine: what an estimator is asked about.

    The trace and diagonal estimators' requests
    (:class:`~sharpcli.curvature.trace.estimators.TraceRequest`,
    :class:`~sharpcli.curvature.diagonal.DiagonalRequest`) add their budgets.

    Attributes:
        engine: the analysis's engine (model, data, scope, cached graphs).
        operator: a registered operator name.
    """

    engine: "CurvatureEngine"
    operator: str

    def build(self) -> "CurvatureOperator":
        """The operator on the engine (:func:`build_operator`).

        Returns:
            The operator, sharing the engine's cached graphs.
        """
        return build_operator(self.operator, self.engine)


def _split(symbol: str, psd: bool) -> dict[str, object]:
    """The ``info`` of a part of ``H = G + N``: its symbol, PSD, and that it cannot be removed."""
    return {"symbol": symbol, "psd": psd, "split": True}


@declare("operator", HESSIAN, "Hessian of the loss", info={**_split("H", False), "default": True})
def build_hessian(engine: "CurvatureEngine") -> "CurvatureOperator":
    """``hessian``: H on the engine (``engine`` -> the operator)."""
    return HessianOperator(engine=engine)


@declare("operator", GGN, "Gauss-Newton J^T H_z J", paper="Schraudolph2002", info=_split("G", True))
def build_ggn(engine: "CurvatureEngine") -> "CurvatureOperator":
    """``ggn``: G on the engine (``engine`` -> the operator)."""
    return GGNOperator(engine=engine)


@declare("operator", NME, "nonlinear modelling error H - G", paper="NME", info=_split("N", False))
def build_nme(engine: "CurvatureEngine") -> "CurvatureOperator":
    """``nme``: N = H - G on the engine (``engine`` -> the operator)."""
    return NMEOperator(engine=engine)


def _ggn_rank_bound(num_samples: int, num_outputs: int, loss: str) -> int:
    # G = (1/N) sum_i J_i^T H_z,i J_i has rank <= N * rank(H_z) (Loss.logit_hessian_rank)
    return num_samples * get_loss(loss).logit_hessian_rank(num_outputs)


register_operator(HESSIAN, build_hessian)
register_operator(GGN, build_ggn, rank_bound=_ggn_rank_bound)
register_operator(NME, build_nme)
