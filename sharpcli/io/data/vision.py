"""Readers for the standard CIFAR-10/100 and MNIST download folders (docs/index.md, ``--data``).

Everything is read from disk (never downloaded). Layouts, as the official archives
unpack:

- ``cifar10-python`` (``cifar-10-batches-py/``): ``data_batch_1`` .. ``data_batch_5`` and
  ``test_batch``, each a Python-2 pickle of a dict with ``b"data"`` (uint8 array
  ``(n, 3072)``: 1024 red, 1024 green, 1024 blue values of a 32x32 image, row-major)
  and ``b"labels"`` (n ints in 0..9). Read with ``safe_pickle.restricted_loads``.
- ``cifar100-python`` (``cifar-100-python/``): ``train`` and ``test`` pickles with
  ``b"data"``, ``b"fine_labels"`` (0..99) and ``b"coarse_labels"`` (0..19).
- ``cifar10-binary`` (``cifar-10-batches-bin/``): ``data_batch_1.bin`` .. ``data_batch_5.bin``,
  ``test_batch.bin``; records of 1 label byte + 3072 pixel bytes.
- ``cifar100-binary`` (``cifar-100-binary/``): ``train.bin``, ``test.bin``; records of
  2 label bytes (coarse, fine) + 3072 pixel bytes.
- ``mnist-idx`` (MNIST, Fashion-MNIST, KMNIST, ...): ``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``,
  each optionally ``.gz``. An idx file is ``0x00 0x00 <type> <ndim>``, then ``ndim``
  big-endian uint32 sizes, then the values (big-endian) in row-major order.

Images come out as float32 ``(N, C, H, W)`` scaled to ``[0, 1]`` (byte / 255).
CIFAR-100 uses the 100 fine labels unless ``label_column="coarse"`` (20 classes).
The train split of a CIFAR-10 folder is every ``data_batch_k`` present, which must be
numbered 1..K without gaps.

Each layout is declared on its probe here (its record names its reader);
:mod:`sharpcli.io.data.formats` also finds a layout in the subfolders of the directory given to
``--data``.
"""

from __future__ import annotations

import gzip
import math
import os
import re
import struct

import numpy as np
import torch

from sharpcli.bounded import MAX_DEFLATE_RATIO, data_file_size, open_data_file, read_data_file
from sharpcli.catalogue.values import TEST, TRAIN
from sharpcli.errors import InputError, UsageError
from sharpcli.io.data.dataset import Dataset, finalize_dataset, format_info, read_failure
from sharpcli.io.data.safe_pickle import restricted_loads
from sharpcli.registry import declare

CIFAR_PIXELS = 3 * 32 * 32
MAX_IDX_BYTES = 2**31  # larger than any MNIST-family file; a header promising more is corrupt
_IDX_TYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_CIFAR100_LABELS = {
    None: "fine",
    "fine": "fine",
    "fine_labels": "fine",
    "coarse": "coarse",
    "coarse_labels": "coarse",
}
# an MNIST split's files by what they hold (its images, its labels)
_MNIST_STEMS = {
    (TRAIN, "image"): ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    (TRAIN, "label"): ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    (TEST, "image"): ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    (TEST, "label"): ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}
# what messages call an image folder's arrays: images, labels, test images, test labels (made
# from their parts: the plural alone is the built-in dataset `images`, declared elsewhere)
_ARRAY_NAMES = ("images", "labels", "test images", "test labels")

# the layouts' names, which read_cifar dispatches on
CIFAR10_PYTHON, CIFAR10_BINARY = "cifar10-python", "cifar10-binary"
CIFAR100_BINARY, CIFAR100_PYTHON = "cifar100-binary", "cifar100-python"


# ----------------------------------------------------------------------------- layout probing


def _numbered_batches(folder: str, suffix: str) -> list[str]:
    """Paths of ``data_batch_<k><suffix>`` in ``folder``, ordered by k; gaps in 1..K raise InputError."""
    pattern = re.compile(r"data_batch_(\d+)" + re.escape(suffix) + r"$")
    numbered = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(folder)
        if (m := pattern.match(name)) and os.path.isfile(os.path.join(folder, name))
    )
    numbers = [k for k, _ in numbered]
    if numbers != list(range(1, len(numbers) + 1)):
        raise InputError(
            f"training batches are numbered {numbers}; expected data_batch_1{suffix} .. data_batch_K{suffix}",
            source=folder,
        )
    return [os.path.join(folder, name) for _, name in numbered]


