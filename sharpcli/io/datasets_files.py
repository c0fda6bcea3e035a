"""Readers for tensor files and tables (docs/index.md, ``--data``).

Tensor files (``.safetensors``, ``.pt``/``.pth``, ``.npz``) hold a flat mapping with
keys ``x`` and ``y`` and, optionally, ``x_test`` and ``y_test``; any other key is
refused (a misspelt ``x_tset`` would otherwise drop the test split silently).
``.pt`` files are read with ``torch.load(weights_only=True)`` and ``.npz`` with
``numpy.load(allow_pickle=False)``, so no file can run code. Feature values are
kept as stored: integer features (token ids, counts, uint8 pixels) as int64, any other
dtype cast to float32; uint8 images are *not* rescaled to [0, 1].

Tables (``.csv``, ``.parquet``) are read through pandas: the label column (option
``--label-column``, default ``label``) is the target and every other column is a
numeric feature (read as int64 when every feature column holds integers, as float64
otherwise), except an optional column named ``split`` whose values
``train``/``test`` (case-insensitive) assign each row to a split; without that
column the whole table is the train split. Integer or boolean labels are classes
``0..C-1``; textual labels are mapped to classes by sorted name
(``Dataset.class_names``); floating labels make a regression target.

Each format is declared, with its probe, in :mod:`sharpcli.io.file_formats` (its record
names the reader here); :mod:`sharpcli.io.formats` routes a path to it.
"""

from __future__ import annotations

import math
import os
import re
import warnings
import zipfile
from typing import TYPE_CHECKING

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
from sharpcli.io.datasets_arrow import ArrowColumns, table_has_list_columns
from sharpcli.io.datasets_common import Dataset, finalize_dataset, read_failure
from sharpcli.io.datasets_keyed import LABEL_KEYS, dataset_from_mapping
from sharpcli.io.file_formats import CSV, NPZ, PARQUET, PT, SAFETENSORS

if TYPE_CHECKING:  # pandas (with pyarrow: ~0.4 s, ~80 MB) is imported only to read a table
    import pandas as pd

