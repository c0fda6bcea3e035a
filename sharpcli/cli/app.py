"""The ``sharp`` command: one Typer app, every command group registered here.

Only commands that work are registered. ``main`` runs the app so that a usage
error (unknown option, bad value) is one line on stderr with exit code 2 (and
a JSON error object when ``--json -`` was asked) instead of a usage panel.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from sharpcli import __version__
from sharpcli.cli import common
from sharpcli.errors import SharpError

app = typer.Typer(
    name="sharp",
    help="Measure and control the sharpness of neural-network loss landscapes.",
    invoke_without_command=True,  # bare ``sharp``: the help, exit 0 (see _root)
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"sharp {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        Optional[bool],
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    """Measure and control the sharpness of neural-network loss landscapes."""
    common.state()["debug"] = debug
    if ctx.invoked_subcommand is None:  # bare ``sharp`` (or ``sharp --debug``): the help
        print(ctx.get_help())
        raise typer.Exit(0)


def _register() -> None:
    # Each module adds its commands to ``app``; imported here, in one place.
    from sharpcli.cli import (  # noqa: F401
        cmd_analyze,
        cmd_compare,
        cmd_diagnostics,
        cmd_spectrum,
        cmd_sweep,
        cmd_train,
    )


_register()


def _json_requested(argv: list[str]) -> str | None:
    """The ``--json`` target; the last one when given twice, as click takes it."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--json" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--json="):
            found = arg.split("=", 1)[1]
    return found


_OUTPUT_OPTIONS = ("--json", "--out", "--plot")


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def _output_clash(argv: list[str]):
    """``(error, paths)`` when an output option names a file the command line also reads or
    writes otherwise, else ``None``.

    ``sharp eigen m.safetensors --json m.safetensors`` would replace the checkpoint by its report,
    ``train --data d.npz --out d.npz`` the data by the model, ``train --out m --json m`` the
    checkpoint just written by the report; every one of them "succeeds" and loses a file. Any
    other token naming an existing file (the checkpoint, ``--data``, compared reports) counts as
    an input. Checked before any work, so nothing is read or written.
    """
    from sharpcli.errors import UsageError

    outputs, others = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in _OUTPUT_OPTIONS and eq:
            outputs.append((name, value))
        elif arg in _OUTPUT_OPTIONS and i + 1 < len(argv):
            outputs.append((arg, argv[i + 1]))
            i += 1
        else:
            others.append(value if arg.startswith("--") and eq else arg)
        i += 1
    seen: list[tuple[str, str]] = []
    for option, path in outputs:
        if path == "-":
            continue
        for token in others:
            if os.path.isfile(token) and _same_file(path, token):
                return UsageError(
                    f"{path} is also an input of this command; writing there would destroy it",
                    source=option,
                ), (path, token)
        for other_option, other in seen:
            if _same_file(path, other):
                return UsageError(
                    f"{path} is also the {other_option} file; one would overwrite the other",
                    source=option,
                ), (path, other)
        seen.append((option, path))
    return None


def _write_json_error(argv: list[str], command: str, err, avoid=()) -> None:
    """The JSON error object for an error found before a command ran (``--json -`` or PATH)."""
    target = _json_requested(argv)
    if target == "-":
        sys.stdout.write(common.dumps(common.error_document(command, err)))
    elif target is not None and not any(_same_file(target, p) for p in avoid):
        try:
            from sharpcli.io.atomic import check_writable, write_text_atomic

            check_writable(target, "--json")
            write_text_atomic(target, common.dumps(common.error_document(command, err)))
        except (OSError, SharpError):
            pass


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``sharp`` console script.

    Under ``torchrun`` (``WORLD_SIZE > 1``) the process group is joined first and left on exit
    (:mod:`sharpcli.distributed`); only rank 0 prints.
    """
    from sharpcli import distributed
    from sharpcli.errors import SharpError, UsageError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        distributed.init_from_environment(argv)
    except SharpError as err:
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
        clash = _output_clash(argv)
        if clash is not None:
            err, paths = clash
            command = argv[0] if argv and not argv[0].startswith("-") else "sharp"
            if distributed.is_main_process():
                print(f"sharp {command}: error: {err.one_line()}", file=sys.stderr)
                _write_json_error(argv, command, err, avoid=paths)
            sys.exit(err.exit_code)
        code = app(argv, prog_name="sharp", standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("sharp: aborted", file=sys.stderr)
        sys.exit(130)
    except typer.exceptions.TyperException as exc:  # the vendored click's usage errors
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
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
        sys.exit(getattr(exc, "exit_code", 2) or 2)
    finally:
        distributed.cleanup()
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
