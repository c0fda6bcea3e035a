"""The data formats that ``--data PATH`` reads and the built-in datasets of ``--data NAME``.

This module imports no torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from sharpcli.registry import Entry, Registry

__all__ = ["DATASETS", "DATA_FORMATS"]


def _format(
    name: str,
    summary: str,
    probe: str,
    read: str,
    extensions: Sequence[str] = (),
    spec_keys: Sequence[str] = (),
    *,
    test_split: str,
    directory: bool = False,
) -> Entry:
    """A data format's record.

    ``info`` holds what :class:`sharpcli.io.formats.DataFormat` is made of (``probe`` and
    ``read`` as ``"module:function"``, imported with the format module).
    """
    info = {
        "probe": probe,
        "read": read,
        "extensions": tuple(extensions),
        "spec_keys": tuple(spec_keys),
        "directory": directory,
        "test_split": test_split,
    }
    return Entry(name, summary, "sharpcli.io.formats", info=info)


_TENSOR_TEST = "add tensors x_test and y_test (or <key>_test for named keys)"
_KEYS = ("x_key", "y_key")
_TABLE_TEST = "add a column named 'split' with values train/test"
_FOLDER_TEST = "the folder holds no test files"
_FILES = "sharpcli.io.datasets_files"
_VISION = "sharpcli.io.datasets_vision"
_ARROW = "sharpcli.io.datasets_arrow"

# ``--data PATH`` (sharpcli.io.formats). Order matters twice: it is the order of the lists in
# messages, and folder layouts are probed in it (CIFAR-10 batches win over a CIFAR-100
# train/test pair in the same folder).
DATA_FORMATS: Registry[Any] = Registry(
    "data format",
    source="data",
    entries=[
        _format(
            "safetensors",
            "safetensors file with tensors x, y (optional x_test, y_test) or named keys",
            f"{_FILES}:is_safetensors",
            f"{_FILES}:read_tensor_file",
            (".safetensors",),
            _KEYS,
            test_split=_TENSOR_TEST,
        ),
        _format(
            "pt",
            "torch.save dict of tensors x, y (optional x_test, y_test) or named keys; a "
            "TensorDataset with trust_pickle",
            f"{_FILES}:is_torch_file",
            f"{_FILES}:read_tensor_file",
            (".pt", ".pth"),
            _KEYS,
            test_split=_TENSOR_TEST,
        ),
        _format(
            "npz",
            "numpy.savez archive with arrays x, y (optional x_test, y_test) or named keys",
            f"{_FILES}:is_npz",
            f"{_FILES}:read_tensor_file",
            (".npz",),
            _KEYS,
            test_split=_TENSOR_TEST,
        ),
        _format(
            "npy",
            "numpy .npy features beside their labels file (x.npy and y.npy, X_train.npy and "
            "y_train.npy)",
            f"{_FILES}:is_npy",
            f"{_FILES}:read_npy_pair",
            (".npy",),
            ("y_key",),
            test_split="add the test files (train -> test in both names)",
        ),
        _format(
            "arrow",
            "Arrow file (a Hugging Face dataset shard): number and list-of-ids columns",
            f"{_ARROW}:is_arrow",
            f"{_ARROW}:read_arrow",
            (".arrow",),
            _KEYS,
            test_split="use a save_to_disk DatasetDict folder with a test split",
        ),
        _format(
            "csv",
            "csv table: numeric feature columns, a label column, an optional split column",
            f"{_FILES}:is_csv",
            f"{_FILES}:read_table",
            (".csv",),
            ("label_column",),
            test_split=_TABLE_TEST,
        ),
        _format(
            "parquet",
            "parquet table: numeric feature columns, a label column, an optional split "
            "column; list columns (token ids) as named keys",
            f"{_FILES}:is_parquet",
            f"{_FILES}:read_table",
            (".parquet",),
            ("label_column", *_KEYS),
            test_split=_TABLE_TEST,
        ),
        _format(
            "hf-dataset",
            "Hugging Face datasets save_to_disk folder (Dataset or DatasetDict)",
            f"{_ARROW}:is_hf_dataset_folder",
            f"{_ARROW}:read_hf_dataset_folder",
            spec_keys=_KEYS,
            directory=True,
            test_split="save a DatasetDict with a test split",
        ),
        _format(
            "cifar10-python",
            "CIFAR-10 python batches (cifar-10-batches-py)",
            f"{_VISION}:is_cifar10_python",
            f"{_VISION}:read_cifar",
            directory=True,
            test_split=_FOLDER_TEST,
        ),
        _format(
            "cifar10-binary",
            "CIFAR-10 binary batches (cifar-10-batches-bin)",
            f"{_VISION}:is_cifar10_binary",
            f"{_VISION}:read_cifar",
            directory=True,
            test_split=_FOLDER_TEST,
        ),
        _format(
            "cifar100-binary",
            "CIFAR-100 binary train/test files (cifar-100-binary); fine or coarse labels",
            f"{_VISION}:is_cifar100_binary",
            f"{_VISION}:read_cifar",
            spec_keys=("label_column",),
            directory=True,
            test_split=_FOLDER_TEST,
        ),
        _format(
            "cifar100-python",
            "CIFAR-100 python train/test pickles (cifar-100-python); fine or coarse labels",
            f"{_VISION}:is_cifar100_python",
            f"{_VISION}:read_cifar",
            spec_keys=("label_column",),
            directory=True,
            test_split=_FOLDER_TEST,
        ),
        _format(
            "mnist-idx",
            "MNIST-family idx files, plain or .gz (MNIST, Fashion-MNIST, KMNIST)",
            f"{_VISION}:is_mnist_idx",
            f"{_VISION}:read_mnist",
            directory=True,
            test_split=_FOLDER_TEST,
        ),
    ],
)

# ``--data NAME[:k=v,...]``: the built-in synthetic datasets (sharpcli.io.datasets_builtin);
# their parameters are typed and checked there
DATASETS: Registry[Any] = Registry(
    "built-in dataset",
    source="data",
    entries=[
        Entry("blobs", "a Gaussian mixture in R^dim", "sharpcli.io.datasets_builtin:make_blobs"),
        Entry(
            "images",
            "channels x size x size images, one smooth template per class",
            "sharpcli.io.datasets_builtin:make_images",
        ),
    ],
)
