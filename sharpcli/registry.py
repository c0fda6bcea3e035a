"""One registry for everything that has a name, and one ``NAME[:k=v,...]`` grammar.

A :class:`Registry` holds the named things of one kind (regularizers, curvature operators,
data formats, losses, activations, ...). Each name has an :class:`Entry`: a declarative,
torch-free record (a one-line summary, typed :class:`Param` s with defaults and ranges, a
paper key of docs/references.md, data-parallel exactness, and the implementation as a
``"module:attr"`` string). The implementation is imported only when it is first asked for
(:meth:`Registry.get`), so ``sharp --help`` lists every name without importing torch.

Every problem with a name is one exception, :class:`~sharpcli.specs.RegistryError` (a
:class:`~sharpcli.errors.UsageError`: exit 2 in the CLI), naming the kind, the bad name and
the accepted names; :meth:`Registry.parse` reads ``NAME[:k=v,...]`` by the one grammar,
:func:`sharpcli.specs.parse_spec`.

This module imports nothing heavy (the standard library and :mod:`sharpcli.specs`).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, Mapping, Sequence, TypeVar

from sharpcli.specs import Param, RegistryError, format_value, parse_spec

__all__ = ["DECLARATION", "Entry", "Registry", "declaration", "declare", "resolve"]

T = TypeVar("T")

# a name as a CLI value: lower case letters, digits and '-', starting with a letter
NAME_PATTERN = re.compile(r"[a-z][a-z0-9-]*\Z")


@dataclass(frozen=True)
class Entry:
    """The declarative record of one named thing (torch-free).

    Attributes:
        name: what the CLI and the library call it.
        summary: one line for ``--help`` and the docs' tables.
        impl: ``"module:attr"`` of the implementation, imported on first use ("" for an
            extension registered with its object).
        params: its parameters, in positional order.
        paper: the key of docs/references.md it implements, or "".
        data_parallel: where it applies, ``None`` when averaging per-rank results is exact
            under torchrun, else the reason it is not.
        info: further facts of the kind (an operator's symbol, a format's extensions).
    """

    name: str
    summary: str
    impl: str = ""
    params: tuple[Param, ...] = ()
    paper: str = ""
    data_parallel: str | None = None
    info: Mapping[str, Any] = field(default_factory=dict)

    def spec_hint(self) -> str:
        """``name`` or ``name:k=default,...``: the entry written with its defaults.

        Returns:
            The text.
        """
        if not self.params:
            return self.name
        return (
            self.name + ":" + ",".join(f"{p.name}={format_value(p.default)}" for p in self.params)
        )


# the attribute :func:`declare` gives an implementation: ``(kind, Entry)``
DECLARATION = "__sharp_declaration__"
# whether :meth:`Registry.register` compares a built-in's declaration with the catalogue's
# index (off only while ``python -m sharpcli.catalogue.generate`` remakes the index)
CHECK_INDEX = True


def declare(
    kind: str,
    name: str,
    summary: str,
    *,
    params: Sequence[Param] = (),
    paper: str = "",
    data_parallel: str | None = None,
    info: Mapping[str, Any] | None = None,
) -> Callable[[T], T]:
    """Declare a named thing where it is implemented: a decorator of its function or class.

    The record it attaches is the one declaration of a built-in: ``python -m
    sharpcli.catalogue.generate`` collects every declared object of the package into the
    torch-free index (:mod:`sharpcli.catalogue.index`) that ``--help``, completion and the
    docs' tables read, and :meth:`Registry.get` imports the object from there on first use. An
    extension declares itself the same way and is added by :meth:`Registry.add`.

    Args:
        kind: the registry's kind (``"estimator"``, ``"operator"``, ``"regularizer"``).
        name: its name, a CLI value.
        summary: one line for ``--help`` and the docs' tables.
        params: its typed parameters, in positional order.
        paper: the key of docs/references.md it implements, or "".
        data_parallel: ``None`` when it is exact under torchrun, else the reason it is not.
        info: further facts of the kind (an operator's symbol).

    Returns:
        The decorator; it returns the object itself, its record in its ``__sharp_declaration__``.

    >>> @declare("estimator", "toy", "a toy")
    ... def toy():
    ...     pass
    >>> declaration(toy)[1].impl
    'sharpcli.registry:toy'
    """

    def mark(obj: T) -> T:
        impl = f"{obj.__module__}:{obj.__qualname__}"  # type: ignore[attr-defined]
        entry = Entry(name, summary, impl, tuple(params), paper, data_parallel, dict(info or {}))
        setattr(obj, DECLARATION, (kind, entry))
        return obj

    return mark


def declaration(obj: Any) -> tuple[str, Entry] | None:
    """The ``(kind, Entry)`` that :func:`declare` gave ``obj`` itself (not a base class's).

    Args:
        obj: a function or class.

    Returns:
        The declaration, or ``None``.
    """
    own = getattr(obj, "__dict__", {})
    return own.get(DECLARATION) if isinstance(own, Mapping) else None


def resolve(impl: str) -> Any:
    """The object that ``"module:attr"`` names, or the module that ``"module"`` names.

    Args:
        impl: the implementation string of an :class:`Entry`.

    Returns:
        The object (its module is imported).
    """
    module, _, attr = impl.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded


class Registry(Generic[T]):
    """The named things of one kind: entries in order, implementations resolved lazily.

    It reads like a dict of the implementations (``name in r``, ``r[name]``, ``list(r)``,
    ``r.items()``), where ``r[name]`` imports a built-in's module on first use and an unknown
    name is a :class:`RegistryError`. :meth:`register` adds an implementation (its entry is
    the built-in record of that name, or one given or made by ``make_entry``) once the kind's
    ``check`` accepts it, refusing a taken name unless ``replace=True``; :meth:`unregister`
    removes one, except the ``protected`` names.

    Args:
        kind: what one entry is, as messages say it (``"regularizer"``).
        source: the library parameter errors name by default (``"regs"``).
        entries: the built-in records, in the order messages and ``--help`` list them.
        protected: names :meth:`unregister` refuses.
        protected_reason: why, for its message.
        name_pattern: the names :meth:`register` accepts.
        check: the kind's validation, ``"module:attr"`` of a function ``(entry, obj) -> obj``
            that every implementation passes before it is added (it may make a built-in's
            declared object into the kind's record); imported at the first :meth:`register`,
            so a torch-free registry may name a torch module's function. "" accepts anything.
        make_entry: ``"module:attr"`` of a function ``(name, obj) -> Entry``: the record of
            an extension registered without one ("": a record with no summary).
    """

    def __init__(
        self,
        kind: str,
        *,
        source: str,
        entries: Sequence[Entry] = (),
        protected: Sequence[str] = (),
        protected_reason: str = "it is built in",
        name_pattern: re.Pattern[str] = NAME_PATTERN,
        check: str = "",
        make_entry: str = "",
    ):
        self.kind = kind
        self.source = source
        self.protected = tuple(protected)
        self.protected_reason = protected_reason
        self.name_pattern = name_pattern
        self._entries: dict[str, Entry] = {}
        self._objects: dict[str, T] = {}
        self.check_impl = check
        self.make_entry_impl = make_entry
        self._builtins: tuple[str, ...] = ()
        for entry in entries:
            self.declare(entry)

    # ------------------------------------------------------------------ the declarative side
    def declare(self, entry: Entry) -> None:
        """Add a built-in's record, as :mod:`sharpcli.catalogue` does for each of its entries.

        Its implementation is imported from ``entry.impl`` when first asked for, and
        :meth:`register` gives an implementation registered under its name this record.

        Args:
            entry: the record.

        Raises:
            RegistryError: a name already declared or registered.
        """
        if entry.name in self._entries:
            raise self.error(f"{self.kind} {entry.name!r} is declared twice")
        self._entries[entry.name] = entry
        self._builtins += (entry.name,)

    def error(self, message: str, source: str | None = None) -> RegistryError:
        """A :class:`RegistryError` with this registry's default source.

        Args:
            message: the message.
            source: the library parameter it names, if not the registry's own.

        Returns:
            The error (to raise).
        """
        return RegistryError(message, source=source or self.source)

    def names(self) -> tuple[str, ...]:
        """Every name, the built-ins first, in registration order (no import).

        Returns:
            The names.
        """
        return tuple(self._entries)

    def builtin_names(self) -> tuple[str, ...]:
        """The names declared in :mod:`sharpcli.catalogue` (no import).

        Returns:
            The names.
        """
        return self._builtins

    def entries(self) -> tuple[Entry, ...]:
        """Every entry, in the order of :meth:`names` (no import).

        Returns:
            The entries.
        """
        return tuple(self._entries.values())

    def entry(self, name: str, source: str | None = None) -> Entry:
        """The entry of ``name`` (no import).

        Args:
            name: the name.
            source: the library parameter an unknown name is reported on.

        Returns:
            The entry.

        Raises:
            RegistryError: an unknown name, listing the accepted ones.
        """
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        raise self.unknown(name, source)

    def unknown(
        self, name: Any, source: str | None = None, accepted: str | None = None
    ) -> RegistryError:
        """The error for an unknown ``name``: ``unknown KIND 'name'; accepted: a, b, c``.

        Args:
            name: the name that was asked for.
            source: the library parameter it names, if not the registry's own.
            accepted: the accepted names as the message lists them (default: the names).

        Returns:
            The error (to raise).
        """
        shown = ", ".join(self.names()) if accepted is None else accepted
        return self.error(f"unknown {self.kind} {name!r}; accepted: {shown}", source)

    # ------------------------------------------------------------------ implementations
    def get(self, name: str, source: str | None = None) -> T:
        """The implementation of ``name``, importing a built-in's module on first use.

        Args:
            name: the name.
            source: the library parameter an unknown name is reported on.

        Returns:
            The implementation.

        Raises:
            RegistryError: an unknown name, listing the accepted ones.
        """
        if isinstance(name, str) and name in self._objects:
            return self._objects[name]
        entry = self.entry(name, source)
        obj = resolve(entry.impl)  # importing the module may register it
        if name not in self._objects:
            if ":" not in entry.impl:
                raise self.error(f"{self.kind} {name!r}: {entry.impl} does not register it")
            self.register(name, obj)
        return self._objects[name]

    def load_all(self) -> None:
        """Resolve every entry (a module calls it at import to check its built-ins)."""
        for name in self.names():
            self.get(name)

    def register(
        self, name: str, obj: T, *, entry: Entry | None = None, replace: bool = False
    ) -> T:
        """Add ``obj`` as ``name``.

        Args:
            name: a CLI value (``name_pattern``).
            obj: the implementation.
            entry: its record; default the built-in record of ``name``, else ``make_entry``.
            replace: replace an implementation registered as ``name``.

        Returns:
            ``obj`` (as the registry's ``check`` returned it).

        Raises:
            RegistryError: a malformed or taken name, or an implementation that fails the
                kind's ``check``.
        """
        if not isinstance(name, str) or not self.name_pattern.match(name):
            raise self.error(f"{self.kind} name {name!r}: use lower case letters, digits and '-'")
        if name in self._objects and not replace:
            raise self.error(
                f"{self.kind} {name!r} is already registered (pass replace=True to replace it)"
            )
        declared = declaration(obj)
        if declared is not None and declared[0] != self.kind:
            raise self.error(f"{name!r} is declared as a {declared[0]}, not a {self.kind}")
        builtin = self._entries.get(name) if name in self._builtins else None
        if entry is None and declared is not None:
            entry = declared[1]
        if entry is not None and builtin is not None and entry.impl == builtin.impl:
            if entry != builtin and CHECK_INDEX:  # the built-in itself, changed since
                raise self.error(
                    f"the catalogue's record of {self.kind} {name!r} differs from its "
                    "declaration; run `python -m sharpcli.catalogue.generate`"
                )
        if entry is None:
            entry = builtin
        if entry is None:
            made = resolve(self.make_entry_impl) if self.make_entry_impl else None
            entry = made(name, obj) if made else Entry(name, "")
        if self.check_impl:
            obj = resolve(self.check_impl)(entry, obj)
        self._entries[name] = entry
        self._objects[name] = obj
        return obj

    def add(self, obj: T, *, replace: bool = False) -> T:
        """Register an object declared with :func:`declare` under its declared name.

        Args:
            obj: the implementation, declared as this registry's kind.
            replace: replace an implementation registered under that name.

        Returns:
            ``obj`` (as :meth:`register` returned it).

        Raises:
            RegistryError: an undeclared object, or one :meth:`register` refuses.
        """
        declared = declaration(obj)
        if declared is None:
            raise self.error(f"{obj!r} has no declaration: decorate it with sharpcli.declare")
        return self.register(declared[1].name, obj, replace=replace)

    def unregister(self, name: str) -> T:
        """Remove and return the implementation registered as ``name``.

        Its entry goes too, unless it is a built-in's, which is declared in the catalogue.

        Args:
            name: the name.

        Returns:
            The implementation that was registered.

        Raises:
            RegistryError: a protected or unregistered name.
        """
        if name in self.protected:
            raise self.error(f"{self.kind} {name!r} cannot be removed: {self.protected_reason}")
        if name not in self._objects:
            raise self.error(f"{self.kind} {name!r} is not registered")
        obj = self._objects.pop(name)
        if name not in self._builtins:
            del self._entries[name]
        return obj

    def pop(self, name: str, *default: Any) -> Any:
        """:meth:`unregister`, or ``default`` when ``name`` is not registered (dict-like).

        Args:
            name: the name.
            *default: returned when nothing is registered as ``name``.

        Returns:
            The implementation, or the default.
        """
        if default and name not in self._objects:
            return default[0]
        return self.unregister(name)

    # ------------------------------------------------------------------ dict-like reading
    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> tuple[str, ...]:
        """The names (dict-like).

        Returns:
            :meth:`names`.
        """
        return self.names()

    def values(self) -> list[T]:
        """The implementations, resolved (dict-like).

        Returns:
            One per name.
        """
        return [self.get(name) for name in self.names()]

    def items(self) -> list[tuple[str, T]]:
        """``(name, implementation)`` pairs, resolved (dict-like).

        Returns:
            One per name.
        """
        return [(name, self.get(name)) for name in self.names()]

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"

    # ------------------------------------------------------------------ NAME[:k=v,...]
    def parse(
        self,
        text: str,
        *,
        positional: bool = True,
        source: str | None = None,
        accepted: str | None = None,
    ) -> tuple[Entry, dict[str, Any]]:
        """Parse ``NAME[:k=v,...]`` against this registry's entries (:func:`parse_spec`).

        Every parameter is typed and the defaults filled in.

        Args:
            text: the spec.
            positional: whether values may be given without their key, in the entry's order.
            source: the library parameter errors name, if not the registry's own.
            accepted: the accepted names as an unknown-name message lists them.

        Returns:
            The entry and ``{param: typed value}`` for every parameter, in order.

        Raises:
            RegistryError: an unknown name, or a bad, unknown, repeated or missing value.
        """
        source = source or self.source
        if not isinstance(text, str) or not text.strip():
            shown = ", ".join(self.names()) if accepted is None else accepted
            raise self.error(
                f"{self.kind} must be a non-empty NAME[:k=v,...]; got {text!r}; accepted: {shown}",
                source,
            )
        name, given = parse_spec(
            text,
            lambda n: [p.name for p in self._entries[n].params] if n in self._entries else None,
            positional=positional,
            source=source,
            unknown=lambda n: self.unknown(n, source, accepted),
        )
        entry = self._entries[name]
        values = {
            p.name: p.accept(name, given.get(p.name, p.default), source) for p in entry.params
        }
        return entry, values