def _mnist_file(folder: str, split: str, kind: str) -> str | None:
    """Path of an MNIST idx file in ``folder`` (plain preferred over ``.gz``), or None."""
    for stem in _MNIST_STEMS[(split, kind)]:
        for name in (stem, stem + ".gz"):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    return None


def _has_files(folder: str, *names: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, name)) for name in names)


@declare(
    "data format",
    CIFAR10_PYTHON,
    "CIFAR-10 python batches (cifar-10-batches-py)",
    info=format_info(8, f"{__name__}:read_cifar", directory=True),
)
def is_cifar10_python(folder: str) -> bool:
    """``data_batch_1`` (python pickle batches of ``cifar-10-batches-py``)."""
    return _has_files(folder, "data_batch_1")


@declare(
    "data format",
    CIFAR10_BINARY,
    "CIFAR-10 binary batches (cifar-10-batches-bin)",
    info=format_info(9, f"{__name__}:read_cifar", directory=True),
)
def is_cifar10_binary(folder: str) -> bool:
    """``data_batch_1.bin`` (binary records of ``cifar-10-batches-bin``)."""
    return _has_files(folder, "data_batch_1.bin")


@declare(
    "data format",
    CIFAR100_BINARY,
    "CIFAR-100 binary train/test files (cifar-100-binary); fine or coarse labels",
    info=format_info(10, f"{__name__}:read_cifar", spec_keys=("label_column",), directory=True),
)
def is_cifar100_binary(folder: str) -> bool:
    """``train.bin`` and ``test.bin`` (``cifar-100-binary``)."""
    return _has_files(folder, "train.bin", "test.bin")


@declare(
    "data format",
    CIFAR100_PYTHON,
    "CIFAR-100 python train/test pickles (cifar-100-python); fine or coarse labels",
    info=format_info(11, f"{__name__}:read_cifar", spec_keys=("label_column",), directory=True),
)
def is_cifar100_python(folder: str) -> bool:
    """``train`` and ``test`` pickles (``cifar-100-python``)."""
    return _has_files(folder, TRAIN, TEST)


@declare(
    "data format",
    "mnist-idx",
    "MNIST-family idx files, plain or .gz (MNIST, Fashion-MNIST, KMNIST)",
    info=format_info(12, f"{__name__}:read_mnist", directory=True),
)
def is_mnist_idx(folder: str) -> bool:
    """A training-images idx file, plain or ``.gz``, under either of its usual names."""
    return os.path.isdir(folder) and _mnist_file(folder, TRAIN, "image") is not None


# ----------------------------------------------------------------------------- CIFAR


def _entry(batch: dict, key: str, path: str):
    """``batch[b"key"]`` (Python 2 pickles) or ``batch["key"]`` (re-pickled by Python 3)."""
    for candidate in (key.encode(), key):
        if candidate in batch:
            return batch[candidate]
    raise InputError(f"CIFAR batch has no {key!r} entry ({len(batch)} other key(s))", source=path)


def _pixels_to_images(data: np.ndarray) -> torch.Tensor:
    """uint8 rows of 3072 CIFAR values -> float32 (n, 3, 32, 32) in [0, 1]."""
    return (
        torch.from_numpy(np.ascontiguousarray(data))
        .reshape(-1, 3, 32, 32)
        .to(torch.float32)
        .div_(255.0)
    )


