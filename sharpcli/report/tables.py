"""Rich tables for people: number formatting and generic key/value tables."""

from __future__ import annotations

import math

from rich.table import Table


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


def key_value_table(title: str, rows: dict | list) -> Table:
    table = Table(title=title)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    items = rows.items() if isinstance(rows, dict) else rows
    for key, value in items:
        table.add_row(str(key), fmt(value))
    return table


def records_table(title: str, records: list[dict], columns: list[str] | None = None) -> Table:
    columns = columns or list(dict.fromkeys(k for r in records for k in r))
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right", overflow="fold")
    for r in records:
        table.add_row(*[fmt(r.get(c)) for c in columns])
    return table
