"""Property tests: whatever bytes or tensors a data file holds, ``load_dataset`` either returns a
Dataset that meets the contract or raises InputError; no other exception type escapes."""

from __future__ import annotations

import gzip
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from sharpcli.errors import InputError
from sharpcli.io.data.loading import Dataset, load_dataset
from sharpcli.io.data.safe_pickle import restricted_loads

_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "make_data_fixtures.py"
if "make_data_fixtures" not in sys.modules:  # fixtures/ is a script folder, not a package
    _spec = importlib.util.spec_from_file_location("make_data_fixtures", _FIXTURES)
    sys.modules["make_data_fixtures"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["make_data_fixtures"])
fx = sys.modules["make_data_fixtures"]

FUZZ = settings(
    max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
EXTENSIONS = [".safetensors", ".pt", ".pth", ".npz", ".csv", ".parquet"]


def check_contract(ds: Dataset) -> None:
    """A successfully loaded dataset satisfies the Dataset contract."""
    assert ds.x_train.dtype in (torch.float32, torch.int64)  # int64: integer sources, exact
    assert ds.x_train.dim() in (2, 4) and ds.x_train.shape[0] > 0
    assert bool(torch.isfinite(ds.x_train).all())
    assert ds.y_train.shape[0] == ds.x_train.shape[0]
    if ds.task == "classification":
        assert ds.y_train.dtype == torch.int64 and ds.y_train.dim() == 1
        assert int(ds.y_train.min()) >= 0 and int(ds.y_train.max()) < ds.num_classes
    else:
        assert ds.num_classes is None and ds.y_train.dtype == torch.float32
        assert bool(torch.isfinite(ds.y_train).all())
    if ds.x_test is not None:
        assert (
            ds.x_test.shape[1:] == ds.x_train.shape[1:] and ds.y_test.shape[0] == ds.x_test.shape[0]
        )
        assert ds.x_test.dtype == ds.x_train.dtype


def load_or_input_error(path: str) -> None:
    """Only InputError may escape; a successful load must satisfy the contract."""
    try:
        ds = load_dataset(path)
    except InputError as exc:
        assert "\n" not in exc.one_line() and exc.source
        return
    check_contract(ds)


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory):
    """Bytes of one valid file per extension and of each vision layout's files, to mutate."""
    root = tmp_path_factory.mktemp("valid")
    out = {
        ".safetensors": fx.write_safetensors(str(root)).path,
        ".pt": fx.write_pt(str(root)).path,
        ".npz": fx.write_npz(str(root), test=True).path,
        ".csv": fx.write_csv(str(root), with_split=True).path,
        ".parquet": fx.write_parquet(str(root), label="label").path,
    }
    out[".pth"] = out[".pt"]
    files = {ext: Path(path).read_bytes() for ext, path in out.items()}
    cifar = fx.write_cifar10_python(str(root), batch_sizes=(2,), test_size=1)
    files["data_batch_1"] = Path(cifar.path, "data_batch_1").read_bytes()
    mnist = fx.write_mnist_idx(str(root), train_size=3, test_size=2, size=4, gz=False)
    files["train-labels-idx1-ubyte"] = Path(mnist.path, "train-labels-idx1-ubyte").read_bytes()
    files["train-images-idx3-ubyte"] = Path(mnist.path, "train-images-idx3-ubyte").read_bytes()
    return files


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    """Overwrite bytes at (position mod length) and optionally truncate."""
    buffer = bytearray(data)
    for position, value in edits:
        buffer[position % len(buffer)] = value
    return bytes(buffer[:cut] if cut is not None else buffer)


byte_edits = st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=8)


@FUZZ
@given(ext=st.sampled_from(EXTENSIONS), payload=st.binary(max_size=512))
def test_random_bytes_with_each_extension(ext, payload):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "data" + ext)
        Path(path).write_bytes(payload)
        load_or_input_error(path)


@FUZZ
@given(ext=st.sampled_from(EXTENSIONS), edits=byte_edits, cut=st.none() | st.integers(0, 4096))
def test_mutated_valid_files(valid_files, ext, edits, cut):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "data" + ext)
        Path(path).write_bytes(mutate(valid_files[ext], edits, cut))
        load_or_input_error(path)


