"""Data formats researchers have (``fixtures/make_hf_fixtures.py`` writes them): ``.npz`` with any
key names, ``.npy`` pairs, Arrow files and Hugging Face ``save_to_disk`` folders (number and
list-of-ids columns), parquet list columns, a pickled ``TensorDataset``; keyword inputs stacked
in one tensor; token labels equal to the inputs refused unless shifted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures import make_hf_fixtures as hf
from sharpcli.errors import InputError, UsageError
from sharpcli.io.data.loading import load_dataset

BERT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def stacked(arrays: dict, keys=BERT_KEYS) -> torch.Tensor:
    return torch.stack([torch.from_numpy(arrays[k]) for k in keys], dim=1)


def test_npz_keyword_inputs_are_stacked_in_file_order(tmp_path):
    arrays = hf.bert_data()
    ds = load_dataset(hf.write_npz(tmp_path / "b.npz", arrays))
    assert ds.input_keys == BERT_KEYS
    assert ds.x_train.dtype == torch.int64 and ds.x_train.shape == (8, 3, hf.LENGTH)
    assert torch.equal(ds.x_train, stacked(arrays))  # (N, K, T): no channel axis
    assert torch.equal(ds.y_train, torch.from_numpy(arrays["labels"]))


def test_npz_any_key_names_with_x_key_and_y_key(tmp_path):
    rng = np.random.default_rng(0)
    feats, target = rng.standard_normal((5, 3)), rng.integers(0, 2, 5)
    path = hf.write_npz(tmp_path / "d.npz", {"features": feats, "target": target})
    with pytest.raises(InputError) as info:
        load_dataset(path)
    assert "keys found: features, target" in info.value.message
    ds = load_dataset(path, x_key="features", y_key="target")
    assert ds.input_keys is None  # one positional input
    assert torch.equal(ds.x_train, torch.from_numpy(feats))
    assert ds.spec["x_key"] == "features" and load_dataset(ds.spec).x_train.shape == (5, 3)
    with pytest.raises(InputError, match="has no key 'feat' .*keys found: features, target"):
        load_dataset(path, x_key="feat", y_key="target")
    with pytest.raises(UsageError):
        load_dataset("blobs", x_key="x")


def test_no_3d_array_gets_a_channel_axis_unless_x_shape_says_so(tmp_path):
    """Integer ids, uint8 pixels and floats (N, 3, 4) stay as stored (a Conv1d's (N, C, L) as
    much as images); `x_shape` 1,3,4 is the one way to one-channel images."""
    ids = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    ds = load_dataset(hf.write_npz(tmp_path / "i.npz", {"x": ids, "y": np.array([0, 1])}))
    assert ds.x_train.shape == (2, 3, 4)
    for dtype in (np.uint8, np.float32):
        path = hf.write_npz(tmp_path / "p.npz", {"x": ids.astype(dtype), "y": np.array([0, 1])})
        assert load_dataset(path).x_train.shape == (2, 3, 4)
        images = load_dataset(path, x_shape="1,3,4").x_train
        assert images.shape == (2, 1, 3, 4) and images[1, 0, 2, 3].item() == 23


def test_npy_pairs_with_test_split(tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 3, 6)
    path = hf.write_npy_pair(tmp_path, x, y, stem="X_train")
    hf.write_npy_pair(tmp_path, x[:2], y[:2], stem="X_test")
    ds = load_dataset(path)
    assert ds.spec["format"] == "npy"
    assert torch.equal(ds.x_train, torch.from_numpy(x)) and torch.equal(
        ds.y_train, torch.from_numpy(y)
    )
    assert torch.equal(ds.x_test, torch.from_numpy(x[:2]))
    lonely = tmp_path / "other" / "feats.npy"
    lonely.parent.mkdir()
    np.save(lonely, x)
    with pytest.raises(InputError, match="no x to pair"):
        load_dataset(str(lonely))
    np.save(tmp_path / "other" / "classes.npy", y)
    assert torch.equal(load_dataset(str(lonely), y_key="classes").y_train, torch.from_numpy(y))


@pytest.mark.parametrize("ragged", [False, True])
def test_hf_save_to_disk_dataset_dict(tmp_path, ragged):
    pytest.importorskip("datasets")
    train, test = hf.bert_data(n=8, seed=2), hf.bert_data(n=4, seed=5)
    folder = hf.write_hf_dataset(tmp_path / "hf", train, test=test, ragged=ragged)
    ds = load_dataset(folder)
    assert ds.spec["format"] == "hf-dataset" and ds.input_keys == BERT_KEYS
    # ragged rows are padded to the longest row with 0 (the masks say where)
    width = int(train["attention_mask"].sum(1).max()) if ragged else hf.LENGTH
    assert torch.equal(ds.x_train, stacked(train)[:, :, :width])
    assert torch.equal(ds.y_train, torch.from_numpy(train["labels"]))
    width = int(test["attention_mask"].sum(1).max()) if ragged else hf.LENGTH
    assert torch.equal(ds.x_test, stacked(test)[:, :, :width])
    single = hf.write_hf_dataset(tmp_path / "one", train)
    assert load_dataset(single).x_test is None


def test_arrow_file_and_parquet_list_columns(tmp_path):
    pytest.importorskip("datasets")
    arrays = hf.bert_data()
    for path in (
        hf.write_arrow(tmp_path / "b.arrow", arrays, ragged=True),
        hf.write_parquet_lists(tmp_path / "b.parquet", arrays, ragged=True),
    ):
        ds = load_dataset(path)
        width = int(arrays["attention_mask"].sum(1).max())
        assert ds.input_keys == BERT_KEYS, path
        assert torch.equal(ds.x_train, stacked(arrays)[:, :, :width]), path
        assert torch.equal(ds.y_train, torch.from_numpy(arrays["labels"])), path


def test_ragged_token_labels_are_padded_with_ignore_index(tmp_path):
    ids = [[1, 2, 3], [4, 5]]
    lm = {
        "input_ids": np.array([[1, 2, 3], [4, 5, 0]]),
        "attention_mask": np.array([[1, 1, 1], [1, 1, 0]]),
    }
    lm["labels"] = np.array([[2, 3, 1], [5, 1, 0]])
    path = hf.write_arrow(tmp_path / "lm.arrow", lm, ragged=True)
    ds = load_dataset(path)
    assert ds.y_train.tolist() == [[2, 3, 1], [5, 1, -100]]
    assert ds.x_train[:, 0].tolist() == [ids[0], ids[1] + [0]]


def test_tensor_dataset_needs_trust_pickle(tmp_path):
    x, y = np.ones((4, 2), np.float32), np.array([0, 1, 0, 1])
    path = hf.write_tensor_dataset(tmp_path / "td.pt", x, y)
    with pytest.raises(InputError) as info:
        load_dataset(path)
    message = info.value.one_line()
    assert "`trust_pickle`" in message and "d.tensors[0]" in message
    assert "\x1b" not in message and all(ch.isprintable() for ch in message)
    ds = load_dataset(path, trust_pickle=True)
    assert torch.equal(ds.x_train, torch.from_numpy(x)) and "trust_pickle" not in ds.spec


def test_labels_equal_to_inputs_are_refused_or_shifted(tmp_path):
    arrays = hf.gpt2_data(n=3)
    path = hf.write_npz(tmp_path / "lm.npz", arrays)
    with pytest.raises(InputError, match="token labels equal the input ids.*`shift_labels`"):
        load_dataset(path)
    ds = load_dataset(path, shift_labels=True)
    ids = torch.from_numpy(arrays["input_ids"])
    assert torch.equal(ds.y_train[:, :-1], ids[:, 1:]) and (ds.y_train[:, -1] == -100).all()
    assert ds.spec["shift_labels"] is True
    assert torch.equal(load_dataset(ds.spec).y_train, ds.y_train)  # the spec reproduces it
    kept = load_dataset(path, shift_labels=False)
    assert torch.equal(kept.y_train, ids)
    with pytest.raises(UsageError, match="contradicts"):
        load_dataset(ds.spec, shift_labels=False)
