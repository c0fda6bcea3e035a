"""The single-file data formats of ``--data PATH``, each declared on its probe.

A format's declaration (:func:`sharpcli.registry.declare`, kind ``"data format"``) is its
record in :data:`sharpcli.catalogue.DATA_FORMATS`: its name (a file spec's ``format``), the
extensions that route a file to it, its reader (:mod:`sharpcli.io.datasets_files`), the
optional spec keys it reads, how it provides a test split, and its ``order``: where it is
listed in messages and probed among the built-in formats (:mod:`sharpcli.io.formats`).

The probes recognise a file by its signature when its extension routes it nowhere: the
safetensors header, the zip archives of ``torch.save`` and ``numpy.savez`` (told apart by
their member names), numpy's and parquet's magic bytes. Plain-text csv has no signature and
is routed by its ``.csv`` extension only.
"""

from __future__ import annotations

import os
import zipfile

from sharpcli.bounded import open_data_file
from sharpcli.errors import InputError
from sharpcli.io.datasets_common import NAMED_KEYS, format_info
from sharpcli.registry import declare

__all__ = [
    "CSV",
    "NPY",
    "NPZ",
    "PARQUET",
    "PT",
    "SAFETENSORS",
    "is_csv",
    "is_npy",
    "is_npz",
    "is_parquet",
    "is_safetensors",
    "is_torch_file",
]

# the formats' names, which the readers of sharpcli.io.datasets_files dispatch on
SAFETENSORS, PT, NPZ, NPY, CSV, PARQUET = "safetensors", "pt", "npz", "npy", "csv", "parquet"

_READERS = "sharpcli.io.datasets_files"
_TENSOR_TEST = "add tensors x_test and y_test (or <key>_test for named keys)"
_TABLE_TEST = "add a column named 'split' with values train/test"


def _head(path: str, size: int) -> bytes:
    """The first ``size`` bytes of a file (fewer when it is shorter; none when unreadable)."""
    try:
        with open_data_file(path) as handle:
            return handle.read(size)
    except (OSError, InputError):
        return b""


def _zip_members(path: str) -> list[str]:
    """Member names of a zip archive; empty for anything else."""
    try:
        with open_data_file(path) as handle, zipfile.ZipFile(handle) as archive:
            return archive.namelist()
    except (OSError, InputError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):
        return []


@declare(
    "data format",
    SAFETENSORS,
    "safetensors file with tensors x, y (optional x_test, y_test) or named keys",
    info=format_info(
        0,
        f"{_READERS}:read_tensor_file",
        extensions=(".safetensors",),
        spec_keys=NAMED_KEYS,
        test_split=_TENSOR_TEST,
    ),
)
def is_safetensors(path: str) -> bool:
    """A little-endian u64 header length that fits the file, then a JSON object."""
    head = _head(path, 9)
    if len(head) < 9:
        return False
    header_length = int.from_bytes(head[:8], "little")
    try:
        return head[8:9] == b"{" and 0 < header_length <= os.path.getsize(path) - 8
    except OSError:
        return False


# torch.save's legacy (pre-zip) files open with a pickled magic number (torch.serialization)
_TORCH_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


@declare(
    "data format",
    PT,
    "torch.save dict of tensors x, y (optional x_test, y_test) or named keys; a "
    "TensorDataset with trust_pickle",
    info=format_info(
        1,
        f"{_READERS}:read_tensor_file",
        extensions=(".pt", ".pth"),
        spec_keys=NAMED_KEYS,
        test_split=_TENSOR_TEST,
    ),
)
def is_torch_file(path: str) -> bool:
    """A ``torch.save`` archive (a zip holding ``<name>/data.pkl``) or a legacy torch file."""
    head = _head(path, 14)
    if head[:1] == b"\x80" and head[2:4] == b"\x8a\x0a" and head[4:14] == _TORCH_LEGACY_MAGIC:
        return True
    return any(name == "data.pkl" or name.endswith("/data.pkl") for name in _zip_members(path))


@declare(
    "data format",
    NPZ,
    "numpy.savez archive with arrays x, y (optional x_test, y_test) or named keys",
    info=format_info(
        2,
        f"{_READERS}:read_tensor_file",
        extensions=(".npz",),
        spec_keys=NAMED_KEYS,
        test_split=_TENSOR_TEST,
    ),
)
def is_npz(path: str) -> bool:
    """A zip archive of ``.npy`` members only (``numpy.savez``)."""
    members = _zip_members(path)
    return bool(members) and all(name.endswith(".npy") for name in members)


@declare(
    "data format",
    NPY,
    "numpy .npy features beside their labels file (x.npy and y.npy, X_train.npy and y_train.npy)",
    info=format_info(
        3,
        f"{_READERS}:read_npy_pair",
        extensions=(".npy",),
        spec_keys=("y_key",),
        test_split="add the test files (train -> test in both names)",
    ),
)
def is_npy(path: str) -> bool:
    """numpy's ``.npy`` magic ``\\x93NUMPY``."""
    return _head(path, 6) == b"\x93NUMPY"


@declare(
    "data format",
    PARQUET,
    "parquet table: numeric feature columns, a label column, an optional split "
    "column; list columns (token ids) as named keys",
    info=format_info(
        6,
        f"{_READERS}:read_table",
        extensions=(".parquet",),
        spec_keys=("label_column", *NAMED_KEYS),
        test_split=_TABLE_TEST,
    ),
)
def is_parquet(path: str) -> bool:
    """``PAR1`` at both ends of the file."""
    try:
        with open_data_file(path) as handle:
            start = handle.read(4)
            handle.seek(-4, os.SEEK_END)
            return start == b"PAR1" and handle.read(4) == b"PAR1"
    except (OSError, InputError):
        return False


@declare(
    "data format",
    CSV,
    "csv table: numeric feature columns, a label column, an optional split column",
    info=format_info(
        5,
        f"{_READERS}:read_table",
        extensions=(".csv",),
        spec_keys=("label_column",),
        test_split=_TABLE_TEST,
    ),
)
def is_csv(path: str) -> bool:
    """Plain text carries no signature: a csv file is routed by its ``.csv`` extension only."""
    return False
