"""Tensor files: ``.safetensors``, ``.pt``/``.pth``, ``.npz`` and ``.npy`` pairs, each declared
on its probe beside its reader (docs/index.md, ``--data``).

Tensor files (``.safetensors``, ``.pt``/``.pth``, ``.npz``) hold a flat mapping with
keys ``x`` and ``y`` and, optionally, ``x_test`` and ``y_test``; any other key is
refused (a misspelt ``x_tset`` would otherwise drop the test split silently).
``.pt`` files are read with ``torch.load(weights_only=True)`` and ``.npz`` with
``numpy.load(allow_pickle=False)``, so no file can run code. Feature values are
kept as stored: integer features (token ids, counts, uint8 pixels) as int64, any other
dtype cast to float32; uint8 images are *not* rescaled to [0, 1]. An ``.npy`` features
file is read with its labels file beside it (:func:`read_npy_pair`).

A format's declaration (:func:`sharpcli.registry.declare`, kind ``"data format"``) is its
record in :data:`sharpcli.catalogue.DATA_FORMATS`: its name (a file spec's ``format``), the
extensions that route a file to it, its reader, the optional spec keys it reads, how it
provides a test split, and its ``order``: where it is listed in messages and probed among the
built-in formats (:mod:`sharpcli.io.data.formats` routes a path to it). The probes recognise
a file by its signature when its extension routes it nowhere: the safetensors header, the zip
archives of ``torch.save`` and ``numpy.savez`` (told apart by their member names), numpy's
magic bytes.
"""

from __future__ import annotations

import math
import os
import re
import warnings
import zipfile

import numpy as np
import torch

from sharpcli import ledger
from sharpcli.bounded import (
    check_data_path,
    check_zip_members,
    data_file_size,
    open_data_file,
    read_data_file,
)
from sharpcli.catalogue.values import TEST, TRAIN
from sharpcli.errors import InputError, UsageError
from sharpcli.io.data.dataset import (
    NAMED_KEYS,
    Dataset,
    finalize_dataset,
    format_info,
    read_failure,
)
from sharpcli.io.data.keyed import dataset_from_mapping
from sharpcli.registry import declare

__all__ = [
    "NPY",
    "NPZ",
    "PT",
    "SAFETENSORS",
    "is_npy",
    "is_npz",
    "is_safetensors",
    "is_torch_file",
    "read_npy_pair",
    "read_tensor_file",
]

# the formats' names, which the readers below dispatch on
SAFETENSORS, PT, NPZ, NPY = "safetensors", "pt", "npz", "npy"

_READER = "sharpcli.io.data.tensor_files"
_TENSOR_TEST = "add tensors x_test and y_test (or <key>_test for named keys)"


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
        f"{_READER}:read_tensor_file",
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
        f"{_READER}:read_tensor_file",
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
        f"{_READER}:read_tensor_file",
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
        f"{_READER}:read_npy_pair",
        extensions=(".npy",),
        spec_keys=("y_key",),
        test_split="add the test files (train -> test in both names)",
    ),
)
def is_npy(path: str) -> bool:
    """numpy's ``.npy`` magic ``\\x93NUMPY``."""
    return _head(path, 6) == b"\x93NUMPY"


def _read_mapping(path: str, fmt: str, trust_pickle: bool = False) -> dict:
    """Read the key -> array mapping of a tensor file, wrapping every library error.

    The file is read through :func:`sharpcli.bounded.open_data_file` (a regular file, at
    most its size); zip archives (``.pt``, ``.npz``) are checked by
    :func:`sharpcli.bounded.check_zip_members` before a member is read.
    """
    if fmt == SAFETENSORS:
        from safetensors.torch import load as load_safetensors

        content = read_data_file(path)
        try:
            return load_safetensors(content)
        except Exception as exc:
            raise read_failure("safetensors file", exc, path) from exc
    with open_data_file(path) as handle:
        if fmt == PT:
            return _read_torch_mapping(handle, path, trust_pickle)
        if fmt == NPZ:
            return _read_npz_mapping(handle, path)
    raise ValueError(f"not a tensor file format: {fmt}")


