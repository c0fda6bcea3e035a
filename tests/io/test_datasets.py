"""Dataset loading (``--data``, docs/index.md): every format against the values its writer put on disk,
built-in generators, seeded subsets, the restricted unpickler, and every bad-input error."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pickle
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from sharpcli.errors import InputError, UsageError
from sharpcli.io.data.loading import (
    Dataset,
    format_data_spec,
    load_dataset,
    parse_data_spec,
    subset,
    validate_for_model,
)
from sharpcli.io.data.safe_pickle import restricted_loads
from sharpcli.specs import RegistryError

_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "make_data_fixtures.py"
if "make_data_fixtures" not in sys.modules:  # fixtures/ is a script folder, not a package
    _spec = importlib.util.spec_from_file_location("make_data_fixtures", _FIXTURES)
    sys.modules["make_data_fixtures"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["make_data_fixtures"])
fx = sys.modules["make_data_fixtures"]


def t(array):
    return torch.from_numpy(np.asarray(array))


def assert_matches(ds: Dataset, written, *, test=True):
    """Loaded tensors equal the written arrays exactly, with the contract's dtypes."""
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert torch.equal(ds.x_train, t(written.x_train))
    assert torch.equal(ds.y_train, t(written.y_train))
    if test:
        assert torch.equal(ds.x_test, t(written.x_test))
        assert torch.equal(ds.y_test, t(written.y_test))
    else:
        assert ds.x_test is None and ds.y_test is None


def expect_error(kind, source_part: str, message_part: str, fn, *args, **kwargs):
    """fn raises ``kind`` whose one-line message names ``source_part`` and says ``message_part``."""
    with pytest.raises(kind) as info:
        fn(*args, **kwargs)
    line = info.value.one_line()
    assert "\n" not in line
    assert source_part in line, line
    assert message_part in line, line
    return info.value


# ----------------------------------------------------------------------------- formats


