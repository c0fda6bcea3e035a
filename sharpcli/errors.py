"""User-facing error types and their exit codes (docs/index.md, "Exit codes"; docs/json.md).

Every error a user can cause is raised as one of these; the CLI turns it into
one line on stderr (``sharp: error: <file>: <problem>``), a JSON error object
when ``--json`` was asked, and the exit code below. Anything else is a bug and
shows a traceback only under ``--debug``.

The library speaks in parameters: the ``source`` of a :class:`UsageError` (or of a
:class:`NumericalError` that a setting caused) is the name of the library parameter it is about
(``"max_matvecs"``), and a message refers to a parameter in backticks, with or without a value
(``"raise `max_matvecs`"``, ``"use `engine=native`"``). The CLI shows both as the running
command's flags (``--max-matvecs``, ``--engine native``; :mod:`sharpcli.cli.flags`). The
``source`` of an :class:`InputError` or an :class:`OutputPathError` is a file path
(``source_is_path``), never read as a parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EXIT_OK = 0
EXIT_GATE = 1
EXIT_USAGE = 2
EXIT_NUMERICAL = 3


class SharpError(Exception):
    """Base class: a message for the user, the file or parameter it concerns, an exit code."""

    exit_code = EXIT_USAGE
    kind = "error"
    source_is_path = False  # True: ``source`` is a file path, False: a parameter (or a label)
    propagated = False  # True: raised on another rank and re-raised here (sharpcli.distributed)

    def __init__(self, message: str, *, source: str | None = None, **details):
        super().__init__(message)
        self.message = message
        self.source = source  # the file path or library parameter the problem is about
        self.details = details

    def one_line(self) -> str:
        """The message on one line, prefixed by ``source`` unless the message already names it."""
        named = self.source and self.source not in self.message  # never name it twice
        text = f"{self.source}: {self.message}" if named else self.message
        return " ".join(text.split())  # never more than one line

    def to_json(self) -> dict:
        """The error as a JSON dict: type, message, exit code, source and the details
        that are set."""
        out = {"type": self.kind, "message": self.one_line(), "exit_code": self.exit_code}
        if self.source is not None:
            out["source"] = self.source
        out.update({k: v for k, v in self.details.items() if v is not None})
        return out


class UsageError(SharpError):
    """Bad or contradictory options (exit 2); ``source`` names the library parameter."""

    kind = "usage"


class OutputPathError(UsageError):
    """An output path that cannot be written (exit 2, a usage error); ``source`` is the path.

    Its own class so that the CLI never reads the path as a parameter name (an output file
    called ``model`` is not ``--model``).
    """

    source_is_path = True


class InputError(SharpError):
    """A missing, corrupt or inconsistent file or dataset (exit 2); ``source`` is its path."""

    kind = "input"
    source_is_path = True


class NumericalError(SharpError):
    """NaN/Inf or a breakdown during a computation (exit 3)."""

    exit_code = EXIT_NUMERICAL
    kind = "numerical"


class GateTripped(SharpError):
    """A ``--fail-if`` condition held (exit 1)."""

    exit_code = EXIT_GATE
    kind = "gate"


def check_positive(values: Sequence[float], name: str) -> None:
    """A UsageError on ``name`` (``sigma``, ``rho``, ``alpha``: the option or parameter giving
    the scales) unless ``values`` holds at least one number, each finite and > 0."""
    if not values:
        raise UsageError(f"needs at least one {name}", source=name)
    for value in values:
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(
                f"every {name} must be a finite number > 0, got {value:g}", source=name
            )


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (at most ``limit`` characters), or its type's
    name when it has none: what a one-line error quotes of a failure inside torch."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__
