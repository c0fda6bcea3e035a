"""``sharp sweep``: train and analyse over a grid of regularizer hyper-parameters and seeds."""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Optional

import typer

from sharpcli import catalogue
from sharpcli.catalogue.values import TRACE_KEY, TRAIN
from sharpcli.cli import choices, common, lazyhelp, runner
from sharpcli.cli.declared import with_options
from sharpcli.cli.group import app
from sharpcli.cli.train_options import SWEEP_OPTIONS, TrainOptions, regularizer_option
from sharpcli.registry import declare
from sharpcli.report.envelope import environment_info, make_report
from sharpcli.report.tables import records_table
from sharpcli.training.config import TrainConfig, validate_config

SWEEP = "sweep"

# the TrainConfig fields --set may set (the regularizers and the seed are the sweep's own)
_SETTABLE = tuple(f.name for f in fields(TrainConfig) if f.name not in ("regs", "seed"))


def _train_config(train: TrainOptions, sets: list[str] | None) -> TrainConfig:
    """The training configuration of every run: sweep's training options, then ``--set``."""
    cfg = train.config()
    given = set()
    for item in sets or []:
        if "=" not in item:
            raise common.UsageError(f"{item!r} is not KEY=VALUE", source="--set")
        key, raw = item.split("=", 1)
        if key not in _SETTABLE:
            raise common.UsageError(
                f"unknown training setting {key!r}; accepted: {', '.join(sorted(_SETTABLE))}",
                source="--set",
            )
        given.add(key)
        setattr(cfg, key, _set_value(raw, key))
    try:
        validate_config(cfg)
    except common.UsageError as err:  # a --set value: name --set and the key, not train's option
        if err.source in given:
            raise common.UsageError(f"{err.source}: {err.message}", source="--set") from None
        raise
    return cfg


def _set_value(raw: str, key: str):
    """The JSON value of ``--set KEY=RAW`` (nesting bounded), or RAW itself as a string."""
    # kept out of sharp's start-up (--help, completion)
    from sharpcli.bounded import JsonTooDeep, loads_json

    try:
        return loads_json(raw, max_depth=32)
    except JsonTooDeep as exc:
        raise common.UsageError(f"{key}: JSON {exc}", source="--set") from None
    except ValueError:  # not JSON (a plain word), or an integer too long to read
        return raw


