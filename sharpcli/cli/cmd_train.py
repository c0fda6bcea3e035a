"""``sharp train``: train a model under any combination of sharpness regularizers."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from sharpcli.cli import common
from sharpcli.cli.app import app
from sharpcli.report.tables import fmt
from sharpcli.training.regularizers import describe_registry

REG_HELP = (
    "Regularizer NAME[:k=v,...]; repeat to combine (e.g. --reg ad:sigma=0.1 --reg wd:sigma=0.01). "
    + "; ".join(
        f"{row['name']}"
        + (
            f"({', '.join(h['name'] + '=' + str(h['default']) for h in row['hyperparameters'])})"
            if row["hyperparameters"]
            else ""
        )
        for row in describe_registry()
    )
)


@app.command("train")
def train_command(
    model: Annotated[str, typer.Option("--model", help="mlp, cnn, vgg-small or resnet.")] = "mlp",
    depth: Annotated[
        Optional[int],
        typer.Option("--depth", help="Hidden layers (mlp) or depth (resnet: 20, 56)."),
    ] = None,
    width: Annotated[
        Optional[int], typer.Option("--width", help="Hidden width (mlp) or base channels.")
    ] = None,
    activation: Annotated[
        Optional[str],
        typer.Option(
            "--activation",
            help="relu, gelu, beta-gelu:beta=B, augmented-relu:beta=B, diminished-gelu.",
        ),
    ] = None,
    model_args: Annotated[
        Optional[str], typer.Option("--model-args", help="Further model arguments as JSON.")
    ] = None,
    data: Annotated[
        str, typer.Option("--data", help="Dataset spec (built-in name[:k=v,..] or a path).")
    ] = "blobs",
    label_column: common.LabelColumnOpt = None,
    epochs: Annotated[int, typer.Option("--epochs")] = 5,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 64,
    optimizer: Annotated[
        str, typer.Option("--optimizer", help="sgd (with momentum) or adam.")
    ] = "sgd",
    lr: Annotated[float, typer.Option("--lr", help="Learning rate.")] = 0.05,
    momentum: Annotated[float, typer.Option("--momentum", help="SGD momentum.")] = 0.9,
    schedule: Annotated[str, typer.Option("--schedule", help="constant or cosine.")] = "constant",
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
    reg: Annotated[Optional[list[str]], typer.Option("--reg", help=REG_HELP)] = None,
    out: Annotated[
        str, typer.Option("--out", "-o", help="Checkpoint to write (.safetensors).")
    ] = "model.safetensors",
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted run of the same options.")
    ] = False,
    stop_after: Annotated[
        Optional[int],
        typer.Option(
            "--stop-after",
            help="Stop after this epoch as an interruption would; continue later with --resume.",
        ),
    ] = None,
    track: Annotated[
        Optional[str],
        typer.Option(
            "--track",
            help="Curvature to record during training: comma list of trace, eigen, gn-nme.",
        ),
    ] = None,
    track_every: Annotated[int, typer.Option("--track-every", help="Track every K epochs.")] = 1,
    track_samples: Annotated[
        int, typer.Option("--track-samples", help="Training samples used for tracking.")
    ] = 512,
    plot: Annotated[
        Optional[str],
        typer.Option(
            "--plot", help="Write a PNG of the training curves (and tracked curvature) to PATH."
        ),
    ] = None,
    seed: common.SeedOpt = 0,
    device: common.DeviceOpt = "cpu",
    dtype: common.DtypeOpt = "float32",
    json_out: common.JsonOpt = None,
    quiet: common.QuietOpt = False,
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
        cfg = TrainConfig(
            model=model,
            model_args=margs,
            data=data,
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
        with common.epoch_progress(quiet or json_out == "-", "training") as progress:
            result = train(
                cfg, out, resume=resume, stop_after=stop_after, progress=progress, tracker=tracker
            )
        common.print_notes(result.notes, quiet)  # also in the report's data.notes
        if plot is not None:
            from sharpcli.report.plots import plot_training_history

            plot_training_history(
                result.history, plot, title=f"{model} with {' + '.join(result.config['regs'])}"
            )
        report = train_report(
            result,
            {"resume": resume, "stop_after": stop_after, "plot": plot},
            out=out,
            device=device,
            dtype=dtype,
        )
        return common.Outcome(report, render=lambda console: _render(console, result))

    # the library names model arguments --arch-args and subset sizes --samples
    aliases = {"--arch-args": "--model-args", "--samples": "--track-samples"}
    common.run_command("train", json_out, quiet, body, aliases=aliases)


def _render(console, result) -> None:
    table = Table(title="training history")
    cols = [
        "epoch",
        "train_loss",
        "train_accuracy",
        "test_loss",
        "test_accuracy",
        "grad_evals",
        "seconds",
    ]
    tracked_keys = sorted({k for row in result.history for k in (row.get("tracked") or {})})
    for c in cols + tracked_keys:
        table.add_column(c, justify="right", overflow="fold")
    for row in result.history:
        table.add_row(
            *[fmt(row.get(c)) for c in cols],
            *[fmt((row.get("tracked") or {}).get(k)) for k in tracked_keys],
        )
    console.print(table)
    final = Table(title="final")
    final.add_column("metric")
    final.add_column("value", justify="right")
    for k, v in result.final.items():
        final.add_row(k, fmt(v))
    final.add_row("checkpoint", result.checkpoint["path"])
    final.add_row("sha256", result.checkpoint["sha256"][:16] + "…")
    console.print(final)
