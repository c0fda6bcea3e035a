"""What every command shares: the common options, the run wrapper, output.

``run_command`` is the one place that turns a library call into output and an
exit code: it times the call, renders tables (stdout) or writes JSON
(``--json PATH`` atomically, ``--json -`` as the only thing on stdout), turns
``SharpError`` into one line on stderr plus a JSON error object (the library's parameter
names spelled as this command's flags, :mod:`sharpcli.cli.flags`), and maps errors to the exit
codes of docs/index.md ("Exit codes").
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from sharpcli import SCHEMA_ID, __version__, catalogue, distributed, interrupts, ledger, memory
from sharpcli.atomic import publication, write_text_atomic
from sharpcli.cli import choices
from sharpcli.cli.flags import spell_flags, to_cli_error
from sharpcli.errors import EXIT_GATE, EXIT_OK, SharpError, UsageError
from sharpcli.report.envelope import dumps

stdout_console = Console(highlight=False)
stderr_console = Console(stderr=True, highlight=False)
# Width of tables written to a pipe or a file when COLUMNS is not set. Tables never fold a
# number at any width (sharpcli.report.tables.FitTable): a narrow console splits them.
PIPE_WIDTH = 80


def table_console() -> Console:
    """The console tables are rendered on: ``stdout_console`` on a terminal (its width);
    otherwise (stdout is a pipe or a file) one ``COLUMNS`` (default ``PIPE_WIDTH``) wide."""
    if stdout_console.is_terminal:
        return stdout_console
    columns = os.environ.get("COLUMNS", "").strip()
    width = int(columns) if columns.isdigit() and int(columns) > 0 else PIPE_WIDTH
    return Console(highlight=False, width=width)


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
SplitOpt = Annotated[
    choices.Split,
    typer.Option("--split", rich_help_panel="Data", help="The dataset split that is analysed."),
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
        help="Activation (default: the model's); beta-gelu and augmented-relu take :beta=B, "
        "e.g. beta-gelu:beta=4.",
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
    x_key: str | None = _option(XKeyOpt, None)
    y_key: str | None = _option(YKeyOpt, None)
    shift_labels: bool | None = _option(ShiftLabelsOpt, None)
    split: str = _option(SplitOpt, "train")
    samples: int | None = _option(SamplesOpt, None)
    batch_size: int = _option(BatchSizeOpt, 256)
    device: str = _option(DeviceOpt, "cpu")
    dtype: str = _option(DtypeOpt, "float32")
    seed: int = _option(SeedOpt, 0)
    json: str | None = _option(JsonOpt, None)
    quiet: bool = _option(QuietOpt, False)
    verbose: bool = _option(VerboseOpt, False)
    arch: str | None = _option(ArchOpt, None)
    arch_args: str | None = _option(ArchArgsOpt, None)
    model_factory: str | None = _option(FactoryOpt, None)
    output: str | None = _option(OutputOpt, None)
    trust_pickle: bool = _option(TrustPickleOpt, False)
    cache_mb: int | None = _option(CacheOpt, None)
    max_memory: str | None = _option(MaxMemoryOpt, None)
    token_reduction: str = _option(TokenReductionOpt, "tokens")
    threads: int | None = _option(ThreadsOpt, None)
    debug: bool = _option(DebugOpt, False)
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


@dataclass
class Outcome:
    """What a command body returns: the report and how to show it to a person."""

    report: dict
    render: Callable[[Console], None] | None = None
    gate_tripped: bool = False
    notice: str | None = None  # one line on stderr after the output, even under --quiet
    exit_code: int | None = None  # instead of 0 / 1 (gate): the run's outputs are published


def state() -> dict:
    """Global flags set by the app callback (``--debug``)."""
    return _STATE


_STATE: dict = {"debug": False, "verbose": False, "notes": []}


def error_document(command: str, err: SharpError) -> dict:
    """The JSON document of a failed ``command``: schema, command, version and the error."""
    return {"schema": SCHEMA_ID, "command": command, "version": __version__, "error": err.to_json()}


def run_command(
    command: str,
    json_path: str | None,
    quiet: bool,
    body: Callable[[], Outcome],
    *,
    uses_models: bool = True,
    threads: int | None = None,
    debug: bool = False,
    aliases: dict[str, str] | None = None,
    verbose: bool = False,
) -> None:
    """Run ``body``, print or write its report, and exit with the right code.

    Everything the command writes (the ``--json`` report, checkpoints, side files, plots) is
    staged in one publication and published at the very end, after the tables are printed
    (:mod:`sharpcli.atomic`): a run that fails (exit 2, 3, 4) or is stopped by SIGINT/SIGTERM
    (130, 143; :mod:`sharpcli.interrupts`) replaces nothing. The files the command reads and
    writes are recorded (:mod:`sharpcli.ledger`) so that no output lands on an input. A
    reader that closes stdout early (``--json - | head``) ends the run quietly with 141, the
    status of a process killed by SIGPIPE; the files are still published.
    A command that runs models (``uses_models``) runs on ``threads`` CPU threads
    (:func:`use_threads`) with forward passes that can be differentiated twice (attention,
    weight normalisation, embedding bags, reentrant checkpoints:
    :func:`sharpcli.curvature.differentiable.twice_differentiable`). ``debug`` (the command's
    own ``--debug``) shows tracebacks as ``sharp --debug`` does. ``aliases`` maps an option the
    library names (model arguments are ``--arch-args``) to the option of this command that set
    the value (``train``: ``--model-args``), so an error never names an option the command lacks.
    The notes of the results go to stderr after the report (:func:`print_note`; ``verbose``
    adds those on how the numbers were computed).
    """
    _STATE["debug"] = _STATE["debug"] or debug
    _STATE["verbose"], _STATE["notes"] = verbose, []
    with ledger.scope():
        try:
            with publication(own=True, final=True):
                outcome = _run_body(json_path, body, uses_models, threads)
                stdout_lost = _deliver(outcome, json_path, quiet)
        except typer.Exit:
            raise
        except (Exception, KeyboardInterrupt, interrupts.Interrupted) as exc:
            if aliases and isinstance(exc, SharpError) and exc.source in aliases:
                exc.source = aliases[exc.source]
            raise typer.Exit(_failure_code(command, json_path, exc)) from None
    _print_notice(command, outcome.notice)
    if stdout_lost:
        raise typer.Exit(EXIT_STDOUT_GONE)
    if outcome.exit_code is not None:
        raise typer.Exit(outcome.exit_code)
    raise typer.Exit(EXIT_GATE if outcome.gate_tripped else EXIT_OK)


# The exit status of a command whose stdout reader went away (closed pipe, closed descriptor):
# 128 + SIGPIPE, what a shell reports for a writer that SIGPIPE killed (``yes | head -1``).
EXIT_STDOUT_GONE = 141
EXIT_INTERNAL = 4


def _run_body(
    json_path: str | None, body: Callable[[], Outcome], uses_models: bool, threads: int | None
) -> Outcome:
    """Declare ``--json``, honour a signal that came during start-up, run ``body`` (timed)."""
    if json_path not in (None, "-"):
        ledger.declare_output(json_path, "json")
    interrupts.start()
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if uses_models:
            use_threads(threads)
            # torch, the curvature engine and the session's library (checkpoints, data,
            # models) are imported here, before the computation's clock starts: start-up
            import sharpcli.session  # noqa: F401
            from sharpcli.curvature.differentiable import twice_differentiable

            stack.enter_context(twice_differentiable())
        compute_start = time.perf_counter()
        try:
            outcome = body()
            plan = memory.active()
            if plan is not None:  # what was planned beside what was measured
                outcome.report.setdefault("timing", {})["memory"] = plan.to_dict()
                if _STATE["verbose"]:
                    _STATE["notes"].append(plan.summary())
        finally:
            memory.clear()  # the next command (in this process: tests, sweeps) plans anew
            if "sharpcli.losses" in sys.modules:  # and averages token losses per its options
                sys.modules["sharpcli.losses"].clear_token_reduction()
    end = time.perf_counter()
    started = _STATE.pop("started", None)  # set by cli.app.main for this command only
    timing = outcome.report.setdefault("timing", {})
    timing["seconds"] = round(end - start, 6)
    timing["startup_seconds"] = round(
        compute_start - (start if started is None else min(started, start)), 6
    )
    timing["compute_seconds"] = round(end - compute_start, 6)
    distributed.raise_if_peer_failed()  # data-parallel: did another rank fail after our last reduction?
    return outcome


def _deliver(outcome: Outcome, json_path: str | None, quiet: bool) -> bool:
    """Stage the ``--json`` report, print the report or tables; True when stdout is gone.

    Rank 0 alone prints and writes under data-parallel runs.
    """
    if not distributed.is_main_process():
        return False
    text = dumps(outcome.report)
    if json_path not in (None, "-"):
        write_text_atomic(json_path, text)  # staged: published with the command's other files
    try:
        if json_path == "-":
            sys.stdout.write(text)
        elif not quiet and outcome.render is not None:
            console = table_console()
            with console.capture() as captured:  # rich exits 1 on a closed pipe: write it here
                outcome.render(console)
                for note in scope_notes(outcome.report.get("results")):
                    print_note(console, note)
                plot = written_plot(outcome.report)
                if plot:
                    console.print(f"plot written to {plot}", markup=False)
            sys.stdout.write(captured.get())
        sys.stdout.flush()
        _flush_notes()
    except (OSError, ValueError) as exc:
        if not stdout_gone(exc):
            raise
        silence_stdout()
        return True
    return False


def stdout_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says that stdout has no reader: a closed pipe or descriptor."""
    if isinstance(exc, BrokenPipeError):
        return True
    if isinstance(exc, OSError):
        return exc.errno in (errno.EPIPE, errno.EBADF)
    return isinstance(exc, ValueError) and "closed file" in str(exc)


