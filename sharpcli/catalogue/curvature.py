"""The curvature operators (``--operator``) and trace estimators (``--estimator``), and the
``--operator`` help and docs table made from them.

This module imports no torch.
"""

from __future__ import annotations

from sharpcli.registry import Entry, Registry

__all__ = ["ESTIMATORS", "OPERATORS", "entries_help", "operator_help", "operator_table"]

# ``--operator NAME`` (sharpcli.curvature.registry): the curvature operators. ``info``: the
# symbol in tables and whether the operator is positive semi-definite.
OPERATORS: Registry = Registry(
    "operator",
    source="operator",
    entries=[
        Entry(
            "hessian",
            "Hessian of the loss",
            "sharpcli.curvature.registry:build_hessian",
            info={"symbol": "H", "psd": False},
        ),
        Entry(
            "ggn",
            "Gauss-Newton J^T H_z J",
            "sharpcli.curvature.registry:build_ggn",
            paper="Schraudolph2002",
            info={"symbol": "G", "psd": True},
        ),
        Entry(
            "nme",
            "nonlinear modelling error H - G",
            "sharpcli.curvature.registry:build_nme",
            paper="NME",
            info={"symbol": "N", "psd": False},
        ),
    ],
    protected=("hessian", "ggn", "nme"),
    protected_reason="it is part of the H = G + N split",
)

# ``sharp trace --estimator NAME`` (sharpcli.analyses.spectrum), the default first
ESTIMATORS: Registry = Registry(
    "estimator",
    source="estimator",
    entries=[
        Entry(
            "hutchpp",
            "Hutch++: the top subspace exactly, Hutchinson on the rest",
            "sharpcli.curvature.estimators:hutchpp_trace",
            paper="Hutch++",
        ),
        Entry(
            "hutchinson",
            "Rademacher probes averaged until the standard error meets tol",
            "sharpcli.curvature.estimators:hutchinson_trace",
            paper="Hutchinson1989",
        ),
        Entry(
            "gn-split",
            "tr(G) and tr(N) from shared probes, tr(H) their sum",
            "sharpcli.curvature.estimators:gn_split",
            paper="NME",
        ),
        Entry(
            "exact",
            "the trace of the Gauss-Newton matrix, exactly (small models)",
            "sharpcli.curvature.estimators:exact_trace",
        ),
    ],
)


def entries_help(registry: Registry) -> str:
    """A registry's names with their summaries, as an option's help lists them.

    Args:
        registry: the kind.

    Returns:
        ``a (summary), b (summary) or c (summary)``, extensions included.

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


def operator_table() -> str:
    """The docs' Markdown table of the operators (docs/commands/eigen.md).

    Returns:
        The table, extensions included.
    """
    rows = ["| `--operator` | symbol | what it is | PSD |", "|---|---|---|---|"]
    rows += [
        f"| `{e.name}` | {e.info['symbol']} | {e.summary} | {'yes' if e.info['psd'] else 'no'} |"
        for e in OPERATORS.entries()
    ]
    return "\n".join(rows)
