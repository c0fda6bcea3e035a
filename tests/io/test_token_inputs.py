"""Token-id inputs: integer features reach an ``nn.Embedding`` first layer as int64.

The model (``fixtures/make_token_fixtures.py``) is Embedding(7, 3) -> mean over 4 positions ->
Linear(3, 3), loaded from a plain state_dict with ``--model-factory tokmodel:make``. Integer
token ids in a data file must stay integer all the way to the model; float ids holding whole
numbers are converted to int64 with a note; ids the embedding cannot look up are a one-line
input error naming the data file (exit 2), never an internal error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fixtures.make_token_fixtures import (
    CLASSES,
    POSITIONS,
    VOCAB,
    token_arrays,
    token_model,
    write_token_checkpoint,
    write_token_data,
    write_token_module,
)
from tests.cli_helpers import assert_one_line_error, run_cli

FACTORY = ("--model-factory", "tokmodel:make")


@pytest.fixture
def token_dir(tmp_path, monkeypatch):
    """A folder with ``tokmodel.py`` (importable) and ``tokens.pt``; it is the cwd."""
    write_token_module(tmp_path)
    write_token_checkpoint(tmp_path / "tokens.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def dense_hessian(x: np.ndarray, y: np.ndarray) -> torch.Tensor:
    """The dense float64 Hessian of the mean cross-entropy w.r.t. all parameters (torch.func)."""
    model = token_model().double().eval()
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])
    xt, yt = torch.from_numpy(np.asarray(x, dtype=np.int64)), torch.from_numpy(y)

    def loss(theta):
        params = {n: t.reshape(s) for n, t, s in zip(names, torch.split(theta, sizes), shapes)}
        return F.cross_entropy(torch.func.functional_call(model, params, (xt,)), yt)

    return torch.func.hessian(loss)(flat)


def dense_top_eigenvalues(x: np.ndarray, y: np.ndarray, k: int) -> np.ndarray:
    """Top-k eigenvalues of :func:`dense_hessian`, largest first."""
    return torch.linalg.eigvalsh(dense_hessian(x, y)).flip(0)[:k].numpy()


def eigen(capsys, data, *extra):
    return run_cli(
        capsys,
        "eigen",
        "tokens.pt",
        *FACTORY,
        "--data",
        str(data),
        "--top-k",
        "2",
        "--tol",
        "1e-10",
        "--dtype",
        "float64",
        "--json",
        "-",
        *extra,
    )


def test_integer_ids_eigenvalues_match_dense_hessian(token_dir, capsys):
    x, y = token_arrays()
    data = write_token_data(token_dir / "ids.npz", x, y)
    run = eigen(capsys, data)
    assert run.code == 0, run.err
    report = run.json()
    expected = dense_top_eigenvalues(x, y, 2)
    got = np.array(report["results"]["eigenvalues"])
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert expected[0] > expected[1] > 0
    assert not report["data"].get("notes")  # integer ids: nothing converted
    assert "int64" not in run.err


def test_float_ids_are_converted_with_a_note(token_dir, capsys):
    x, y = token_arrays()
    data = write_token_data(token_dir / "float_ids.npz", x.astype(np.float32), y)
    run = eigen(capsys, data)
    assert run.code == 0, run.err
    report = run.json()
    np.testing.assert_allclose(
        report["results"]["eigenvalues"], dense_top_eigenvalues(x, y, 2), rtol=1e-6
    )
    notes = report["data"]["notes"]
    assert len(notes) == 1 and "int64" in notes[0] and "Embedding 'emb'" in notes[0], notes
    assert "note:" in run.err and "int64" in run.err


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("ids.npz", np.int32),
        ("ids.safetensors", np.int64),
        ("ids.pt", np.int16),
        ("ids.csv", np.int64),
        ("ids.parquet", np.int64),
    ],
)
def test_every_format_keeps_integer_ids_to_the_model(token_dir, name, dtype):
    """Loader: int64 features; session: int64 on the model's device beside a float64 model."""
    from sharpcli.io.data.loading import load_dataset
    from sharpcli.session import build_session

    x, y = token_arrays()
    data = write_token_data(token_dir / name, x.astype(dtype), y)
    ds = load_dataset(str(data))
    assert ds.x_train.dtype == torch.int64 and ds.x_train.shape == (len(x), POSITIONS)
    assert torch.equal(ds.x_train, torch.from_numpy(x))
    session = build_session(
        str(token_dir / "tokens.pt"),
        data=str(data),
        model_factory="tokmodel:make",
        dtype="float64",
    )
    assert session.x.dtype == torch.int64 and torch.equal(session.x, torch.from_numpy(x))
    assert next(session.model.parameters()).dtype == torch.float64
    assert session.notes == []


