"""The ``sharp`` group: the Typer app every command module adds its commands to.

Its own options (``--version``, ``--debug``) and the bare ``sharp`` help are here; the command
modules import this module, and :mod:`sharpcli.cli.app` imports them (registration) and runs
the app, so no command module imports the module that imports it.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sharpcli import __version__
from sharpcli.cli import lazyhelp, runner

__all__ = ["app"]

app = typer.Typer(
    name="sharp",
    help="Measure and control the sharpness of neural-network loss landscapes.",
    invoke_without_command=True,  # bare ``sharp``: the help, exit 0 (see _root)
    # --install-completion / --show-completion: completion of commands, options and their
    # values (sharpcli/cli/choices.py) in bash, zsh, fish and PowerShell
    add_completion=True,
    cls=lazyhelp.SharpGroup,
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
    runner.state()["debug"] = debug
    if ctx.invoked_subcommand is None:  # bare ``sharp`` (or ``sharp --debug``): the help
        print(ctx.get_help())
        raise typer.Exit(0)
