"""``sharp train``: train a model under any combination of sharpness regularizers."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli.cli import choices, common
from sharpcli.cli.app import app
from sharpcli.errors import EXIT_NUMERICAL
from sharpcli.report.tables import FitTable, fmt, records_table

REG_HELP = (
    "Regularizer NAME[:k=v,...]; repeat to combine, e.g. --reg sam:rho=0.05 --reg fa "
    "(default: none). The regularizers, with their defaults:"
)
# --reg's help for the built-in regularizers, without importing them (and torch); equal to
# _reg_help() with no extension registered (tests/test_cli_usability.py).
BUILTIN_REG_HELP = (
    f"{REG_HELP} none; wd (sigma=0.001); dropout (p=0.1); ad (sigma=0.1); sam (rho=0.05); "
    "usam (rho=0.05); asam (rho=0.5, eta=0.01); gp (rho=0.01, p=1, mode=exact, eps=0.001); "
    "hessian-trace (sigma2=0.01, probes=1, mode=exact, eps=0.1); gn-trace (sigma2=0.01); "
    "weight-noise (sigma=0.01, report=perturbed); nso (sigma=0.01, k=1, report=perturbed); "
    "fa (lambda=0.01, mode=exact, eps=auto)"
)


def _reg_help() -> str:
    """``--reg``'s help with every registered regularizer and its hyper-parameters."""
    from sharpcli.training.regularizers import describe_registry

    return f"{REG_HELP} " + "; ".join(
        f"{row['name']}"
        + (
            # a space before "(": no word wider than the help column at 80 columns
            f" ({', '.join(h['name'] + '=' + str(h['default']) for h in row['hyperparameters'])})"
            if row["hyperparameters"]
            else ""
        )
        for row in describe_registry()
    )


