"""What the commands share: the common options, the analysis-command decorator, option checks.

The options every analysis command takes are declared once (:class:`CommonOptions`) and
added to each command's signature by :func:`analysis_command`, which runs the command through
:func:`sharpcli.cli.runner.run_command`; :func:`open_session` builds the analysis session
from them. The option parsers and checks raise usage errors on the option they are about.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Annotated, Optional

import typer

from sharpcli import catalogue, ledger
from sharpcli.cli import choices, runner
from sharpcli.cli.declared import OptionSet, option
from sharpcli.cli.lazyhelp import LazyHelpCommand
from sharpcli.errors import UsageError

# Annotated option types, declared once and reused by every command.
CheckpointArg = Annotated[
    str,
    typer.Argument(
        metavar="CKPT", help="Checkpoint: .safetensors (own or state_dict) or .pt/.pth."
    ),
]
DataOpt = Annotated[
    Optional[str],
    typer.Option(
        "--data",
        rich_help_panel="Data",
        metavar="SPEC",
        help="blobs[:k=v,..], images[:k=v,..] or a path (tensor file, .csv, .parquet, CIFAR "
        "or MNIST folder), e.g. --data blobs:n=500. Default: the checkpoint's data.",
    ),
]
LabelColumnOpt = Annotated[
    Optional[str],
    typer.Option(
        "--label-column",
        rich_help_panel="Data",
        metavar="NAME",
        help="Label column of a table (default: label).",
    ),
]
XKeyOpt = Annotated[
    Optional[str],
    typer.Option(
        "--x-key",
        rich_help_panel="Data",
        metavar="KEYS",
        help="Input arrays of a data file (several: by name).",
    ),
]
YKeyOpt = Annotated[
    Optional[str],
    typer.Option(
        "--y-key",
        rich_help_panel="Data",
        metavar="KEY",
        help="Label array of a data file (default: y or labels).",
    ),
]
ShiftLabelsOpt = Annotated[
    Optional[bool],
    typer.Option(
        "--shift-labels",
        rich_help_panel="Data",
        help="Labels are the inputs: position t predicts t+1.",
        show_default=False,
    ),
]
XShapeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--x-shape",
        rich_help_panel="Data",
        metavar="DIMS",
        help="Reshape each sample's input, e.g. 1,28,28.",
    ),
]
SplitOpt = Annotated[
    choices.Split,
    typer.Option("--split", rich_help_panel="Data", help="The split."),
]
SamplesOpt = Annotated[
    Optional[int],
    typer.Option(
        "--samples",
        rich_help_panel="Data",
        metavar="N",
        help="A fixed seeded random subset of N samples.",
    ),
]
BatchSizeOpt = Annotated[
    int,
    typer.Option("--batch-size", rich_help_panel="Data", help="Batch size of the data passes."),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        rich_help_panel="Run",
        metavar="DEVICE",
        autocompletion=choices.completer(catalogue.DEVICES),
        help="Torch device, e.g. cuda:1.",
    ),
]
DtypeOpt = Annotated[
    choices.Dtype, typer.Option("--dtype", rich_help_panel="Run", help="Floating-point precision.")
]
ActivationOpt = Annotated[
    Optional[str],
    typer.Option(
        "--activation",
        rich_help_panel="Model",
        metavar=choices.metavar(catalogue.ACTIVATIONS, params=True),
        autocompletion=choices.completer(catalogue.ACTIVATIONS),
        # the placeholder shows beta-gelu's and augmented-relu's :beta=B; the default is
        # the model's own
        help="Activation.",
    ),
]
SeedOpt = Annotated[
    int,
    typer.Option("--seed", rich_help_panel="Run", help="Seed of every random choice."),
]
JsonOpt = Annotated[
    Optional[str],
    typer.Option(
        "--json",
        rich_help_panel="Output",
        metavar="PATH|-",
        help="JSON report to PATH ('-': stdout).",
    ),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        rich_help_panel="Output",
        help="Also notes on how numbers were computed.",
    ),
]
QuietOpt = Annotated[
    bool,
    typer.Option("--quiet", "-q", rich_help_panel="Output", help="No progress bars or tables."),
]
ArchOpt = Annotated[
    Optional[choices.Model],
    typer.Option("--arch", rich_help_panel="Model", help="Architecture of a foreign state_dict."),
]
ArchArgsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--arch-args",
        rich_help_panel="Model",
        metavar="JSON",
        help="Keyword arguments of --arch or --model-factory, e.g. '{\"width\": 64}'.",
    ),
]
FactoryOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model-factory",
        rich_help_panel="Model",
        metavar="MODULE:FUNCTION",
        help="Function returning the nn.Module of a foreign state_dict.",
    ),
]
OutputOpt = Annotated[
    Optional[str],
    typer.Option(
        "--output",
        rich_help_panel="Model",
        metavar="INDEX|KEY",
        help="Output holding the logits: tuple index, dict key or attribute "
        "(default: .logits, else the first tensor).",
    ),
]
TrustPickleOpt = Annotated[
    bool,
    typer.Option(
        "--trust-pickle",
        rich_help_panel="Model",
        help="Load a pickled module or TensorDataset (runs code).",
    ),
]
CacheOpt = Annotated[
    Optional[int],
    typer.Option(
        "--cache-mb",
        rich_help_panel="Run",
        metavar="MB",
        help="Graph cache (default: as the budget allows).",
    ),
]
TokenReductionOpt = Annotated[
    choices.TokenReduction,
    typer.Option(
        "--token-reduction",
        rich_help_panel="Data",
        help="Token loss: mean over tokens, or per sample.",
    ),
]
LossOpt = Annotated[
    Optional[str],
    typer.Option(
        "--loss",
        rich_help_panel="Data",
        metavar=choices.metavar(catalogue.LOSSES, params=True),
        # one help line, no values listed (every analysis command's --help fits 80 lines);
        # an unknown name or option is refused listing them (sharpcli.io.torch_losses.options)
        help="Loss (default: the checkpoint's, else inferred).",
    ),
]
MaxMemoryOpt = Annotated[
    Optional[str],
    typer.Option(
        "--max-memory",
        rich_help_panel="Run",
        metavar="SIZE",
        help="Memory budget, e.g. 8G (default: 80% of free).",
    ),
]
ThreadsOpt = Annotated[
    Optional[int],
    typer.Option(
        "--threads",
        rich_help_panel="Run",
        metavar="N",
        help="Torch CPU threads (default: OMP_NUM_THREADS or 1).",
    ),
]
DebugOpt = Annotated[
    bool, typer.Option("--debug", rich_help_panel="Run", help="Show tracebacks for errors.")
]
ParamsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--params",
        metavar="SCOPE",
        help="Parameter scope: all (default), last (final linear layer), or a glob on "
        "parameter names, e.g. --params '*.weight'.",
    ),
]
PlotOpt = Annotated[
    Optional[str],
    typer.Option(
        "--plot", rich_help_panel="Output", metavar="PATH", help="Write a PNG plot to PATH."
    ),
]
# One name per meaning: --eig-* bound the Lanczos (or power) eigensolver, --trace-* the
# stochastic trace estimators; the old --tol / --max-matvecs stay as second names.
EigTolOpt = Annotated[
    float,
    typer.Option(
        "--eig-tol",
        "--tol",
        help="Converged when ||A u - lambda u|| <= tol |lambda| (--tol: former name).",
    ),
]
TraceMaxMatvecsOpt = Annotated[
    int,
    typer.Option(
        "--trace-max-matvecs",
        "--max-matvecs",
        metavar="N",
        help="Products per trace estimate at most (--max-matvecs: former name).",
    ),
]


@dataclass
class CommonOptions:
    """The options shared by the analysis commands (docs/index.md), declared once: each field's
    default is the option's default and its metadata the option (see :func:`analysis_command`).

    ``command_options`` holds the command's own options as the command received them (filled by
    :func:`analysis_command`), from which :meth:`report_settings` builds the report's settings.
    """

    data: str | None = option(DataOpt, None)
    label_column: str | None = option(LabelColumnOpt, None)
    x_key: str | None = option(XKeyOpt, None)
    y_key: str | None = option(YKeyOpt, None)
    shift_labels: bool | None = option(ShiftLabelsOpt, None)
    x_shape: str | None = option(XShapeOpt, None)
    split: str = option(SplitOpt, catalogue.TRAIN)
    samples: int | None = option(SamplesOpt, None)
    batch_size: int = option(BatchSizeOpt, 256)
    device: str = option(DeviceOpt, "cpu")
    dtype: str = option(DtypeOpt, "float32")
    seed: int = option(SeedOpt, 0)
    json: str | None = option(JsonOpt, None)
    quiet: bool = option(QuietOpt, False)
    verbose: bool = option(VerboseOpt, False)
    arch: str | None = option(ArchOpt, None)
    arch_args: str | None = option(ArchArgsOpt, None)
    model_factory: str | None = option(FactoryOpt, None)
    output: str | None = option(OutputOpt, None)
    trust_pickle: bool = option(TrustPickleOpt, False)
    cache_mb: int | None = option(CacheOpt, None)
    max_memory: str | None = option(MaxMemoryOpt, None)
    token_reduction: str = option(TokenReductionOpt, "tokens")
    loss: str | None = option(LossOpt, None)
    threads: int | None = option(ThreadsOpt, None)
    debug: bool = option(DebugOpt, False)
    command_options: dict = field(default_factory=dict, repr=False, compare=False)

    def settings(self) -> dict:
        """The common options that describe the analysis (not ``--json``, ``--quiet``,
        ``--verbose``, ``--threads`` (``environment.threads`` records it) or ``--debug``)."""
        skip = ("json", "quiet", "verbose", "threads", "debug", "command_options")
        return {k: v for k, v in asdict(self).items() if k not in skip}

    def report_settings(self, *, skip: tuple[str, ...] = (), **parsed) -> dict:
        """The report's ``settings``: :meth:`settings`, then the command's own options in the
        order the command declares them, less ``skip``; ``parsed`` gives the values to record
        instead of the raw ones (e.g. ``alpha=[0.1, 10.0]`` for ``--alpha 0.1,10``)."""
        own = {k: v for k, v in self.command_options.items() if k not in skip}
        return self.settings() | own | parsed


def parse_json_option(text: str | None, option: str) -> dict | None:
    """The JSON object an option gives (``--arch-args``, ``--model-args``), or None.

    Nesting is bounded (:func:`sharpcli.bounded.loads_json`, 32 levels as checkpoint
    metadata), so deeply nested text is a UsageError rather than a RecursionError.
    """
    import json

    # kept out of sharp's start-up (--help, completion)
    from sharpcli.bounded import JsonTooDeep, loads_json

    if text is None:
        return None
    try:
        value = loads_json(text, max_depth=32)
    except JsonTooDeep as exc:
        raise UsageError(f"is JSON {exc}", source=option) from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"not valid JSON ({exc.msg})", source=option) from exc
    except ValueError:  # an integer of more than 4300 digits
        raise UsageError("holds a number too long to read", source=option) from None
    if not isinstance(value, dict):
        raise UsageError("must be a JSON object", source=option)
    return value


def parse_float_list(text: str, option: str) -> list[float]:
    """The numbers of comma-separated ``text``; a UsageError on ``option`` unless there is at
    least one and every item is one (an empty item is refused, not dropped)."""
    items = text.split(",")
    if text.strip() and not all(t.strip() for t in items):
        raise UsageError(
            f"{text!r} has an empty item: give numbers separated by single commas", source=option
        )
    try:
        values = [float(t) for t in items if t.strip()]
    except ValueError:
        raise UsageError(
            f"{text!r} is not a comma-separated list of numbers", source=option
        ) from None
    if not values:
        raise UsageError("needs at least one number", source=option)
    return values


def check_output(path: str | None, option: str = "--plot") -> None:
    """UsageError on ``option`` unless ``path`` can be written and is no input or other output
    of the command (:func:`sharpcli.ledger.declare_output`; nothing to check for None): an
    output file is checked before the work that fills it starts."""
    if path is not None:
        ledger.declare_output(path, option)


def require(condition: bool, message: str, option: str) -> None:
    """Raise a UsageError on ``option`` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(message, source=option)


