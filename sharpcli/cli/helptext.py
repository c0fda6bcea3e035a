"""``--help`` that a person reads in an 80-column terminal.

typer's own rendering gives every option four columns (names, short name, value type,
help); at 80 columns the help column is ~19 characters wide, so ``sharp train --help`` ran
to 228 lines and value lists broke mid-word. Here each option is one row of two columns:

    --top-k N                Number of eigenvalues (at each end with --which
                             both). [default: 1]

the names with one placeholder (an upper-case word: ``N``, ``FLOAT``, ``PATH``, ``NAME``;
a closed set's placeholder is the option's name, ``--which WHICH``), then the help, the
values the option takes (a closed set's, or those shell completion offers for an open set
such as ``--reg``: the registry's names), the default and ``Required.``, wrapped at word
boundaries. Options are grouped in panels (``Model``, ``Data``, the command's own panel,
``Output``, ``Run``) by their ``rich_help_panel``; an option without one is in the command's
own panel (:data:`OWN_PANEL`). ``sharp --help`` lists the commands in the order of the
workflow (train, measure, compare) with a plain-words summary each (:data:`WORKFLOW`).

Only rich is imported (typer imports it already): help stays free of torch.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Iterable

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from sharpcli import catalogue

# The commands in the order a person uses them, each with a summary in plain words.
WORKFLOW: dict[str, str] = {e.name: e.summary for e in catalogue.COMMANDS.entries()}
# The panel of a command's options that declare none, where its declaration names one.
OWN_PANEL: dict[str, str] = {
    e.name: e.info["panel"] for e in catalogue.COMMANDS.entries() if "panel" in e.info
}
DEFAULT_OWN_PANEL = "Estimator"
# The widest the names column gets; longer names wrap at the space before the placeholder.
NAMES_WIDTH = 22
# Help is not spread wider than this on a wide terminal (lines stay readable).
MAX_WIDTH = 100


def _console() -> Console:
    """stdout at the terminal's width (``COLUMNS`` when set, 80 off a terminal), at most
    :data:`MAX_WIDTH`."""
    console = Console(highlight=False, soft_wrap=False)
    if console.width > MAX_WIDTH:
        console = Console(highlight=False, soft_wrap=False, width=MAX_WIDTH)
    return console


def placeholder(param) -> str:
    """The option's value placeholder: its metavar, its name for a closed set, ``N`` for an
    integer, ``FLOAT``, else ``VALUE``; empty for a flag."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    if param.metavar:
        return param.metavar
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None and descriptor.is_choice:
        return (param.name or "value").upper().replace("_", "-")
    annotation = getattr(descriptor, "annotation", None)
    placeholders: dict[object, str] = {int: "N", float: "FLOAT"}
    return placeholders.get(annotation, "VALUE")


def values_of(param, ctx) -> list[str]:
    """The values an option takes: a closed set's, or those shell completion offers (the
    built-in names of an open set: regularizers, operators, metrics); [] for free values."""
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None and descriptor.is_choice:
        return [str(c) for c in descriptor.choices or ()]
    if getattr(param, "_custom_shell_complete", None) is None:
        return []
    try:
        items = param.shell_complete(ctx, "")
    except Exception:  # a completer that needs more context: the help lists nothing
        return []
    return [str(getattr(item, "value", item)) for item in items]


def default_of(param, ctx) -> str | None:
    """The default shown as ``[default: x]``: not for flags that are off, empty lists,
    None, or an option whose help states its default in words."""
    if not getattr(param, "show_default", True) or getattr(param, "is_flag", False):
        return None
    if param.required or param.default is None:
        return None
    default = param.default
    if isinstance(default, (list, tuple)):
        if not default:
            return None
        return ",".join(map(str, default))
    text = str(getattr(default, "value", default))
    return text if text != "" else None


def describe(param, ctx) -> str:
    """The help column of one option: help, values, default, Required."""
    parts = [" ".join((param.help or "").split())]
    values = values_of(param, ctx)
    if values:
        parts.append("Values: " + ", ".join(values) + ".")
    default = default_of(param, ctx)
    if default is not None:
        parts.append(f"[default: {default}]")
    if param.required:
        parts.append("Required.")
    return " ".join(p for p in parts if p)


