"""``sharp train``: train a model under any combination of sharpness regularizers."""

from __future__ import annotations

from sharpcli.cli import common, lazyhelp, runner
from sharpcli.cli.declared import with_options
from sharpcli.cli.group import app
from sharpcli.cli.train_options import TrainOptions
from sharpcli.errors import EXIT_NUMERICAL
from sharpcli.registry import declare
from sharpcli.report.tables import FitTable, fmt, records_table

TRAIN = "train"


@declare(
    "command",
    TRAIN,
    "Train a model, optionally under a sharpness regularizer.",
    info={
        "order": 1,
        "panel": "Training",
        "reports_regularizers": True,
    },
)
@app.command(TRAIN, cls=lazyhelp.LazyHelpCommand)
@with_options(opts=TrainOptions)
def train_command(opts: TrainOptions) -> None:
    """Train a model, optionally under sharpness regularizers; write a checkpoint."""
    stop_on_divergence = opts.stop_on_divergence or opts.stop_diverged

    def body() -> runner.Outcome:
        # imports torch: kept out of start-up
        from sharpcli.analyses.tracking import check_tracked, make_tracker
        from sharpcli.report.plots import plot_training_history
        from sharpcli.training.loop import train, train_report

        common.check_output(opts.plot)
        cfg = opts.config()
        tracked = cfg.track
        check_tracked(tracked)
        tracker = make_tracker(tracked, seed=cfg.seed) if tracked else None
        with common.progress_bar(opts.quiet, opts.json, "training"):
            result = train(
                cfg,
                opts.out,
                resume=opts.resume,
                stop_after=opts.stop_after,
                tracker=tracker,
                max_memory=opts.max_memory,
                stop_on_divergence=stop_on_divergence,
            )
        runner.print_notes(result.notes, opts.quiet)  # also in the report's data.notes
        if opts.plot is not None:
            plot_training_history(
                result.history,
                opts.plot,
                title=_plot_title(opts.model_factory or opts.model, result.config["regs"]),
                tracked=result.tracked if _per_step(result.config) else None,
            )
        report = train_report(
            result,
            {
                "resume": opts.resume,
                "stop_after": opts.stop_after,
                "stop_on_divergence": stop_on_divergence,
                "plot": opts.plot,
            },
            out=opts.out,
            device=opts.device,
            dtype=opts.dtype,
        )
        return runner.Outcome(
            report,
            render=lambda console: _render(console, result),
            notice=_divergence_warning(result),
            exit_code=EXIT_NUMERICAL if result.stopped_on_divergence else None,
        )

    # the library names subset sizes `samples`: here they are --track-samples
    aliases = {"samples": "--track-samples"}
    runner.run_command(
        TRAIN,
        opts.json,
        opts.quiet,
        body,
        threads=opts.threads,
        debug=opts.debug,
        aliases=aliases,
    )


# The history's columns with their headers, short enough for one table at 80 columns.
_HISTORY = {
    "epoch": "epoch",
    "train_loss": "train loss",
    "train_accuracy": "train acc",
    "test_loss": "test loss",
    "test_accuracy": "test acc",
    "grad_evals": "grad evals",
    "seconds": "seconds",
}


def _divergence_warning(result) -> str | None:
    """The warning line of a diverged run (None otherwise)."""
    d = result.divergence
    if d is None:
        return None
    kept = (
        f"stopped; {result.checkpoint['path']} holds epoch {d['best_epoch']}, the lowest "
        "training loss"
        if result.stopped_on_divergence
        else "--stop-on-divergence stops such a run and keeps its best epoch"
    )
    return f"warning: training diverged at epoch {d['epoch']}: {d['reason']}; {kept}"


def _per_step(config: dict) -> bool:
    """Whether the run tracked curvature per step (``--track-every Nsteps``)."""
    # imports torch: kept out of start-up
    from sharpcli.training.config import parse_track_every

    return parse_track_every(config["track_every"])[1] == "steps"


def _plot_title(model: str, regs: list[str]) -> str:
    named = [r for r in regs if r != "none"]
    return f"{model}, " + (f"regularized by {' + '.join(named)}" if named else "no regularizer")


# Under the history: why its train columns differ from the final table's.
HISTORY_NOTE = (
    "train loss and acc: running means over each epoch's steps (the model changes as it "
    "trains); final model: the trained model evaluated on the whole training and test sets."
)


def history_title(regularizers: list[dict]) -> str:
    """``training history: ad:sigma=0.1 + sam:rho=0.05`` (``no regularizer`` for none)."""
    specs = [r["spec"] for r in regularizers if r.get("spec") not in (None, "none")]
    return "training history: " + (" + ".join(specs) if specs else "no regularizer")


# the last rows of per-step tracking shown under the history (all in results.tracked and
# the tracked CSV)
TRACKED_SHOWN = 5


def _render_tracked(console, result) -> None:
    """The last :data:`TRACKED_SHOWN` rows of per-step tracking, and where the others are."""
    rows = result.tracked[-TRACKED_SHOWN:]
    columns = list(dict.fromkeys(k for row in rows for k in row if k != "epoch"))
    console.print(
        records_table(
            f"tracked steps: the last {len(rows)} of {len(result.tracked)}", rows, columns
        )
    )
    console.print(
        f"every tracked step: results.tracked and {result.tracked_csv}",
        markup=False,
        highlight=False,
    )


def _render(console, result) -> None:
    tracked_keys = sorted({k for row in result.history for k in (row.get("tracked") or {})})
    penalty_names = list(
        dict.fromkeys(k for row in result.history for k in (row.get("penalties") or {}))
    )
    penalties = {f"penalty:{name}": f"{name} penalty" for name in penalty_names}
    rows = [
        row
        | (row.get("tracked") or {})
        | {f"penalty:{k}": v for k, v in (row.get("penalties") or {}).items()}
        for row in result.history
    ]
    console.print(
        records_table(
            history_title(result.regularizers),
            rows,
            [*_HISTORY, *penalties, *tracked_keys],
            digits={"seconds": 3},
            headers=_HISTORY | penalties,
        )
    )
    console.print(HISTORY_NOTE, markup=False, highlight=False)
    if result.tracked and _per_step(result.config):
        _render_tracked(console, result)
    final = [(k, v) for k, v in result.final.items()]
    final += [
        ("checkpoint", result.checkpoint["path"]),
        ("sha256", result.checkpoint["sha256"][:16] + "…"),
    ]
    console.print(
        FitTable(
            "final model",
            ["metric", "value"],
            [[k, fmt(v)] for k, v in final],
            justify=["left", "right"],
        )
    )
