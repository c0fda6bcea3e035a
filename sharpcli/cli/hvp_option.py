"""``--hvp`` of ``sharp eigen``, ``trace`` and ``density``: how Hessian products are taken
(exact double backward, central differences of gradients, or those on a model sharded by FSDP2),
its check before the session loads, and the line that reports finite-difference products."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli import catalogue
from sharpcli.cli import common, runner

# --hvp fsdp: finite differences on the model sharded by FSDP2 (one option, one help line:
# eigen's and trace's help stay within 80 lines); checked by check (exit 2), not by click
HVP_CHOICES = (*catalogue.HVP_METHODS, "fsdp")
# left out: exact, or finite differences where --max-memory holds only their workspace
HvpOpt = Annotated[
    Optional[str],
    typer.Option(
        "--hvp",
        metavar="KIND",
        show_default=False,
        help="exact, finite-difference (if only it fits) or fsdp.",
    ),
]


def check(
    hvp: str | None, operator: str, engine: str, blocks, estimator=None
) -> tuple[str | None, bool]:
    """``--hvp`` as the library's ``(hvp, fsdp)``, checked against the other options before
    the session loads (``fsdp``: finite differences on the model sharded by FSDP2; left out:
    None, exact products or, where the budget holds only theirs, finite differences)."""
    # imports torch: kept out of start-up
    from sharpcli.analyses.hvp import check_hvp

    if hvp is None:
        return (None if blocks is None else catalogue.EXACT_HVP), False
    common.require(hvp in HVP_CHOICES, f"must be one of {', '.join(HVP_CHOICES)}", "--hvp")
    fsdp = hvp == "fsdp"
    hvp = catalogue.FINITE_DIFFERENCE if fsdp else hvp
    check_hvp(hvp, operator=operator, fsdp=fsdp, estimator=estimator, engine=engine)
    common.require(blocks is None or hvp == catalogue.EXACT_HVP, "needs --hvp exact", "--blocks")
    return hvp, fsdp


def print_products(console, results: dict, notes: bool = True) -> None:
    """One line on the finite-difference products and their error bound (none when exact),
    and with ``notes`` the run's notes (for the commands whose table shows none)."""
    record = results.get("hvp")
    if record is None:
        return
    for note in (results.get("notes") or []) if notes else []:
        runner.print_note(note)
    console.print(
        f"Hessian products by central differences ({record['gradients']} gradients"
        f"{', model sharded by FSDP' if record['sharded'] else ''}): step |h v| = "
        f"{record['step_norm']:.3g}, error bound |D v - H v| <= {record['error_bound']:.3g} |v| "
        f"({record['error_bound_relative']:.2g} of the largest |D u|)"
    )