@FUZZ
@given(
    edits=byte_edits,
    cut=st.none() | st.integers(0, 7000),
    random_stream=st.none() | st.binary(max_size=300),
)
def test_mutated_cifar_pickles_only_raise_input_error(valid_files, edits, cut, random_stream):
    data = (
        random_stream
        if random_stream is not None
        else mutate(valid_files["data_batch_1"], edits, cut)
    )
    try:
        restricted_loads(data, source="batch")
    except InputError as exc:
        assert exc.source == "batch"
    with tempfile.TemporaryDirectory() as folder:
        root = os.path.join(folder, "cifar-10-batches-py")
        os.mkdir(root)
        Path(root, "data_batch_1").write_bytes(data)
        load_or_input_error(root)


@FUZZ
@given(
    layout=st.sampled_from(["cifar10-binary", "cifar100-binary", "mnist-raw", "mnist-gz"]),
    payload=st.binary(max_size=8000),
    edits=byte_edits,
    use_valid=st.booleans(),
)
def test_random_vision_files(valid_files, layout, payload, edits, use_valid):
    with tempfile.TemporaryDirectory() as folder:
        if layout == "cifar10-binary":
            Path(folder, "data_batch_1.bin").write_bytes(payload)
        elif layout == "cifar100-binary":
            Path(folder, "train.bin").write_bytes(payload)
            Path(folder, "test.bin").write_bytes(payload[: len(payload) // 2])
        else:
            gz = layout == "mnist-gz"
            suffix = ".gz" if gz else ""
            images = (
                mutate(valid_files["train-images-idx3-ubyte"], edits, None)
                if use_valid
                else payload
            )
            labels = valid_files["train-labels-idx1-ubyte"] if use_valid else payload[:64]
            for name, data in (
                ("train-images-idx3-ubyte", images),
                ("train-labels-idx1-ubyte", labels),
            ):
                Path(folder, name + suffix).write_bytes(gzip.compress(data) if gz else data)
        load_or_input_error(folder)


DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, np.int8, np.bool_]
special_floats = st.sampled_from(
    [0.0, -1.0, 1.5, 3.0, 1e39, -1e39, float("nan"), float("inf"), 2.0**40, -7.0]
)


@st.composite
def tensor_dicts(draw):
    """Random dicts with keys drawn from x, y, x_test, y_test (and a stray one), random shapes and dtypes."""
    keys = draw(
        st.lists(st.sampled_from(["x", "y", "x_test", "y_test", "extra"]), unique=True, max_size=5)
    )
    out = {}
    for key in keys:
        ndim = draw(st.integers(0, 5))
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
        dtype = draw(st.sampled_from(DTYPES))
        size = int(np.prod(shape)) if shape else 1
        values = np.array(
            draw(
                st.lists(
                    special_floats | st.integers(-3, 9).map(float), min_size=size, max_size=size
                )
            ),
            dtype=np.float64,
        )
        with np.errstate(all="ignore"):
            if np.dtype(dtype).kind in "iub":
                values = np.nan_to_num(values, nan=0, posinf=0, neginf=0).clip(-100, 100)
            out[key] = values.astype(dtype).reshape(shape)
    return out


@FUZZ
@given(arrays=tensor_dicts(), fmt=st.sampled_from(["safetensors", "pt", "npz"]))
def test_random_tensor_dicts(arrays, fmt):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "data." + fmt)
        if fmt == "npz":
            np.savez(path, **arrays)
        else:
            tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
            save_file(tensors, path) if fmt == "safetensors" else torch.save(tensors, path)
        load_or_input_error(path)


@FUZZ
@given(
    rows=st.lists(
        st.lists(
            st.one_of(
                st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=3), st.none()
            ),
            min_size=3,
            max_size=3,
        ),
        max_size=6,
    ),
    columns=st.lists(st.sampled_from(["a", "b", "label", "split", "c"]), min_size=3, max_size=3),
    fmt=st.sampled_from(["csv", "parquet"]),
)
def test_random_tables(rows, columns, fmt):
    import pandas as pd

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "t." + fmt)
        frame = pd.DataFrame(rows, columns=columns) if rows else pd.DataFrame(columns=columns)
        try:
            if fmt == "csv":
                frame.to_csv(path, index=False)
            else:
                frame.to_parquet(path, index=False)
        except Exception:
            return  # pandas/pyarrow cannot write this frame (mixed types, duplicate names): nothing to load
        load_or_input_error(path)