def test_cifar10_python_matches_written_batches_and_pixel_layout(tmp_path):
    written = fx.write_cifar10_python(str(tmp_path))
    ds = load_dataset(written.path)
    assert ds.x_train.shape == (12, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
    assert_matches(ds, written)
    assert ds.num_classes == 10 and ds.task == "classification" and ds.input_shape == (3, 32, 32)
    # hand check of the CIFAR row layout: R plane, G plane, B plane, each 32x32 row-major
    rows = written.extra["rows"]
    assert ds.x_train[4, 1, 2, 3].item() == np.float32(rows[4, 1024 + 2 * 32 + 3]) / np.float32(255)
    assert ds.x_train[0, 2, 31, 0].item() == np.float32(rows[0, 2048 + 31 * 32]) / np.float32(255)
    assert float(ds.x_train.min()) >= 0.0 and float(ds.x_train.max()) <= 1.0
    assert ds.spec == {
        "kind": "file",
        "path": written.path,
        "format": "cifar10-python",
        "label_column": None,
    }


def test_cifar10_python_fixture_is_a_real_python2_pickle(tmp_path):
    written = fx.write_cifar10_python(str(tmp_path))
    raw = Path(written.path, "data_batch_1").read_bytes()
    assert raw.startswith(b"\x80\x02}q\x01(U\x04dataq\x02cnumpy.core.multiarray\n_reconstruct\n")
    batch = restricted_loads(raw, source="x")
    assert set(batch) == {b"data", b"labels", b"batch_label", b"filenames"}
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (3, 3072)
    assert batch[b"batch_label"] == b"training batch 1 of 5"
    assert np.array_equal(batch[b"data"], written.extra["rows"][:3])


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("key_type", [bytes, str])
def test_cifar_python_batches_repickled_by_python3_load(tmp_path, protocol, key_type):
    """Python 3 pickles reach numpy through _codecs.encode (protocol 2) and _frombuffer (5)."""
    rng = np.random.default_rng(protocol)
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    key = (lambda s: s.encode()) if key_type is bytes else (lambda s: s)
    rows = rng.integers(0, 256, size=(5, 3072), dtype=np.uint8)
    labels = [3, 1, 4, 1, 5]
    (root / "data_batch_1").write_bytes(
        pickle.dumps({key("data"): rows, key("labels"): labels}, protocol=protocol)
    )
    ds = load_dataset(str(root))
    assert torch.equal(ds.y_train, torch.tensor(labels))
    assert torch.equal(
        ds.x_train, t(rows.reshape(5, 3, 32, 32).astype(np.float32) / np.float32(255))
    )
    assert ds.x_test is None


def test_cifar10_binary_matches(tmp_path):
    written = fx.write_cifar10_binary(str(tmp_path))
    ds = load_dataset(written.path)
    assert_matches(ds, written)
    assert ds.x_train.shape == (10, 3, 32, 32) and ds.num_classes == 10
    assert ds.spec["format"] == "cifar10-binary"


def test_cifar100_python_fine_and_coarse(tmp_path):
    written = fx.write_cifar100_python(str(tmp_path))
    fine = load_dataset(written.path)
    assert_matches(fine, written)
    assert fine.num_classes == 100 and fine.spec["format"] == "cifar100-python"
    coarse = load_dataset(written.path, label_column="coarse")
    assert coarse.num_classes == 20
    assert torch.equal(coarse.y_train, t(written.extra["coarse_train"]))
    assert torch.equal(coarse.y_test, t(written.extra["coarse_test"]))
    assert torch.equal(coarse.x_train, fine.x_train)
    assert load_dataset(coarse.spec).num_classes == 20  # the spec keeps the label choice


def test_cifar100_binary_fine_and_coarse(tmp_path):
    written = fx.write_cifar100_binary(str(tmp_path))
    fine = load_dataset(written.path)
    assert_matches(fine, written)
    assert fine.num_classes == 100
    coarse = load_dataset(written.path, label_column="coarse_labels")
    assert (
        torch.equal(coarse.y_train, t(written.extra["coarse_train"])) and coarse.num_classes == 20
    )


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_matches(tmp_path, gz):
    written = fx.write_mnist_idx(str(tmp_path), gz=gz)
    ds = load_dataset(written.path)
    assert_matches(ds, written)
    assert ds.x_train.shape == (6, 1, 28, 28) and ds.x_test.shape == (4, 1, 28, 28)
    assert ds.num_classes == 10 and ds.input_shape == (1, 28, 28)


def test_parent_folders_are_probed(tmp_path):
    """torchvision roots: data/cifar-10-batches-py and data/MNIST/raw are found from data/."""
    cifar = fx.write_cifar10_binary(str(tmp_path / "c"))
    assert load_dataset(str(tmp_path / "c")).spec["path"] == cifar.path
    mnist = fx.write_mnist_idx(str(tmp_path / "m" / "MNIST"), folder="raw")
    ds = load_dataset(str(tmp_path / "m"))
    assert ds.spec["path"] == mnist.path
    assert_matches(ds, mnist)


def test_csv_without_split_is_train_only(tmp_path):
    written = fx.write_csv(str(tmp_path))
    ds = load_dataset(written.path)
    assert ds.x_train.dtype == torch.float32 and ds.x_train.shape == (10, 4)
    assert_matches(ds, written, test=False)
    assert ds.num_classes == int(written.y_train.max()) + 1
    expect_error(InputError, written.path, "has no test split", ds.split, "test")


def test_csv_with_split_column_and_custom_label(tmp_path):
    written = fx.write_csv(str(tmp_path), with_split=True, label="cls", n=11)
    ds = load_dataset(written.path, label_column="cls")
    assert_matches(ds, written)
    assert ds.spec["label_column"] == "cls"
    assert torch.equal(load_dataset(ds.spec).x_test, ds.x_test)


def test_parquet_with_split(tmp_path):
    written = fx.write_parquet(str(tmp_path))
    ds = load_dataset({"kind": "file", "path": written.path, "label_column": "target"})
    assert_matches(ds, written)
    assert ds.spec["format"] == "parquet"


def test_table_text_labels_and_float_targets(tmp_path):
    path = tmp_path / "animals.csv"
    pd.DataFrame(
        {"a": [1.0, 2.0, 3.0, 4.0], "label": ["dog", "cat", "dog", "emu"], "b": [0, 1, 0, 1]}
    ).to_csv(path, index=False)
    ds = load_dataset(str(path))
    assert ds.class_names == ["cat", "dog", "emu"]
    assert ds.y_train.tolist() == [1, 0, 1, 2] and ds.num_classes == 3
    assert ds.x_train.tolist() == [[1, 0], [2, 1], [3, 0], [4, 1]]
    path = tmp_path / "reg.csv"
    pd.DataFrame({"a": [1, 2, 3], "label": [0.5, -1.25, 2.0]}).to_csv(path, index=False)
    reg = load_dataset(str(path))
    assert reg.task == "regression" and reg.num_classes is None
    assert reg.y_train.dtype == torch.float32 and reg.y_train.tolist() == [0.5, -1.25, 2.0]


@pytest.mark.parametrize(
    "writer,ext",
    [(fx.write_safetensors, "safetensors"), (fx.write_pt, "pt"), (fx.write_npz, "npz")],
)
def test_tensor_files_match(tmp_path, writer, ext):
    written = writer(str(tmp_path), test=True)
    ds = load_dataset(written.path)
    assert_matches(ds, written)
    assert ds.num_classes == int(max(written.y_train.max(), written.y_test.max())) + 1
    assert ds.spec["format"] == ext and ds.source == written.path
    written = writer(str(tmp_path), name="train_only." + ext, test=False)
    assert_matches(load_dataset(written.path), written, test=False)


def test_pth_extension_and_regression_targets(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "x": rng.standard_normal((6, 3)),
        "y": rng.standard_normal((6, 2)),
    }  # float64 in the file
    written = fx.write_pt(str(tmp_path), name="reg.pth", arrays=arrays)
    ds = load_dataset(written.path)
    assert ds.task == "regression" and ds.num_classes is None and ds.spec["format"] == "pt"
    assert (  # float64 in the file stays float64 (tests/curvature/test_float64_data.py)
        ds.x_train.dtype == torch.float64
        and ds.y_train.dtype == torch.float64
        and ds.y_train.shape == (6, 2)
    )
    assert torch.equal(ds.y_train, t(arrays["y"]))
    assert ds.output_size == 2


def test_tensor_file_shape_conventions(tmp_path):
    """(N, H, W) uint8 stays (N, H, W) int64 (values kept; `x_shape` 1,H,W makes one-channel
    images), (N, C, D, H, W) stays as stored, (N, 1) integer labels -> (N,), bool labels -> 0/1."""
    x = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    written = fx.write_npz(
        str(tmp_path), arrays={"x": x, "y": np.array([[1], [0]], dtype=np.int32)}
    )
    ds = load_dataset(written.path)
    assert ds.x_train.shape == (2, 3, 4) and ds.x_train[1, 2, 3].item() == 23
    assert ds.x_train.dtype == torch.int64  # integer features stay exact (token ids)
    ds = load_dataset(written.path, x_shape="1,3,4")
    assert ds.x_train.shape == (2, 1, 3, 4) and ds.x_train[1, 0, 2, 3].item() == 23
    assert ds.spec["x_shape"] == [1, 3, 4] and ds.input_shape == (1, 3, 4)
    assert load_dataset(ds.spec).x_train.shape == (2, 1, 3, 4)  # the spec reproduces it
    volumes = np.arange(2 * 2 * 3 * 3 * 3, dtype=np.float32).reshape(2, 2, 3, 3, 3)
    written = fx.write_npz(
        str(tmp_path), name="v.npz", arrays={"x": volumes, "y": np.array([0, 1])}
    )
    assert torch.equal(load_dataset(written.path).x_train, torch.from_numpy(volumes))
    assert ds.y_train.tolist() == [1, 0] and ds.y_train.dtype == torch.int64
    written = fx.write_safetensors(
        str(tmp_path),
        name="b.safetensors",
        arrays={"x": np.ones((3, 2), np.float16), "y": np.array([True, False, True])},
    )
    ds = load_dataset(written.path)
    assert (
        ds.y_train.tolist() == [1, 0, 1]
        and ds.num_classes == 2
        and ds.x_train.dtype == torch.float32
    )


# ----------------------------------------------------------------------------- built-ins


def test_blobs_defaults_shapes_balance_and_statistics():
    ds = load_dataset()  # the default data
    assert ds.source == "builtin:blobs"
    assert ds.x_train.shape == (1500, 16) and ds.x_test.shape == (500, 16)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.num_classes == 4 and ds.task == "classification"
    counts = torch.bincount(torch.cat([ds.y_train, ds.y_test]), minlength=4)
    assert counts.tolist() == [500, 500, 500, 500]  # arange(n) % classes, permuted
    # within-class noise is N(0, I): pooled per-coordinate variance ~ 1 (3000 dof per coordinate)
    means = torch.stack([ds.x_train[ds.y_train == c].mean(0) for c in range(4)])
    residual = ds.x_train - means[ds.y_train]
    assert abs(float(residual.var(0).mean()) - 1.0) < 0.05
    # ||mu_c|| ~= separation (3); nearest-mean accuracy on the test split is high but not perfect
    assert 2.0 < float(means.norm(dim=1).mean()) < 4.0
    predicted = torch.cdist(ds.x_test, means).argmin(1)
    accuracy = float((predicted == ds.y_test).float().mean())
    assert 0.85 < accuracy < 0.99


def test_builtins_deterministic_per_seed_and_different_across_seeds():
    for name in ("blobs:n=200", "images:n=60,size=6"):
        a, b = load_dataset(name), load_dataset(name)
        assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)
        assert torch.equal(a.x_test, b.x_test)
        c = load_dataset(name + ",seed=1")
        assert not torch.equal(a.x_train, c.x_train)
    # class means do not depend on n: the first draws are the class parameters
    small, large = (
        load_dataset("blobs:n=8,test_fraction=0,separation=100"),
        load_dataset("blobs:n=4000,test_fraction=0,separation=100"),
    )
    for c in range(4):
        assert torch.allclose(
            small.x_train[small.y_train == c].mean(0),
            large.x_train[large.y_train == c].mean(0),
            atol=6.0,
        )  # mean norm ~100, noise of 2 samples ~ 1/sqrt(2)


