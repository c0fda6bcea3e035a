"""The curvature operators (``--operator``) and trace estimators (``--estimator``), and the
``--operator`` help and docs table made from them.

This module imports no torch.
"""

from __future__ import annotations

from sharpcli.registry import Entry, Registry

__all__ = ["DIAGONAL_ESTIMATORS", "ESTIMATORS", "OPERATORS", "operator_help", "operator_table"]

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
        Entry(
            "ef",
            "empirical Fisher (1/N) sum_i g_i g_i^T, data labels",
            "sharpcli.curvature.fisher:EmpiricalFisherOperator",
            paper="Kunstner2019",
            info={"symbol": "F_emp", "psd": True},
        ),
        Entry(
            "fisher",
            "Fisher with labels drawn from the model; its mean over draws is G",
            "sharpcli.curvature.fisher:FisherOperator",
            paper="Martens2020",
            info={"symbol": "F", "psd": True},
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
            "sharpcli.curvature.hutchpp:hutchpp",
            paper="Hutch++",
        ),
        Entry(
            "hutchinson",
            "Rademacher probes averaged until the standard error meets tol",
            "sharpcli.curvature.trace:hutchinson",
            paper="Hutchinson1989",
        ),
        Entry(
            "gn-split",
            "tr(G) and tr(N) from shared probes, tr(H) their sum",
            "sharpcli.curvature.split:gn_nme_split",
            paper="NME",
        ),
        Entry(
            "exact", "the trace of the dense matrix (small models)", "sharpcli.analyses.spectrum"
        ),
    ],
)

# ``sharp diagonal --estimator NAME`` (sharpcli.analyses.diagonal), the default first
DIAGONAL_ESTIMATORS: Registry = Registry(
    "diagonal estimator",
    source="estimator",
    entries=[
        Entry(
            "hutchinson",
            "mean of v * (A v) over Rademacher probes, per-entry standard errors",
            "sharpcli.curvature.diagonal:hutchinson_diagonal",
            paper="Bekas2007",
        ),
        Entry(
            "exact",
            "(A e_j)_j, one product per parameter (small scopes)",
            "sharpcli.curvature.diagonal:exact_diagonal",
        ),
        Entry(
            "gnb",
            "Sophia's Gauss-Newton-Bartlett B g^2 at sampled labels (ggn)",
            "sharpcli.curvature.diagonal:gnb_diagonal",
            paper="Sophia",
        ),
        Entry(
            "per-sample",
            "squared per-sample gradients: exact ggn (DiagGGN) or ef diagonal",
            "sharpcli.curvature.diagonal:per_sample_diagonal",
            paper="BackPACK",
        ),
    ],
)


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