def progress_bar(quiet: bool, json_path: str | None, text: str):
    """The progress bar on stderr for the work inside the ``with`` block
    (:mod:`sharpcli.cli.bars`): the runs that :mod:`sharpcli.progress` reports, and ``text``
    while none is open. Nothing under ``--quiet``, ``--json -``, off a terminal, or on ranks
    other than 0."""
    # kept out of sharp's start-up (--help, completion)
    from sharpcli.cli.bars import progress_bar as bar

    return bar(runner.stderr_console, quiet or json_path == "-", text)


# The library's model arguments (models.specs: `model_args`, train's --model-args) are what an
# analysis command's --arch-args gives (the arguments of --arch, a foreign state_dict's model).
_ARCH_ARGS = {"model_args": "--arch-args"}

# The common options, as the parameters analysis_command adds to each command's signature.
_COMMON = OptionSet(CommonOptions)


def analysis_command(app, name: str):
    """Register ``func(opts: CommonOptions, checkpoint, **own_options) -> Outcome`` as command ``name``.

    The common options (docs/index.md) are added to the command's signature
    here, once, so every analysis command spells them the same way.
    """
    import functools
    import inspect
    import typing

    def decorate(func):
        sig = inspect.signature(func)
        hints = typing.get_type_hints(
            func, include_extras=True
        )  # resolve string annotations in func's module
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in sig.parameters.values()
            if p.name != "opts"
        ]
        extra = _COMMON.parameters()
        positional = [p for p in own if p.kind != inspect.Parameter.KEYWORD_ONLY]
        keyword = [p for p in own if p.kind == inspect.Parameter.KEYWORD_ONLY]

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            opts = _COMMON.build(kwargs)
            bound = sig.bind(opts, *args, **kwargs)
            bound.apply_defaults()
            opts.command_options = {k: v for k, v in bound.arguments.items() if k != "opts"}
            runner.run_command(
                name,
                opts.json,
                opts.quiet,
                lambda: func(opts, *args, **kwargs),
                threads=opts.threads,
                debug=opts.debug,
                verbose=opts.verbose,
                aliases=_ARCH_ARGS,
            )

        # the signature typer reads (inspect honours __signature__; typeshed does not declare it)
        wrapper.__signature__ = sig.replace(  # type: ignore[attr-defined]
            parameters=positional + keyword + extra, return_annotation=None
        )
        wrapper.__annotations__ = {p.name: p.annotation for p in positional + keyword + extra}
        del wrapper.__wrapped__
        return app.command(name, cls=LazyHelpCommand)(wrapper)

    return decorate


def open_session(
    checkpoint: str, opts: CommonOptions, curvature: bool = True, double_backward: bool = True
):
    """Build the analysis session from a checkpoint and the common options (``curvature``:
    whether the command differentiates the model twice, see
    :func:`sharpcli.preflight.check_second_derivatives`; ``double_backward=False``: its
    Hessian products are differences of gradients, so that check is skipped).

    The session's notes (what was done to the data, e.g. float token ids converted to int64)
    go to stderr as ``sharp: note: ...`` lines (rank 0, not under ``--quiet``); the report
    carries them in ``data.notes`` either way.
    """
    # imports torch: kept out of start-up
    from sharpcli.session import build_session

    kwargs = opts.settings()
    kwargs["arch_args"] = parse_json_option(opts.arch_args, "--arch-args")
    session = build_session(
        checkpoint, curvature=curvature, double_backward=double_backward, **kwargs
    )
    runner.print_notes(session.notes, opts.quiet)
    return session
