"""The curvature operators by name: ``--operator NAME`` -> :class:`OperatorSpec`.

Everything the rest of the code knows about an operator is its record here: how to build it
on a :class:`~sharpcli.curvature.CurvaturePass`, its symbol, a one-line description (the
``--operator`` help and the docs table are made from these) and whether it is positive
semi-definite. The analyses look operators up here (:func:`build_operator`), so an operator
is added by ONE class and ONE :func:`register_operator` call (docs/architecture.md, "Adding a
curvature operator", works one through).

Built in, for the analysis loss ``L = (1/N) sum_i l(f(theta, x_i), y_i)``:

- ``hessian`` H = d^2 L / dtheta^2;
- ``ggn``     G = (1/N) sum_i J_i^T H_z,i J_i, the generalised Gauss-Newton matrix [Schraudolph2002];
- ``nme``     N = H - G, the nonlinear modelling error [NME] eq. 2.

``SPLIT`` names the three parts of ``H = G + N``, which ``sharp gn-nme`` estimates together
from shared probes (:mod:`sharpcli.curvature.split`).

Paper keys resolve in docs/references.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from sharpcli.errors import UsageError

if TYPE_CHECKING:
    from sharpcli.curvature.operators import CurvatureOperator, CurvaturePass

__all__ = [
    "GGN",
    "HESSIAN",
    "NME",
    "OPERATORS",
    "SPLIT",
    "OperatorSpec",
    "build_operator",
    "operator_help",
    "operator_names",
    "operator_spec",
    "operator_table",
    "register_operator",
    "unregister_operator",
]

HESSIAN, GGN, NME = "hessian", "ggn", "nme"
SPLIT = (HESSIAN, GGN, NME)  # H = G + N ([NME] eq. 2), in that order

_NAME = re.compile(r"[a-z][a-z0-9-]*\Z")  # spelled as a CLI value: lower case, digits, '-'


@dataclass(frozen=True)
class OperatorSpec:
    """What the code knows about one curvature operator.

    ``build(curvature_pass)`` returns the operator (a
    :class:`~sharpcli.curvature.CurvatureOperator` of size ``scope.numel``) sharing the pass's
    model, data, scope and cached graphs. ``symbol`` is its letter in tables (``"H"``);
    ``description`` one line for ``--help`` and the docs. ``psd``: positive semi-definite, so
    its smallest eigenvalue is >= 0 (negative Ritz values are rounding). ``rank_bound``, when
    known, maps ``(num_samples, num_outputs, loss)`` to a bound on the rank: below P it makes 0
    an eigenvalue that ``sharp eigen --which smallest|both`` notes.
    """

    name: str
    build: Callable[["CurvaturePass"], "CurvatureOperator"]
    symbol: str
    description: str
    psd: bool
    rank_bound: Callable[[int, int, str], int] | None = None


OPERATORS: dict[str, OperatorSpec] = {}


def register_operator(
    name: str,
    build: Callable[["CurvaturePass"], "CurvatureOperator"],
    *,
    symbol: str,
    description: str,
    psd: bool,
    rank_bound: Callable[[int, int, str], int] | None = None,
    replace: bool = False,
) -> OperatorSpec:
    """Make ``build`` available as ``--operator NAME`` (and to :func:`build_operator`).

    ``build`` is called with the :class:`~sharpcli.curvature.CurvaturePass` of the analysis; a
    class whose constructor takes that pass is a valid ``build``. Raises ``ValueError`` for a
    name that is not a CLI value (lower case, digits and '-') or is taken (unless ``replace``).
    """
    if not _NAME.match(name):
        raise ValueError(f"operator name {name!r}: use lower case letters, digits and '-'")
    if name in OPERATORS and not replace:
        raise ValueError(f"operator {name!r} is already registered (pass replace=True)")
    if not callable(build):
        raise ValueError(f"operator {name!r}: build must be callable with a CurvaturePass")
    spec = OperatorSpec(name, build, symbol, " ".join(description.split()), bool(psd), rank_bound)
    OPERATORS[name] = spec
    return spec


def unregister_operator(name: str) -> OperatorSpec:
    """Remove an operator registered with :func:`register_operator`; returns its record.

    The parts of ``H = G + N`` stay: ``sharp gn-nme`` and ``analyze`` need them.
    """
    if name in SPLIT:
        raise ValueError(f"operator {name!r} is part of the H = G + N split and cannot be removed")
    if name not in OPERATORS:
        raise ValueError(f"operator {name!r} is not registered")
    return OPERATORS.pop(name)


def operator_names() -> tuple[str, ...]:
    """The registered names, in registration order (the built-ins first)."""
    return tuple(OPERATORS)


def operator_spec(name: str, parameter: str = "operator") -> OperatorSpec:
    """The record of ``name``; ``UsageError(source=parameter)`` (the caller's parameter that
    named it) listing the accepted names if none."""
    spec = OPERATORS.get(name)
    if spec is None:
        raise UsageError(
            f"unknown value {name!r}; accepted: {', '.join(operator_names())}", source=parameter
        )
    return spec


def build_operator(name: str, curvature_pass: "CurvaturePass") -> "CurvatureOperator":
    """The operator ``name`` on ``curvature_pass`` (sharing its cache); UsageError if unknown."""
    return operator_spec(name).build(curvature_pass)


def operator_help() -> str:
    """The ``--operator`` help: every name with its symbol and description."""
    items = [f"{s.name} ({s.symbol}: {s.description})" for s in OPERATORS.values()]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def operator_table() -> str:
    """The docs' Markdown table of the registered operators (docs/commands/eigen.md)."""
    rows = ["| `--operator` | symbol | what it is | PSD |", "|---|---|---|---|"]
    rows += [
        f"| `{s.name}` | {s.symbol} | {s.description} | {'yes' if s.psd else 'no'} |"
        for s in OPERATORS.values()
    ]
    return "\n".join(rows)


def _ggn_rank_bound(num_samples: int, num_outputs: int, loss: str) -> int:
    # G = (1/N) sum_i J_i^T H_z,i J_i has rank <= N * rank(H_z): C - 1 for cross-entropy (its
    # H_z = diag(p) - p p^T annihilates the all-ones vector), C for mse.
    return num_samples * max(1, num_outputs - (1 if loss == "cross-entropy" else 0))


register_operator(
    HESSIAN,
    lambda curvature_pass: curvature_pass.hessian(),
    symbol="H",
    description="Hessian of the loss",
    psd=False,
)
register_operator(
    GGN,
    lambda curvature_pass: curvature_pass.ggn(),
    symbol="G",
    description="Gauss-Newton J^T H_z J",
    psd=True,
    rank_bound=_ggn_rank_bound,
)
register_operator(
    NME,
    lambda curvature_pass: curvature_pass.nme(),
    symbol="N",
    description="nonlinear modelling error H - G",
    psd=False,
)
