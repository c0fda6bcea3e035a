"""The one ``NAME[:k=v,...]`` grammar, typed parameters, and the one error about names.

:func:`parse_spec` is the grammar of ``--reg``, ``--activation`` and the built-in datasets of
``--data``:

.. code-block:: text

    spec  := NAME [":" item ("," item)*]
    item  := VALUE | KEY "=" VALUE        (positional values first, where the kind allows them)

A :class:`Param` is one typed parameter of a named thing (type, default, range) and converts
the text a spec gives it. Every problem with a name or a parameter is one exception,
:class:`RegistryError` (a :class:`~sharpcli.errors.UsageError`: exit 2 in the CLI), naming the
kind, the bad name or value and what is accepted. :mod:`sharpcli.registry` builds on these.

This module imports nothing heavy (the standard library and :mod:`sharpcli.errors`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sharpcli.errors import UsageError

__all__ = ["Param", "RegistryError", "accepted_params", "format_value", "parse_spec"]


class RegistryError(UsageError, KeyError, TypeError, ValueError):
    """A name that is unknown, taken or malformed, or a bad parameter of a named thing.

    A :class:`~sharpcli.errors.UsageError` (exit 2 in the CLI) whose message names the kind,
    the name and what is accepted; ``source`` is the library parameter that named it. It is
    also a ``KeyError``, ``TypeError`` and ``ValueError``, the types the separate registries
    raised before they shared this one, so callers catching those keep working.
    """

    def __str__(self) -> str:
        """The message itself (``KeyError`` would quote it)."""
        return self.message


def format_value(value: Any) -> str:
    """A parameter value as the canonical spec writes it (``repr`` of a float: ``0.05``).

    Args:
        value: the value.

    Returns:
        Its text form.
    """
    if isinstance(value, float):
        return repr(value)
    return str(value)


@dataclass(frozen=True)
class Param:
    """One typed parameter of a named thing: ``NAME:key=value``.

    Attributes:
        name: the key.
        kind: ``"float"``, ``"int"`` or ``"choice"``.
        default: the value when it is not given.
        doc: one-line description.
        minimum: inclusive lower bound (numbers).
        below: exclusive upper bound (numbers).
        positive: strictly greater than 0 (numbers).
        choices: the admissible values of a ``"choice"``.
        auto: the word ``auto`` is accepted besides a number.
    """

    name: str
    kind: str
    default: Any
    doc: str
    minimum: float | None = None
    below: float | None = None
    positive: bool = False
    choices: tuple[Any, ...] = ()
    auto: bool = False

    def describe(self) -> str:
        """``name=default``, the admissible choices if any, and the description, on one line.

        Returns:
            The line.
        """
        allowed = ""
        if self.choices:
            allowed = " in {" + ", ".join(str(c) for c in self.choices) + "}"
        return f"{self.name}={format_value(self.default)}{allowed}: {self.doc}"

    def convert(self, owner: str, text: str, source: str | None = None) -> Any:
        """Parse ``text`` into this parameter's value.

        Args:
            owner: the name of the thing the parameter belongs to (starts the message).
            text: the value as typed.
            source: the library parameter an error names (``UsageError.source``).

        Returns:
            The typed value.

        Raises:
            RegistryError: a value of the wrong type or out of range.
        """
        raw = text.strip()
        if self.kind == "choice":
            return self._choice(owner, raw, source)
        if self.auto and raw.lower() == "auto":
            return "auto"

        try:
            number = float(raw)
        except ValueError:
            raise self._bad(owner, "a number or auto" if self.auto else "a number", raw, source)
        return self._checked(owner, number, raw, source)

    def accept(self, owner: str, value: Any, source: str | None = None) -> Any:
        """A value given as text (parsed by :meth:`convert`) or already typed (checked only).

        A typed value is never formatted and parsed again.

        Args:
            owner: the name of the thing the parameter belongs to (starts the message).
            value: the value, text or typed.
            source: the library parameter an error names (``UsageError.source``).

        Returns:
            The typed value.

        Raises:
            RegistryError: a value of the wrong type or out of range.
        """
        if isinstance(value, str):
            return self.convert(owner, value, source)
        if self.kind == "choice":
            if value not in self.choices:
                allowed = ", ".join(str(c) for c in self.choices)
                raise self._bad(owner, f"one of {allowed}", repr(value), source)
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(owner, "a number", repr(value), source)
        return self._checked(owner, value, repr(value), source)

    def _bad(self, owner: str, problem: str, raw: str, source: str | None) -> RegistryError:
        return RegistryError(f"{owner}: {self.name} must be {problem}; got {raw!r}", source=source)

    def _checked(self, owner: str, number: float, raw: str, source: str | None) -> Any:
        """``number`` as this parameter's type, once it is finite and in range."""
        if not math.isfinite(number):
            raise self._bad(owner, "finite", raw, source)
        if self.kind == "int":
            if not float(number).is_integer():
                raise self._bad(owner, "an integer", raw, source)
            number = int(number)
        elif self.kind == "float":
            number = float(number)
        if self.positive and number <= 0:
            raise self._bad(owner, "> 0", raw, source)
        if self.minimum is not None and number < self.minimum:
            raise self._bad(owner, f">= {self.minimum:g}", raw, source)
        if self.below is not None and number >= self.below:
            raise self._bad(owner, f"< {self.below:g}", raw, source)
        return number

    def _choice(self, owner: str, raw: str, source: str | None) -> Any:
        value: Any = raw
        if raw.lower() in self.choices:
            value = raw.lower()
        else:
            try:
                as_num = float(raw)
                value = int(as_num) if as_num.is_integer() else as_num
            except ValueError:
                pass
        if value not in self.choices:
            allowed = ", ".join(str(c) for c in self.choices)
            raise RegistryError(
                f"{owner}: {self.name} must be one of {allowed}; got {raw!r}", source=source
            )
        return value


