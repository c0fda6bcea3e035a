"""`sharp eigen`/`trace` with a data file compute torch's loss on the shapes torch takes:
cross-entropy with the classes on dim 1 of K-dimensional outputs, MSE over outputs of any
shape; where two readings fit, `--loss` chooses; a checkpoint's stored loss that does not fit
the data names the checkpoint, the loss and `--loss`.

References: dense float64 Hessians by double backward of torch's own loss on the model, the
Gauss-Newton matrix as ``J^T H_z J`` from autograd Jacobians.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.cli_helpers import assert_one_line_error, factory_checkpoint, run_cli
from tests.hessian_helpers import double_backward_hessian, jacobian_ggn

SHAPED = """
from torch import nn

class Shaped(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.head = nn.Linear(4, {numel})

    def forward(self, x):
        return self.head(self.body(x)).view(x.shape[0], *{shape})

def build():
    return Shaped()
"""


def _factory(tmp_path, monkeypatch, shape: tuple, name: str):
    source = textwrap.dedent(SHAPED).format(numel=int(torch.tensor(shape).prod()), shape=shape)
    model, weights = factory_checkpoint(tmp_path, monkeypatch, name, source, seed=1)
    return model.double().eval(), weights


def _run(capsys, command: str, weights, data, factory: str, *extra: str) -> dict:
    run = run_cli(
        capsys, command, weights, "--model-factory", f"{factory}:build", "--data", data,
        "--dtype", "float64", *extra, "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    return run.json()


def _check(capsys, weights, data, factory, hessian, ggn, *extra: str) -> dict:
    """`eigen` top-3 and `trace` (exact tr(G)) against the dense references."""
    report = _run(
        capsys, "eigen", weights, data, factory, "--top-k", "3", "--eig-tol", "1e-10", *extra
    )
    exact = torch.linalg.eigvalsh(hessian).flip(0)[:3].tolist()
    assert report["results"]["eigenvalues"] == pytest.approx(exact, rel=1e-8)
    trace = _run(
        capsys, "trace", weights, data, factory, "--operator", "ggn", "--estimator", "exact", *extra
    )
    assert trace["results"]["trace"]["estimate"] == pytest.approx(float(ggn.trace()), rel=1e-9)
    return report


def _references(model, x, y, loss_fn):
    params = list(model.parameters())
    return (
        double_backward_hessian(model, params, x, y, loss_fn=loss_fn),
        jacobian_ggn(model, params, x, y, loss_fn),
    )


def test_k_dim_cross_entropy_from_a_data_file(tmp_path, capsys, monkeypatch):
    """(N, 3, 4) outputs with (N, 4) labels, some -100: classes on dim 1, inferred."""
    model, weights = _factory(tmp_path, monkeypatch, (3, 4), "kdim_ce")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(10, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (10, 4), generator=gen)
    y[2, 1:] = -100
    data = tmp_path / "kdim.safetensors"
    save_file({"x": x, "y": y}, str(data))
    report = _check(capsys, weights, data, "kdim_ce", *_references(model, x, y, F.cross_entropy))
    assert any("classes on dim 1" in note for note in report["data"]["notes"])


def test_square_outputs_need_loss_and_each_choice_is_its_loss(tmp_path, capsys, monkeypatch):
    """(N, 3, 3) outputs with (N, 3) labels: refused naming --loss; --loss cross-entropy is
    torch's classes on dim 1, --loss token-cross-entropy the classes last."""
    model, weights = _factory(tmp_path, monkeypatch, (3, 3), "square_ce")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (8, 3), generator=gen)
    data = tmp_path / "square.safetensors"
    save_file({"x": x, "y": y}, str(data))
    run = run_cli(
        capsys, "eigen", weights, "--model-factory", "square_ce:build", "--data", data,
    )  # fmt: skip
    assert_one_line_error(
        run, 2, "read two ways", "--loss cross-entropy", "--loss token-cross-entropy"
    )

    dim_1 = _references(model, x, y, F.cross_entropy)
    _check(capsys, weights, data, "square_ce", *dim_1, "--loss", "cross-entropy")

    def classes_last(z, labels):
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1))

    _check(capsys, weights, data, "square_ce", *_references(model, x, y, classes_last),
           "--loss", "token-cross-entropy")  # fmt: skip


