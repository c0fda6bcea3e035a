"""Arrow data: ``.arrow`` files, Hugging Face ``save_to_disk`` folders, parquet list columns.

Every column becomes one array of the name -> array mapping that
:func:`sharpcli.io.data.keyed.dataset_from_mapping` picks inputs and labels from; a
column is converted only when it is picked, so text columns beside the ids do no harm:

- numbers (integers, floats, booleans): ``(N,)``;
- lists (``list<int32>`` ids, nested lists of pixels): ``(N, T, ...)``; rows of varying
  length (unpadded token ids) are padded at the end to the longest, with 0 in inputs and
  with ``-100`` (unlabelled) in label columns; nested lists must be rectangular below the
  first level;
- a missing cell (null) or a text column that is picked is an ``InputError``.

A ``save_to_disk`` folder holds ``state.json`` and its Arrow stream files (a ``Dataset``: the
train split), or ``dataset_dict.json`` and one such folder per split (a ``DatasetDict``:
``train``, and ``test``, else ``validation``, as the test split). The files are read with
pyarrow, never through ``datasets`` (which is not needed to read them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np

from sharpcli.bounded import open_data_file, read_data_file
from sharpcli.catalogue.values import TEST, TRAIN
from sharpcli.errors import InputError
from sharpcli.io.data.dataset import NAMED_KEYS, Dataset, format_info, read_failure
from sharpcli.io.data.keyed import LABEL_KEYS, dataset_from_mapping
from sharpcli.registry import declare

__all__ = [
    "ArrowColumns",
    "is_arrow",
    "is_hf_dataset_folder",
    "read_arrow",
    "read_hf_dataset_folder",
    "table_has_list_columns",
]

ARROW_FILE_MAGIC = b"ARROW1"
_STREAM_CONTINUATION = b"\xff\xff\xff\xff"


class ArrowColumns(Mapping):
    """The columns of a pyarrow table as ``name -> numpy array``, converted when read.

    ``label_keys``: the columns padded with -100 (labels) rather than 0 when rows vary in length.
    """

    def __init__(self, table, path: str, label_keys=LABEL_KEYS):
        self.table, self.path, self.label_keys = table, path, tuple(label_keys)
        self._cache: dict = {}

    def __getitem__(self, name):
        if name not in self._cache:
            if name not in self.table.column_names:
                raise KeyError(name)
            column = self.table.column(name).combine_chunks()
            pad = -100 if name in self.label_keys else 0
            self._cache[name] = column_array(column, pad, self.path)
        return self._cache[name]

    def __iter__(self):
        return iter(self.table.column_names)

    def __len__(self) -> int:
        return len(self.table.column_names)


def column_array(column, pad, path: str) -> np.ndarray:
    """One Arrow column as a numpy array (rules in the module docstring)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if column.null_count:
        raise InputError(f"a column has {column.null_count} missing value(s)", source=path)
    kind = column.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return column.to_numpy(zero_copy_only=False)
    if not (
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    ):
        raise InputError(f"a picked column holds {kind}, not numbers or lists of them", source=path)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    inner = column_array(column.flatten(), pad, path)
    rows = len(lengths)
    if rows and (lengths == lengths[0]).all():
        return inner.reshape(rows, int(lengths[0]), *inner.shape[1:])
    if inner.ndim != 1:
        raise InputError("a column holds nested lists of varying length", source=path)
    width = int(lengths.max()) if rows else 0
    dtype = np.float64 if inner.dtype.kind == "f" else np.int64
    out = np.full((rows, width), pad, dtype=dtype)
    out[np.arange(width)[None, :] < lengths[:, None]] = inner
    return out


def table_has_list_columns(table) -> bool:
    """Whether some column of a pyarrow table holds lists (token ids, pixels)."""
    import pyarrow as pa

    return any(
        pa.types.is_list(f.type)
        or pa.types.is_large_list(f.type)
        or pa.types.is_fixed_size_list(f.type)
        for f in table.schema
    )


def _read_table(path: str):
    """The table in an Arrow IPC file (``ARROW1`` magic) or stream (what ``save_to_disk`` writes)."""
    import pyarrow as pa

    content = read_data_file(path)
    try:
        buffer = pa.py_buffer(content)
        if content[:6] == ARROW_FILE_MAGIC:
            return pa.ipc.open_file(buffer).read_all()
        return pa.ipc.open_stream(buffer).read_all()
    except Exception as exc:
        raise read_failure("Arrow file", exc, path) from exc