@declare(
    "command",
    SWEEP,
    "Train and measure over a grid of regularizer settings and seeds.",
    info={"order": 14, "panel": "Sweep"},
)
@app.command(SWEEP, cls=lazyhelp.LazyHelpCommand)
@with_options(train=SWEEP_OPTIONS)
def sweep_command(
    *,
    reg: Annotated[
        str,
        regularizer_option(
            "--reg",
            "Regularizer whose settings are swept; fixed ones after the colon, e.g. "
            "--reg sam:rho=0.1.",
        ),
    ],
    grid: Annotated[
        list[str],
        typer.Option(
            "--grid",
            metavar="NAME=V1,V2,...",
            help="Values of one hyper-parameter; repeat for a product grid, e.g. --grid "
            "sigma=0.01,0.05,0.1.",
        ),
    ],
    seeds: Annotated[
        str,
        typer.Option(
            "--seeds", metavar="S,...", help="Comma list of training seeds, e.g. --seeds 0,1,2."
        ),
    ] = "0",
    extra_reg: Annotated[
        Optional[list[str]],
        regularizer_option(
            "--extra-reg", "Fixed regularizer of every run; repeatable, e.g. --extra-reg wd."
        ),
    ] = None,
    metrics: Annotated[
        str,
        typer.Option(
            "--metrics",
            metavar="NAME,...",
            autocompletion=choices.list_completer(catalogue.METRICS.names()),
            help="Analyses per run, as analyze --metrics.",
        ),
    ] = ",".join(catalogue.DEFAULT_METRICS),
    out_dir: Annotated[
        str,
        typer.Option(
            "--out-dir",
            metavar="DIR",
            help="Folder for checkpoints, reports, tables and the plot.",
        ),
    ] = "sweep",
    max_runs: Annotated[
        Optional[int],
        typer.Option(
            "--max-runs",
            metavar="N",
            help="Stop after N new runs (the same command continues).",
        ),
    ] = None,
    analyze_samples: Annotated[
        int,
        typer.Option(
            "--analyze-samples",
            help="Samples analysed per run (of the test split when there is one).",
        ),
    ] = 512,
    train: TrainOptions,
    sets: Annotated[
        Optional[list[str]],
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            rich_help_panel="Training",
            help="Any other training setting (a JSON value); repeatable, e.g. --set momentum=0.8.",
        ),
    ] = None,
    json_out: common.JsonOpt = None,
    quiet: common.QuietOpt = False,
    threads: common.ThreadsOpt = None,
    debug: common.DebugOpt = False,
) -> None:
    """Sweep a regularizer's hyper-parameters over seeds: train, analyse, tabulate, plot."""

    def body() -> runner.Outcome:
        # imports torch: kept out of start-up
        from sharpcli.training.sweep import parse_grid, run_sweep

        parsed_grid = parse_grid(grid)
        try:
            seed_list = [int(s) for s in seeds.split(",") if s.strip()]
        except ValueError:
            raise common.UsageError(
                f"{seeds!r} is not a comma list of integers", source="--seeds"
            ) from None
        # imports torch: kept out of start-up
        from sharpcli.preflight import check_seed

        for seed in seed_list:
            check_seed(seed, "--seeds")
        common.require(max_runs is None or max_runs >= 1, "must be at least 1", "--max-runs")
        common.require(analyze_samples >= 1, "must be at least 1", "--analyze-samples")
        cfg = _train_config(train, sets)
        with common.progress_bar(quiet, json_out, "sweep"):
            result = run_sweep(
                cfg,
                reg,
                parsed_grid,
                seed_list,
                out_dir,
                metrics=[m.strip() for m in metrics.split(",") if m.strip()],
                extra_regs=list(extra_reg or []),
                analyze_samples=analyze_samples,
                max_runs=max_runs,
            )
        settings = {
            "reg": reg,
            "grid": parsed_grid,
            "seeds": seed_list,
            "extra_regs": list(extra_reg or []),
            "metrics": metrics,
            "out_dir": out_dir,
            "max_runs": max_runs,
            TRAIN: cfg.to_dict(),
        }
        results = {
            "runs": result.runs,
            "summary": result.summary,
            "completed": result.completed,
            "skipped": result.skipped,
            "diverged": result.diverged,
            "tables": {
                "runs_csv": result.table_csv,
                "summary_csv": result.summary_csv,
                "summary_markdown": result.summary_markdown,
            },
            "plot": result.plot,
        }
        # kept out of sharp's start-up (--help, completion)
        from sharpcli.report.rank_correlation import measure_correlations

        # which measure predicts generalization over the runs ([Jiang2019]'s tau table)
        kendall = {
            gap: measure_correlations(result.runs, gap=gap, axes=list(parsed_grid))
            for gap in ("error", "loss")
        }
        results["kendall"] = kendall
        report = make_report(
            SWEEP,
            settings=settings,
            results=results,
            environment=environment_info(cfg.device, cfg.dtype),
        )

        def render(console):
            shown = (
                list(parsed_grid)
                + ["seeds"]
                + [
                    f"{k}_{s}"
                    for k in ("test_accuracy", "lambda_max", TRACE_KEY, "frobenius_sq")
                    for s in ("mean", "std")
                ]
            )
            console.print(
                records_table(
                    "sweep summary (over seeds)",
                    result.summary,
                    [c for c in shown if any(r.get(c) is not None for r in result.summary)],
                    key=len(parsed_grid),
                )
            )
            table = kendall["error"]
            if table["runs"] >= 3 and table["rows"]:
                console.print(
                    records_table(
                        f"Kendall's tau against test error - train error, {table['runs']} runs",
                        table["rows"],
                        [
                            c
                            for c in ("measure", "tau", "tau_noise_sd", "p_value", "runs")
                            if c != "tau_noise_sd" or any(c in r for r in table["rows"])
                        ]
                        + ["granulated"],
                    )
                )
                for note in table["notes"]:
                    runner.print_note(note)
            if result.diverged:
                console.print(
                    f"diverged (NaN/Inf in training, empty in the tables): {', '.join(result.diverged)}"
                )
            if not result.completed:
                console.print(
                    f"stopped after --max-runs {max_runs}; run the same command again to continue"
                )

        return runner.Outcome(report, render)

    runner.run_command(
        SWEEP, json_out, quiet, body, threads=threads, debug=debug, aliases=_set_aliases()
    )


def _set_aliases() -> dict[str, str]:
    """``--set`` for every training setting sweep has no option of (``--label-column``,
    ``--momentum``, ...) and for ``model_args`` (sweep sets model arguments with ``--width``,
    ``--depth``, ``--activation`` or ``--set model_args=...``); ``--seeds`` for ``--seed``."""
    own = {*(SWEEP_OPTIONS.names or ()), "regs"}
    return {name: "--set" for name in _SETTABLE if name not in own} | {"seed": "--seeds"}