def test_images_builtin_is_learnable_and_shaped():
    ds = load_dataset("images")
    assert ds.x_train.shape == (750, 3, 8, 8) and ds.x_test.shape == (250, 3, 8, 8)
    assert ds.num_classes == 10 and ds.input_shape == (3, 8, 8)
    assert abs(float(ds.x_train.mean()) - 0.5) < 0.05
    flat = ds.x_train.flatten(1)
    means = torch.stack([flat[ds.y_train == c].mean(0) for c in range(10)])
    accuracy = float(
        (torch.cdist(ds.x_test.flatten(1), means).argmin(1) == ds.y_test).float().mean()
    )
    assert accuracy > 0.9
    gray = load_dataset("images:n=40,size=5,channels=1,classes=3,test_fraction=0")
    assert gray.x_train.shape == (40, 1, 5, 5) and gray.x_test is None


def test_builtin_spec_round_trip_and_json():
    ds = load_dataset("blobs:n=100, dim=3 ,seed=7")
    assert ds.spec == {
        "kind": "builtin",
        "name": "blobs",
        "args": {
            "n": 100,
            "dim": 3,
            "classes": 4,
            "seed": 7,
            "test_fraction": 0.25,
            "separation": 3.0,
        },
    }
    again = load_dataset(json.loads(json.dumps(ds.spec)))
    assert torch.equal(again.x_train, ds.x_train) and torch.equal(again.y_test, ds.y_test)
    text = format_data_spec(ds.spec)
    assert text == "blobs:n=100,dim=3,classes=4,seed=7,test_fraction=0.25,separation=3.0"
    assert torch.equal(load_dataset(text).x_train, ds.x_train)


