"""The ``sharp`` command: one Typer app, every command group registered here.

Only commands that work are registered. ``main`` runs the app so that a usage
error (unknown option, bad value) is one line on stderr with exit code 2 (and
a JSON error object when ``--json -`` was asked) instead of a usage panel.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from sharpcli import __version__
from sharpcli.cli import common

app = typer.Typer(
    name="sharp",
    help="Measure and control the sharpness of neural-network loss landscapes.",
    no_args_is_help=True,
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
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    """Measure and control the sharpness of neural-network loss landscapes."""
    common.state()["debug"] = debug


def _register() -> None:
    # Each module adds its commands to ``app``; imported here, in one place.
    from sharpcli.cli import cmd_analyze, cmd_compare, cmd_diagnostics, cmd_spectrum, cmd_sweep, cmd_train  # noqa: F401


_register()


def _json_requested(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--json" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--json="):
            return arg.split("=", 1)[1]
    return None


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
        print(f"sharp: error: torch.distributed: could not join the process group ({first})", file=sys.stderr)
        sys.exit(2)
    try:
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
        err.source = (opts[0] if opts else getattr(param, "name", None)) or getattr(exc, "option_name", None)
        if distributed.is_main_process():
            print(f"sharp {command}: error: {line}", file=sys.stderr)
            target = _json_requested(argv)
            if target == "-":
                sys.stdout.write(common.dumps(common.error_document(command, err)))
            elif target is not None:
                try:
                    from sharpcli.io.atomic import check_writable, write_text_atomic

                    check_writable(target, "--json")
                    write_text_atomic(target, common.dumps(common.error_document(command, err)))
                except (OSError, SharpError):
                    pass
        sys.exit(getattr(exc, "exit_code", 2) or 2)
    finally:
        distributed.cleanup()
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
