"""What every command shares: the common options, the run wrapper, output.

``run_command`` is the one place that turns a library call into output and an
exit code: it times the call, renders tables (stdout) or writes JSON
(``--json PATH`` atomically, ``--json -`` as the only thing on stdout), turns
``SharpError`` into one line on stderr plus a JSON error object, and maps
errors to the exit codes of docs/index.md ("Exit codes").
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console

from sharpcli import SCHEMA_ID, __version__, distributed
from sharpcli.errors import EXIT_GATE, EXIT_OK, SharpError, UsageError
from sharpcli.io.atomic import check_writable, write_text_atomic
from sharpcli.report.envelope import dumps

stdout_console = Console(highlight=False)
stderr_console = Console(stderr=True, highlight=False)
# Width of tables written to a pipe or a file (rich's default there is 80 columns, which folds
# the digits of a number across lines in the wider tables: 0.00010 / 2546).
PIPE_WIDTH = 200


def table_console() -> Console:
    """The console tables are rendered on: ``stdout_console`` on a terminal (its width) or when
    ``COLUMNS`` is set; otherwise (stdout is a pipe or a file) one ``PIPE_WIDTH`` columns wide."""
    if stdout_console.is_terminal or os.environ.get("COLUMNS"):
        return stdout_console
    return Console(highlight=False, width=PIPE_WIDTH)


# Annotated option types, declared once and reused by every command.
DataOpt = Annotated[
    Optional[str],
    typer.Option(
        "--data",
        help="Dataset: built-in 'blobs[:k=v,..]', 'images[:k=v,..]', or a path (tensor file, .csv/.parquet, CIFAR or MNIST folder). Default: the checkpoint's own data.",
    ),
]
LabelColumnOpt = Annotated[
    Optional[str],
    typer.Option(
        "--label-column", help="Label column of a .csv/.parquet dataset (default 'label')."
    ),
]
SplitOpt = Annotated[str, typer.Option("--split", help="Analysis split: train or test.")]
SamplesOpt = Annotated[
    Optional[int], typer.Option("--samples", help="Use a fixed seeded random subset of N samples.")
]
BatchSizeOpt = Annotated[
    int, typer.Option("--batch-size", help="Batch size for streaming the analysis set.")
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:1, mps ...")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32 or float64.")]
SeedOpt = Annotated[
    int, typer.Option("--seed", help="Seed for every random choice (probes, subsets).")
]
JsonOpt = Annotated[
    Optional[str],
    typer.Option(
        "--json",
        help="Write the JSON report to PATH, or '-' for stdout (then nothing else goes to stdout).",
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or tables.")]
ArchOpt = Annotated[
    Optional[str],
    typer.Option(
        "--arch", help="Architecture of a foreign state_dict (mlp, cnn, vgg-small, resnet)."
    ),
]
ArchArgsOpt = Annotated[
    Optional[str], typer.Option("--arch-args", help="JSON arguments for --arch or --model-factory.")
]
FactoryOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model-factory", help="module:function returning the nn.Module for a foreign state_dict."
    ),
]
OutputOpt = Annotated[
    Optional[str],
    typer.Option(
        "--output",
        help="Which of the model's outputs are the logits: an index of a tuple (0, 1, -1), a "
        "dict key or an attribute. Default: the tensor itself, .logits / 'logits', else the "
        "first tensor.",
    ),
]
TrustPickleOpt = Annotated[
    bool,
    typer.Option(
        "--trust-pickle", help="Allow loading a pickled whole module (runs code from the file)."
    ),
]
CacheOpt = Annotated[
    int,
    typer.Option(
        "--cache-mb",
        help="Memory for cached first-order graphs (faster products); 0 recomputes them per product, bounding memory by one batch.",
    ),
]
ParamsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--params",
        help="Parameter scope: all (default), last (final linear layer), or a glob on parameter names.",
    ),
]


def _option(annotated, default):
    """A :class:`CommonOptions` field: its default and, in its metadata, its typer option."""
    return field(default=default, metadata={"option": annotated})


@dataclass
class CommonOptions:
    """The options shared by the analysis commands (docs/index.md), declared once: each field's
    default is the option's default and its metadata the option (see :func:`analysis_command`).

    ``command_options`` holds the command's own options as the command received them (filled by
    :func:`analysis_command`), from which :meth:`report_settings` builds the report's settings.
    """

    data: str | None = _option(DataOpt, None)
    label_column: str | None = _option(LabelColumnOpt, None)
    split: str = _option(SplitOpt, "train")
    samples: int | None = _option(SamplesOpt, None)
    batch_size: int = _option(BatchSizeOpt, 256)
    device: str = _option(DeviceOpt, "cpu")
    dtype: str = _option(DtypeOpt, "float32")
    seed: int = _option(SeedOpt, 0)
    json: str | None = _option(JsonOpt, None)
    quiet: bool = _option(QuietOpt, False)
    arch: str | None = _option(ArchOpt, None)
    arch_args: str | None = _option(ArchArgsOpt, None)
    model_factory: str | None = _option(FactoryOpt, None)
    output: str | None = _option(OutputOpt, None)
    trust_pickle: bool = _option(TrustPickleOpt, False)
    cache_mb: int = _option(CacheOpt, 1024)
    command_options: dict = field(default_factory=dict, repr=False, compare=False)

    def settings(self) -> dict:
        """The common options that describe the analysis (not ``--json``/``--quiet``)."""
        return {
            k: v for k, v in asdict(self).items() if k not in ("json", "quiet", "command_options")
        }

    def report_settings(self, *, skip: tuple[str, ...] = (), **parsed) -> dict:
        """The report's ``settings``: :meth:`settings`, then the command's own options in the
        order the command declares them, less ``skip``; ``parsed`` gives the values to record
        instead of the raw ones (e.g. ``alpha=[0.1, 10.0]`` for ``--alpha 0.1,10``)."""
        own = {k: v for k, v in self.command_options.items() if k not in skip}
        return self.settings() | own | parsed


@dataclass
class Outcome:
    """What a command body returns: the report and how to show it to a person."""

    report: dict
    render: Callable[[Console], None] | None = None
    gate_tripped: bool = False


def state() -> dict:
    """Global flags set by the app callback (``--debug``)."""
    return _STATE


_STATE = {"debug": False}


def error_document(command: str, err: SharpError) -> dict:
    return {"schema": SCHEMA_ID, "command": command, "version": __version__, "error": err.to_json()}


def run_command(
    command: str,
    json_path: str | None,
    quiet: bool,
    body: Callable[[], Outcome],
    *,
    uses_models: bool = True,
    aliases: dict[str, str] | None = None,
) -> None:
    """Run ``body``, print or write its report, and exit with the right code.

    A command that runs models (``uses_models``) runs with attention that can be
    differentiated twice (:func:`sharpcli.curvature.attention.differentiable_attention`).
    ``aliases`` maps an option the library names (it serves several commands: model
    arguments are ``--arch-args``) to the option of this command that set the value
    (``train``: ``--model-args``), so an error never names an option the command lacks.
    """
    try:
        if json_path not in (None, "-"):
            check_writable(json_path, "--json")
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if uses_models:
                from sharpcli.curvature.attention import differentiable_attention

                stack.enter_context(differentiable_attention())
            outcome = body()
        outcome.report.setdefault("timing", {})
        outcome.report["timing"]["seconds"] = round(time.perf_counter() - start, 6)
        distributed.raise_if_peer_failed()  # data-parallel: did another rank fail after our last reduction?
    except SharpError as err:
        if aliases and err.source in aliases:
            err.source = aliases[err.source]
        raise typer.Exit(_report_error(command, json_path, err).exit_code)
    except KeyboardInterrupt:
        stderr_console.print("sharp: interrupted", markup=False)
        raise typer.Exit(130)
    except typer.Exit:
        raise
    except Exception as exc:  # a bug, not a user error: say so, traceback under --debug
        if _STATE["debug"]:
            traceback.print_exc()
        err = SharpError(
            f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)"
        )
        err.exit_code = 4
        raise typer.Exit(_report_error(command, json_path, err).exit_code)

    if not distributed.is_main_process():  # data-parallel: rank 0 alone prints and writes
        raise typer.Exit(EXIT_GATE if outcome.gate_tripped else EXIT_OK)
    if json_path == "-":
        sys.stdout.write(dumps(outcome.report))
    else:
        if json_path is not None:
            try:
                write_text_atomic(json_path, dumps(outcome.report))
            except OSError as exc:
                err = UsageError(
                    f"cannot write the report ({exc.strerror or exc})", source=json_path
                )
                _report_error(command, None, err)
                raise typer.Exit(err.exit_code) from None
        if not quiet and outcome.render is not None:
            console = table_console()
            outcome.render(console)
            for note in scope_notes(outcome.report.get("results")):
                console.print(f"note: {note}", markup=False)
    raise typer.Exit(EXIT_GATE if outcome.gate_tripped else EXIT_OK)


def scope_notes(results, depth: int = 3) -> list[str]:
    """The notes of every ``scope`` record in ``results`` (frozen parameters in or out), once each."""
    found: list[str] = []
    if not isinstance(results, dict) or depth < 0:
        return found
    scope = results.get("scope")
    if isinstance(scope, dict):
        found.extend(scope.get("notes") or [])
    for key, value in results.items():
        if key != "scope" and isinstance(value, dict):
            found.extend(n for n in scope_notes(value, depth - 1) if n not in found)
    return list(dict.fromkeys(found))


def _report_error(command: str, json_path: str | None, err: SharpError) -> SharpError:
    """Print (rank 0 only) and return the error every rank agrees on (see :mod:`sharpcli.distributed`)."""
    if _STATE["debug"]:
        traceback.print_exc()
    try:
        err = distributed.announce_failure(err)
    except (RuntimeError, SharpError):  # the process group is broken: report this rank's error
        pass
    # rank 0 prints, or for a stalled/dead peer the lowest rank not to blame
    if not (distributed.is_main_process() or getattr(err, "report_here", False)):
        return err
    print(f"sharp {command}: error: {err.one_line()}", file=sys.stderr)
    if json_path == "-":
        sys.stdout.write(dumps(error_document(command, err)))
    elif json_path is not None:
        try:
            write_text_atomic(json_path, dumps(error_document(command, err)))
        except OSError:
            pass
    return err


def parse_json_option(text: str | None, option: str) -> dict | None:
    """The JSON object an option gives (``--arch-args``, ``--model-args``), or None.

    Nesting is bounded (:func:`sharpcli.io.bounded.loads_json`, 32 levels as checkpoint
    metadata), so deeply nested text is a UsageError rather than a RecursionError.
    """
    import json

    from sharpcli.io.bounded import JsonTooDeep, loads_json

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
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(
            f"{text!r} is not a comma-separated list of numbers", source=option
        ) from None
    if not values:
        raise UsageError("needs at least one number", source=option)
    return values


def check_output(path: str | None, option: str = "--plot") -> None:
    """UsageError on ``option`` unless ``path`` can be written (nothing to check for None): an
    output file is checked before the work that fills it starts."""
    if path is not None:
        check_writable(path, option)


def require(condition: bool, message: str, option: str) -> None:
    if not condition:
        raise UsageError(message, source=option)


class _NoProgress:
    def __call__(self, *args, **kwargs) -> None:
        return None


def epoch_progress(disabled: bool, description: str):
    """A rich progress bar on stderr; yields ``callback(done, total, info)``."""
    import contextlib

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextlib.contextmanager
    def manager():
        if (
            disabled or not stderr_console.is_terminal or not distributed.is_main_process()
        ):  # no bars in logs, pipes, ranks > 0
            yield _NoProgress()
            return
        with Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=stderr_console,
            transient=True,
        ) as progress:
            task = progress.add_task(description, total=None, info="")

            def callback(done: int, total: int | None, info=None) -> None:
                text = ""
                if isinstance(info, dict) and "train_loss" in info:
                    text = f"loss {info['train_loss']:.4g}"
                elif isinstance(info, str):
                    text = info
                progress.update(task, completed=done, total=total, info=text)

            yield callback

    return manager()


# (name, typer option, default) of each common option, from the fields of CommonOptions.
_COMMON_PARAMS = [
    (f.name, f.metadata["option"], f.default)
    for f in fields(CommonOptions)
    if "option" in f.metadata
]


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
        extra = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
            for n, a, d in _COMMON_PARAMS
        ]
        positional = [p for p in own if p.kind != inspect.Parameter.KEYWORD_ONLY]
        keyword = [p for p in own if p.kind == inspect.Parameter.KEYWORD_ONLY]

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            common = {n: kwargs.pop(n) for n, _, _ in _COMMON_PARAMS}
            opts = CommonOptions(**common)
            bound = sig.bind(opts, *args, **kwargs)
            bound.apply_defaults()
            opts.command_options = {k: v for k, v in bound.arguments.items() if k != "opts"}
            run_command(name, opts.json, opts.quiet, lambda: func(opts, *args, **kwargs))

        wrapper.__signature__ = sig.replace(
            parameters=positional + keyword + extra, return_annotation=None
        )
        wrapper.__annotations__ = {p.name: p.annotation for p in positional + keyword + extra}
        wrapper.__wrapped__ = None
        del wrapper.__wrapped__
        return app.command(name)(wrapper)

    return decorate


def open_session(checkpoint: str, opts: CommonOptions):
    """Build the analysis session from a checkpoint and the common options.

    The session's notes (what was done to the data, e.g. float token ids converted to int64)
    go to stderr as ``sharp: note: ...`` lines (rank 0, not under ``--quiet``); the report
    carries them in ``data.notes`` either way.
    """
    from sharpcli.session import build_session

    kwargs = opts.settings()
    kwargs["arch_args"] = parse_json_option(opts.arch_args, "--arch-args")
    session = build_session(checkpoint, **kwargs)
    print_notes(session.notes, opts.quiet)
    return session


def print_notes(notes: list[str], quiet: bool) -> None:
    """One ``sharp: note: ...`` line on stderr per note (rank 0 only, nothing under --quiet)."""
    if quiet or not distributed.is_main_process():
        return
    for note in notes:
        print(f"sharp: note: {' '.join(note.split())}", file=sys.stderr)


def status(disabled: bool, text: str):
    """A spinner on stderr while a computation runs (no output in pipes, logs or --quiet)."""
    import contextlib

    if disabled or not stderr_console.is_terminal or not distributed.is_main_process():
        return contextlib.nullcontext()
    return stderr_console.status(text)