def names_of(param) -> str:
    """``--top-k N``, ``--quiet, -q``: the current long name, a short name, the placeholder."""
    if getattr(param, "param_type_name", None) == "argument":
        return placeholder(param) or (param.name or "").upper()
    opts = list(param.opts)
    long_names = [o for o in opts if o.startswith("--")]
    shorts = [o for o in opts if not o.startswith("--")]
    names = ", ".join(long_names[:1] + shorts)
    value = placeholder(param)
    return f"{names} {value}" if value else names


def panel_of(param, command_name: str) -> str:
    """The panel an option is shown in (module docstring)."""
    if getattr(param, "param_type_name", None) == "argument":
        return "Arguments"
    if "--help" in param.opts:
        return "Run"
    return getattr(param, "rich_help_panel", None) or OWN_PANEL.get(command_name, DEFAULT_OWN_PANEL)


def _ordered_panels(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    head = [n for n in ("Arguments", "Model", "Data") if n in names]
    tail = [n for n in ("Output", "Run") if n in names]
    return head + [n for n in names if n not in head + tail] + tail


def _panel(title: str, rows: list[tuple[str, str]], names_width: int) -> Panel:
    grid = Table.grid(padding=(0, 2), expand=True)
    grid.add_column(width=names_width, overflow="fold")
    grid.add_column(ratio=1, overflow="fold")
    for names, text in rows:
        grid.add_row(Text(names, style="bold cyan"), Text(text))
    return Panel(
        grid, title=title, title_align="left", box=box.ROUNDED, border_style="dim", padding=(0, 1)
    )


def _usage(command, ctx) -> str:
    pieces = [ctx.command_path]
    if any(getattr(p, "param_type_name", None) == "option" for p in command.params):
        pieces.append("[OPTIONS]")
    for param in command.params:
        if getattr(param, "param_type_name", None) != "argument":
            continue
        name = placeholder(param) or (param.name or "").upper()
        if param.nargs == -1:
            name += "..."
        pieces.append(name if param.required else f"[{name}]")
    return " ".join(pieces)


def _header(console: Console, usage: str, text: str | None) -> None:
    console.print(Text(f" Usage: {usage}", style="bold"), overflow="fold")
    console.print()
    for paragraph in inspect.cleandoc(text or "").split("\n\n"):
        words = " ".join(paragraph.split())
        if words:
            for line in textwrap.wrap(words, max(console.width - 2, 20), break_long_words=False):
                console.print(Text(f" {line}"), overflow="fold")
            console.print()


def format_command_help(command, ctx) -> None:
    """Print ``sharp COMMAND --help`` (module docstring)."""
    console = _console()
    params = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
    rows: dict[str, list[tuple[str, str]]] = {}
    for param in params:
        rows.setdefault(panel_of(param, command.name), []).append(
            (names_of(param), describe(param, ctx))
        )
    names_width = min(max(len(names) for panel in rows.values() for names, _ in panel), NAMES_WIDTH)
    _header(console, _usage(command, ctx), command.help)
    for title in _ordered_panels(rows):
        console.print(_panel(title, rows[title], names_width))


def format_group_help(group, ctx) -> None:
    """Print ``sharp --help``: usage, the group's options, the commands in workflow order."""
    console = _console()
    params = [p for p in group.get_params(ctx) if not getattr(p, "hidden", False)]
    options = [(names_of(p), describe(p, ctx)) for p in params]
    names = list(group.list_commands(ctx))
    ordered = [n for n in WORKFLOW if n in names] + [n for n in names if n not in WORKFLOW]
    commands = []
    for name in ordered:
        command = group.get_command(ctx, name)
        summary = WORKFLOW.get(name) or (command.get_short_help_str(limit=300) if command else "")
        commands.append((name, summary))
    width = min(max(len(n) for n, _ in options + commands), NAMES_WIDTH)
    _header(console, f"{ctx.command_path} [OPTIONS] COMMAND [ARGS]...", group.help)
    console.print(_panel("Commands", commands, width))
    console.print(_panel("Options", options, width))
    console.print(
        Text(f" Run '{ctx.command_path} COMMAND --help' for a command's options.", style="dim"),
        overflow="fold",
    )