def test_file_spec_round_trip(tmp_path):
    written = fx.write_safetensors(str(tmp_path))
    ds = load_dataset(os.path.relpath(written.path))
    assert ds.spec["path"] == written.path  # made absolute
    again = load_dataset(json.loads(json.dumps(ds.spec)))
    assert torch.equal(again.x_train, ds.x_train) and torch.equal(again.y_test, ds.y_test)
    assert parse_data_spec(ds.spec) == ds.spec


# ----------------------------------------------------------------------------- subset, split, validate


def test_subset_seeded_nested_without_replacement():
    x = torch.arange(50, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(50)
    xs, ys = subset(x, y, 20, seed=3)
    assert xs.shape == (20, 1) and torch.equal(xs[:, 0].long(), ys)  # rows stay paired
    assert len(set(ys.tolist())) == 20 and ys.tolist() == sorted(ys.tolist())
    assert torch.equal(subset(x, y, 20, seed=3)[1], ys)
    assert not torch.equal(subset(x, y, 20, seed=4)[1], ys)
    assert set(subset(x, y, 10, seed=3)[1].tolist()) <= set(ys.tolist())
    assert torch.equal(subset(x, y, 50, seed=9)[1], y)
    assert subset(x, y, None, seed=0)[0] is x
    expect_error(UsageError, "samples", "only 50", subset, x, y, 51, 0)
    expect_error(UsageError, "samples", "at least 1", subset, x, y, 0, 0)


def test_subset_is_uniform_over_seeds():
    """Each row is picked with probability samples/N: over 400 seeds, 5 of 10 -> every count ~ 200."""
    x, y = torch.zeros(10, 1), torch.arange(10)
    counts = torch.zeros(10)
    for seed in range(400):
        counts[subset(x, y, 5, seed)[1]] += 1
    assert float(counts.min()) > 160 and float(counts.max()) < 240  # binomial sd = 10


def test_split_and_input_shape():
    ds = load_dataset("blobs:n=40,dim=5")
    assert ds.split("train")[0] is ds.x_train and ds.split("test")[1] is ds.y_test
    assert ds.input_shape == (5,)
    expect_error(UsageError, "split", "unknown split", ds.split, "val")
    no_test = load_dataset("blobs:n=40,test_fraction=0")
    expect_error(InputError, "builtin:blobs", "no test split", no_test.split, "test")


def test_validate_for_model():
    ds = load_dataset("blobs:n=40,dim=12,classes=4")
    validate_for_model(ds, (12,), 4, "data.csv")
    expect_error(
        InputError,
        "data.csv",
        "features have 12 columns but the model expects 16",
        validate_for_model,
        ds,
        (16,),
        4,
        "data.csv",
    )
    expect_error(
        InputError,
        "builtin:blobs",
        "labels include 3 but the model has 3 classes",
        validate_for_model,
        ds,
        [12],
        3,
        None,
    )
    images = load_dataset("images:n=20,size=4")
    expect_error(
        InputError,
        "img",
        "shape (3, 4, 4) but the model expects (3, 8, 8)",
        validate_for_model,
        (images.x_train, images.y_train),
        (3, 8, 8),
        10,
        "img",
    )
    x = torch.ones(3, 2)
    x[1, 1] = float("nan")
    expect_error(
        InputError,
        "p",
        "1 non-finite",
        validate_for_model,
        (x, torch.zeros(3, dtype=torch.long)),
        (2,),
        2,
        "p",
    )
    expect_error(
        InputError,
        "p",
        "empty",
        validate_for_model,
        (torch.ones(0, 2), torch.zeros(0)),
        (2,),
        2,
        "p",
    )
    reg = (torch.ones(4, 2), torch.ones(4, 3))
    validate_for_model(reg, (2,), 3, "r")
    expect_error(
        InputError,
        "r",
        "3 value(s) per sample but the model has 1 outputs",
        validate_for_model,
        reg,
        (2,),
        1,
        "r",
    )
    expect_error(
        InputError,
        "r",
        "-1",
        validate_for_model,
        (torch.ones(2, 2), torch.tensor([0, -1])),
        (2,),
        2,
        "r",
    )


# ----------------------------------------------------------------------------- malicious pickles


def test_malicious_cifar_batch_is_refused_not_executed(tmp_path):
    marker = tmp_path / "PWNED"
    folder = fx.write_malicious_cifar10_python(str(tmp_path / "evil"), str(marker))
    expect_error(
        InputError,
        os.path.join(folder, "data_batch_1"),
        "refusing to unpickle os.system",
        load_dataset,
        folder,
    )
    assert not marker.exists()
    # the payload is real: a plain pickle.loads would have run the command
    pickle.loads(Path(folder, "data_batch_1").read_bytes(), encoding="bytes")
    assert marker.exists()


@pytest.mark.parametrize(
    "module,name",
    [
        ("builtins", "eval"),
        ("subprocess", "Popen"),
        ("numpy", "load"),
        ("posix", "system"),
        ("numpy.testing", "_private"),
    ],
)
def test_restricted_unpickler_refuses_globals(module, name):
    stream = b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\nU\x01x\x85R."
    expect_error(
        InputError,
        "f.pkl",
        f"refusing to unpickle {module}.{name}",
        restricted_loads,
        stream,
        source="f.pkl",
    )


def test_restricted_codecs_encode_only_latin1():
    assert restricted_loads(pickle.dumps(b"\xff\x00ab", protocol=2), source="s") == b"\xff\x00ab"
    stream = b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x05\x00\x00\x00rot13\x86R."
    expect_error(InputError, "s", "only latin-1", restricted_loads, stream, source="s")


# ----------------------------------------------------------------------------- bad inputs


def test_missing_path_and_unknown_extension(tmp_path):
    expect_error(
        InputError,
        "blob",
        "no such file or directory; built-in datasets: blobs, images",
        load_dataset,
        "blob",
    )
    missing = str(tmp_path / "nope.safetensors")
    expect_error(InputError, missing, "no such file", load_dataset, missing)
    odd = tmp_path / "data.txt"
    odd.write_text("1,2\n")
    expect_error(InputError, str(odd), "unknown data file extension '.txt'", load_dataset, str(odd))
    expect_error(
        InputError, str(tmp_path), "not a recognised dataset folder", load_dataset, str(tmp_path)
    )


def test_builtin_and_spec_usage_errors():
    expect_error(UsageError, "data", "unknown parameter 'dims'", load_dataset, "blobs:dims=3")
    expect_error(UsageError, "data", "n must be an integer", load_dataset, "blobs:n=ten")
    expect_error(
        UsageError,
        "data",
        "test_fraction must be in [0, 1)",
        load_dataset,
        "blobs:test_fraction=1",
    )
    expect_error(UsageError, "data", "expected key=value", load_dataset, "images:size")
    expect_error(
        UsageError, "data", "leaves an empty split", load_dataset, "blobs:n=3,test_fraction=0.1"
    )
    expect_error(UsageError, "data", "kind", load_dataset, {"kind": "web", "url": "x"})
    expect_error(
        UsageError, "label_column", "no label column", load_dataset, "blobs", label_column="y"
    )


def test_label_column_rules(tmp_path):
    written = fx.write_safetensors(str(tmp_path))
    expect_error(
        UsageError,
        "label_column",
        "not to safetensors",
        load_dataset,
        written.path,
        label_column="y",
    )
    cifar = fx.write_cifar10_binary(str(tmp_path))
    expect_error(
        UsageError,
        "label_column",
        "not to cifar10-binary data",
        load_dataset,
        cifar.path,
        label_column="fine",
    )
    c100 = fx.write_cifar100_binary(str(tmp_path))
    expect_error(
        UsageError,
        "label_column",
        "'fine' (100 classes) or 'coarse'",
        load_dataset,
        c100.path,
        label_column="superclass",
    )
    table = fx.write_csv(str(tmp_path))
    expect_error(
        UsageError,
        "label_column",
        "contradicts",
        load_dataset,
        {"kind": "file", "path": table.path, "label_column": "a"},
        label_column="b",
    )


def test_truncated_and_corrupt_tensor_files(tmp_path):
    for writer in (fx.write_safetensors, fx.write_pt, fx.write_npz):
        written = writer(str(tmp_path))
        raw = Path(written.path).read_bytes()
        Path(written.path).write_bytes(raw[: len(raw) // 2])
        expect_error(InputError, written.path, "cannot read", load_dataset, written.path)
    npy = tmp_path / "single.npz"
    with open(npy, "wb") as handle:
        np.save(handle, np.ones(3))
    expect_error(InputError, str(npy), "single .npy array", load_dataset, str(npy))
    objects = tmp_path / "objects.npz"
    np.savez(objects, x=np.array([{"a": 1}], dtype=object), y=np.array([0]))
    expect_error(InputError, str(objects), "cannot read npz archive", load_dataset, str(objects))


def test_pt_with_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": torch.ones(2, 2), "y": torch.zeros(2, dtype=torch.long), "z": Path("/")}, path)
    expect_error(InputError, str(path), "weights_only=True", load_dataset, str(path))
    path = tmp_path / "list.pt"
    torch.save([torch.ones(2)], path)
    expect_error(InputError, str(path), "holds a list", load_dataset, str(path))


@pytest.mark.parametrize(
    "arrays,message",
    [
        ({"X": np.ones((2, 2)), "y": np.zeros(2, np.int64)}, "keys found: X, y"),
        ({"x": np.ones((2, 2))}, "has no label key (y, labels, label); keys found: x"),
        (
            {"x": np.ones((3, 2)), "y": np.zeros(2, np.int64)},
            "y has 2 labels but the features have 3 rows",
        ),
        (
            {"x": np.ones((2, 2)), "y": np.zeros(2, np.int64), "x_test": np.ones((1, 2))},
            "has test key(s) x_test but not y_test",
        ),
        (
            {
                "x": np.ones((2, 2)),
                "y": np.zeros(2, np.int64),
                "x_test": np.ones((1, 3)),
                "y_test": np.zeros(1, np.int64),
            },
            "x_test has per-sample shape (3,) but x has (2,)",
        ),
        (
            {"x": np.array([[1.0, np.inf]]), "y": np.zeros(1, np.int64)},
            "x has 1 non-finite value(s)",
        ),
        ({"x": np.ones((0, 2)), "y": np.zeros(0, np.int64)}, "x is empty"),
        ({"x": np.ones((2, 2)), "y": np.array([0, -3])}, "negative label (-3)"),
        ({"x": np.ones((2, 2)), "y": np.array([0.5, np.nan])}, "y has 1 non-finite"),
        (
            {"x": np.ones((2, 2)), "y": np.full((2, 2, 2), -100, np.int64)},
            "y has no labelled position (every label is -100)",
        ),
        (
            {
                "x": np.ones((2, 2)),
                "y": np.zeros(2, np.int64),
                "x_test": np.ones((1, 2)),
                "y_test": np.ones(1),
            },
            "y_test has dtype torch.float64 but y has torch.int64",
        ),
    ],
)
def test_bad_tensor_contents(tmp_path, arrays, message):
    written = fx.write_npz(str(tmp_path), arrays=arrays)
    expect_error(InputError, written.path, message, load_dataset, written.path)


def test_bad_tables(tmp_path):
    def csv(name, frame):
        path = tmp_path / name
        frame.to_csv(path, index=False)
        return str(path)

    path = csv("nolabel.csv", pd.DataFrame({"a": [1], "b": [2]}))
    expect_error(InputError, path, "has no label column 'label' (2 columns)", load_dataset, path)
    path = csv("text.csv", pd.DataFrame({"a": [1, 2], "city": ["x", "y"], "label": [0, 1]}))
    expect_error(
        InputError,
        path,
        "1 non-numeric feature column(s) (the first is column 2 of 3)",
        load_dataset,
        path,
    )
    path = csv("nan.csv", pd.DataFrame({"a": [1.0, None, 3.0], "label": [0, 1, 0]}))
    expect_error(
        InputError,
        path,
        "feature column 1 of 2 has a missing or NaN value (row 2)",
        load_dataset,
        path,
    )
    path = csv(
        "split.csv", pd.DataFrame({"a": [1, 2], "label": [0, 1], "split": ["train", "valid"]})
    )
    expect_error(
        InputError,
        path,
        "column 'split' has 1 value(s) other than train or test (the first in row 2)",
        load_dataset,
        path,
    )
    path = csv(
        "onlytest.csv", pd.DataFrame({"a": [1, 2], "label": [0, 1], "split": ["test", "test"]})
    )
    expect_error(InputError, path, "marks no row as train", load_dataset, path)
    path = csv("onlylabel.csv", pd.DataFrame({"label": [0, 1]}))
    expect_error(InputError, path, "no feature columns", load_dataset, path)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    expect_error(InputError, str(empty), "cannot read csv table", load_dataset, str(empty))
    header_only = tmp_path / "header.csv"
    header_only.write_text("a,label\n")
    expect_error(InputError, str(header_only), "no rows", load_dataset, str(header_only))
    garbage = tmp_path / "bad.parquet"
    garbage.write_bytes(b"PAR1 not really")
    expect_error(InputError, str(garbage), "cannot read parquet table", load_dataset, str(garbage))


def test_bad_cifar_folders(tmp_path):
    # truncated binary record
    written = fx.write_cifar10_binary(str(tmp_path / "a"))
    batch = Path(written.path, "data_batch_2.bin")
    batch.write_bytes(batch.read_bytes()[:-5])
    expect_error(
        InputError,
        str(batch),
        "not a positive multiple of the 3073-byte record",
        load_dataset,
        written.path,
    )
    # a gap in the numbering
    written = fx.write_cifar10_binary(str(tmp_path / "b"))
    os.remove(os.path.join(written.path, "data_batch_3.bin"))
    expect_error(InputError, written.path, "numbered [1, 2, 4, 5]", load_dataset, written.path)
    # label out of range in a python batch, wrong data shape, truncated pickle
    root = tmp_path / "c" / "cifar-10-batches-py"
    root.mkdir(parents=True)
    rows = np.zeros((2, 3072), np.uint8)
    (root / "data_batch_1").write_bytes(fx.py2_pickle({b"data": rows, b"labels": [3, 10]}))
    expect_error(
        InputError, str(root), "has label 10 but the format has 10 classes", load_dataset, str(root)
    )
    (root / "data_batch_1").write_bytes(fx.py2_pickle({b"data": rows[:, :100], b"labels": [3, 1]}))
    expect_error(
        InputError, str(root / "data_batch_1"), "expected uint8 (n, 3072)", load_dataset, str(root)
    )
    (root / "data_batch_1").write_bytes(fx.py2_pickle({b"data": rows, b"labels": [3]}))
    expect_error(
        InputError, str(root / "data_batch_1"), "2 images but 1 labels", load_dataset, str(root)
    )
    (root / "data_batch_1").write_bytes(fx.py2_pickle({b"data": rows, b"labels": [3, 1]})[:-40])
    expect_error(
        InputError, str(root / "data_batch_1"), "cannot read pickle data", load_dataset, str(root)
    )
    (root / "data_batch_1").write_bytes(fx.py2_pickle({b"pixels": rows}))
    expect_error(
        InputError,
        str(root / "data_batch_1"),
        "no 'data' entry (1 other key(s))",
        load_dataset,
        str(root),
    )
    # two layouts below one folder
    fx.write_cifar10_binary(str(tmp_path / "two"))
    fx.write_mnist_idx(str(tmp_path / "two"))
    expect_error(
        InputError,
        str(tmp_path / "two"),
        "holds several datasets",
        load_dataset,
        str(tmp_path / "two"),
    )


def test_bad_mnist_folders(tmp_path):
    written = fx.write_mnist_idx(str(tmp_path / "a"), gz=False)
    labels = Path(written.path, "train-labels-idx1-ubyte")
    labels.write_bytes(fx.idx_bytes(np.zeros(5, np.uint8)))  # 5 labels for 6 images
    expect_error(
        InputError,
        written.path,
        "has 6 images but train-labels-idx1-ubyte has 5 labels",
        load_dataset,
        written.path,
    )
    labels.write_bytes(fx.idx_bytes(np.zeros(6, np.uint8))[:-2])
    expect_error(
        InputError, str(labels), "truncated: 4 of 6 data bytes", load_dataset, written.path
    )
    labels.write_bytes(fx.idx_bytes(np.zeros(6, np.uint8)) + b"\x00")
    expect_error(InputError, str(labels), "trailing bytes", load_dataset, written.path)
    labels.write_bytes(b"\x01\x02\x08\x01" + struct.pack(">I", 6) + bytes(6))
    expect_error(
        InputError,
        str(labels),
        "not an idx file (magic bytes 01020801)",
        load_dataset,
        written.path,
    )
    labels.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 6) + bytes([0, 1, 2, 3, 4, 11]))
    validated = load_dataset(written.path)
    assert validated.num_classes == 12  # an EMNIST-style label beyond 9 widens the class count
    labels.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 2**31))
    expect_error(InputError, str(labels), "truncated", load_dataset, written.path)
    os.remove(labels)
    expect_error(InputError, written.path, "no train-labels-idx1-ubyte", load_dataset, written.path)
    written = fx.write_mnist_idx(str(tmp_path / "b"), gz=True)
    images = Path(written.path, "t10k-images-idx3-ubyte.gz")
    images.write_bytes(images.read_bytes()[:-30])
    expect_error(InputError, str(images), "idx file", load_dataset, written.path)
    images.write_bytes(b"not gzip at all")
    expect_error(InputError, str(images), "cannot read idx file", load_dataset, written.path)
    images.write_bytes(gzip.compress(fx.idx_bytes(np.zeros((4, 28), np.uint8))))
    expect_error(InputError, str(images), "3 dimensions", load_dataset, written.path)


