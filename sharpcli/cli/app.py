"""The ``sharp`` command: one Typer app, every command group registered here.

Only commands that work are registered. ``main`` runs the app so that a usage
error (unknown option, bad value) is one line on stderr with exit code 2 (and
a JSON error object when ``--json -`` was asked) instead of a usage panel.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import typer

from sharpcli import distributed, interrupts, ledger
from sharpcli.atomic import write_text_atomic

# each command module adds its commands to the group's app when imported: here, in one place
from sharpcli.cli import (  # noqa: F401
    cmd_analyze,
    cmd_compare,
    cmd_diagnostics,
    cmd_diagonal,
    cmd_landscape,
    cmd_sharpness,
    cmd_spectrum,
    cmd_sweep,
    cmd_train,
    runner,
)
from sharpcli.cli.flags import to_cli_error
from sharpcli.cli.group import app
from sharpcli.errors import SharpError, UsageError

__all__ = ["app", "main"]


def _json_requested(argv: list[str]) -> str | None:
    """The ``--json`` target; the last one when given twice, as click takes it."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--json" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--json="):
            found = arg.split("=", 1)[1]
    return found


def _other_files(argv: list[str]) -> list[str]:
    """The tokens of ``argv`` that name existing files, except the ``--json`` value: files the
    command may read, onto which an error object must not go before the command could tell."""
    skip = set()
    for i, arg in enumerate(argv):
        if arg == "--json":
            skip.add(i + 1)
    tokens = [a.split("=", 1)[1] if a.startswith("--") and "=" in a else a for a in argv]
    return [
        t
        for i, t in enumerate(tokens)
        if i not in skip and not argv[i].startswith("--json=") and os.path.isfile(t)
    ]


def _write_json_error(argv: list[str], command: str, err) -> None:
    """The JSON error object for an error found before a command ran (``--json -`` or PATH).

    Not onto a file the command line names otherwise (``sharp eigen m.safetensors --json
    m.safetensors --bad-option`` keeps the checkpoint)."""

    target = _json_requested(argv)
    if target == "-":
        try:
            sys.stdout.write(runner.dumps(runner.error_document(command, err)))
            sys.stdout.flush()
        except (OSError, ValueError) as exc:
            if not runner.stdout_gone(exc):
                raise
            runner.silence_stdout()
    elif target is not None and not any(ledger.same_file(target, p) for p in _other_files(argv)):
        try:
            ledger.check_writable(target, "--json")
            write_text_atomic(target, runner.dumps(runner.error_document(command, err)))
        except (OSError, SharpError):
            pass


def _usage_error(argv: list[str], exc) -> int:
    """One stderr line (and the JSON error object) for click's usage errors; exit 2."""

    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    # typer's value coercion prefixes a refused choice with its validator's label:
    # "Invalid value for '--which': Value error, 'x' is not one of ..."
    message = message.replace(": Value error, ", ": ")
    command = argv[0] if argv and not argv[0].startswith("-") else "sharp"
    err = UsageError(message)
    line = err.one_line()  # click's message already names the option
    param = getattr(exc, "param", None)
    opts = list(getattr(param, "opts", None) or [])
    err.source = (opts[0] if opts else getattr(param, "name", None)) or getattr(
        exc, "option_name", None
    )
    if distributed.is_main_process():
        print(f"sharp {command}: error: {line}", file=sys.stderr)
        _write_json_error(argv, command, err)
    return getattr(exc, "exit_code", 2) or 2


def _run_app(argv: list[str]) -> int:
    """Run the Typer app on ``argv``; its exit status (see :func:`main`)."""

    command = argv[0] if argv and not argv[0].startswith("-") else None
    try:
        code = app(argv, prog_name="sharp", standalone_mode=False)
        code = code if isinstance(code, int) else 0
    except typer.Exit as exc:
        code = exc.exit_code
    except interrupts.Interrupted as exc:
        code = interrupts.report(command, exc.signum)
    except (KeyboardInterrupt, typer.Abort):
        code = interrupts.report(command, interrupts.received() or signal.SIGINT)
    except typer.exceptions.TyperException as exc:  # the vendored click's usage errors
        code = _usage_error(argv, exc)
    except (OSError, ValueError) as exc:  # --help or --version into a closed pipe
        if not runner.stdout_gone(exc):
            raise
        runner.silence_stdout()
        code = runner.EXIT_STDOUT_GONE
    signum = interrupts.received()
    if code == 0 and signum is not None and interrupts.mode() != "done":
        code = interrupts.report(command, signum)  # a deferred signal; nothing was published
    return code


def main(argv: list[str] | None = None, *, started: float | None = None) -> None:
    """Entry point of the ``sharp`` command (``sharpcli.__main__.main`` calls it).

    ``started``: the ``time.perf_counter()`` reading at which the process started
    (``sharpcli.__main__`` passes it), from which the report's ``timing.startup_seconds``
    is counted; in-process callers leave it out and start-up counts from this call.

    SIGINT and SIGTERM are handled by :mod:`sharpcli.interrupts` (installed here when the
    caller has not: in-process callers get their handlers back on return). Under ``torchrun``
    (``WORLD_SIZE > 1``) the process group is joined first and left on exit
    (:mod:`sharpcli.distributed`); only rank 0 prints.
    """

    runner.state()["started"] = time.perf_counter() if started is None else started
    installed_here = interrupts.install()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            distributed.init_from_environment(argv)
        except SharpError as err:
            command = argv[0] if argv and not argv[0].startswith("-") else None
            err = to_cli_error(err, command, typer.main.get_command(app))
            print(f"sharp: error: {err.one_line()}", file=sys.stderr)
            sys.exit(err.exit_code)
        except (RuntimeError, ValueError) as exc:  # rendezvous failed (address, port, timeout)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(
                f"sharp: error: torch.distributed: could not join the process group ({first})",
                file=sys.stderr,
            )
            sys.exit(2)
        try:
            code = _run_app(argv)
            interrupts.finishing()
        finally:
            distributed.cleanup()
    finally:
        if installed_here:
            interrupts.uninstall()
    sys.exit(code)


if __name__ == "__main__":
    main()