def silence_stdout() -> None:
    """Point stdout at /dev/null so that nothing more (the interpreter's last flush) fails."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _failure_code(command: str, json_path: str | None, exc: BaseException) -> int:
    """Report a failed or stopped run (one stderr line, the JSON error object) and return its
    exit status; nothing was published (:func:`run_command`).

    A signal wins over any error it caused: library code can turn the exception a signal raises
    into another one, or swallow it and fail later.
    """
    signum = interrupts.received()
    if isinstance(exc, interrupts.Interrupted):
        signum = exc.signum
    elif isinstance(exc, KeyboardInterrupt):
        signum = signum or signal.SIGINT
    if signum is not None:
        if _STATE["debug"]:
            traceback.print_exception(exc)
        return interrupts.report(command, signum)
    exc = memory.as_usage_error(exc) or exc  # an allocation that failed: exit 2, not 4
    if isinstance(exc, SharpError):
        return _report_error(command, json_path, exc).exit_code
    if isinstance(exc, NotImplementedError) and "derivative for" in str(exc):
        # a layer of the user's model that torch cannot differentiate twice (and that
        # twice_differentiable has no composite for): a limit of the model, not a bug of ours
        err = UsageError(
            f"the model uses an operation torch cannot differentiate twice ({str(exc).rstrip('.')}); this "
            "command needs second derivatives (Hessian products or a second-order regularizer)"
        )
        return _report_error(command, json_path, err).exit_code
    # a bug, not a user error: say so (the traceback under --debug, by _report_error)
    err = SharpError(
        f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)"
    )
    err.exit_code = EXIT_INTERNAL
    return _report_error(command, json_path, err).exit_code


def written_plot(report: dict) -> str | None:
    """The PNG a command writes (``results.plot`` or ``settings.plot``), published with the
    command's other outputs when it succeeds."""
    results, settings = report.get("results") or {}, report.get("settings") or {}
    plot = (results.get("plot") if isinstance(results, dict) else None) or settings.get("plot")
    return plot if isinstance(plot, str) else None