@pytest.mark.parametrize("bad_id, row", [(VOCAB, 13), (VOCAB + 5, 13), (-1, 13), (VOCAB, 0)])
def test_ids_out_of_the_embedding_range_are_an_input_error(token_dir, capsys, bad_id, row):
    """Row 13 is neither in the probed first samples nor in the first batch of 8."""
    x, y = token_arrays()
    x[row, 2] = bad_id
    data = write_token_data(token_dir / "bad_ids.npz", x, y)
    run = eigen(capsys, data, "--batch-size", "8")
    seen = f"[{min(0, bad_id)}, {max(VOCAB - 1, bad_id)}]"
    assert_one_line_error(run, 2, str(data), f"token ids range over {seen}", "'emb' has 7 rows")
    assert "internal error" not in run.err


def test_float_ids_out_of_range_and_fractional_ids_are_input_errors(token_dir, capsys):
    x, y = token_arrays()
    wide = x.astype(np.float32)
    wide[5, 0] = VOCAB
    data = write_token_data(token_dir / "wide.npz", wide, y)
    assert_one_line_error(eigen(capsys, data), 2, str(data), "[0, 7]", "'emb' has 7 rows")
    fractional = x.astype(np.float32)
    fractional[3, 1] = 2.5
    data = write_token_data(token_dir / "fractional.npz", fractional, y)
    assert_one_line_error(
        eigen(capsys, data), 2, str(data), "not whole numbers (e.g. 2.5)", "'emb'"
    )


def test_other_analyses_run_on_token_ids(token_dir, capsys):
    """trace, the PyHessian engine and activation-stats (Jacobian skipped with a note)."""
    x, y = token_arrays()
    data = write_token_data(token_dir / "ids.npz", x, y)
    common = (*FACTORY, "--data", str(data), "--dtype", "float64", "--json", "-")
    run = run_cli(capsys, "trace", "tokens.pt", "--max-matvecs", "300", "--tol", "1e-9", *common)
    assert run.code == 0, run.err
    exact = float(torch.trace(dense_hessian(x, y)))
    assert abs(run.json()["results"]["trace"]["estimate"] - exact) <= 1e-6 * abs(exact)
    run = run_cli(capsys, "eigen", "tokens.pt", "--engine", "pyhessian", *common)
    assert run.code == 0, run.err
    top = dense_top_eigenvalues(x, y, 1)[0]
    assert abs(run.json()["results"]["eigenvalues"][0] - top) <= 0.05 * abs(top)
    run = run_cli(capsys, "activation-stats", "tokens.pt", *common)
    assert run.code == 0, run.err
    results = run.json()["results"]
    assert results["input_jacobian_fro"] is None
    assert any("not floating point" in note for note in results["notes"]), results["notes"]


def test_train_and_analyse_an_mlp_on_integer_features(tmp_path, capsys):
    """Integer features of a float model (no embedding) are cast to the analysis dtype as before."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, size=(40, 6), dtype=np.int64)
    y = (x.sum(axis=1) % CLASSES).astype(np.int64)
    data = write_token_data(tmp_path / "counts.npz", x, y)
    out = tmp_path / "mlp.safetensors"
    run = run_cli(
        capsys,
        "train",
        "--model",
        "mlp",
        "--data",
        str(data),
        "--epochs",
        "1",
        "--out",
        str(out),
        "--quiet",
    )
    assert run.code == 0, run.err
    run = run_cli(capsys, "eigen", str(out), "--data", str(data), "--json", "-")
    assert run.code == 0, run.err
    assert np.isfinite(run.json()["results"]["eigenvalues"][0])
    assert not run.json()["data"].get("notes")


def test_loader_keeps_integers_exact_and_splits_consistent(tmp_path):
    """int64 beyond float32's exact range stays exact; a split mix, uint64 >= 2**63, a float
    or bool column keep the float32 path."""
    from sharpcli.io.data.loading import load_dataset

    y = np.array([0, 1], dtype=np.int64)
    big = np.array([[2**40 + 1], [3]], dtype=np.int64)
    ds = load_dataset(str(write_token_data(tmp_path / "big.npz", big, y)))
    assert ds.x_train.dtype == torch.int64 and int(ds.x_train[0, 0]) == 2**40 + 1
    path = tmp_path / "mixed.npz"
    np.savez(path, x=big, y=y, x_test=np.ones((2, 1), np.float32), y_test=y)
    ds = load_dataset(str(path))
    assert ds.x_train.dtype == ds.x_test.dtype == torch.float32
    path = tmp_path / "huge.npz"
    np.savez(path, x=np.array([[2**63 + 2048], [1]], dtype=np.uint64), y=y)
    assert load_dataset(str(path)).x_train.dtype == torch.float32
    import pandas as pd

    for column in ([0.5, 1.0], [True, False]):
        table = tmp_path / "t.csv"
        pd.DataFrame({"a": [1, 2], "b": column, "label": [0, 1]}).to_csv(table, index=False)
        assert load_dataset(str(table)).x_train.dtype == torch.float32


CONVERTING_MODULE = """
from torch import nn