def accepted_params(keys: Sequence[str]) -> str:
    """The parameter names as messages list them (``(none)`` for none).

    Args:
        keys: the parameter names.

    Returns:
        The text.
    """
    return ", ".join(keys) if keys else "(none)"


def parse_spec(
    text: str,
    keys_of: Callable[[str], Sequence[str] | None],
    *,
    positional: bool,
    source: str,
    unknown: Callable[[str], Exception],
) -> tuple[str, dict[str, str]]:
    """The one ``NAME[:k=v,...]`` grammar: split a spec into its name and its values.

    The name is case-insensitive and ``_`` stands for ``-``; blanks around items are
    ignored. With ``positional``, values without a key take the parameters in order and
    come before any ``key=value``; otherwise every item is ``key=value``.

    Args:
        text: the spec.
        keys_of: the parameter names of a name, in positional order; None for an unknown name.
        positional: whether values may be given without their key.
        source: the library parameter errors name.
        unknown: the error for an unknown name.

    Returns:
        The canonical name and ``{key: value text}`` of the values given.

    Raises:
        RegistryError: an empty spec or item, an unknown key, a key given twice, a
            positional value after a key or beyond the parameters, or a missing ``=``.
        Exception: what ``unknown`` returns, for an unknown name.
    """
    if not isinstance(text, str) or not text.strip():
        raise RegistryError(f"empty spec {text!r}", source=source)
    raw = text.strip()
    head, colon, body = raw.partition(":")
    name = head.strip().lower().replace("_", "-")
    found = keys_of(name)
    if found is None:
        raise unknown(head.strip() or raw)
    keys = list(found)

    def fail(message: str) -> RegistryError:
        return RegistryError(f"{name}: {message}", source=source)

    items = [item.strip() for item in body.split(",")] if body.strip() else []
    given: dict[str, str] = {}
    seen_keyword = False
    for position, item in enumerate(items):
        if not item:
            raise fail(f"empty parameter in {raw!r}; accepted: {accepted_params(keys)}")
        key, eq, value = item.partition("=")
        if eq:
            key = key.strip().lower()
            seen_keyword = True
            if not key or not value.strip():
                raise fail(f"expected key=value, got {item!r}")
            if key not in keys:
                raise fail(f"unknown parameter {key!r}; accepted: {accepted_params(keys)}")
        elif not positional:
            raise fail(f"expected key=value, got {item!r}")
        elif seen_keyword:
            raise fail(f"positional value {item!r} after a keyword in {raw!r}")
        elif position >= len(keys):
            raise fail(
                f"takes at most {len(keys)} positional parameter(s) "
                f"({accepted_params(keys)}); got {len(items)} in {raw!r}"
            )
        else:
            key, value = keys[position], item
        if key in given:
            raise fail(f"{key} given twice in {raw!r}")
        given[key] = value.strip()
    return name, given