def _print_notice(command: str, notice: str | None) -> None:
    """An :class:`Outcome`'s notice: one line on stderr (rank 0), even under --quiet."""
    if notice:
        print(f"sharp {command}: {notice}", file=sys.stderr)


def default_threads() -> int:
    """``--threads``' default: ``OMP_NUM_THREADS`` when set to a positive integer, else 1.

    Torch's own default (one thread per core) oversubscribes a shared or busy machine: on a
    loaded 2-core machine ``sharp analyze`` took 227 s with it and 18.5 s with one thread;
    docs/benchmarks.md ("Threads") has the measurements behind this choice.
    """
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) >= 1 else 1


def use_threads(threads: int | None) -> int:
    """Set torch's CPU threads to ``threads`` (``--threads``; None: :func:`default_threads`)
    before any work; the report's ``environment.threads`` records it."""
    if threads is not None and threads < 1:
        raise UsageError(f"must be at least 1, got {threads}", source="--threads")
    import torch

    count = default_threads() if threads is None else threads
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count


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
    """Print (rank 0 only) and return the error every rank agrees on (see :mod:`sharpcli.distributed`),
    in this command's spelling (:func:`sharpcli.cli.flags.to_cli_error`)."""
    if _STATE["debug"]:
        traceback.print_exc()
    err = to_cli_error(err, command)  # before the ranks compare errors: each spells its own
    try:
        err = distributed.announce_failure(err)
    except (RuntimeError, SharpError):  # the process group is broken: report this rank's error
        pass
    # rank 0 prints, or for a stalled/dead peer the lowest rank not to blame
    if not (distributed.is_main_process() or getattr(err, "report_here", False)):
        return err
    print(f"sharp {command}: error: {err.one_line()}", file=sys.stderr)
    if json_path == "-":
        try:
            sys.stdout.write(dumps(error_document(command, err)))
            sys.stdout.flush()
        except (OSError, ValueError) as exc:
            if not stdout_gone(exc):
                raise
            silence_stdout()
    elif json_path is not None and ledger.may_write_error_document(json_path):
        # not onto a file the command reads or another output (train --out X --json X)
        try:
            write_text_atomic(json_path, dumps(error_document(command, err)))
        except (OSError, SharpError):
            pass
    return err


