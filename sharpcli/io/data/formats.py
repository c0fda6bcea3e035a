"""Registry of the data formats a ``--data`` path can hold: one :class:`DataFormat` record each.

A record carries everything about its format: the name a file spec stores, the extensions
that route a file to it, ``probe(path)`` recognising its files or folder layout,
``read(spec) -> Dataset``, the optional spec keys it takes, whether it is a folder layout,
a one-line description and how it provides a test split. A new format (an ImageFolder,
JSON lines) is a module with its probe and reader plus one :func:`register` call; a
built-in one is that module with its probe declared (:func:`sharpcli.registry.declare`, kind
``"data format"``, its ``info`` made by :func:`sharpcli.io.data.dataset.format_info`), from
which :data:`sharpcli.catalogue.DATA_FORMATS` lists it (:data:`FORMATS` *is* that registry);
see docs/architecture.md, "Adding a data format".

Routing a path whose spec names no format (:func:`route`):

- a file goes to the format claiming its extension (case-insensitive; among several
  claimants the first whose probe accepts it, else the first, whose reader then says what
  is wrong with the file). With no claimant, the first file format whose probe recognises
  the contents takes it, and otherwise the path is an ``InputError`` listing the accepted
  extensions and folder layouts;
- a directory goes to the first folder format (in registry order) whose probe accepts it,
  else to the one layout found in its subfolders or their ``raw/`` folders (torchvision's
  ``root/MNIST/raw``); several layouts, or none, are an ``InputError``.

A format named in a spec must exist (``UsageError`` listing the accepted names) and fit
the path (a folder layout needs a directory holding it, a file format a file); it
overrides the extension. Nothing is ever read by a format the path was not routed to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from sharpcli import catalogue
from sharpcli.errors import InputError
from sharpcli.io.data.dataset import Dataset, read_failure
from sharpcli.registry import Entry, declaration, resolve

__all__ = [
    "DataFormat",
    "FORMATS",
    "data_format",
    "optional_spec_keys",
    "register",
    "route",
    "unregister",
]


@dataclass(frozen=True)
class DataFormat:
    """One data format: how a path is recognised as it and how it is read.

    - ``name``: stored as the ``format`` of a file spec (``{"kind": "file", "path",
      "format", "label_column", ...}``);
    - ``extensions``: lower-case file extensions with the dot (``(".pt", ".pth")``) that
      route a file here; empty for a folder layout;
    - ``probe(path) -> bool``: whether the path holds this format (a folder layout's
      files; a file's signature). OSError and ValueError (e.g. undecodable text) count
      as "no"; anything else it raises is a bug;
    - ``read(spec) -> Dataset``: load the complete file spec (its ``path``, ``format``,
      ``label_column`` and this format's ``spec_keys``), raising ``InputError`` for a bad
      file; the arrays go through ``dataset.finalize_dataset``;
    - ``spec_keys``: the optional file-spec keys this format reads (``"label_column"``:
      tables pick their target column, CIFAR-100 its label set); given to another
      format they are a ``UsageError``;
    - ``description``: one line for messages and documentation;
    - ``directory``: a folder layout rather than a single file;
    - ``test_split``: how data in this format provides a test split (for the message
      when one is missing).
    """

    name: str
    extensions: tuple[str, ...]
    probe: Callable[[str], bool]
    read: Callable[[dict], Dataset]
    spec_keys: tuple[str, ...] = ()
    description: str = ""
    directory: bool = False
    test_split: str = "its format provides none"


FORMATS = catalogue.DATA_FORMATS


def check_format(entry: Entry, fmt: DataFormat | Callable[[str], bool]) -> DataFormat:
    """The registry's check of a format record (see :func:`register`), the kind's ``check``
    (:data:`sharpcli.catalogue.DATA_FORMATS`); a built-in's declared probe is made into its
    record here."""
    if not isinstance(fmt, DataFormat):
        if declaration(fmt) is None:
            raise FORMATS.error(f"data format {entry.name!r}: register a DataFormat")
        fmt = _builtin(entry, fmt)
    where = f"data format {fmt.name!r}"
    if fmt.name != entry.name:
        raise FORMATS.error(f"{where}: register a DataFormat under its own name")
    if not callable(fmt.probe) or not callable(fmt.read):
        raise FORMATS.error(f"{where}: probe and read must be callables")
    if any(not ext.startswith(".") or ext != ext.lower() for ext in fmt.extensions):
        raise FORMATS.error(f"{where}: extensions are lower-case with their dot, e.g. '.csv'")
    if fmt.directory and fmt.extensions:
        raise FORMATS.error(f"{where}: a folder layout has no file extensions")
    if set(fmt.spec_keys) & {"kind", "path", "format"}:
        raise FORMATS.error(f"{where}: spec_keys cannot redefine kind, path or format")
    return fmt


def format_entry(name: str, fmt: DataFormat) -> Entry:
    """The record of an extension: its description and routing facts (the kind's
    ``make_entry``)."""
    info = {
        "extensions": fmt.extensions,
        "spec_keys": fmt.spec_keys,
        "directory": fmt.directory,
        "test_split": fmt.test_split,
    }
    return Entry(name, fmt.description, getattr(fmt.read, "__module__", ""), info=info)


def register(fmt: DataFormat, *, replace: bool = False) -> DataFormat:
    """Add a format to :data:`FORMATS` (appended: earlier formats win ties of routing).

    Args:
        fmt: the format.
        replace: replace a format registered under the same name.

    Returns:
        ``fmt``.

    Raises:
        RegistryError: a name taken or not a CLI value, or an inconsistent record (an
            extension without its dot or in upper case, a folder layout with extensions, a
            reserved spec key).
    """
    return FORMATS.register(fmt.name, fmt, replace=replace)


def unregister(name: str) -> DataFormat:
    """Remove and return the format registered as ``name``.

    Args:
        name: the format.

    Returns:
        Its record.

    Raises:
        RegistryError: nothing is registered as ``name``.
    """
    return FORMATS.unregister(name)


def data_format(name) -> DataFormat:
    """The format registered as ``name``.

    Args:
        name: the format (any JSON value a spec holds).

    Returns:
        Its record.

    Raises:
        RegistryError: (a UsageError, source ``spec``) an unknown one, listing the accepted.
    """
    return FORMATS.get(name)


def optional_spec_keys() -> tuple[str, ...]:
    """Every optional file-spec key some registered format reads, ``label_column`` first."""
    keys = ["label_column"]
    for fmt in FORMATS.values():
        keys += [key for key in fmt.spec_keys if key not in keys]
    return tuple(keys)


def _accepts(fmt: DataFormat, path: str) -> bool:
    try:
        return bool(fmt.probe(path))
    except (OSError, ValueError):  # unreadable or undecodable: not this format; a reader
        return False  # it is routed to by extension reports what is wrong with it


def route(path: str, named: DataFormat | None = None) -> tuple[str, DataFormat]:
    """``(path, format)`` for an existing absolute path (rules in the module docstring).

    For a directory without a named format the returned path may be a subfolder holding
    the layout.
    """
    is_directory = os.path.isdir(path)
    if named is None:
        return _find_layout(path) if is_directory else (path, _file_format(path))
    if is_directory and not named.directory:
        raise InputError(f"is a directory, but format {named.name!r} is a single file", source=path)
    if named.directory and not is_directory:
        raise InputError(f"format {named.name!r} needs a directory, this is a file", source=path)
    if named.directory and not _accepts(named, path):
        raise InputError(f"does not hold a {named.name} layout", source=path)
    return path, named


def _file_format(path: str) -> DataFormat:
    """The format of a file: by extension, else by content (module docstring)."""
    extension = os.path.splitext(path)[1].lower()
    file_formats = [fmt for fmt in FORMATS.values() if not fmt.directory]
    claimants = [fmt for fmt in file_formats if extension and extension in fmt.extensions]
    if len(claimants) > 1:
        return next((fmt for fmt in claimants if _accepts(fmt, path)), claimants[0])
    if claimants:
        return claimants[0]
    recognised = next((fmt for fmt in file_formats if _accepts(fmt, path)), None)
    if recognised is not None:
        return recognised
    known = ", ".join(ext for fmt in file_formats for ext in fmt.extensions)
    layouts = ", ".join(fmt.name for fmt in FORMATS.values() if fmt.directory)
    raise InputError(
        f"unknown data file extension {extension or '(none)'!r} and no format recognises its "
        f"contents; accepted: {known}, or a folder of {layouts}",
        source=path,
    )


def _layout_of(folder: str) -> DataFormat | None:
    """The first folder format whose probe accepts ``folder`` itself."""
    return next((fmt for fmt in FORMATS.values() if fmt.directory and _accepts(fmt, folder)), None)


def _find_layout(folder: str) -> tuple[str, DataFormat]:
    """``(dataset folder, format)`` for a directory given to ``--data``: the directory
    itself, else its subdirectories and their ``raw/`` folders (so both ``data/`` and
    ``data/cifar-10-batches-py`` work). Several candidates, or none, raise InputError."""
    fmt = _layout_of(folder)
    if fmt is not None:
        return folder, fmt
    try:
        children = sorted(os.listdir(folder))
    except OSError as exc:
        raise read_failure("directory", exc, folder) from exc
    found = []
    for name in children:
        for candidate in (os.path.join(folder, name), os.path.join(folder, name, "raw")):
            if os.path.isdir(candidate) and (sub := _layout_of(candidate)) is not None:
                found.append((candidate, sub))
    if len(found) == 1:
        return found[0]
    if found:
        listed = ", ".join(f"{os.path.relpath(path, folder)} ({sub.name})" for path, sub in found)
        raise InputError(
            f"holds several datasets: {listed}; point `spec` at one of them", source=folder
        )
    layouts = ", ".join(fmt.name for fmt in FORMATS.values() if fmt.directory)
    raise InputError(
        f"is not a recognised dataset folder (expected a layout of: {layouts})", source=folder
    )


def _builtin(entry: Entry, probe: Callable[[str], bool]) -> DataFormat:
    """A built-in format made from its declared ``probe`` and its record."""
    info = entry.info
    return DataFormat(
        entry.name,
        info["extensions"],
        probe,
        resolve(info["read"]),
        info["spec_keys"],
        entry.summary,
        info["directory"],
        info["test_split"],
    )


# the built-ins now (their names taken before any extension's), listed and probed in the
# catalogue's order
FORMATS.load_all()