@declare(
    "data format",
    "arrow",
    "Arrow file (a Hugging Face dataset shard): number and list-of-ids columns",
    info=format_info(
        4,
        f"{__name__}:read_arrow",
        extensions=(".arrow",),
        spec_keys=NAMED_KEYS,
        test_split="use a save_to_disk DatasetDict folder with a test split",
    ),
)
def is_arrow(path: str) -> bool:
    """An Arrow IPC file (``ARROW1``) or stream (a continuation marker then a schema message)."""
    try:
        with open_data_file(path) as handle:
            head = handle.read(8)
    except (OSError, InputError):
        return False
    return head[:6] == ARROW_FILE_MAGIC or head[:4] == _STREAM_CONTINUATION


def read_arrow(spec: dict) -> Dataset:
    """Load an ``.arrow`` file of a complete file spec (its columns are the keys)."""
    path = spec["path"]
    labels = (spec["y_key"],) if spec.get("y_key") else LABEL_KEYS
    return dataset_from_mapping(
        ArrowColumns(_read_table(path), path, labels), spec, path, default_keys=False
    )


def _split_folder_files(folder: str) -> list[str]:
    """The Arrow files of one ``save_to_disk`` split folder, in the order state.json lists."""
    state_file = os.path.join(folder, "state.json")
    try:
        state = json.loads(read_data_file(state_file))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise read_failure("save_to_disk state.json", exc, folder) from exc
    files = []
    for name in names:
        if not isinstance(name, str) or os.path.basename(name) != name:
            raise InputError("state.json lists a data file outside its folder", source=folder)
        files.append(os.path.join(folder, name))
    if not files:
        raise InputError("state.json lists no data file", source=folder)
    return files


def _split_table(folder: str):
    import pyarrow as pa

    tables = [_read_table(path) for path in _split_folder_files(folder)]
    try:
        return pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except Exception as exc:
        raise read_failure("save_to_disk shards", exc, folder) from exc


@declare(
    "data format",
    "hf-dataset",
    "Hugging Face datasets save_to_disk folder (Dataset or DatasetDict)",
    info=format_info(
        7,
        f"{__name__}:read_hf_dataset_folder",
        spec_keys=NAMED_KEYS,
        directory=True,
        test_split="save a DatasetDict with a test split",
    ),
)
def is_hf_dataset_folder(path: str) -> bool:
    """A ``save_to_disk`` folder: ``state.json`` with Arrow files, or ``dataset_dict.json``."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        return True
    return os.path.isfile(os.path.join(path, "state.json")) and any(
        name.endswith(".arrow") for name in os.listdir(path)
    )


def _dict_splits(folder: str) -> tuple[str, str | None]:
    """``(train folder, test folder or None)`` of a DatasetDict folder."""
    try:
        listed = json.loads(read_data_file(os.path.join(folder, "dataset_dict.json")))["splits"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise read_failure("dataset_dict.json", exc, folder) from exc
    splits = [s for s in listed if isinstance(s, str) and os.path.basename(s) == s]
    if not splits:
        raise InputError("dataset_dict.json lists no split", source=folder)
    train = TRAIN if TRAIN in splits else splits[0]
    test = next((s for s in (TEST, "validation") if s in splits and s != train), None)
    return os.path.join(folder, train), (os.path.join(folder, test) if test else None)


def read_hf_dataset_folder(spec: dict) -> Dataset:
    """Load a ``save_to_disk`` folder (module docstring); a DatasetDict's test split is
    renamed ``<key>_test`` (``x_test``/``y_test`` for x and y) before the keys are picked."""
    path = spec["path"]
    labels = (spec["y_key"],) if spec.get("y_key") else LABEL_KEYS
    if not os.path.isfile(os.path.join(path, "dataset_dict.json")):
        return dataset_from_mapping(
            ArrowColumns(_split_table(path), path, labels), spec, path, default_keys=False
        )
    train_folder, test_folder = _dict_splits(path)
    train = ArrowColumns(_split_table(train_folder), path, labels)
    if test_folder is None:
        return dataset_from_mapping(train, spec, path, default_keys=False)
    test = ArrowColumns(_split_table(test_folder), path, labels)
    merged = _MergedSplits(train, test)
    return dataset_from_mapping(merged, spec, path, default_keys=False)


class _MergedSplits(Mapping):
    """A train and a test mapping as one: test keys renamed ``<key>_test``."""

    def __init__(self, train: Mapping, test: Mapping):
        self.train, self.test = train, test
        self.renamed = {f"{k}_test": k for k in test}

    def __getitem__(self, name):
        if name in self.train:
            return self.train[name]
        return self.test[self.renamed[name]]

    def __iter__(self):
        yield from self.train
        yield from self.renamed

    def __len__(self) -> int:
        return len(self.train) + len(self.renamed)