def parse_json_option(text: str | None, option: str) -> dict | None:
    """The JSON object an option gives (``--arch-args``, ``--model-args``), or None.

    Nesting is bounded (:func:`sharpcli.bounded.loads_json`, 32 levels as checkpoint
    metadata), so deeply nested text is a UsageError rather than a RecursionError.
    """
    import json

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
    least one."""
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
    from sharpcli.cli.bars import progress_bar as bar

    return bar(stderr_console, quiet or json_path == "-", text)


# Option helps listed from the catalogue, by the text they showed when the option was made.
_LAZY_HELP: dict[str, Callable[[], str]] = {}


def lazy_help(make: Callable[[], str]) -> str:
    """An option's help listed from a registry of :mod:`sharpcli.catalogue` (operators).

    typer builds every command's options when ``sharp`` starts, before a plugin may register
    more entries; the help is ``make()`` then and again when it is shown, so it lists the
    entries registered in this process too. ``make`` must import no torch. Use on a command
    registered with ``cls=LazyHelpCommand`` (every :func:`analysis_command` is).

    Args:
        make: the help text, from the catalogue.

    Returns:
        The help as it reads now.
    """
    text = make()
    _LAZY_HELP[text] = make
    return text


def plain_flags(params) -> None:
    """Show no value type where it says nothing: flags and arguments.

    typer's help prints each parameter's type next to it, also for flags that take no value
    (``--quiet <bool>``, ``--help`` included) and for arguments, which their metavar names
    already (``CKPT <str>``, ``REPORT <list[str]>``); an empty metavar blanks a flag's, and
    arguments get no type column."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
        elif getattr(param, "param_type_name", None) == "argument":
            param.display_type_rich = _no_type


def _no_type(ctx) -> None:
    return None


@contextlib.contextmanager
def first_long_names_only(params):
    """Show one long name per option while help is formatted: the option's current name.

    A renamed option keeps its former spelling as a second name (``--eig-tol`` / ``--tol``),
    which parses as before and which the option's help text names; listed beside the current
    name it would widen the names column until, at 80 columns, names are cut and choices
    wrap. Parsing is untouched: the names are restored afterwards."""
    saved = []
    for param in params:
        opts = list(getattr(param, "opts", None) or ())
        long_names = [o for o in opts if o.startswith("--")]
        if len(long_names) > 1:
            saved.append((param, opts))
            param.opts = [o for o in opts if not o.startswith("--") or o == long_names[0]]
    try:
        yield
    finally:
        for param, opts in saved:
            param.opts = opts


