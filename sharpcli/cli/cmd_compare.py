"""``sharp compare REPORT.json...``: runs side by side (pandas), as a table, CSV, Markdown or JSON."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli.atomic import write_text_atomic
from sharpcli.catalogue.values import CSV
from sharpcli.cli import choices, common, lazyhelp, runner
from sharpcli.cli.group import app
from sharpcli.registry import declare
from sharpcli.report.envelope import environment_info, make_report
from sharpcli.report.tables import records_table

COMPARE = "compare"


@declare(
    "command",
    COMPARE,
    "Runs side by side in one table and plot.",
    info={"order": 13, "panel": "Options"},
)
@app.command(COMPARE, cls=lazyhelp.LazyHelpCommand)
def compare_command(
    reports: Annotated[
        list[str],
        typer.Argument(
            metavar="REPORT",
            help="One or more JSON reports written by sharp commands (--json), e.g. runs/*.json.",
        ),
    ],
    columns: Annotated[
        Optional[str],
        typer.Option(
            "--columns",
            metavar="COLUMN,...",
            help="Comma list of columns: canonical names (regularizers, test_accuracy, lambda_max, trace, frobenius_sq, nme_share, ...) or dotted report keys (results.hessian.trace_stderr, settings.lr).",
        ),
    ] = None,
    sort: Annotated[
        Optional[str],
        typer.Option(
            "--sort",
            metavar="[-]COLUMN",
            help="Column to sort by; prefix '-' for descending, e.g. --sort=-lambda_max.",
        ),
    ] = None,
    fmt: Annotated[
        choices.TableFormat, typer.Option("--format", help="Output format of the table.")
    ] = "table",
    out: Annotated[
        Optional[str],
        typer.Option(
            "--out",
            "-o",
            metavar="PATH",
            help="Write the CSV/Markdown/JSON table to PATH instead of stdout.",
        ),
    ] = None,
    plot: Annotated[
        Optional[str],
        typer.Option(
            "--plot",
            metavar="PATH",
            help="Write a PNG scatter of sharpness against accuracy (or, for runs without "
            "one, another measure) to PATH.",
        ),
    ] = None,
    plot_x: Annotated[
        Optional[str],
        typer.Option(
            "--plot-x",
            metavar="COLUMN",
            help="Column on the scatter's x axis (default: the first sharpness column the "
            "runs have: lambda_max, trace, ...).",
        ),
    ] = None,
    plot_y: Annotated[
        Optional[str],
        typer.Option(
            "--plot-y",
            metavar="COLUMN",
            help="Column on the y axis (default: test_accuracy, train_accuracy, else the next "
            "sharpness column).",
        ),
    ] = None,
    gap: Annotated[
        choices.GapKind,
        typer.Option(
            "--gap",
            help="Generalization gap of the Kendall tau table: test error - train error, or "
            "test loss - train loss.",
        ),
    ] = "error",
    axes: Annotated[
        Optional[str],
        typer.Option(
            "--axes",
            metavar="COLUMN,...",
            help="Hyper-parameter columns of the runs: left out of the measures, and the axes "
            "of Jiang et al.'s granulated tau.",
        ),
    ] = None,
    json_out: common.JsonOpt = None,
    quiet: common.QuietOpt = False,
    debug: common.DebugOpt = False,
) -> None:
    """Compare runs side by side: regularizer, accuracies, lambda_max, trace, Tr(H^2), NME share, ..."""

    def body() -> runner.Outcome:
        # kept out of sharp's start-up (--help, completion)
        from sharpcli.report.compare import (
            FORMATS,
            compare_table,
            difference_note,
            differences,
            render,
        )

        common.require(
            fmt in FORMATS, f"unknown format {fmt!r}; accepted: {', '.join(FORMATS)}", "--format"
        )
        common.check_output(out, "--out")
        common.check_output(plot)
        cols = [c.strip() for c in columns.split(",") if c.strip()] if columns else None
        frame = compare_table(list(reports), columns=cols, sort=sort)
        records = frame.astype(object).where(frame.notna(), None).to_dict(orient="records")
        text = render(frame, CSV if fmt == "table" else fmt)
        if out is not None:
            write_text_atomic(out, text)
        if plot is not None:
            # kept out of sharp's start-up (--help, completion)
            from sharpcli.report.plots import plot_compare_scatter, scatter_axes

            x, y = scatter_axes(records, plot_x, plot_y)
            plot_compare_scatter(records, plot, x=x, y=y)
        axis_list = [a.strip() for a in axes.split(",") if a.strip()] if axes else []
        kendall = _kendall(list(reports), records, gap, axis_list)
        results = {"rows": records, "columns": list(frame.columns)}
        results["differences"] = differences(list(reports))
        if kendall is not None:
            results["kendall"] = kendall
        report = make_report(
            COMPARE,
            settings={
                "reports": list(reports),
                "columns": cols,
                "sort": sort,
                "format": fmt,
                "out": out,
                "plot": plot,
            },
            results=results,
            environment=environment_info(),
        )

        def show(console):
            if out is not None:
                console.print(f"{len(records)} runs written to {out}")
            elif fmt == "table":
                console.print(records_table("runs", records, list(frame.columns)))
            else:
                console.file.write(text)
            if kendall is not None and fmt == "table" and out is None:
                _show_kendall(console, kendall)
            if fmt == "table" and out is None:
                for row in results["differences"]:
                    runner.print_note(difference_note(row))

        return runner.Outcome(report, show)

    runner.run_command(COMPARE, json_out, quiet, body, uses_models=False, debug=debug)


def _kendall(paths: list[str], records: list[dict], gap: str, axes: list[str]) -> dict | None:
    """Kendall's tau of every numeric column against the gap (``--gap``), when at least three
    runs have one; the train and test losses from each report's ``results.final``."""
    # kept out of sharp's start-up (--help, completion)
    from sharpcli.report.compare import read_report, run_names
    from sharpcli.report.rank_correlation import measure_correlations

    path_of = dict(zip(run_names(paths), paths))  # the rows may be sorted (--sort)
    joined = []
    for record in records:
        final = (read_report(path_of[record["run"]]).get("results") or {}).get("final") or {}
        losses = {k: final.get(k) for k in ("train_loss", "test_loss")}
        joined.append(record | {k: v for k, v in losses.items() if v is not None})
    found = measure_correlations(joined, gap=gap, axes=axes)
    return found if found["runs"] >= 3 and found["rows"] else None


def _show_kendall(console, kendall: dict) -> None:
    gap = "test error - train error" if kendall["gap"] == "error" else "test loss - train loss"
    columns = ["measure", "tau", "p_value", "runs"]
    if any("tau_noise_sd" in row for row in kendall["rows"]):
        columns.insert(2, "tau_noise_sd")
    if any("granulated" in row for row in kendall["rows"]):
        columns.append("granulated")
    console.print(
        records_table(
            f"Kendall's tau against the gap ({gap}), {kendall['runs']} runs",
            kendall["rows"],
            columns,
        )
    )
    for note in kendall["notes"]:
        runner.print_note(note)
