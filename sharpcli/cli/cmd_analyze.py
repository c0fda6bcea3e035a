"""``sharp analyze``: a chosen set of metrics in one report, and ``--fail-if`` CI gates."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli.cli import common
from sharpcli.cli.app import app
from sharpcli.cli.cmd_spectrum import CheckpointArg
from sharpcli.report.tables import key_value_table, records_table


@common.analysis_command(app, "analyze")
def analyze_command(
    opts: common.CommonOptions,
    checkpoint: CheckpointArg,
    metrics: Annotated[
        Optional[str],
        typer.Option(
            "--metrics",
            help="Comma list of eigen, trace, frobenius, gn-nme, activation-stats (default eigen,trace).",
        ),
    ] = None,
    fail_if: Annotated[
        Optional[list[str]],
        typer.Option(
            "--fail-if",
            help="Gate 'KEY OP NUMBER' on a result key, e.g. 'hessian.lambda_max > 500'; exit 1 when it holds. Repeatable.",
        ),
    ] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="Hessian eigenvalues to report.")] = 1,
    tol: Annotated[float, typer.Option("--tol", help="Relative standard error of traces.")] = 1e-2,
    eig_tol: Annotated[
        float, typer.Option("--eig-tol", help="Residual tolerance of eigenvalues.")
    ] = 1e-3,
    max_matvecs: Annotated[
        int, typer.Option("--max-matvecs", help="Budget per trace estimate.")
    ] = 1000,
    params: common.ParamsOpt = None,
) -> common.Outcome:
    """Several sharpness metrics in one report; with --fail-if, a CI gate (exit 1 when a condition holds)."""
    from sharpcli.analyses.analyze import analyze, analyze_report, parse_metrics
    from sharpcli.curvature.registry import SPLIT
    from sharpcli.report.gate import parse_gate

    chosen = parse_metrics(metrics)
    gates = [parse_gate(text) for text in (fail_if or [])]
    common.require(top_k >= 1, "must be at least 1", "--top-k")
    common.require(tol > 0, "must be > 0", "--tol")
    common.require(eig_tol > 0, "must be > 0", "--eig-tol")
    session = common.open_session(checkpoint, opts)
    with common.status(opts.quiet, f"analysing: {', '.join(chosen)}"):
        results, matvecs = analyze(
            session,
            chosen,
            top_k=top_k,
            tol=tol,
            eig_tol=eig_tol,
            max_matvecs=max_matvecs,
            params=params,
        )
    settings = opts.report_settings(
        skip=("checkpoint",), metrics=chosen, fail_if=[g.text for g in gates]
    )
    report, tripped = analyze_report(session, settings, results, matvecs, gates)
    verdicts = report["results"]["gates"]

    def render(console):
        flat = {"loss": results["loss"], "accuracy": results["accuracy"]}
        for group in SPLIT:  # the result groups named after the operators of H = G + N
            for k, v in (results.get(group) or {}).items():
                if not isinstance(v, (dict, list)):
                    flat[f"{group}.{k}"] = v
        if "nme_share" in results:
            flat["nme_share"] = results["nme_share"]
        console.print(key_value_table(f"sharpness of {checkpoint}", flat))
        if verdicts:
            console.print(
                records_table(
                    "gates",
                    [
                        {"condition": v["expr"], "value": v["value"], "tripped": v["tripped"]}
                        for v in verdicts
                    ],
                )
            )
            if tripped:
                console.print("[bold red]a --fail-if gate tripped: exit 1[/]")

    return common.Outcome(report, render, gate_tripped=tripped)