class LazyHelpCommand(TyperCommand):
    """A typer command whose :func:`lazy_help` option helps are resolved when shown, whose
    flags show no ``<bool>`` (:func:`plain_flags`), and whose renamed options show their
    current name (:func:`first_long_names_only`); every ``sharp`` command is one."""

    def format_help(self, ctx, formatter) -> None:
        """Read the lazy option helps again, then format the help."""
        for param in self.params:
            make = _LAZY_HELP.get(getattr(param, "help", None) or "")
            if make is not None:
                param.help = make()
                _LAZY_HELP[param.help] = make
        from sharpcli.cli.helptext import format_command_help

        format_command_help(self, ctx)


class SharpGroup(TyperGroup):
    """The ``sharp`` group: its flags (``--version``, ``--debug``, ``--help``) show no
    ``<bool>`` either."""

    def format_help(self, ctx, formatter) -> None:
        """Blank the flags' value type (:func:`plain_flags`), then format the help."""
        from sharpcli.cli.helptext import format_group_help

        format_group_help(self, ctx)


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
            run_command(
                name,
                opts.json,
                opts.quiet,
                lambda: func(opts, *args, **kwargs),
                threads=opts.threads,
                debug=opts.debug,
                verbose=opts.verbose,
            )

        wrapper.__signature__ = sig.replace(
            parameters=positional + keyword + extra, return_annotation=None
        )
        wrapper.__annotations__ = {p.name: p.annotation for p in positional + keyword + extra}
        wrapper.__wrapped__ = None
        del wrapper.__wrapped__
        return app.command(name, cls=LazyHelpCommand)(wrapper)

    return decorate


def open_session(checkpoint: str, opts: CommonOptions, curvature: bool = True):
    """Build the analysis session from a checkpoint and the common options (``curvature``:
    whether the command differentiates the model twice, see
    :func:`sharpcli.preflight.check_second_derivatives`).

    The session's notes (what was done to the data, e.g. float token ids converted to int64)
    go to stderr as ``sharp: note: ...`` lines (rank 0, not under ``--quiet``); the report
    carries them in ``data.notes`` either way.
    """
    from sharpcli.session import build_session

    kwargs = opts.settings()
    kwargs["arch_args"] = parse_json_option(opts.arch_args, "--arch-args")
    session = build_session(checkpoint, curvature=curvature, **kwargs)
    print_notes(session.notes, opts.quiet)
    return session


def print_notes(notes: list[str], quiet: bool) -> None:
    """One ``sharp: note: ...`` line on stderr per note (rank 0 only, nothing under --quiet)."""
    if quiet or not distributed.is_main_process():
        return
    for note in notes:
        print(f"sharp: note: {' '.join(spell_flags(note).split())}", file=sys.stderr)


# Notes on how the numbers were computed, not on what to do: shown under --verbose only.
DETAIL_NOTES = (
    "residuals are explicit",
    "residuals computed by sharpcli's native",
    "warm start:",
)


def is_detail(note: str) -> bool:
    """Whether ``note`` says how a number was computed (:data:`DETAIL_NOTES`), which only
    ``--verbose`` shows, rather than something the user may act on."""
    return note.startswith(DETAIL_NOTES)


def print_note(console, note: str) -> None:
    """A note of the results: held until the report is printed, then one
    ``sharp: note: ...`` line on stderr (the library's `name` references spelled as this
    command's flags); a detail (:func:`is_detail`) only under ``--verbose``. ``console`` is
    the table console the note used to be printed on (stdout is the report's alone)."""
    if is_detail(note) and not _STATE["verbose"]:
        return
    if note not in _STATE["notes"]:
        _STATE["notes"].append(note)


def _flush_notes() -> None:
    """The held notes on stderr, each wrapped at the terminal's width (``COLUMNS``, else 80
    off a terminal) with its continuation lines indented."""
    import textwrap

    notes, _STATE["notes"] = _STATE["notes"], []
    columns = os.environ.get("COLUMNS", "").strip()
    width = (
        stderr_console.width
        if stderr_console.is_terminal
        else int(columns)
        if columns.isdigit() and int(columns) > 0
        else PIPE_WIDTH
    )
    for note in notes:
        text = f"sharp: note: {' '.join(spell_flags(note).split())}"
        lines = textwrap.wrap(text, width - 1, subsequent_indent="  ", break_long_words=False)
        print("\n".join(lines), file=sys.stderr)
