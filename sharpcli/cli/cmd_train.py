"""``sharp train``: train a model under any combination of sharpness regularizers."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli import catalogue
from sharpcli.cli import choices, common, lazyhelp, runner
from sharpcli.cli.app import app
from sharpcli.errors import EXIT_NUMERICAL
from sharpcli.report.tables import FitTable, fmt, records_table

# The token loss a sequence model trains on (sharpcli.losses.token_reduction): one line of help
TrainTokenReductionOpt = Annotated[
    choices.TokenReduction,
    typer.Option("--token-reduction", metavar="MODE", rich_help_panel="Data", help="Token CE."),
]
PrecisionOpt = Annotated[
    choices.Precision,
    typer.Option("--precision", metavar="MODE", rich_help_panel="Run", help="Autocast."),
]
AscentSyncOpt = Annotated[
    choices.AscentSync,
    typer.Option(
        "--ascent-sync", metavar="MODE", rich_help_panel="Run", help="Torchrun SAM ascent."
    ),
]
StopOnDivergenceOpt = Annotated[
    bool,
    typer.Option("--stop-on-divergence", help="On divergence: stop, keep the best epoch, exit 3."),
]
# its first spelling, still accepted, left out of --help
StopDivergedOpt = Annotated[
    bool, typer.Option("--stop-diverged", hidden=True, help="As --stop-on-divergence.")
]


@app.command("train", cls=lazyhelp.LazyHelpCommand)
def train_command(
    model: Annotated[
        choices.Model, typer.Option("--model", rich_help_panel="Model", help="Built-in model.")
    ] = "mlp",
    depth: Annotated[
        Optional[int],
        typer.Option(
            "--depth",
            rich_help_panel="Model",
            help="Hidden layers (mlp) or depth (resnet: 20, 56).",
        ),
    ] = None,
    width: Annotated[
        Optional[int],
        typer.Option(
            "--width", rich_help_panel="Model", help="Hidden width (mlp) or base channels."
        ),
    ] = None,
    activation: common.ActivationOpt = None,
    model_args: Annotated[
        Optional[str],
        typer.Option(
            "--model-args",
            "--arch-args",
            metavar="JSON",
            rich_help_panel="Model",
            help="Model keyword arguments (or --arch-args).",
        ),
    ] = None,
    model_factory: Annotated[
        Optional[str],
        typer.Option(
            "--model-factory",
            metavar="MODULE:FUNCTION",
            rich_help_panel="Model",
            help="Function returning your nn.Module, instead of --model.",
        ),
    ] = None,
    output: common.OutputOpt = None,
    penultimate: Annotated[
        Optional[str],
        typer.Option(
            "--penultimate",
            metavar="MODULE",
            rich_help_panel="Model",
            help="Module ad penalises (default: the last Linear).",
        ),
    ] = None,
    data: Annotated[
        str,
        typer.Option(
            "--data",
            metavar="SPEC",
            rich_help_panel="Data",
            help="blobs[:k=v,..], images[:k=v,..] or a path (tensor file, .csv, .parquet, "
            "CIFAR or MNIST folder), e.g. --data images:n=2000.",
        ),
    ] = "blobs",
    label_column: common.LabelColumnOpt = None,
    x_key: common.XKeyOpt = None,
    y_key: common.YKeyOpt = None,
    shift_labels: common.ShiftLabelsOpt = None,
    token_reduction: TrainTokenReductionOpt = "tokens",
    epochs: Annotated[
        int, typer.Option("--epochs", rich_help_panel="Training", help="Training epochs.")
    ] = 5,
    batch_size: Annotated[
        int, typer.Option("--batch-size", rich_help_panel="Training", help="Minibatch size.")
    ] = 64,
    optimizer: Annotated[
        choices.Optimizer,
        typer.Option("--optimizer", rich_help_panel="Training", help="Optimizer."),
    ] = "sgd",
    lr: Annotated[
        float, typer.Option("--lr", rich_help_panel="Training", help="Learning rate.")
    ] = 0.05,
    momentum: Annotated[
        float, typer.Option("--momentum", rich_help_panel="Training", help="SGD momentum.")
    ] = 0.9,
    schedule: Annotated[
        choices.Schedule,
        typer.Option("--schedule", rich_help_panel="Training", help="Learning-rate schedule."),
    ] = "constant",
    label_noise: Annotated[
        float,
        typer.Option(
            "--label-noise",
            rich_help_panel="Data",
            help="Fraction of labels flipped.",
        ),
    ] = 0.0,
    augment: Annotated[
        bool,
        typer.Option(
            "--augment",
            rich_help_panel="Data",
            help="Random crop and flip of images.",
        ),
    ] = False,
    input_noise: Annotated[
        float,
        typer.Option("--input-noise", rich_help_panel="Data", help="Std of Gaussian input noise."),
    ] = 0.0,
    mask_ratio: Annotated[
        Optional[float],
        typer.Option(
            "--mask-ratio",
            rich_help_panel="Model",
            help="Fraction of activations zeroed (MAN Table 1).",
        ),
    ] = None,
    per_sample_norm: Annotated[
        bool,
        typer.Option(
            "--per-sample-norm",
            rich_help_panel="Model",
            help="Per-sample normalisation (MAN 5.1).",
        ),
    ] = False,
    repeat_batch: Annotated[
        int,
        typer.Option(
            "--repeat-batch",
            rich_help_panel="Training",
            help="Steps on each batch (MAN Table 2).",
        ),
    ] = 1,
    noise_finetune: Annotated[
        float,
        typer.Option(
            "--noise-finetune",
            rich_help_panel="Training",
            help="Last-epoch noise std (MAN Tab. 4).",
        ),
    ] = 0.0,
    reg: Annotated[
        Optional[list[str]],
        typer.Option(
            "--reg",
            metavar=choices.metavar(catalogue.REGULARIZERS, params=True),
            autocompletion=choices.completer(catalogue.REGULARIZERS),
            rich_help_panel="Training",
            help="Regularizer, e.g. sam:rho=0.05; repeat to combine.",
        ),
    ] = None,
    out: Annotated[
        str,
        typer.Option(
            "--out",
            "-o",
            metavar="PATH",
            rich_help_panel="Output",
            help="Checkpoint to write (.safetensors).",
        ),
    ] = "model.safetensors",
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            rich_help_panel="Run",
            help="Continue an interrupted run of the same options.",
        ),
    ] = False,
    stop_after: Annotated[
        Optional[int],
        typer.Option(
            "--stop-after",
            metavar="N",
            rich_help_panel="Run",
            help="Stop after epoch N, as if interrupted.",
        ),
    ] = None,
    stop_on_divergence: StopOnDivergenceOpt = False,
    stop_diverged: StopDivergedOpt = False,
    track: Annotated[
        Optional[str],
        typer.Option(
            "--track",
            metavar="NAME,...",
            autocompletion=choices.list_completer(catalogue.TRACKABLE),
            rich_help_panel="Training",
            help="Curvature recorded while training, e.g. --track eigen,trace.",
        ),
    ] = None,
    track_every: Annotated[
        int,
        typer.Option(
            "--track-every", metavar="N", rich_help_panel="Training", help="Track every N epochs."
        ),
    ] = 1,
    track_samples: Annotated[
        int,
        typer.Option(
            "--track-samples", rich_help_panel="Training", help="Training samples for tracking."
        ),
    ] = 512,
    plot: Annotated[
        Optional[str],
        typer.Option(
            "--plot",
            metavar="PATH",
            rich_help_panel="Output",
            help="PNG of the training curves (and tracked curvature).",
        ),
    ] = None,
    seed: Annotated[
        int,
        typer.Option(
            "--seed",
            rich_help_panel="Run",
            help="Seed of weights, data order, noise.",
        ),
    ] = 0,
    device: common.DeviceOpt = "cpu",
    dtype: common.DtypeOpt = "float32",
    precision: PrecisionOpt = "fp32",
    ascent_sync: AscentSyncOpt = "per-replica",
    json_out: common.JsonOpt = None,
    quiet: common.QuietOpt = False,
    max_memory: common.MaxMemoryOpt = None,
    threads: common.ThreadsOpt = None,
    debug: common.DebugOpt = False,
) -> None:
    """Train a model, optionally under sharpness regularizers; write a checkpoint."""

    stop_on_divergence = stop_on_divergence or stop_diverged

    def body() -> runner.Outcome:
        from sharpcli.training.loop import config_from_options, train, train_report

        common.check_output(plot)
        margs = common.parse_json_option(model_args, "--model-args") or {}
        if per_sample_norm:
            margs["per_sample_norm"] = True
        tracked = [t.strip() for t in track.split(",") if t.strip()] if track else []
        if model_factory is not None and model != "mlp":
            raise common.UsageError("give --model or --model-factory, not both", source="--model")
        cfg = config_from_options(
            model=model,
            model_factory=model_factory,
            output=output,
            penultimate=penultimate,
            model_args=margs,
            depth=depth,
            width=width,
            activation=activation,
            mask_ratio=mask_ratio,
            data=_data_spec(data, x_key, y_key, shift_labels),
            label_column=label_column,
            epochs=epochs,
            batch_size=batch_size,
            optimizer=optimizer,
            lr=lr,
            momentum=momentum,
            schedule=schedule,
            label_noise=label_noise,
            augment=augment,
            input_noise=input_noise,
            repeat_batch=repeat_batch,
            noise_finetune=noise_finetune,
            seed=seed,
            regs=list(reg) if reg else ["none"],
            dtype=dtype,
            precision=precision,
            ascent_sync=ascent_sync,
            device=device,
            track=tracked,
            track_every=track_every,
            track_samples=track_samples,
            token_reduction=token_reduction,
        )
        tracker = None
        from sharpcli.analyses.tracking import check_tracked

        check_tracked(tracked)
        if tracked:
            from sharpcli.analyses.tracking import make_tracker

            tracker = make_tracker(tracked, seed=seed)
        with common.progress_bar(quiet, json_out, "training"):
            result = train(
                cfg,
                out,
                resume=resume,
                stop_after=stop_after,
                tracker=tracker,
                max_memory=max_memory,
                stop_on_divergence=stop_on_divergence,
            )
        runner.print_notes(result.notes, quiet)  # also in the report's data.notes
        if plot is not None:
            from sharpcli.report.plots import plot_training_history

            plot_training_history(
                result.history,
                plot,
                title=_plot_title(model_factory or model, result.config["regs"]),
            )
        report = train_report(
            result,
            {
                "resume": resume,
                "stop_after": stop_after,
                "stop_on_divergence": stop_on_divergence,
                "plot": plot,
            },
            out=out,
            device=device,
            dtype=dtype,
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
        "train", json_out, quiet, body, threads=threads, debug=debug, aliases=aliases
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


def _data_spec(data: str, x_key, y_key, shift_labels):
    """``--data`` with ``--x-key``/``--y-key``/``--shift-labels`` folded into its spec dict (the
    checkpoint stores it, so analyses of the trained model read the same arrays)."""
    if x_key is None and y_key is None and shift_labels is None:
        return data
    from sharpcli.io.datasets import parse_data_spec

    return parse_data_spec(data, x_key=x_key, y_key=y_key, shift_labels=shift_labels)


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