TENSOR_KEYS = ("x", "y", "x_test", "y_test")
DEFAULT_LABEL_COLUMN = "label"
SPLIT_COLUMN = "split"


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
    (:func:`sharpcli.io.datasets_keyed.dataset_from_mapping`).

    ``spec["trust_pickle"]`` (set by :func:`sharpcli.io.datasets.load_dataset` for the read
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


def _read_table(path: str, fmt: str) -> pd.DataFrame:
    """Read a csv or parquet file into a DataFrame, wrapping every library error."""
    import pandas as pd

    with open_data_file(path) as handle:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if fmt == CSV:
                    return pd.read_csv(handle)
                return pd.read_parquet(handle)
        except Exception as exc:
            raise read_failure(f"{fmt} table", exc, path) from exc


def _parquet_with_lists(spec: dict) -> Dataset | None:
    """A parquet file with list columns (token ids per row) or named keys, read as named arrays
    (:mod:`sharpcli.io.datasets_arrow`: lists padded, ``x_key``/``y_key`` or keyword inputs; the
    label column is ``label_column`` or ``y_key``); None for a plain table of numbers."""
    import pyarrow.parquet as pq

    path = spec["path"]
    with open_data_file(path) as handle:
        try:
            table = pq.read_table(handle)
        except Exception as exc:
            raise read_failure("parquet table", exc, path) from exc
    named = spec.get("x_key") is not None or spec.get("y_key") is not None
    if not named and not table_has_list_columns(table):
        return None
    label = spec.get("y_key") or spec.get("label_column")
    chosen = {**spec, "y_key": label} if label else spec
    labels = (label,) if label else LABEL_KEYS
    dataset = dataset_from_mapping(
        ArrowColumns(table, path, labels), chosen, path, default_keys=False
    )
    dataset.spec = spec
    return dataset


def _label_array(column: pd.Series, name: str, path: str) -> tuple[np.ndarray, list[str] | None]:
    """Labels of a table column: numbers as they are, text mapped to sorted class indices."""
    import pandas as pd

    values = column.to_numpy()
    if values.dtype.kind in "biuf":
        return values, None
    if pd.api.types.is_bool_dtype(column.dtype) or pd.api.types.is_integer_dtype(column.dtype):
        if column.isna().any():
            raise InputError(
                f"label column {name!r} has {int(column.isna().sum())} missing value(s)",
                source=path,
            )
        return column.to_numpy(dtype=np.int64), None
    if pd.api.types.is_float_dtype(column.dtype):
        return column.to_numpy(dtype=np.float64, na_value=np.nan), None
    if column.isna().any():
        raise InputError(
            f"label column {name!r} has {int(column.isna().sum())} missing value(s)", source=path
        )
    text = column.astype(str)
    names = sorted(text.unique())
    index = {label: i for i, label in enumerate(names)}
    return text.map(index).to_numpy(dtype=np.int64), names


def _is_missing(value) -> bool:
    """Whether a table cell is empty (None, NaN, pandas NA)."""
    import pandas as pd

    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _integer_columns(frame: pd.DataFrame, names: list[str]) -> bool:
    """Whether every feature column holds integers only (no bool, no missing cell, no uint64).

    Such features (token ids, counts) are read exactly as int64 instead of through float64;
    one floating, boolean or partly empty column sends the whole table down the float path.
    """
    import pandas as pd

    for name in names:
        column = frame[name]
        if pd.api.types.is_bool_dtype(column.dtype) or not pd.api.types.is_integer_dtype(
            column.dtype
        ):
            return False
        if pd.api.types.is_unsigned_integer_dtype(column.dtype) and column.dtype.itemsize >= 8:
            return False
        if column.isna().any():
            return False
    return True


def read_table(spec: dict) -> Dataset:
    """Load the csv/parquet table of a complete file spec (rules in the module docstring).

    pandas/pyarrow decode some cells lazily (e.g. invalid UTF-8 in a parquet string
    column fails only when the cell is converted), so any library error raised while
    the table is turned into arrays is reported as an InputError naming the file.
    """
    path, fmt, label_column = spec["path"], spec["format"], spec["label_column"]
    if fmt == PARQUET:
        listed = _parquet_with_lists(spec)
        if listed is not None:
            return listed
    frame = _read_table(path, fmt)
    try:
        return _table_dataset(frame, path, fmt, label_column, spec)
    except (InputError, UsageError):
        raise
    except Exception as exc:
        raise read_failure(f"{fmt} table contents", exc, path) from exc


def _table_dataset(
    frame: pd.DataFrame, path: str, fmt: str, label_column: str | None, spec: dict
) -> Dataset:
    """Split a table into features, labels and (with a 'split' column) train/test parts."""
    label = label_column or DEFAULT_LABEL_COLUMN
    columns = [str(c) for c in frame.columns]
    frame.columns = columns
    feature_names = _table_feature_names(frame, columns, label, path)
    features = _table_features(frame, columns, feature_names, path)
    labels, class_names = _label_array(frame[label], label, path)
    if SPLIT_COLUMN not in columns:
        x_train, y_train, x_test, y_test = features, labels, None, None
        names = (
            "features",
            f"label column {label!r}",
            "test features",
            f"test label column {label!r}",
        )
    else:
        is_train, is_test = _split_rows(frame, path)
        x_train, y_train = features[is_train], labels[is_train]
        x_test, y_test = (features[is_test], labels[is_test]) if is_test.any() else (None, None)
        names = (
            "train features",
            f"label column {label!r}",
            "test features",
            f"test labels in column {label!r}",
        )
    return finalize_dataset(
        x_train,
        y_train,
        x_test,
        y_test,
        source=path,
        spec=spec,
        task="classification" if class_names else None,
        num_classes=len(class_names) if class_names else None,
        class_names=class_names,
        names=names,
    )


def _table_feature_names(frame, columns: list[str], label: str, path: str) -> list[str]:
    """The feature columns (all but the label and split columns), once the table is checked:
    unique column names, the label column present, rows, and every feature numeric."""
    import pandas as pd

    if len(set(columns)) != len(columns):
        raise InputError(
            f"has {len(columns) - len(set(columns))} duplicate column name(s)", source=path
        )
    if label not in columns:
        raise InputError(
            f"has no label column {label!r} ({len(columns)} columns); choose one with `label_column`",
            source=path,
        )
    if len(frame) == 0:
        raise InputError("table has no rows", source=path)
    feature_names = [c for c in columns if c not in (label, SPLIT_COLUMN)]
    if not feature_names:
        raise InputError(f"has no feature columns besides the label column {label!r}", source=path)
    non_numeric = [
        c
        for c in feature_names
        if not (pd.api.types.is_numeric_dtype(frame[c]) or pd.api.types.is_bool_dtype(frame[c]))
    ]
    if non_numeric:
        first = columns.index(non_numeric[0]) + 1
        raise InputError(
            f"has {len(non_numeric)} non-numeric feature column(s) (the first is column {first} "
            f"of {len(columns)}); every column but the label must be a number",
            source=path,
        )
    return feature_names


def _table_features(frame, columns: list[str], feature_names: list[str], path: str) -> np.ndarray:
    """The feature columns as int64 (all integer) or float64, with no missing value."""
    try:
        if _integer_columns(frame, feature_names):
            features = frame[feature_names].to_numpy(dtype=np.int64)
        else:
            features = frame[feature_names].to_numpy(dtype=np.float64, na_value=np.nan)
    except (TypeError, ValueError, OverflowError) as exc:
        raise read_failure("feature columns as numbers", exc, path) from exc
    missing = np.isnan(features) if features.dtype.kind == "f" else np.zeros(features.shape, bool)
    if missing.any():
        row, col = np.argwhere(missing)[0]
        raise InputError(
            f"feature column {columns.index(feature_names[col]) + 1} of {len(columns)} has a "
            f"missing or NaN value (row {row + 1}); {int(missing.sum())} in all",
            source=path,
        )
    return features


def _split_rows(frame, path: str) -> tuple[np.ndarray, np.ndarray]:
    """``(is_train, is_test)`` row masks from the 'split' column (train or test, any case)."""
    split = np.array(
        ["<missing>" if _is_missing(v) else str(v).strip().lower() for v in frame[SPLIT_COLUMN]],
        dtype=object,
    )
    bad = ~np.isin(split, [TRAIN, TEST])
    if bad.any():
        raise InputError(
            f"column 'split' has {int(bad.sum())} value(s) other than train or test (the first "
            f"in row {int(np.argmax(bad)) + 1}); expected train or test",
            source=path,
        )
    is_train, is_test = split == TRAIN, split == TEST
    if not is_train.any():
        raise InputError("column 'split' marks no row as train", source=path)
    return is_train, is_test
