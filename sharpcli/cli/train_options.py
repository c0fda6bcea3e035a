"""The options of ``sharp train``, declared once; ``sharp sweep`` takes a subset of them.

:class:`TrainOptions` is a dataclass of options (:mod:`sharpcli.cli.declared`): each field is
one option of ``train``, its default the default of the
:class:`~sharpcli.training.config.TrainConfig` field it sets, and :meth:`TrainOptions.config`
builds that configuration from them, once. :data:`SWEEP_OPTIONS` are those ``sweep`` shows
under their own names (the rest it takes as ``--set KEY=VALUE``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Any, Optional

import typer

from sharpcli import catalogue
from sharpcli.cli import choices, common
from sharpcli.cli.declared import OptionSet, option
from sharpcli.errors import UsageError
from sharpcli.training.config import TrainConfig, config_from_options

# the defaults of TrainConfig: each option's default is the field's it sets
_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


def _setting(annotated: Any, name: str) -> Any:
    """The option that sets TrainConfig's field ``name``, with that field's default."""
    return option(annotated, _DEFAULTS[name])


def _model_opt(flag: str, help: str, *, type_: Any = Optional[int]) -> Any:
    return Annotated[type_, typer.Option(flag, rich_help_panel="Model", help=help)]


def _valued(panel: str, metavar: str, *flags: str, help: str, type_: Any = Optional[str]) -> Any:
    """An option of ``panel`` whose value the placeholder ``metavar`` names."""
    return Annotated[type_, typer.Option(*flags, metavar=metavar, rich_help_panel=panel, help=help)]


def regularizer_option(flag: str, help: str, **panel: Any) -> Any:
    """The typer option of an option naming regularizers ``NAME[:k=v,...]`` (train's
    ``--reg``, sweep's ``--reg`` and ``--extra-reg``): its placeholder and completion read the
    registry."""
    return typer.Option(
        flag,
        metavar=choices.metavar(catalogue.REGULARIZERS, params=True),
        autocompletion=choices.completer(catalogue.REGULARIZERS),
        help=help,
        **panel,
    )


ModelOpt = Annotated[
    choices.Model, typer.Option("--model", rich_help_panel="Model", help="Built-in model.")
]
DepthOpt = _model_opt("--depth", "Hidden layers (mlp) or depth (resnet: 20, 56).")
WidthOpt = _model_opt("--width", "Hidden width (mlp) or base channels.")
ModelArgsOpt = _valued(
    "Model", "JSON", "--model-args", "--arch-args", help="Model keyword arguments (or --arch-args)."
)
ModelFactoryOpt = _valued(
    "Model",
    "MODULE:FUNCTION",
    "--model-factory",
    help="Function returning your nn.Module, instead of --model.",
)
PenultimateOpt = _valued(
    "Model",
    "MODULE",
    "--penultimate",
    help="Module ad penalises (default: the last Linear).",
)
TrainDataOpt = Annotated[
    str,
    typer.Option(
        "--data",
        metavar="SPEC",
        rich_help_panel="Data",
        help="blobs[:k=v,..], images[:k=v,..], a file (tensors, .csv, .parquet) or folder.",
    ),
]
# The token loss a sequence model trains on (sharpcli.losses.token_reduction): one line of help
TrainTokenReductionOpt = Annotated[
    choices.TokenReduction,
    typer.Option("--token-reduction", metavar="MODE", rich_help_panel="Data", help="Token CE."),
]


def _training_opt(flag: str, type_: Any, help: str, **kw: Any) -> Any:
    return Annotated[type_, typer.Option(flag, rich_help_panel="Training", help=help, **kw)]


def _data_opt(flag: str, type_: Any, help: str) -> Any:
    return Annotated[type_, typer.Option(flag, rich_help_panel="Data", help=help)]


RegOpt = Annotated[
    Optional[list[str]],
    regularizer_option(
        "--reg", "Regularizer, e.g. sam:rho=0.05 (repeatable).", rich_help_panel="Training"
    ),
]
OutOpt = _valued("Output", "PATH", "--out", "-o", help="Checkpoint file.", type_=str)
# the loss the model trains on: one help line, no values listed (an unknown name is refused
# listing them); mse on class labels regresses one-hot rows (sharpcli.losses)
TrainLossOpt = _valued(
    "Training", "NAME", "--loss", help="Loss (default: inferred from the data and model)."
)
OptimizerOpt = Annotated[
    str,
    typer.Option(
        "--optimizer",
        metavar="NAME[:k=v,...]",
        autocompletion=choices.completer(catalogue.OPTIMIZERS),
        rich_help_panel="Training",
        help="Optimizer, e.g. adamw:weight_decay=0.01.",
    ),
]
TrackOnOpt = Annotated[
    choices.TrackOn,
    typer.Option("--track-on", metavar="SET", rich_help_panel="Training", help="Probe set."),
]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume", rich_help_panel="Run", help="Continue an interrupted run of the same options."
    ),
]
StopAfterOpt = _valued(
    "Run", "N", "--stop-after", help="Stop after epoch N, as if interrupted.", type_=Optional[int]
)
StopOnDivergenceOpt = Annotated[
    bool,
    typer.Option("--stop-on-divergence", help="On divergence: stop, keep the best epoch, exit 3."),
]
# its first spelling, still accepted, left out of --help
StopDivergedOpt = Annotated[
    bool, typer.Option("--stop-diverged", hidden=True, help="As --stop-on-divergence.")
]
TrackOpt = Annotated[
    Optional[str],
    typer.Option(
        "--track",
        metavar="NAME,...",
        autocompletion=choices.list_completer(catalogue.TRACKABLE.names()),
        rich_help_panel="Training",
        help="Curvature, e.g. eigen,trace.",
    ),
]
TrainPlotOpt = _valued(
    "Output", "PATH", "--plot", help="PNG of the training curves (and tracked curvature)."
)
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
TrainSeedOpt = Annotated[
    int, typer.Option("--seed", rich_help_panel="Run", help="Seed of weights, data order, noise.")
]


@dataclass
class TrainOptions:
    """The options of ``sharp train`` in the order its help lists them. The fields that
    name a :class:`TrainConfig` field set it; ``depth``, ``width``, ``activation``,
    ``mask_ratio`` and ``per_sample_norm`` go into its ``model_args``; ``x_key``, ``y_key``,
    ``shift_labels`` and ``x_shape`` into its data spec; the others steer the run."""

    model: str = _setting(ModelOpt, "model")
    depth: int | None = option(DepthOpt, None)
    width: int | None = option(WidthOpt, None)
    activation: str | None = option(common.ActivationOpt, None)
    model_args: str | None = option(ModelArgsOpt, None)
    model_factory: str | None = _setting(ModelFactoryOpt, "model_factory")
    output: str | None = _setting(common.OutputOpt, "output")
    penultimate: str | None = _setting(PenultimateOpt, "penultimate")
    data: str = _setting(TrainDataOpt, "data")
    label_column: str | None = _setting(common.LabelColumnOpt, "label_column")
    x_key: str | None = option(common.XKeyOpt, None)
    y_key: str | None = option(common.YKeyOpt, None)
    shift_labels: bool | None = option(common.ShiftLabelsOpt, None)
    x_shape: str | None = option(common.XShapeOpt, None)
    token_reduction: str = _setting(TrainTokenReductionOpt, "token_reduction")
    epochs: int = _setting(_training_opt("--epochs", int, "Training epochs."), "epochs")
    steps: int | None = _setting(
        _training_opt("--steps", Optional[int], "Optimizer steps, instead of --epochs."), "steps"
    )
    batch_size: str = option(
        _training_opt("--batch-size", str, "Minibatch size, or full.", metavar="N"),
        str(_DEFAULTS["batch_size"]),
    )
    loss: str | None = _setting(TrainLossOpt, "loss")
    optimizer: str = _setting(OptimizerOpt, "optimizer")
    lr: float = _setting(_training_opt("--lr", float, "Learning rate."), "lr")
    momentum: float = _setting(_training_opt("--momentum", float, "SGD momentum."), "momentum")
    schedule: str = _setting(
        _training_opt("--schedule", choices.Schedule, "Learning-rate schedule."), "schedule"
    )
    warmup: int = _setting(
        _training_opt("--warmup", int, "Steps of linear learning-rate warm-up."), "warmup"
    )
    label_noise: float = _setting(
        _data_opt("--label-noise", float, "Fraction of labels flipped."), "label_noise"
    )
    augment: bool = _setting(
        _data_opt("--augment", bool, "Random crop and flip of images."), "augment"
    )
    input_noise: float = _setting(
        _data_opt("--input-noise", float, "Std of Gaussian input noise."), "input_noise"
    )
    mask_ratio: float | None = option(
        _model_opt(
            "--mask-ratio",
            "Fraction of activations zeroed (MAN Table 1).",
            type_=Optional[float],
        ),
        None,
    )
    per_sample_norm: bool = option(
        _model_opt("--per-sample-norm", "Per-sample normalisation (MAN 5.1).", type_=bool),
        False,
    )
    repeat_batch: int = _setting(
        _training_opt("--repeat-batch", int, "Steps on each batch (MAN Table 2)."), "repeat_batch"
    )
    noise_finetune: float = _setting(
        _training_opt("--noise-finetune", float, "Last-epoch noise std (MAN Tab. 4)."),
        "noise_finetune",
    )
    regs: list[str] | None = option(RegOpt, None)
    out: str = option(OutOpt, "model.safetensors")
    resume: bool = option(ResumeOpt, False)
    stop_after: int | None = option(StopAfterOpt, None)
    stop_on_divergence: bool = option(StopOnDivergenceOpt, False)
    stop_diverged: bool = option(StopDivergedOpt, False)
    track: str | None = option(TrackOpt, None)
    track_every: str = option(
        _training_opt(
            "--track-every", str, "Track every N epochs (or Nsteps).", metavar="N[steps]"
        ),
        str(_DEFAULTS["track_every"]),
    )
    track_samples: int = _setting(
        _training_opt("--track-samples", int, "Training samples for tracking."), "track_samples"
    )
    track_on: str = _setting(TrackOnOpt, "track_on")
    plot: str | None = option(TrainPlotOpt, None)
    seed: int = _setting(TrainSeedOpt, "seed")
    device: str = _setting(common.DeviceOpt, "device")
    dtype: str = _setting(common.DtypeOpt, "dtype")
    precision: str = _setting(PrecisionOpt, "precision")
    ascent_sync: str = _setting(AscentSyncOpt, "ascent_sync")
    json: str | None = option(common.JsonOpt, None)
    quiet: bool = option(common.QuietOpt, False)
    max_memory: str | None = option(common.MaxMemoryOpt, None)
    threads: int | None = option(common.ThreadsOpt, None)
    debug: bool = option(common.DebugOpt, False)

    def tracked(self) -> list[str]:
        """``--track eigen,trace`` as ``["eigen", "trace"]``."""
        return [t.strip() for t in self.track.split(",") if t.strip()] if self.track else []

    def config(self) -> TrainConfig:
        """The :class:`TrainConfig` these options make (not yet checked by
        :func:`~sharpcli.training.config.validate_config`).

        Raises:
            UsageError: ``--model-args`` not a JSON object, ``--model`` with
                ``--model-factory``, a depth or width below 1, a ``--reg`` that does not parse.
        """
        if self.model_factory is not None and self.model != _DEFAULTS["model"]:
            raise UsageError("give --model or --model-factory, not both", source="--model")
        model_args = common.parse_json_option(self.model_args, "--model-args") or {}
        if self.per_sample_norm:
            model_args["per_sample_norm"] = True
        # every TrainConfig field that is an option here; model_args, data and track parsed
        settings = {
            f.name: getattr(self, f.name) for f in fields(TrainConfig) if hasattr(self, f.name)
        }
        settings |= {"model_args": model_args, "data": self._data_spec(), "track": self.tracked()}
        if not self.regs:  # none given: TrainConfig's default (no regularizer)
            del settings["regs"]
        sizes: dict[str, Any] = {"depth": self.depth, "width": self.width}
        sizes |= {"activation": self.activation, "mask_ratio": self.mask_ratio}
        return config_from_options(**settings, **sizes)

    def _data_spec(self) -> str | dict:
        """``--data`` with ``--x-key``/``--y-key``/``--shift-labels``/``--x-shape`` folded into
        its spec dict (the checkpoint stores it, so analyses of the trained model read the same
        arrays in the same shape)."""
        given = (self.x_key, self.y_key, self.shift_labels, self.x_shape)
        if all(value is None for value in given):
            return self.data
        # imports torch: kept out of start-up
        from sharpcli.io.data.loading import parse_data_spec

        return parse_data_spec(
            self.data,
            x_key=self.x_key,
            y_key=self.y_key,
            shift_labels=self.shift_labels,
            x_shape=self.x_shape,
        )


# The training options sweep shows under their own names, in its help's order; the other
# TrainConfig fields it sets with --set KEY=VALUE.
SWEEP_OPTIONS = OptionSet(
    TrainOptions,
    names=(
        "model",
        "model_factory",
        "data",
        "token_reduction",
        "epochs",
        "batch_size",
        "lr",
        "optimizer",
        "schedule",
        "width",
        "depth",
        "activation",
        "dtype",
        "device",
    ),
    help={
        "model_factory": "Function returning your nn.Module (arguments: --set model_args={...}).",
        "data": "Training data, as train --data, e.g. --data blobs:n=2000.",
        "epochs": "Epochs per run.",
    },
)
