"""Tables: ``.csv`` and ``.parquet`` files, each declared on its probe beside the reader
(docs/index.md, ``--data``).

Tables are read through pandas: the label column (option ``--label-column``, default
``label``) is the target and every other column is a numeric feature (read as int64 when
every feature column holds integers, as float64 otherwise), except an optional column named
``split`` whose values ``train``/``test`` (case-insensitive) assign each row to a split;
without that column the whole table is the train split. Integer or boolean labels are classes
``0..C-1``; textual labels are mapped to classes by sorted name (``Dataset.class_names``);
floating labels make a regression target. A parquet file with list columns (token ids per
row), or read with named keys, is read as named arrays (:mod:`sharpcli.io.data.arrow`).

Plain-text csv has no signature and is routed by its ``.csv`` extension only; parquet is
recognised by its magic bytes. The declarations are records of
:data:`sharpcli.catalogue.DATA_FORMATS` (see :mod:`sharpcli.io.data.tensor_files`).
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import numpy as np

from sharpcli.bounded import open_data_file
from sharpcli.catalogue.values import TEST, TRAIN
from sharpcli.errors import InputError, UsageError
from sharpcli.io.data.arrow import ArrowColumns, table_has_list_columns
from sharpcli.io.data.dataset import (
    NAMED_KEYS,
    Dataset,
    finalize_dataset,
    format_info,
    read_failure,
)
from sharpcli.io.data.keyed import LABEL_KEYS, dataset_from_mapping
from sharpcli.registry import declare

if TYPE_CHECKING:  # pandas (with pyarrow: ~0.4 s, ~80 MB) is imported only to read a table
    import pandas as pd

__all__ = ["CSV", "PARQUET", "is_csv", "is_parquet", "read_table"]

# the formats' names, which the reader below dispatches on
CSV, PARQUET = "csv", "parquet"

DEFAULT_LABEL_COLUMN = "label"
SPLIT_COLUMN = "split"

_READER = "sharpcli.io.data.tables"
_TABLE_TEST = "add a column named 'split' with values train/test"


@declare(
    "data format",
    PARQUET,
    "parquet table: numeric feature columns, a label column, an optional split "
    "column; list columns (token ids) as named keys",
    info=format_info(
        6,
        f"{_READER}:read_table",
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
        f"{_READER}:read_table",
        extensions=(".csv",),
        spec_keys=("label_column",),
        test_split=_TABLE_TEST,
    ),
)
def is_csv(path: str) -> bool:
    """Plain text carries no signature: a csv file is routed by its ``.csv`` extension only."""
    return False


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
    (:mod:`sharpcli.io.data.arrow`: lists padded, ``x_key``/``y_key`` or keyword inputs; the
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