def _check_archive(handle, path: str) -> None:
    """Bound a zip archive's declared member sizes (a non-zip file passes: its reader decides)."""
    try:
        with zipfile.ZipFile(handle) as archive:
            check_zip_members(archive, data_file_size(handle), path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        pass  # not a zip archive zipfile can read (a version it lacks): torch.load decides
    handle.seek(0)


def _read_torch_mapping(handle, path: str, trust_pickle: bool = False) -> dict:
    """The dict of tensors of a ``torch.save`` file (``weights_only=True``); with
    ``trust_pickle`` a pickled ``TensorDataset`` (or a pair of tensors) as ``{"x", "y"}``."""
    _check_archive(handle, path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            content = torch.load(handle, map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        if "Unsupported global" not in text and "GLOBAL" not in text:
            raise read_failure(
                "torch file with weights_only=True (tensors only, no pickled code)", exc, path
            ) from exc
        if not trust_pickle:
            raise InputError(
                "holds pickled Python objects (a TensorDataset?), not a dict of tensors, so "
                "reading it with weights_only=True fails; unpickling runs code: pass `trust_pickle` if you trust the "
                "file, or convert it once with python -c \"import torch; d = torch.load('IN.pt', "
                "weights_only=False); torch.save({'x': d.tensors[0], 'y': d.tensors[1]}, "
                "'OUT.pt')\"",
                source=path,
            ) from None
        handle.seek(0)
        content = _unpickle_dataset(handle, path)
    if not isinstance(content, dict):
        raise InputError(
            f"holds a {type(content).__name__}, expected a dict of tensors with keys x, y "
            "(optional x_test, y_test)",
            source=path,
        )
    return content


def _unpickle_dataset(handle, path: str) -> dict:
    """A trusted pickle (``trust_pickle``): a ``TensorDataset`` or ``(x, y)`` as ``{"x", "y"}``,
    a dict of tensors as it is."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            content = torch.load(handle, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise read_failure("pickled torch file", exc, path) from exc
    tensors = getattr(content, "tensors", content)
    if isinstance(tensors, (tuple, list)) and len(tensors) == 2:
        return {"x": tensors[0], "y": tensors[1]}
    if isinstance(content, dict):
        return content
    raise InputError(
        f"holds a pickled {type(content).__name__}; expected a TensorDataset of (x, y), a pair "
        "of tensors or a dict of tensors",
        source=path,
    )


def _read_npz_mapping(handle, path: str) -> dict:
    """The arrays of a ``numpy.savez`` archive; each member's declared array must fit in it."""
    if handle.peek(6)[:6] == b"\x93NUMPY":
        raise InputError(
            "is a single .npy array, expected an .npz archive with keys x and y", source=path
        )
    _check_archive(handle, path)
    try:
        archive = np.load(handle, allow_pickle=False)
    except Exception as exc:
        raise read_failure("npz archive", exc, path) from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise InputError("is not an .npz archive with keys x and y", source=path)
    try:
        with archive:
            members = archive.zip
            assert members is not None  # an open archive's zip file
            for info in members.infolist():
                _check_npy_member(members, info, path)
            return {key: archive[key] for key in archive.files}
    except InputError:
        raise
    except Exception as exc:
        raise read_failure("npz archive", exc, path) from exc


def _check_npy_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str) -> None:
    """``InputError`` when a member's ``.npy`` header declares more bytes than the member holds
    (numpy allocates the declared array before reading it)."""
    from numpy.lib import format as npy_format

    with archive.open(info) as member:
        version = npy_format.read_magic(member)
        read_header = (
            npy_format.read_array_header_1_0
            if version == (1, 0)
            else npy_format.read_array_header_2_0
        )
        shape, _, dtype = read_header(member)
    declared = math.prod(shape) * dtype.itemsize
    if declared > info.file_size:
        raise InputError(
            f"an array declares {declared:,} bytes but its archive member holds {info.file_size:,}",
            source=path,
        )


def read_tensor_file(spec: dict) -> Dataset:
    """Load the ``.safetensors`` / ``.pt`` / ``.npz`` file of a complete file spec: keys x, y
    [, x_test, y_test], or the keys ``x_key``/``y_key`` name, or keyword inputs
    (:func:`sharpcli.io.data.keyed.dataset_from_mapping`).

    ``spec["trust_pickle"]`` (set by :func:`sharpcli.io.data.loading.load_dataset` for the read
    only, never stored) lets a ``.pt`` file holding a pickled ``TensorDataset`` be read."""
    trust = bool(spec.get("trust_pickle"))
    spec = {k: v for k, v in spec.items() if k != "trust_pickle"}
    path, fmt = spec["path"], spec["format"]
    content = _read_mapping(path, fmt, trust)
    return dataset_from_mapping(content, spec, path, default_keys=True)


def _npy_partner(path: str, y_key: str | None) -> str:
    """The labels file beside an ``.npy`` features file: ``y_key`` + ``.npy`` when given, else the
    name with its last ``x``/``X`` (a whole word between ``_``, ``-``, ``.`` or the ends) as
    ``y`` (``x.npy`` -> ``y.npy``, ``X_train.npy`` -> ``y_train.npy``, ``train-x.npy`` ->
    ``train-y.npy``)."""
    folder, name = os.path.split(path)
    stem = name[: -len(".npy")] if name.lower().endswith(".npy") else name
    if y_key is not None:
        partner = y_key if y_key.lower().endswith(".npy") else f"{y_key}.npy"
        if os.sep in partner or partner.startswith(".."):
            raise UsageError("an .npy partner is a file name in the same folder", source="y_key")
        return os.path.join(folder, partner)
    parts = re.split(r"([_.\-])", stem)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("x", "X"):
            parts[i] = "y"
            return os.path.join(folder, "".join(parts) + ".npy")
    raise InputError(
        "is an .npy file whose name has no x to pair (x.npy with y.npy, X_train.npy with "
        "y_train.npy); name the labels file with `y_key`",
        source=path,
    )


def _read_npy(path: str) -> np.ndarray:
    """One ``.npy`` array (``allow_pickle=False``), its declared size checked against the file."""
    with open_data_file(path) as handle:
        try:
            from numpy.lib import format as npy_format

            version = npy_format.read_magic(handle)
            read_header = (
                npy_format.read_array_header_1_0
                if version == (1, 0)
                else npy_format.read_array_header_2_0
            )
            shape, _, dtype = read_header(handle)
            if math.prod(shape) * dtype.itemsize > data_file_size(handle):
                raise InputError("its header declares more bytes than the file holds", source=path)
            handle.seek(0)
            return np.load(handle, allow_pickle=False)
        except InputError:
            raise
        except Exception as exc:
            raise read_failure(".npy array", exc, path) from exc


def read_npy_pair(spec: dict) -> Dataset:
    """Load an ``.npy`` features file and its labels file (:func:`_npy_partner`); test arrays
    are the files with ``test`` for ``train`` in both names, when both exist."""
    path = spec["path"]
    partner = _npy_partner(path, spec.get("y_key"))
    if not os.path.isfile(partner):
        raise InputError(
            f"needs its labels file {os.path.basename(partner)} beside it (or name one with "
            "`y_key`)",
            source=path,
        )

    check_data_path(partner)
    ledger.record_input(partner, "the labels of the `data` file")
    x, y = _read_npy(path), _read_npy(partner)
    x_test = y_test = None
    tests = [
        os.path.join(os.path.dirname(p), os.path.basename(p).replace(TRAIN, TEST))
        for p in (path, partner)
    ]
    if TRAIN in os.path.basename(path) and all(os.path.isfile(t) for t in tests):
        for t in tests:
            check_data_path(t)
            ledger.record_input(t, "the test split of the `data` file")
        x_test, y_test = _read_npy(tests[0]), _read_npy(tests[1])
    return finalize_dataset(
        x,
        y,
        x_test,
        y_test,
        keep_float64=True,
        source=path,
        spec=spec,
        names=("features", "labels file", "test features", "test labels file"),
    )