def test_format_given_in_spec_must_fit_the_path(tmp_path):
    written = fx.write_cifar10_binary(str(tmp_path))
    expect_error(
        InputError,
        written.path,
        "does not hold a mnist-idx layout",
        load_dataset,
        {"kind": "file", "path": written.path, "format": "mnist-idx"},
    )
    table = fx.write_csv(str(tmp_path))
    expect_error(
        InputError,
        table.path,
        "needs a directory",
        load_dataset,
        {"kind": "file", "path": table.path, "format": "cifar10-binary"},
    )
    copy = tmp_path / "table.dat"
    shutil.copy(table.path, copy)
    ds = load_dataset(
        {"kind": "file", "path": str(copy), "format": "csv"}
    )  # format overrides the extension
    assert torch.equal(ds.x_train, t(table.x_train))
    expect_error(
        UsageError,
        "data",
        "unknown data format 'tsv'",
        load_dataset,
        {"kind": "file", "path": str(copy), "format": "tsv"},
    )


@pytest.mark.parametrize(
    "x,message",
    [
        (torch.empty(2, 2, device="meta"), "x is a meta tensor"),
        (torch.ones(2, 2).to_sparse(), "x is a torch.sparse_coo tensor, expected a dense tensor"),
        (
            torch.ones(2, 2, dtype=torch.complex64),
            "x has dtype torch.complex64, expected real numbers",
        ),
    ],
)
def test_pt_tensor_kinds_refused(tmp_path, x, message):
    path = tmp_path / "odd.pt"
    torch.save({"x": x, "y": torch.zeros(2, dtype=torch.long)}, path)
    expect_error(InputError, str(path), message, load_dataset, str(path))