class Sliced(nn.Module):
    # ids reach the embedding through a view (x[:, :3]), or converted by the model itself
    def __init__(self, convert=False):
        super().__init__()
        self.convert = convert
        self.emb = nn.Embedding(7, 3)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        ids = x.long() if self.convert else x[:, :3]
        return self.head(self.norm(self.emb(ids).mean(dim=1)))


def make(convert=False):
    return Sliced(convert)
"""


@pytest.mark.parametrize("convert", [False, True])
def test_views_and_model_side_conversion(tmp_path, monkeypatch, convert):
    """A view of the input counts as feeding the embedding; ids the model converts itself
    leave the features in the analysis dtype, and are still range-checked. The probes leave
    BatchNorm's statistics and the modules' modes alone."""
    from sharpcli.errors import InputError
    from sharpcli.preflight import prepare_features

    (tmp_path / "slicedmodel.py").write_text(CONVERTING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    model = importlib.import_module("slicedmodel").make(convert).double().train()
    x, _ = token_arrays()
    features = torch.from_numpy(x).float()
    before = model.norm.running_mean.clone()
    prepared, notes = prepare_features(model, features, torch.float64, torch.device("cpu"), "f")
    assert model.training and model.norm.training
    assert torch.equal(model.norm.running_mean, before)
    if convert:
        assert prepared.dtype == torch.float64 and notes == []
    else:
        assert prepared.dtype == torch.int64 and "Embedding 'emb'" in notes[0]
    assert torch.equal(prepared.long(), torch.from_numpy(x))
    features[11, 1] = 9
    with pytest.raises(InputError, match=r"\[0, 9\].*'emb' has 7 rows") as info:
        prepare_features(model, features, torch.float64, torch.device("cpu"), "f.npz")
    assert info.value.source == "f.npz"


@pytest.mark.parametrize("convert", [False, True])
def test_integer_ids_take_one_pass_whose_first_batch_is_the_loss_read(
    tmp_path, monkeypatch, convert
):
    """Integer ids that feed the embedding (a view of the input, or ``x.long()`` of int64
    ids, the same storage): the probe and the id check are one pass over the data (one
    forward per batch), and its outputs on the first batch are the model's in eval mode, bit
    for bit. An id out of range in the first batch takes the two passes, whose error names
    it as before."""
    from sharpcli.errors import InputError
    from sharpcli.preflight import prepare_features_and_outputs

    (tmp_path / "slicedmodel2.py").write_text(CONVERTING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    model = importlib.import_module("slicedmodel2").make(convert).double().train()
    x, _ = token_arrays()
    features = torch.from_numpy(x)
    calls: list[int] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    before = model.norm.running_mean.clone()
    prepared = prepare_features_and_outputs(
        model, features, torch.float64, torch.device("cpu"), "f", batch_size=5
    )
    assert model.training and torch.equal(model.norm.running_mean, before)
    assert prepared.x.dtype == torch.int64 and torch.equal(prepared.x, features)
    assert prepared.notes == []
    batches = [min(5, len(x) - start) for start in range(0, len(x), 5)]
    assert calls == batches
    with torch.no_grad():
        expected = model.eval()(prepared.x[:5])
    assert prepared.first_outputs is not None
    assert torch.equal(prepared.first_outputs, expected)
    features[1, 0] = VOCAB
    calls.clear()
    with pytest.raises(InputError, match=rf"\[0, {VOCAB}\].*'emb' has 7 rows"):
        prepare_features_and_outputs(
            model, features, torch.float64, torch.device("cpu"), "f", batch_size=5
        )
    assert calls == [5, 2, *batches]  # the shared first batch, then the probe and the check
