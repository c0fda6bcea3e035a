"""``sharp diagonal``: the curvature's diagonal per parameter, as a ``.safetensors`` file."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli import catalogue
from sharpcli.catalogue.values import TRACE_KEY
from sharpcli.cli import choices, common, lazyhelp, runner
from sharpcli.cli.group import app
from sharpcli.registry import declare
from sharpcli.report.tables import key_value_table, records_table

DIAGONAL = "diagonal"


def _operator_help() -> str:
    return (
        f"{catalogue.operator_help()}. Default: hessian for exact and hutchinson, ggn for gnb "
        "and per-sample."
    )


@declare(
    "command",
    DIAGONAL,
    "The curvature's diagonal per parameter, as a .safetensors file.",
    paper="Bekas2007",
    info={"order": 6},
)
@common.analysis_command(app, DIAGONAL)
def diagonal_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    out: Annotated[
        str,
        typer.Option(
            "--out",
            metavar="PATH",
            help="Write the diagonal to PATH (.safetensors, or .npz for a PATH ending so; "
            "the model's parameter names and shapes).",
        ),
    ],
    operator: Annotated[
        Optional[str],
        typer.Option(
            "--operator",
            metavar=choices.metavar(catalogue.OPERATORS),
            autocompletion=choices.completer(catalogue.OPERATORS),
            help=lazyhelp.lazy_help(_operator_help),
        ),
    ] = None,
    estimator: Annotated[
        choices.DiagonalEstimator,
        typer.Option(
            "--estimator",
            help="hutchinson (Rademacher probes, per-entry standard errors), exact (one "
            "product per parameter), gnb (Sophia's Gauss-Newton-Bartlett, sampled labels) or "
            "per-sample (exact ggn, ef or fisher diagonal from per-sample gradients).",
        ),
    ] = catalogue.DIAGONAL_ESTIMATORS.names()[0],
    probes: Annotated[
        int,
        typer.Option("--probes", help="Rademacher probes (hutchinson) or label draws (gnb)."),
    ] = 100,
    max_products: Annotated[
        int,
        typer.Option(
            "--max-products",
            metavar="N",
            help="Products the exact estimator may spend (one per parameter), or backward "
            "passes per sample for per-sample (the loss's output directions).",
        ),
    ] = 10000,
    params: common.ParamsOpt = None,
) -> runner.Outcome:
    """Per-parameter diagonal of the Hessian, GGN or a Fisher, as .safetensors."""
    # imports torch: kept out of start-up
    from sharpcli.analyses.diagonal import diagonal, diagonal_writer

    common.require(probes >= 2, "must be at least 2 (standard errors need two)", "--probes")
    common.require(max_products >= 1, "must be at least 1", "--max-products")
    common.check_output(out, "--out")
    write = diagonal_writer(out)  # before the work: a .pt name is refused, not mislabelled
    session = common.open_session(checkpoint, opts)
    with common.progress_bar(opts.quiet, opts.json, "curvature diagonal"):
        results, tensors = diagonal(
            session,
            operator=operator,
            estimator=estimator,
            probes=probes,
            max_products=max_products,
            params=params,
        )
    metadata = {
        "operator": results["operator"],
        "estimator": results["estimator"],
        "checkpoint": str(checkpoint),
    }
    write(out, tensors, metadata)
    results["output"] = out
    settings = opts.report_settings(skip=("checkpoint",))
    report = session.report(DIAGONAL, settings, results, matvecs=results["matvecs"])

    def render(console):
        total = results[TRACE_KEY]
        console.print(
            key_value_table(
                f"diag({results['operator']}) by {results['estimator']}",
                {
                    "sum (trace)": total["sum"],
                    "stderr": total["sum_stderr"],
                    "sum of squares": total["sum_sq"],
                    "min": total["min"],
                    "max": total["max"],
                    "written": out,
                },
            )
        )
        rows = [
            {
                "parameter": b["name"],
                "sum": b["sum"],
                "± stderr": b["sum_stderr"],
                "sum_sq": b["sum_sq"],
                "min": b["min"],
                "max": b["max"],
            }
            for b in results["blocks"]
        ]
        console.print(records_table("per parameter tensor", rows, digits={"± stderr": 2}))
        for note in results.get("notes") or []:
            runner.print_note(note)

    return runner.Outcome(report, render)