# ----------------------------------------------------------------------------- format registry


def test_every_format_record_is_complete_and_routes_in_order():
    from sharpcli.io.data.formats import FORMATS

    assert list(FORMATS) == [
        "safetensors",
        "pt",
        "npz",
        "npy",
        "arrow",
        "csv",
        "parquet",
        "hf-dataset",
        "cifar10-python",
        "cifar10-binary",
        "cifar100-binary",
        "cifar100-python",
        "mnist-idx",
    ]
    for name, fmt in FORMATS.items():
        assert fmt.name == name and fmt.description and fmt.test_split
        assert callable(fmt.probe) and callable(fmt.read)
        assert fmt.directory == (not fmt.extensions), name
        assert not fmt.probe("/nonexistent/path/x" + (fmt.extensions or ("",))[0]), name
    takers = [n for n, f in FORMATS.items() if "label_column" in f.spec_keys]
    assert takers == ["csv", "parquet", "cifar100-binary", "cifar100-python"]


@pytest.mark.parametrize(
    "writer, fmt",
    [
        (fx.write_safetensors, "safetensors"),
        (fx.write_pt, "pt"),
        (fx.write_npz, "npz"),
        (lambda folder: fx.write_parquet(folder, label="label"), "parquet"),
    ],
)
def test_files_with_other_extensions_are_recognised_by_their_contents(tmp_path, writer, fmt):
    written = writer(str(tmp_path))
    renamed = tmp_path / "data.bin"
    os.rename(written.path, renamed)
    ds = load_dataset(str(renamed))
    assert ds.spec["format"] == fmt
    assert torch.equal(ds.x_train, t(written.x_train))
    assert torch.equal(ds.y_train, t(written.y_train))


