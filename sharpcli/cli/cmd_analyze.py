"""``sharp analyze``: a chosen set of metrics in one report, and ``--fail-if`` CI gates."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli import catalogue
from sharpcli.cli import choices, common, runner
from sharpcli.cli.group import app
from sharpcli.registry import declare
from sharpcli.report.tables import fmt, key_value_table, records_table

ANALYZE = "analyze"


@declare(
    "command",
    ANALYZE,
    "Several of these measures in one report; a gate for CI.",
    info={"order": 7},
)
@common.analysis_command(app, ANALYZE)
def analyze_command(
    opts: common.CommonOptions,
    checkpoint: common.CheckpointArg,
    metrics: Annotated[
        Optional[str],
        typer.Option(
            "--metrics",
            metavar="NAME,...",
            autocompletion=choices.list_completer(catalogue.METRICS.names()),
            help="Comma list, e.g. --metrics eigen,trace,gn-nme (default: eigen,trace).",
        ),
    ] = None,
    fail_if: Annotated[
        Optional[list[str]],
        typer.Option(
            "--fail-if",
            metavar="'KEY OP NUMBER'",
            help="Gate on a result key, exit 1 when it holds; repeat for several, e.g. "
            "--fail-if 'hessian.lambda_max > 500' --fail-if 'hessian.trace > 1e4'.",
        ),
    ] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="Hessian eigenvalues to report.")] = 1,
    tol: Annotated[
        float,
        typer.Option(
            "--trace-tol",
            "--tol",
            help="Stop each trace at this relative standard error (--tol: former name).",
        ),
    ] = 1e-2,
    eig_tol: Annotated[
        float,
        typer.Option(
            "--eig-tol",
            help="Converged when ||A u - lambda u|| <= tol |lambda|.",
        ),
    ] = 1e-3,
    max_matvecs: common.TraceMaxMatvecsOpt = 1000,
    params: common.ParamsOpt = None,
) -> runner.Outcome:
    """Several sharpness metrics in one report; with --fail-if, a CI gate (exit 1 when a condition holds)."""
    # imports torch: kept out of start-up
    from sharpcli.analyses.analyze import analyze, analyze_report, parse_metrics, table_rows
    from sharpcli.report.gate import parse_gate

    chosen = parse_metrics(metrics)
    gates = [parse_gate(text) for text in (fail_if or [])]
    _check_gate_keys(gates, chosen)  # a typo costs nothing: before the checkpoint is read
    common.require(top_k >= 1, "must be at least 1", "--top-k")
    common.require(tol > 0, "must be > 0", "--trace-tol")
    common.require(eig_tol > 0, "must be > 0", "--eig-tol")
    session = common.open_session(checkpoint, opts)
    with common.progress_bar(opts.quiet, opts.json, f"analysing: {', '.join(chosen)}"):
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
        console.print(key_value_table(f"sharpness of {checkpoint}", table_rows(results)))
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
        for note in results.get("notes") or []:
            runner.print_note(note)

    notice = None
    if tripped:  # one line on stderr, even under --quiet or --json -
        held = [f"{v['expr']} (value {fmt(v['value'])})" for v in verdicts if v["tripped"]]
        notice = f"--fail-if tripped: {'; '.join(held)}: exit 1"
    return runner.Outcome(report, render, gate_tripped=tripped, notice=notice)


def _check_gate_keys(gates, chosen: list[str]) -> None:
    """Every gate's key must be one this run reports (``result_keys`` of the chosen metrics);
    a key of another metric names the ``--metrics`` that adds it."""
    # imports torch: kept out of start-up
    from sharpcli.analyses.analyze import METRICS, REPORT_KEYS, result_keys
    from sharpcli.report.gate import check_keys

    available = [*result_keys(""), *(k for m in chosen for k in result_keys(m)), *REPORT_KEYS]
    elsewhere: dict[str, str] = {}
    for metric in METRICS:
        for key in result_keys(metric) if metric not in chosen else ():
            if key not in available:
                elsewhere.setdefault(key, f"--metrics {','.join([*chosen, metric])}")
    check_keys(gates, available, elsewhere)
