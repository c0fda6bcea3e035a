"""The click classes of ``sharp``'s commands and group, and option helps read when shown.

typer builds every option when ``sharp`` starts; :func:`lazy_help` lets an option's help
list a catalogue registry as it is when the help is shown (extensions included), and
:class:`LazyHelpCommand` / :class:`SharpGroup` format help through
:mod:`sharpcli.cli.helptext` with no ``<bool>`` after flags (:func:`plain_flags`) and one long
name per option (:func:`first_long_names_only`).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

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
            if not isinstance(param, (TyperOption, TyperArgument)):
                continue
            make = _LAZY_HELP.get(param.help or "")
            if make is not None:
                param.help = make()
                _LAZY_HELP[param.help] = make
        # loaded only when help is shown, not at every start-up
        from sharpcli.cli.helptext import format_command_help

        format_command_help(self, ctx)


class SharpGroup(TyperGroup):
    """The ``sharp`` group: its flags (``--version``, ``--debug``, ``--help``) show no
    ``<bool>`` either."""

    def format_help(self, ctx, formatter) -> None:
        """Blank the flags' value type (:func:`plain_flags`), then format the help."""
        # loaded only when help is shown, not at every start-up
        from sharpcli.cli.helptext import format_group_help

        format_group_help(self, ctx)