@app.command("train", cls=common.LazyHelpCommand)
def train_command(
    model: Annotated[choices.Model, typer.Option("--model", help="Built-in model.")] = "mlp",
    depth: Annotated[
        Optional[int],
        typer.Option("--depth", help="Hidden layers (mlp) or depth (resnet: 20, 56)."),
    ] = None,
    width: Annotated[
        Optional[int], typer.Option("--width", help="Hidden width (mlp) or base channels.")
    ] = None,
    activation: common.ActivationOpt = None,
    model_args: Annotated[
        Optional[str],
        typer.Option(
            "--model-args",
            "--arch-args",
            metavar="JSON",
            help="Further model arguments as JSON (the factory's keyword arguments with "
            "--model-factory; --arch-args is a second name).",
        ),
    ] = None,
    model_factory: Annotated[
        Optional[str],
        typer.Option(
            "--model-factory",
            metavar="MODULE:FUNCTION",
            help="module:function returning your nn.Module (instead of --model); see "
            "docs/own-model.md.",
        ),
    ] = None,
    output: common.OutputOpt = None,
    penultimate: Annotated[
        Optional[str],
        typer.Option(
            "--penultimate",
            metavar="MODULE",
            help="Module whose output is the penultimate representation that ad penalises "
            "(default: the input of the last nn.Linear).",
        ),
    ] = None,
    data: Annotated[
        str,
        typer.Option(
            "--data",
            metavar="SPEC",
            help="Dataset: built-in 'blobs[:k=v,..]' or 'images[:k=v,..]', or a path (tensor "
            "file, .csv/.parquet, CIFAR or MNIST folder), e.g. --data images:n=2000.",
        ),
    ] = "blobs",
    label_column: common.LabelColumnOpt = None,
    x_key: common.XKeyOpt = None,
    y_key: common.YKeyOpt = None,
    shift_labels: common.ShiftLabelsOpt = None,
    epochs: Annotated[int, typer.Option("--epochs", help="Training epochs.")] = 5,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Minibatch size of the optimizer steps.")
    ] = 64,
    optimizer: Annotated[
        choices.Optimizer, typer.Option("--optimizer", help="sgd (with momentum) or adam.")
    ] = "sgd",
    lr: Annotated[float, typer.Option("--lr", help="Learning rate.")] = 0.05,
    momentum: Annotated[float, typer.Option("--momentum", help="SGD momentum.")] = 0.9,
    schedule: Annotated[
        choices.Schedule,
        typer.Option("--schedule", help="Learning-rate schedule over the epochs."),
    ] = "constant",
    label_noise: Annotated[
        float,
        typer.Option(
            "--label-noise", help="Fraction of training labels replaced by another class."
        ),
    ] = 0.0,
    augment: Annotated[
        bool,
        typer.Option(
            "--augment/--no-augment", help="Random crop (padding 4) and horizontal flip for images."
        ),
    ] = False,
    input_noise: Annotated[
        float, typer.Option("--input-noise", help="Std of Gaussian noise added to inputs.")
    ] = 0.0,
    mask_ratio: Annotated[
        Optional[float],
        typer.Option(
            "--mask-ratio",
            help="Zero a fixed random fraction of every activation layer's outputs for the whole run (MAN Table 1).",
        ),
    ] = None,
    per_sample_norm: Annotated[
        bool,
        typer.Option(
            "--per-sample-norm",
            help="Strict per-sample mean-variance normalisation of activations and He-standardised weights (MAN 5.1).",
        ),
    ] = False,
    repeat_batch: Annotated[
        int,
        typer.Option(
            "--repeat-batch", help="Optimizer steps on each batch before the next (MAN Table 2)."
        ),
    ] = 1,
    noise_finetune: Annotated[
        float,
        typer.Option(
            "--noise-finetune",
            help="Add one final epoch with input Gaussian noise of this std (MAN Table 4).",
        ),
    ] = 0.0,
    reg: Annotated[
        Optional[list[str]],
        typer.Option(
            "--reg",
            metavar="NAME[:k=v,...]",
            autocompletion=choices.completer(choices.REGULARIZERS),
            help=common.lazy_help(BUILTIN_REG_HELP, "sharpcli.training.regularizers", _reg_help),
        ),
    ] = None,
    out: Annotated[
        str,
        typer.Option("--out", "-o", metavar="PATH", help="Checkpoint to write (.safetensors)."),
    ] = "model.safetensors",
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted run of the same options.")
    ] = False,
    stop_after: Annotated[
        Optional[int],
        typer.Option(
            "--stop-after",
            metavar="EPOCH",
            help="Stop after this epoch as an interruption would; continue later with --resume.",
        ),
    ] = None,
    stop_on_divergence: Annotated[
        bool,
        typer.Option(
            "--stop-diverged",
            help="When training diverges (loss above 4x its best, or accuracy back at chance), "
            "stop, write the weights of the epoch with the lowest training loss and exit 3.",
        ),
    ] = False,
    track: Annotated[
        Optional[str],
        typer.Option(
            "--track",
            metavar="NAME,...",
            autocompletion=choices.list_completer(choices.TRACKABLE),
            help="Curvature to record during training: comma list of eigen, trace, gn-nme, "
            "frobenius, e.g. --track eigen,trace.",
        ),
    ] = None,
    track_every: Annotated[
        int, typer.Option("--track-every", metavar="K", help="Track every K epochs.")
    ] = 1,
    track_samples: Annotated[
        int, typer.Option("--track-samples", help="Training samples used for tracking.")
    ] = 512,
    plot: Annotated[
        Optional[str],
        typer.Option(
            "--plot",
            metavar="PATH",
            help="Write a PNG of the training curves (and tracked curvature) to PATH.",
        ),
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the initialisation, the data order and noise.")
    ] = 0,
    device: common.DeviceOpt = "cpu",
    dtype: common.DtypeOpt = "float32",
    json_out: common.JsonOpt = None,
    quiet: common.QuietOpt = False,
    max_memory: common.MaxMemoryOpt = None,
    threads: common.ThreadsOpt = None,
    debug: common.DebugOpt = False,
) -> None:
    """Train a model on built-in or file data under sharpness regularizers; write a checkpoint."""

    def body() -> common.Outcome:
        from sharpcli.training.loop import TrainConfig, train, train_report

        common.check_output(plot)
        for option, value in (("--depth", depth), ("--width", width)):
            common.require(value is None or value >= 1, "must be at least 1", option)
        margs = common.parse_json_option(model_args, "--model-args") or {}
        if per_sample_norm:
            margs["per_sample_norm"] = True
        for key, value in (
            ("depth", depth),
            ("width", width),
            ("activation", activation),
            ("mask_ratio", mask_ratio),
        ):
            if value is not None:
                margs[key] = value
        tracked = [t.strip() for t in track.split(",") if t.strip()] if track else []
        if model_factory is not None and model != "mlp":
            raise common.UsageError("give --model or --model-factory, not both", source="--model")
        cfg = TrainConfig(
            model=model,
            model_factory=model_factory,
            output=output,
            penultimate=penultimate,
            model_args=margs,
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
            device=device,
            track=tracked,
            track_every=track_every,
            track_samples=track_samples,
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
        common.print_notes(result.notes, quiet)  # also in the report's data.notes
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
        return common.Outcome(
            report,
            render=lambda console: _render(console, result),
            notice=_divergence_warning(result),
            exit_code=EXIT_NUMERICAL if result.stopped_on_divergence else None,
        )

    # the library names subset sizes `samples`: here they are --track-samples
    aliases = {"samples": "--track-samples"}
    common.run_command(
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
        else "--stop-diverged stops such a run and keeps its best epoch"
    )
    return f"warning: training diverged at epoch {d['epoch']}: {d['reason']}; {kept}"


def _plot_title(model: str, regs: list[str]) -> str:
    named = [r for r in regs if r != "none"]
    return f"{model}, " + (f"regularized by {' + '.join(named)}" if named else "no regularizer")


def _render(console, result) -> None:
    tracked_keys = sorted({k for row in result.history for k in (row.get("tracked") or {})})
    rows = [row | (row.get("tracked") or {}) for row in result.history]
    console.print(
        records_table(
            "training history",
            rows,
            [*_HISTORY, *tracked_keys],
            digits={"seconds": 3},
            headers=_HISTORY,
        )
    )
    final = [(k, v) for k, v in result.final.items()]
    final += [
        ("checkpoint", result.checkpoint["path"]),
        ("sha256", result.checkpoint["sha256"][:16] + "…"),
    ]
    console.print(
        FitTable(
            "final", ["metric", "value"], [[k, fmt(v)] for k, v in final], justify=["left", "right"]
        )
    )