def test_unroutable_paths_and_formats_list_the_accepted_ones(tmp_path):
    table = fx.write_csv(str(tmp_path))
    text = tmp_path / "table.txt"
    shutil.copy(table.path, text)  # csv text has no signature: only .csv routes it
    error = expect_error(
        InputError, str(text), "unknown data file extension '.txt'", load_dataset, str(text)
    )
    assert "accepted: .safetensors, .pt, .pth, .npz, .npy, .arrow, .csv, .parquet" in error.message
    assert "cifar10-python" in error.message and "mnist-idx" in error.message
    error = expect_error(
        UsageError,
        "data",
        "unknown data format 'cifar'",
        load_dataset,
        {"kind": "file", "path": str(tmp_path), "format": "cifar"},
    )
    assert (
        "accepted: safetensors, pt, npz, npy, arrow, csv, parquet, hf-dataset, cifar10"
        in error.message
    )
    expect_error(
        InputError,
        str(tmp_path),
        "expected a layout of: hf-dataset, cifar10-python",
        load_dataset,
        str(tmp_path),
    )


def test_a_registered_format_routes_reads_and_owns_its_spec_keys(tmp_path):
    """A toy ``.csv`` rival with its own spec key: the probe decides between the claimants,
    the key is completed into the spec and refused for other formats."""
    from sharpcli.io.data import formats
    from sharpcli.io.data.dataset import finalize_dataset

    def is_semicolon_table(path):
        with open(path, encoding="utf-8") as handle:
            return ";" in handle.readline()

    def read_semicolon_table(spec):
        rows = Path(spec["path"]).read_text().split()
        values = np.array([[float(v) for v in row.split(spec["delimiter"] or ";")] for row in rows])
        return finalize_dataset(
            values[:, :-1],
            values[:, -1].astype(np.int64),
            None,
            None,
            source=spec["path"],
            spec=spec,
        )

    with pytest.raises(RegistryError, match="data format 'csv' is already registered"):
        formats.register(formats.FORMATS["csv"])
    with pytest.raises(RegistryError, match="lower-case with their dot"):
        formats.register(formats.DataFormat("toy", ("CSV",), bool, bool))
    formats.register(
        formats.DataFormat(
            "semicolon",
            (".csv",),
            is_semicolon_table,
            read_semicolon_table,
            ("delimiter",),
            "semicolon-separated numbers, the class last",
        )
    )
    try:
        toy = tmp_path / "toy.csv"
        toy.write_text("1;2;0\n3;4;1\n")
        ds = load_dataset(str(toy))
        assert ds.spec == {
            "kind": "file",
            "path": str(toy),
            "format": "semicolon",
            "label_column": None,
            "delimiter": None,
        }
        assert ds.x_train.tolist() == [[1.0, 2.0], [3.0, 4.0]] and ds.y_train.tolist() == [0, 1]
        table = fx.write_csv(str(tmp_path))  # commas: the probe declines, csv reads it
        assert load_dataset(table.path).spec["format"] == "csv"
        expect_error(
            UsageError,
            "data",
            "delimiter do not apply to csv data",
            load_dataset,
            {"kind": "file", "path": table.path, "delimiter": ","},
        )
        expect_error(
            UsageError,
            "label_column",
            "applies to csv, parquet, cifar100-binary, cifar100-python data, not to semicolon",
            load_dataset,
            str(toy),
            label_column="y",
        )
    finally:
        formats.unregister("semicolon")
    expect_error(
        UsageError,
        "data",
        "unknown key(s) delimiter",
        load_dataset,
        {"kind": "file", "path": str(toy), "delimiter": ";"},
    )
