"""float64 data stays float64: a ``--dtype float64`` analysis sees the stored values unrounded.

Tensor files (npz, safetensors, pt) keep float64 features and regression targets; tables (CSV,
parquet), whose text has no stored dtype, give float32 as before; every analysis casts to its
own dtype, and a float64 value beyond the float32 range is a one-line input error in a float32
analysis (it would become Inf) rather than a silent Inf.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import save_file

from sharpcli.io.data.loading import load_dataset
from sharpcli.session import build_session
from tests.cli_helpers import assert_one_line_error, run_cli


def _arrays(rng, n=48, d=5, classes=3):
    x = rng.standard_normal((n, d))  # float64, most values not representable in float32
    y = rng.integers(0, classes, size=n).astype(np.int64)
    return x, y


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".pt"])
def test_tensor_files_keep_float64_features_and_targets(tmp_path, suffix):
    rng = np.random.default_rng(0)
    x, _ = _arrays(rng)
    targets = rng.standard_normal((x.shape[0], 2))
    path = tmp_path / f"data{suffix}"
    arrays = {"x": x, "y": targets, "x_test": x[:7].astype(np.float32), "y_test": targets[:7]}
    if suffix == ".npz":
        np.savez(path, **arrays)
    elif suffix == ".safetensors":
        save_file(arrays, str(path))
    else:
        torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, path)
    ds = load_dataset(str(path))
    assert ds.x_train.dtype == torch.float64 and ds.y_train.dtype == torch.float64
    assert torch.equal(ds.x_train, torch.from_numpy(x))  # bit for bit
    assert torch.equal(ds.y_train, torch.from_numpy(targets))
    # a float32 test split beside a float64 training split: both float64
    assert ds.x_test.dtype == torch.float64
    assert torch.equal(ds.x_test, torch.from_numpy(x[:7].astype(np.float32)).double())


def test_tables_stay_float32(tmp_path):
    rng = np.random.default_rng(1)
    x, y = _arrays(rng, n=10, d=3)
    table = tmp_path / "t.csv"
    pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "label": y}).to_csv(table, index=False)
    assert load_dataset(str(table)).x_train.dtype == torch.float32


@pytest.fixture
def float64_run(tmp_path, capsys):
    """An MLP trained by ``sharp train`` on a float64 ``.npz`` file; (checkpoint, data, x, y)."""
    rng = np.random.default_rng(2)
    x, y = _arrays(rng)
    x *= 1.0 + 1e-3 * rng.standard_normal(x.shape)  # no value a float32 holds exactly
    data = tmp_path / "f64.npz"
    np.savez(data, x=x, y=y)
    ckpt = tmp_path / "mlp.safetensors"
    run = run_cli(
        capsys, "train", "--model", "mlp", "--width", "8", "--depth", "1", "--data", str(data),
        "--epochs", "2", "--seed", "0", "--out", str(ckpt), "--quiet",
    )  # fmt: skip
    assert run.code == 0, run.err
    return ckpt, data, x, y


def _dense_top_eigenvalue(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """lambda_max of the dense float64 Hessian of the mean cross-entropy at features ``x``."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def loss(theta):
        params = {n: t.reshape(s) for n, t, s in zip(names, torch.split(theta, sizes), shapes)}
        return F.cross_entropy(torch.func.functional_call(model, params, (xt,)), yt)

    return float(torch.linalg.eigvalsh(torch.func.hessian(loss)(flat))[-1])


def test_float64_analysis_sees_the_stored_values(float64_run, capsys):
    ckpt, data, x, y = float64_run
    session = build_session(str(ckpt), data=str(data), dtype="float64")
    assert torch.equal(session.x, torch.from_numpy(x))  # the analysis set, unrounded
    run = run_cli(
        capsys, "eigen", str(ckpt), "--data", str(data), "--dtype", "float64",
        "--eig-tol", "1e-12", "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    got = run.json()["results"]["eigenvalues"][0]
    model = session.model.double()
    exact = _dense_top_eigenvalue(model, x, y)
    rounded = _dense_top_eigenvalue(model, x.astype(np.float32).astype(np.float64), y)
    assert abs(got - exact) <= 1e-12 * abs(exact)
    # what the former float32 read of the file measured: 1.2e-9 relative off here
    assert abs(rounded - exact) > 1e-10 * abs(exact)


def test_float64_beyond_the_float32_range(tmp_path, float64_run, capsys):
    ckpt, _, x, y = float64_run
    data = tmp_path / "huge.npz"
    x = x.copy()
    x[3, 1] = 1e39
    np.savez(data, x=x, y=y)
    run = run_cli(capsys, "eigen", str(ckpt), "--data", str(data), "--json", "-")
    assert_one_line_error(run, 2, str(data), "beyond the float32 range", "--dtype float64")
    session = build_session(str(ckpt), data=str(data), dtype="float64")
    assert float(session.x.max()) == 1e39
