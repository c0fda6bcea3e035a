"""The curvature operators (``--operator``) and trace estimators (``--estimator``).

Also the ``--operator`` help and docs table made from them.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from sharpcli.catalogue.index import DECLARED
from sharpcli.registry import Entry, Registry

__all__ = [
    "GGN",
    "HESSIAN",
    "NME",
    "DIAGONAL_ESTIMATORS",
    "ESTIMATORS",
    "OPERATORS",
    "entries_help",
    "operator_help",
    "operator_table",
]

# The parts of the split H = G + N ([NME] eq. 2), declared in sharpcli.curvature.operators.registry, for
# the torch-free modules (reports, the CLI) that name them
HESSIAN, GGN, NME = "hessian", "ggn", "nme"

# ``--operator NAME`` (sharpcli.curvature.operators.registry): the curvature operators, declared there.
# ``info``: the symbol in tables, whether the operator is positive semi-definite, and whether it
# is a part of the split H = G + N (which cannot be unregistered).
OPERATORS: Registry[Any] = Registry(
    "operator",
    source="operator",
    entries=DECLARED.get("operator", ()),
    protected=tuple(e.name for e in DECLARED.get("operator", ()) if e.info.get("split")),
    protected_reason="it is part of the H = G + N split",
    check="sharpcli.curvature.operators.registry:_as_spec",
)

# ``sharp trace --estimator NAME`` (sharpcli.curvature.trace.estimators, declared there), the
# default first
ESTIMATORS: Registry[Any] = Registry(
    "estimator", source="estimator", entries=DECLARED.get("estimator", ())
)

# ``sharp diagonal --estimator NAME`` (sharpcli.curvature.diagonal, declared there), the
# default first; ``info``: the operator each computes by default, and those it accepts (all
# when absent)
DIAGONAL_ESTIMATORS: Registry[Any] = Registry(
    "diagonal estimator", source="estimator", entries=DECLARED.get("diagonal estimator", ())
)


def entries_help(registry: Registry[Any]) -> str:
    """A registry's names with their summaries, as an option's help lists them.

    Args:
        registry: the kind.

    Returns:
        ``a (summary), b (summary) or c (summary)``, extensions included.

    >>> from sharpcli.registry import Entry
    >>> entries_help(Registry("toy", source="toy", entries=[Entry("a", "one"), Entry("b", "two")]))
    'a (one) or b (two)'
    """
    items = [f"{e.name} ({e.summary})" for e in registry.entries()]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def operator_help() -> str:
    """The ``--operator`` help: every operator with its symbol and description.

    Returns:
        ``hessian (H: Hessian of the loss), ggn (...) or nme (...)``, extensions included.
    """
    items = [f"{e.name} ({e.info['symbol']}: {e.summary})" for e in OPERATORS.entries()]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def operator_table(entries: Sequence[Entry] | None = None) -> str:
    """The docs' Markdown table of the operators (docs/commands/eigen.md).

    Args:
        entries: the records to list; default every registered operator, extensions included.

    Returns:
        The table.
    """
    rows = ["| `--operator` | symbol | what it is | PSD |", "|---|---|---|---|"]
    rows += [
        f"| `{e.name}` | {e.info['symbol']} | {e.summary} | {'yes' if e.info['psd'] else 'no'} |"
        for e in (OPERATORS.entries() if entries is None else entries)
    ]
    return "\n".join(rows)
