"""Registry of the data formats a ``--data`` path can hold: one :class:`DataFormat` record each.

A record carries everything about its format: the name a file spec stores, the extensions
that route a file to it, ``probe(path)`` recognising its files or folder layout,
``read(spec) -> Dataset``, the optional spec keys it takes, whether it is a folder layout,
a one-line description and how it provides a test split. A new format (an ImageFolder,
JSON lines) is a module with its probe and reader plus one :func:`register` call; see
docs/architecture.md, "Adding a data format".

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

from sharpcli.errors import InputError, UsageError
from sharpcli.io.datasets_arrow import (
    is_arrow,
    is_hf_dataset_folder,
    read_arrow,
    read_hf_dataset_folder,
)
from sharpcli.io.datasets_common import Dataset, read_failure
from sharpcli.io.datasets_files import (
    is_csv,
    is_npy,
    is_npz,
    is_parquet,
    is_safetensors,
    is_torch_file,
    read_npy_pair,
    read_table,
    read_tensor_file,
)
from sharpcli.io.datasets_vision import (
    is_cifar10_binary,
    is_cifar10_python,
    is_cifar100_binary,
    is_cifar100_python,
    is_mnist_idx,
    read_cifar,
    read_mnist,
)

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
      file; the arrays go through ``datasets_common.finalize_dataset``;
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


FORMATS: dict[str, DataFormat] = {}


def register(fmt: DataFormat) -> DataFormat:
    """Add a format to :data:`FORMATS` (appended: earlier formats win ties of routing).

    Raises TypeError when the record is inconsistent (a name taken, an extension without
    its dot or in upper case, a folder layout with extensions, a reserved spec key).
    """
    where = f"data format {fmt.name!r}"
    if not fmt.name or fmt.name in FORMATS:
        raise TypeError(f"{where}: needs a name not yet registered")
    if not callable(fmt.probe) or not callable(fmt.read):
        raise TypeError(f"{where}: probe and read must be callables")
    if any(not ext.startswith(".") or ext != ext.lower() for ext in fmt.extensions):
        raise TypeError(f"{where}: extensions are lower-case with their dot, e.g. '.csv'")
    if fmt.directory and fmt.extensions:
        raise TypeError(f"{where}: a folder layout has no file extensions")
    if set(fmt.spec_keys) & {"kind", "path", "format"}:
        raise TypeError(f"{where}: spec_keys cannot redefine kind, path or format")
    FORMATS[fmt.name] = fmt
    return fmt


def unregister(name: str) -> DataFormat:
    """Remove and return the format registered as ``name`` (KeyError when there is none)."""
    return FORMATS.pop(name)


def data_format(name) -> DataFormat:
    """The format registered as ``name``; an unknown one is a UsageError listing the accepted."""
    if isinstance(name, str) and name in FORMATS:
        return FORMATS[name]
    raise UsageError(f"unknown data format {name!r}; accepted: {', '.join(FORMATS)}", source="spec")


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


# --------------------------------------------------------------------------- the built-in formats
_TENSOR_TEST = "add tensors x_test and y_test (or <key>_test for named keys)"
_KEYS = ("x_key", "y_key")
_TABLE_TEST = "add a column named 'split' with values train/test"
_FOLDER_TEST = "the folder holds no test files"

# Order matters twice: it is the order of the lists in messages, and folder layouts are
# probed in it (CIFAR-10 batches win over a CIFAR-100 train/test pair in the same folder).
for _builtin in (
    DataFormat(
        "safetensors",
        (".safetensors",),
        is_safetensors,
        read_tensor_file,
        _KEYS,
        description="safetensors file with tensors x, y (optional x_test, y_test) or named keys",
        test_split=_TENSOR_TEST,
    ),
    DataFormat(
        "pt",
        (".pt", ".pth"),
        is_torch_file,
        read_tensor_file,
        _KEYS,
        description="torch.save dict of tensors x, y (optional x_test, y_test) or named keys; a TensorDataset with trust_pickle",
        test_split=_TENSOR_TEST,
    ),
    DataFormat(
        "npz",
        (".npz",),
        is_npz,
        read_tensor_file,
        _KEYS,
        description="numpy.savez archive with arrays x, y (optional x_test, y_test) or named keys",
        test_split=_TENSOR_TEST,
    ),
    DataFormat(
        "npy",
        (".npy",),
        is_npy,
        read_npy_pair,
        ("y_key",),
        "numpy .npy features beside their labels file (x.npy and y.npy, X_train.npy and y_train.npy)",
        test_split="add the test files (train -> test in both names)",
    ),
    DataFormat(
        "arrow",
        (".arrow",),
        is_arrow,
        read_arrow,
        _KEYS,
        "Arrow file (a Hugging Face dataset shard): number and list-of-ids columns",
        test_split="use a save_to_disk DatasetDict folder with a test split",
    ),
    DataFormat(
        "csv",
        (".csv",),
        is_csv,
        read_table,
        ("label_column",),
        "csv table: numeric feature columns, a label column, an optional split column",
        test_split=_TABLE_TEST,
    ),
    DataFormat(
        "parquet",
        (".parquet",),
        is_parquet,
        read_table,
        ("label_column", *_KEYS),
        "parquet table: numeric feature columns, a label column, an optional split column; "
        "list columns (token ids) as named keys",
        test_split=_TABLE_TEST,
    ),
    DataFormat(
        "hf-dataset",
        (),
        is_hf_dataset_folder,
        read_hf_dataset_folder,
        _KEYS,
        "Hugging Face datasets save_to_disk folder (Dataset or DatasetDict)",
        directory=True,
        test_split="save a DatasetDict with a test split",
    ),
    DataFormat(
        "cifar10-python",
        (),
        is_cifar10_python,
        read_cifar,
        description="CIFAR-10 python batches (cifar-10-batches-py)",
        directory=True,
        test_split=_FOLDER_TEST,
    ),
    DataFormat(
        "cifar10-binary",
        (),
        is_cifar10_binary,
        read_cifar,
        description="CIFAR-10 binary batches (cifar-10-batches-bin)",
        directory=True,
        test_split=_FOLDER_TEST,
    ),
    DataFormat(
        "cifar100-binary",
        (),
        is_cifar100_binary,
        read_cifar,
        ("label_column",),
        "CIFAR-100 binary train/test files (cifar-100-binary); fine or coarse labels",
        directory=True,
        test_split=_FOLDER_TEST,
    ),
    DataFormat(
        "cifar100-python",
        (),
        is_cifar100_python,
        read_cifar,
        ("label_column",),
        "CIFAR-100 python train/test pickles (cifar-100-python); fine or coarse labels",
        directory=True,
        test_split=_FOLDER_TEST,
    ),
    DataFormat(
        "mnist-idx",
        (),
        is_mnist_idx,
        read_mnist,
        description="MNIST-family idx files, plain or .gz (MNIST, Fashion-MNIST, KMNIST)",
        directory=True,
        test_split=_FOLDER_TEST,
    ),
):
    register(_builtin)
del _builtin
