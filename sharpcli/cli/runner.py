"""Running a command: the run wrapper, output, exit codes, threads and the results' notes.

:func:`run_command` is the one place that turns a library call into output and an exit
code: it times the call, renders tables (stdout) or writes JSON (``--json PATH``
atomically, ``--json -`` as the only thing on stdout), turns ``SharpError`` into one line on
stderr plus a JSON error object (the library's parameter names spelled as this command's
flags, :mod:`sharpcli.cli.flags`), and maps errors to the exit codes of docs/index.md
("Exit codes").
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import typer
from rich.console import Console

from sharpcli import SCHEMA_ID, __version__, distributed, interrupts, ledger, memory, phases
from sharpcli.atomic import publication, write_text_atomic
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
    :func:`sharpcli.curvature.products.differentiable.twice_differentiable`). ``debug`` (the command's
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
    start, cpu_at_start = time.perf_counter(), time.process_time()
    with contextlib.ExitStack() as stack:
        if uses_models:
            memory.bound_heap()  # freed tensors leave the resident set: the plan bounds it
            use_threads(threads)
            # torch, the curvature engine and the session's library (checkpoints, data,
            # models) are imported here, before the computation's clock starts: start-up
            import sharpcli.session  # noqa: F401
            from sharpcli.curvature.products.differentiable import twice_differentiable

            stack.enter_context(twice_differentiable())
        compute_start = time.perf_counter()
        # CPU seconds by phase (sharpcli.phases): what ran before the computation is start-up,
        # the whole process's for a command line, this call's for an in-process caller
        cpu_start = time.process_time()
        from_process_start = _STATE.get("started") is not None
        cpu_phases = phases.start(cpu_start - (0.0 if from_process_start else cpu_at_start))
        try:
            outcome = body()
            # what follows the products (or the whole analysis of a command without them)
            cpu_phases.mark(phases.REPORT if phases.marked(phases.PRODUCTS) else phases.ANALYSIS)
            timing_out = outcome.report.setdefault("timing", {})
            timing_out["cpu_seconds"] = cpu_phases.split()
            plan = memory.active()
            if plan is not None:  # what was planned beside what was measured
                timing_out["memory"] = plan.to_dict()
                if _STATE["verbose"]:
                    _STATE["notes"].append(plan.summary())
            if _STATE["verbose"]:
                _STATE["notes"].append(cpu_phases.summary())
        finally:
            memory.clear()  # the next command (in this process: tests, sweeps) plans anew
            phases.clear()
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
                loss_line = loss_provenance(outcome.report)
                if loss_line:
                    console.print(loss_line, markup=False)
                for note in scope_notes(outcome.report.get("results")):
                    print_note(note)
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


def loss_provenance(report: dict) -> str | None:
    """The line under an analysis's tables that names the loss differentiated and where it
    came from (the report's ``data.loss`` and ``data.loss_reason``); None for a report
    without one."""
    data = report.get("data")
    if not isinstance(data, dict) or not data.get("loss"):
        return None
    reason = data.get("loss_reason")
    return f"loss: {data['loss']}" + (f" ({reason})" if reason else "")


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
    bug = SharpError(
        f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)"
    )
    bug.exit_code = EXIT_INTERNAL
    return _report_error(command, json_path, bug).exit_code


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

    Torch's own default (one thread per core) oversubscribes a shared or busy machine, where
    one thread runs several times faster (docs/benchmarks.md, "Threads").
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


def print_note(note: str) -> None:
    """A note of the results: held until the report is printed, then one
    ``sharp: note: ...`` line on stderr (the library's `name` references spelled as this
    command's flags); a detail (:func:`is_detail`) only under ``--verbose``."""
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
