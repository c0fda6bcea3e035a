"""Library parameter names -> the flags of the running command, in one place.

Below ``cli/`` an error speaks in parameters (:mod:`sharpcli.errors`): a
``UsageError(message, source="max_matvecs")`` names the library parameter it is about, and a
message refers to a parameter in backticks, alone or with a value: ``"raise `max_matvecs`"``,
``"use `engine=native`"``. A library caller reads them as they are. When such an error reaches
the CLI's error reporting (:func:`sharpcli.cli.runner.run_command`, :func:`sharpcli.cli.app.main`),
:func:`to_cli_error` spells them as the running command's flags: source ``--max-matvecs``,
``"raise --max-matvecs"``, ``"use --engine native"``.

The mapping comes from the click commands themselves: each parameter's python ``name`` and its
``opts`` (``top_k`` -> ``--top-k``), those of the running command first, then those of any
command of the app (a checkpoint's model error names ``--model`` in ``eigen`` too). The running
command's spelling first also lets one parameter carry a flag named by its meaning there:
``tol`` is ``--eig-tol`` in ``eigen`` (a Lanczos residual) and ``--trace-tol`` in ``trace`` (a
relative standard error). A library parameter has the name of the CLI option's parameter
that sets it (``top_k``, ``max_matvecs``, ``steps``, ``broadening``, ``data``, ...), so a new
option needs no entry anywhere and no table maps one name to another.
"""

from __future__ import annotations

import re

from typer.main import get_current_context  # the click of typer's commands (typer's own copy)

from sharpcli.errors import SharpError

# `name` or `name=value` in a message: a library parameter, optionally with its value.
_PARAMETER_IN_TEXT = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)(?:=([^`]*))?`")


def _long_flag(param) -> str | None:
    """``--top-k`` for the option ``top_k`` (its first long flag); None for an argument."""
    opts = [o for o in getattr(param, "opts", ()) if o.startswith("-")]
    if getattr(param, "param_type_name", None) != "option" or not opts:
        return None
    return next((o for o in opts if o.startswith("--")), opts[0])


def _flags(command) -> dict[str, str]:
    """python name -> flag of every option of a click command."""
    found = {}
    for param in getattr(command, "params", ()):
        flag = _long_flag(param)
        if flag is not None and param.name:
            found[param.name] = flag
    return found


class FlagSpelling:
    """How the running command (``command``) spells library parameters, from the commands of
    the app (``commands``; click command objects)."""

    def __init__(self, command, commands):
        self.own = _flags(command) if command is not None else {}
        self.anywhere: dict[str, str] = {}
        for other in commands:
            for name, flag in _flags(other).items():
                self.anywhere.setdefault(name, flag)

    def flag(self, name: str) -> str | None:
        """The flag of library parameter ``name``, or None when no option sets it."""
        for table in (self.own, self.anywhere):
            if name in table:
                return table[name]
        return None

    def text(self, message: str) -> str:
        """``message`` with each known `name` / `name=value` spelled ``--flag`` / ``--flag value``."""

        def spell(match: re.Match) -> str:
            flag = self.flag(match.group(1))
            if flag is None:
                return match.group(0)
            value = match.group(2)
            return flag if value is None else f"{flag} {value}"

        return _PARAMETER_IN_TEXT.sub(spell, message)


def _running_commands(command_name: str | None, root=None):
    """(the running click command, every command of the app): from click's context inside a
    command; before one runs (``command_name`` from argv), from ``root``, the app's click group
    (none: no spelling)."""
    context = get_current_context(silent=True)
    if context is not None:
        top = context.find_root().command
        commands = list(getattr(top, "commands", {}).values()) or [context.command]
        return context.command, commands
    by_name = getattr(root, "commands", {})
    return by_name.get(command_name), list(by_name.values())


def to_cli_error(err: SharpError, command_name: str | None = None, root=None) -> SharpError:
    """``err`` with its parameter names spelled as the running command's flags (in place).

    The source is rewritten when it names a known parameter and is not a path
    (``source_is_path``: InputError, OutputPathError); the message's `name` references for
    every error. An error another rank raised (``propagated``) was rewritten there. Unknown
    names are left as the library wrote them. Outside a running command, ``root`` (the app's
    click group) and ``command_name`` say which command's flags to use.
    """
    if getattr(err, "propagated", False):
        return err
    spelling = FlagSpelling(*_running_commands(command_name, root))
    if not err.source_is_path and isinstance(err.source, str):
        err.source = spelling.flag(err.source) or err.source
    message = spelling.text(err.message)
    if message != err.message:
        err.message = message
        err.args = (message,)
    return err


def spell_flags(text: str) -> str:
    """``text`` (a note, a message) with its `name` references spelled as the running command's
    flags, as :func:`to_cli_error` does for errors."""
    if "`" not in text:
        return text
    return FlagSpelling(*_running_commands(None)).text(text)