def _python_batch(path: str, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(data uint8 (n, 3072), labels (n,))`` of one CIFAR python batch, checked."""
    batch = restricted_loads(read_data_file(path), source=path)
    if not isinstance(batch, dict):
        raise InputError(
            f"CIFAR batch holds a {type(batch).__name__}, expected a dict", source=path
        )
    data = _entry(batch, "data", path)
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != CIFAR_PIXELS
    ):
        described = (
            f"array {data.dtype} {data.shape}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise InputError(
            f"CIFAR 'data' is {described}; expected uint8 (n, {CIFAR_PIXELS})", source=path
        )
    raw_labels = _entry(batch, label_key, path)
    if not isinstance(raw_labels, (list, tuple, np.ndarray)):
        raise InputError(
            f"CIFAR {label_key!r} is a {type(raw_labels).__name__}, expected a list", source=path
        )
    try:
        labels = np.asarray(raw_labels)
    except Exception as exc:
        raise read_failure(f"CIFAR {label_key!r}", exc, path) from exc
    if labels.ndim != 1 or (labels.size and labels.dtype.kind not in "iu"):
        raise InputError(f"CIFAR {label_key!r} must be a list of integers", source=path)
    if labels.shape[0] != data.shape[0]:
        raise InputError(
            f"CIFAR batch has {data.shape[0]} images but {labels.shape[0]} labels", source=path
        )
    return data, labels.astype(np.int64)


def _binary_batch(path: str, label_bytes: int, label_index: int) -> tuple[np.ndarray, np.ndarray]:
    """``(data, labels)`` of a CIFAR binary file: records of ``label_bytes`` + 3072 bytes."""
    raw = read_data_file(path)
    record = label_bytes + CIFAR_PIXELS
    if len(raw) == 0 or len(raw) % record:
        raise InputError(
            f"CIFAR binary file has {len(raw)} bytes, not a positive multiple of the {record}-byte record "
            "(truncated or not this format)",
            source=path,
        )
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, record)
    return rows[:, label_bytes:], rows[:, label_index].astype(np.int64)


def _cifar_dataset(train_parts, test_parts, num_classes: int, source: str, spec: dict) -> Dataset:
    """Concatenate batches and hand images/labels to ``finalize_dataset``."""
    x_train = _pixels_to_images(np.concatenate([d for d, _ in train_parts]))
    y_train = np.concatenate([y for _, y in train_parts])
    x_test = y_test = None
    if test_parts:
        x_test = _pixels_to_images(np.concatenate([d for d, _ in test_parts]))
        y_test = np.concatenate([y for _, y in test_parts])
    return finalize_dataset(
        x_train,
        y_train,
        x_test,
        y_test,
        source=source,
        spec=spec,
        task="classification",
        num_classes=num_classes,
        names=_ARRAY_NAMES,
    )


def read_cifar(spec: dict) -> Dataset:
    """Load the CIFAR-10/100 folder of a complete file spec, python-pickle or binary
    (module docstring)."""
    folder, fmt, label_column = spec["path"], spec["format"], spec["label_column"]
    if fmt.startswith("cifar10-") and label_column is not None:
        raise UsageError(
            "CIFAR-10 has one label set; `label_column` does not apply", source="label_column"
        )
    if fmt.startswith("cifar100-") and label_column not in _CIFAR100_LABELS:
        raise UsageError(
            f"CIFAR-100 labels are 'fine' (100 classes) or 'coarse' (20), got {label_column!r}",
            source="label_column",
        )
    if fmt == CIFAR10_PYTHON:
        train = [_python_batch(p, "labels") for p in _numbered_batches(folder, "")]
        test_path = os.path.join(folder, "test_batch")
        test = [_python_batch(test_path, "labels")] if os.path.isfile(test_path) else []
        return _cifar_dataset(train, test, 10, folder, spec)
    if fmt == CIFAR10_BINARY:
        train = [_binary_batch(p, 1, 0) for p in _numbered_batches(folder, ".bin")]
        test_path = os.path.join(folder, "test_batch.bin")
        test = [_binary_batch(test_path, 1, 0)] if os.path.isfile(test_path) else []
        return _cifar_dataset(train, test, 10, folder, spec)
    coarse = _CIFAR100_LABELS[label_column] == "coarse"
    classes = 20 if coarse else 100
    extension = ".bin" if fmt == CIFAR100_BINARY else ""
    paths = {split: os.path.join(folder, split + extension) for split in (TRAIN, TEST)}
    if not os.path.isfile(paths[TRAIN]):
        raise InputError(
            f"CIFAR-100 folder has no {os.path.basename(paths[TRAIN])!r} file", source=folder
        )

    def read(path: str) -> tuple[np.ndarray, np.ndarray]:
        if fmt == CIFAR100_PYTHON:
            return _python_batch(path, "coarse_labels" if coarse else "fine_labels")
        return _binary_batch(path, 2, 0 if coarse else 1)  # record: coarse byte, fine byte, pixels

    train = [read(paths[TRAIN])]
    test = [read(paths[TEST])] if os.path.isfile(paths[TEST]) else []
    return _cifar_dataset(train, test, classes, folder, spec)


# ----------------------------------------------------------------------------- MNIST idx


def _read_exactly(handle, count: int, path: str) -> bytes:
    """Read ``count`` bytes in 1 MiB chunks (so a lying header cannot force a huge allocation)."""
    chunks, remaining = [], count
    while remaining:
        chunk = handle.read(min(remaining, 1 << 20))
        if not chunk:
            raise InputError(
                f"idx file is truncated: {count - remaining} of {count} data bytes present",
                source=path,
            )
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_idx(path: str) -> np.ndarray:
    """Parse one idx file (optionally gzip-compressed) into a native-endian numpy array.

    Header: two zero bytes, a type code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), the number of dimensions d, then d big-endian uint32
    sizes. The payload must hold exactly ``prod(sizes) * itemsize`` bytes, which may not
    exceed what the file can hold (its size; for ``.gz`` files ``MAX_DEFLATE_RATIO`` times
    it), so a lying header is refused before anything is allocated.
    """
    compressed = path.endswith(".gz")
    try:
        with open_data_file(path) as raw:
            file_size = data_file_size(raw)
            handle = gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw
            dims, dtype, payload = _idx_payload(handle, file_size, compressed, path)
    except InputError:
        raise
    except Exception as exc:  # gzip/zlib/OS errors
        raise read_failure("idx file", exc, path) from exc
    # one copy: native byte order, and writable (torch refuses read-only buffers)
    return (
        np.frombuffer(payload, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="), copy=True)
    )


def _idx_payload(
    handle, file_size: int, compressed: bool, path: str
) -> tuple[tuple[int, ...], np.dtype, bytes]:
    """``(sizes, dtype, payload bytes)`` of an idx stream read from a file of ``file_size`` bytes;
    a declared payload the file cannot hold is refused before it is read."""
    magic = handle.read(4)
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_TYPES:
        raise InputError(f"not an idx file (magic bytes {magic.hex() or 'missing'})", source=path)
    ndim = magic[3]
    if ndim == 0:
        raise InputError("idx header declares 0 dimensions", source=path)
    dims_raw = handle.read(4 * ndim)
    if len(dims_raw) < 4 * ndim:
        raise InputError("idx header is truncated", source=path)
    dims = struct.unpack(f">{ndim}I", dims_raw)
    dtype = np.dtype(_IDX_TYPES[magic[2]])
    size = math.prod(dims) * dtype.itemsize
    if size > MAX_IDX_BYTES:
        raise InputError(
            f"idx header declares shape {dims} ({size} bytes), beyond any real file",
            source=path,
        )
    if compressed and size > file_size * MAX_DEFLATE_RATIO:
        raise InputError(
            f"idx header declares shape {dims} ({size} bytes), more than a gzip file of "
            f"{file_size} bytes can unpack to",
            source=path,
        )
    present = file_size - 4 - 4 * ndim
    if not compressed and size > present:
        raise InputError(
            f"idx file is truncated: {present} of {size} data bytes present", source=path
        )
    payload = _read_exactly(handle, size, path)
    if handle.read(1):
        raise InputError(
            f"idx file has trailing bytes after the {size} declared by its header {dims}",
            source=path,
        )
    return dims, dtype, payload


def _mnist_split(folder: str, split: str) -> tuple[torch.Tensor, np.ndarray] | None:
    """``(images (n, 1, H, W) in [0, 1], labels (n,))`` of one split, or None if its files are absent."""
    images_path, labels_path = (
        _mnist_file(folder, split, "image"),
        _mnist_file(folder, split, "label"),
    )
    if images_path is None and labels_path is None and split == TEST:
        return None
    if images_path is None or labels_path is None:
        missing = _MNIST_STEMS[(split, "image" if images_path is None else "label")][0]
        raise InputError(f"MNIST folder has no {missing}(.gz)", source=folder)
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3:
        raise InputError(
            f"idx images must have 3 dimensions (n, rows, cols), found {images.shape}",
            source=images_path,
        )
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise InputError(
            f"idx labels must be 1-D integers, found {labels.dtype} {labels.shape}",
            source=labels_path,
        )
    if images.shape[0] != labels.shape[0]:
        raise InputError(
            f"{os.path.basename(images_path)} has {images.shape[0]} images but "
            f"{os.path.basename(labels_path)} has {labels.shape[0]} labels",
            source=folder,
        )
    x = torch.from_numpy(np.ascontiguousarray(images)).unsqueeze(1).to(torch.float32)
    if images.dtype == np.uint8:
        x = x.div_(255.0)
    return x, labels.astype(np.int64)


def read_mnist(spec: dict) -> Dataset:
    """Load the MNIST-family idx folder of a complete file spec; classes: ``max(10, 1 +
    largest label)``."""
    folder = spec["path"]
    if spec["label_column"] is not None:
        raise UsageError(
            "MNIST idx folders have one label set; `label_column` does not apply",
            source="label_column",
        )
    train = _mnist_split(folder, TRAIN)
    assert train is not None  # only the test split may be absent
    test = _mnist_split(folder, TEST)
    labels = [train[1]] + ([test[1]] if test else [])
    largest = max(int(part.max()) if part.size else 0 for part in labels)
    return finalize_dataset(
        train[0],
        train[1],
        test[0] if test else None,
        test[1] if test else None,
        source=folder,
        spec=spec,
        task="classification",
        num_classes=max(10, largest + 1),
        names=_ARRAY_NAMES,
    )
