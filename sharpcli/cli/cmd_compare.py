"""``sharp compare REPORT.json...``: runs side by side (pandas), as a table, CSV, Markdown or JSON."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli.cli import choices, common, lazyhelp, runner
from sharpcli.cli.app import app


@app.command("compare", cls=lazyhelp.LazyHelpCommand)
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
    json_out: common.JsonOpt = None,
    quiet: common.QuietOpt = False,
    debug: common.DebugOpt = False,
) -> None:
    """Compare runs side by side: regularizer, accuracies, lambda_max, trace, Tr(H^2), NME share, ..."""

    def body() -> runner.Outcome:
        from sharpcli.atomic import write_text_atomic
        from sharpcli.report.compare import FORMATS, compare_table, render
        from sharpcli.report.envelope import environment_info, make_report
        from sharpcli.report.tables import records_table

        common.require(
            fmt in FORMATS, f"unknown format {fmt!r}; accepted: {', '.join(FORMATS)}", "--format"
        )
        common.check_output(out, "--out")
        common.check_output(plot)
        cols = [c.strip() for c in columns.split(",") if c.strip()] if columns else None
        frame = compare_table(list(reports), columns=cols, sort=sort)
        records = frame.astype(object).where(frame.notna(), None).to_dict(orient="records")
        text = render(frame, "csv" if fmt == "table" else fmt)
        if out is not None:
            write_text_atomic(out, text)
        if plot is not None:
            from sharpcli.report.plots import plot_compare_scatter, scatter_axes

            x, y = scatter_axes(records, plot_x, plot_y)
            plot_compare_scatter(records, plot, x=x, y=y)
        report = make_report(
            "compare",
            settings={
                "reports": list(reports),
                "columns": cols,
                "sort": sort,
                "format": fmt,
                "out": out,
                "plot": plot,
            },
            results={"rows": records, "columns": list(frame.columns)},
            environment=environment_info(),
        )

        def show(console):
            if out is not None:
                console.print(f"{len(records)} runs written to {out}")
            elif fmt == "table":
                console.print(records_table("runs", records, list(frame.columns)))
            else:
                console.file.write(text)

        return runner.Outcome(report, show)

    runner.run_command("compare", json_out, quiet, body, uses_models=False, debug=debug)
