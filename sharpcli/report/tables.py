"""Rich tables for people: number formatting and tables that never fold a number.

A rich table narrower than its content folds cells across lines, so ``0.0894901`` becomes
``0.08949`` over ``01``: two numbers to a reader. :class:`FitTable` instead splits its
columns over as many tables as the console's width needs, repeating the key column (the
row label) in each, and never wraps a cell; only text columns (names, paths) are cut, with
an ellipsis, and only when a single column does not fit beside the key. Every table of
``sharp`` goes through :func:`key_value_table`, :func:`records_table` or :class:`FitTable`
(a test renders each command's at 80 and 60 columns).
"""

from __future__ import annotations

import math
import re

from rich.cells import cell_len
from rich.console import JustifyMethod
from rich.table import Table

# A cell that reads as one number (or a flag): never cut, never wrapped.
_ATOM = re.compile(
    r"^(?:[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan|-|yes|no|True|False)$"
)
_MIN_TEXT = 6  # a cut text column keeps at least this many cells (with the ellipsis)


def fmt(value, digits: int = 6) -> str:
    """A number with ``digits`` significant digits; None/NaN as '-'; bools as yes/no."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v, digits) for v in value)
    return str(value)


class FitTable:
    """A table of formatted cells that fits the console without folding a number.

    ``headers`` and ``rows`` (lists of strings); the first ``key`` columns label the rows and
    are repeated in every part when the columns are split over several tables (the title on
    the first). A column is *text* unless every cell reads as one number; only text columns
    are ever cut (ellipsis), numbers and headers always keep their full width. Text columns
    are left-justified, numbers right-justified, unless ``justify`` says otherwise.
    """

    def __init__(
        self,
        title: str | None,
        headers: list[str],
        rows: list[list[str]],
        *,
        key: int = 1,
        justify: list[JustifyMethod] | None = None,
    ):
        self.title = title
        self.headers = list(headers)
        self.rows = [list(r) for r in rows]
        self.key = max(0, min(key, len(self.headers) - 1))
        self.text = [
            not all(_ATOM.match(r[i].strip()) for r in self.rows) for i in range(len(self.headers))
        ]
        self.justify: list[JustifyMethod] = list(
            justify or ["left" if t else "right" for t in self.text]
        )
        self.natural = [
            max([cell_len(h), *(cell_len(r[i]) for r in self.rows)])
            for i, h in enumerate(self.headers)
        ]

    def _width(self, columns: list[int], widths: list[int] | None = None) -> int:
        widths = widths or self.natural
        return sum(widths[c] + 3 for c in columns) + 1  # padding 1+1, one border each, last

    def parts(self, width: int) -> list[list[int]]:
        """The column indices of each table: the key columns, then as many others as fit."""
        keys = list(range(self.key))
        parts: list[list[int]] = []
        current: list[int] = []
        for column in range(self.key, len(self.headers)):
            if current and self._width(keys + current + [column]) > width:
                parts.append(keys + current)
                current = []
            current.append(column)
        parts.append(keys + current)
        return parts

    def _fit(self, columns: list[int], width: int) -> list[int]:
        """Widths for ``columns``: natural, less what the widest text columns give up when
        the part is still too wide (a key with one column beside it at a narrow width)."""
        widths = list(self.natural)
        excess = self._width(columns, widths) - width
        for column in sorted(columns, key=lambda c: -widths[c]):
            if excess <= 0:
                break
            if self.text[column]:
                cut = min(excess, widths[column] - min(widths[column], _MIN_TEXT))
                widths[column] -= cut
                excess -= cut
        return widths

    def tables(self, width: int) -> list[Table]:
        """One rich table per part (:meth:`parts`) that fits in ``width``; the title on the
        first, which is at least as wide as its title (up to ``width``): a title never wraps
        above a narrow table."""
        out = []
        for n, columns in enumerate(self.parts(width)):
            widths = self._fit(columns, width)
            title = self.title if n == 0 else None
            spare = min(cell_len(title or ""), width) - self._width(columns, widths)
            if spare > 0:  # widen the columns evenly so that the title fits on one line
                widths = list(widths)
                for i, c in enumerate(columns):
                    widths[c] += spare // len(columns) + (i < spare % len(columns))
            table = Table(title=title)
            for c in columns:
                table.add_column(
                    self.headers[c],
                    justify=self.justify[c],
                    width=widths[c],
                    no_wrap=True,
                    overflow="ellipsis",  # only ever reached by a cut text column
                )
            for row in self.rows:
                table.add_row(*[row[c] for c in columns])
            out.append(table)
        return out

    def __rich_console__(self, console, options):
        yield from self.tables(options.max_width)


def key_value_table(title: str, rows: dict | list) -> FitTable:
    """A two-column (quantity, value) table of ``rows`` (a dict or key-value pairs)."""
    items = rows.items() if isinstance(rows, dict) else rows
    return FitTable(
        title,
        ["quantity", "value"],
        [[str(k), fmt(v)] for k, v in items],
        justify=["left", "right"],
    )


def records_table(
    title: str,
    records: list[dict],
    columns: list[str] | None = None,
    *,
    key: int = 1,
    digits: dict[str, int] | None = None,
    headers: dict[str, str] | None = None,
) -> FitTable:
    """One row per record; ``digits`` overrides the significant digits of some columns,
    ``headers`` their header (default the record key); the first ``key`` columns label rows."""
    columns = columns or list(dict.fromkeys(k for r in records for k in r))
    digits, headers = digits or {}, headers or {}
    return FitTable(
        title,
        [headers.get(c, c) for c in columns],
        [[fmt(r.get(c), digits.get(c, 6)) for c in columns] for r in records],
        key=key,
    )