@pytest.mark.parametrize("shape", [(5, 3), (2, 2, 3)], ids=["n-5-3", "image-n-c-h-w"])
def test_mse_on_any_output_shape_from_a_data_file(tmp_path, capsys, monkeypatch, shape):
    name = "mse_" + "_".join(map(str, shape))
    model, weights = _factory(tmp_path, monkeypatch, shape, name)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(7, *shape, generator=gen, dtype=torch.float64)
    data = tmp_path / f"{name}_data.safetensors"
    save_file({"x": x, "y": y}, str(data))
    report = _check(capsys, weights, data, name, *_references(model, x, y, F.mse_loss))
    assert report["data"]["loss"] == "mse"


def test_stored_loss_that_does_not_fit_names_checkpoint_loss_and_option(tmp_path, capsys):
    """A checkpoint trained with mse on 3 targets analysed on 2-column targets: the message
    names the checkpoint, its stored loss and --loss. On class labels the stored mse fits (it
    regresses the one-hot rows, as torch's mse_loss on them), and --loss cross-entropy runs."""
    from sharpcli.io.checkpoints import META_TRAIN
    from tests.cli_helpers import run_in_process

    data = tmp_path / "targets.npz"
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 2, generator=gen)
    import numpy as np

    np.savez(data, x=x.numpy(), y=torch.randn(40, 3, generator=gen).numpy())
    ckpt = tmp_path / "regressor.safetensors"
    run = run_in_process(
        "train", "--model", "mlp", "--data", str(data), "--epochs", "1", "--out", str(ckpt),
        "--quiet",
    )  # fmt: skip
    assert run.code == 0, run.err
    from safetensors import safe_open

    with safe_open(str(ckpt), "pt") as handle:
        assert json.loads(handle.metadata()[META_TRAIN])["loss"] == "mse"
    labels = tmp_path / "targets2.npz"
    np.savez(labels, x=x.numpy(), y=torch.randn(40, 2, generator=gen).numpy())  # 2 columns, not 3
    run = run_cli(capsys, "eigen", ckpt, "--data", labels, "--quiet")
    assert_one_line_error(run, 2, str(ckpt), "stored loss 'mse'", str(labels), "--loss")
    classes = tmp_path / "classes.npz"
    np.savez(classes, x=x.numpy(), y=(x[:, 0] > 0).long().numpy())
    run = run_cli(capsys, "eigen", ckpt, "--data", classes, "--json", "-")
    assert run.code == 0, run.err
    assert run.json()["data"]["loss"] == "mse" and run.json()["data"]["loss_source"] == "checkpoint"
    run = run_cli(capsys, "eigen", ckpt, "--data", classes, "--loss", "cross-entropy", "--quiet")
    assert run.code == 0, run.err


def test_k_dim_cross_entropy_by_chunks_of_rows(tmp_path, capsys, monkeypatch):
    """The cross-entropy's gradient and Hessian by chunks of one row (the automatic chunk
    lowered to 24 bytes, one row of 3 float64 logits): the dense references' eigenvalues, the
    unchunked run's to 1e-10, and the run's memory choices say so."""
    from sharpcli.curvature.products import softmax_chunks

    model, weights = _factory(tmp_path, monkeypatch, (3, 4), "kdim_chunks")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(10, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (10, 4), generator=gen)
    y[2, 1:] = -100
    data = tmp_path / "kdim.safetensors"
    save_file({"x": x, "y": y}, str(data))
    references = _references(model, x, y, F.cross_entropy)
    whole = _check(capsys, weights, data, "kdim_chunks", *references)
    monkeypatch.setattr(softmax_chunks, "DEFAULT_CHUNK_BYTES", 24)
    chunked = _check(capsys, weights, data, "kdim_chunks", *references)
    assert chunked["results"]["eigenvalues"] == pytest.approx(
        whole["results"]["eigenvalues"], rel=1e-10
    )
    choices = " ".join(chunked["timing"]["memory"]["choices"])
    assert "cross-entropy over 40 x 3 logits by chunks of 1 rows" in choices
    assert "by chunks" not in " ".join(whole["timing"]["memory"]["choices"])
