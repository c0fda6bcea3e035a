"""The loss is always named, with where it came from, and never guessed where two fit.

A foreign model and a data file with no ``--loss``: one output per sample with 0/1 labels
(floats or integers) is binary cross-entropy, the loss such a model is trained with, not an
MSE regression on the 0/1 targets; floating 0/1 targets for several outputs (one-hot) fit
three losses and are refused naming ``--loss``. Every report's ``data`` section and every
table say which loss was differentiated and where it came from.

References: dense float64 Hessians by double backward of torch's own loss on the model.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.cli_helpers import assert_one_line_error, factory_checkpoint, run_cli
from tests.hessian_helpers import double_backward_hessian

MODEL = """
from torch import nn

def build():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, {outputs}))
"""


def _setup(tmp_path, monkeypatch, name: str, outputs: int, y: torch.Tensor):
    source = textwrap.dedent(MODEL).format(outputs=outputs)
    model, weights = factory_checkpoint(tmp_path, monkeypatch, name, source, seed=3)
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    data = tmp_path / f"{name}.npz"
    np.savez(data, x=x.numpy(), y=y.numpy())
    return model.double().eval(), weights, data, x


def _eigen(capsys, weights, data, factory, *extra: str):
    return run_cli(
        capsys, "eigen", weights, "--model-factory", f"{factory}:build", "--data", data,
        "--dtype", "float64", "--eig-tol", "1e-10", *extra,
    )  # fmt: skip


def _top(model, x, y, loss_fn) -> float:
    hessian = double_backward_hessian(model, list(model.parameters()), x, y, loss_fn=loss_fn)
    return float(torch.linalg.eigvalsh(hessian)[-1])


def _bce(z, y):
    return F.binary_cross_entropy_with_logits(z, y.to(z.dtype).reshape(z.shape))


def _mse(z, y):
    return F.mse_loss(z, y.to(z.dtype).reshape(z.shape))


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_one_output_with_binary_labels_is_bce_and_says_so(tmp_path, capsys, monkeypatch, dtype):
    labels = torch.from_numpy((np.arange(40) % 3 == 0).astype(dtype))
    model, weights, data, x = _setup(tmp_path, monkeypatch, f"bin_{dtype.__name__}", 1, labels)
    run = _eigen(capsys, weights, data, f"bin_{dtype.__name__}", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    assert report["data"]["loss"] == "binary-cross-entropy"
    assert report["data"]["loss_source"] == "inferred"
    assert "0/1" in report["data"]["loss_reason"]
    expected = _top(model, x, labels, _bce)
    assert report["results"]["eigenvalues"][0] == pytest.approx(expected, rel=1e-8)
    # the MSE Hessian, what was printed before, is another number: the choice matters
    assert abs(_top(model, x, labels, _mse) - expected) > 0.1 * expected

    table = _eigen(capsys, weights, data, f"bin_{dtype.__name__}")
    assert table.code == 0, table.err
    line = [ln for ln in table.out.splitlines() if ln.startswith("loss: ")]
    assert line == [
        "loss: binary-cross-entropy (inferred: one output per sample, "
        f"{'float' if dtype is np.float32 else 'integer'} labels 0/1)"
    ]


def test_loss_option_is_named_as_the_choice(tmp_path, capsys, monkeypatch):
    labels = torch.from_numpy((np.arange(40) % 2).astype(np.float32))
    model, weights, data, x = _setup(tmp_path, monkeypatch, "named_mse", 1, labels)
    run = _eigen(capsys, weights, data, "named_mse", "--loss", "mse", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    assert (report["data"]["loss"], report["data"]["loss_source"]) == ("mse", "option")
    expected = _top(model, x, labels, _mse)
    assert report["results"]["eigenvalues"][0] == pytest.approx(expected, rel=1e-8)


def test_real_valued_targets_are_mse(tmp_path, capsys, monkeypatch):
    targets = torch.randn(40, 2, generator=torch.Generator().manual_seed(5))
    model, weights, data, x = _setup(tmp_path, monkeypatch, "real_targets", 2, targets)
    run = _eigen(capsys, weights, data, "real_targets", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    assert (report["data"]["loss"], report["data"]["loss_source"]) == ("mse", "inferred")
    expected = _top(model, x, targets.double(), _mse)
    assert report["results"]["eigenvalues"][0] == pytest.approx(expected, rel=1e-8)


def test_one_hot_float_targets_fit_several_losses_and_are_refused(tmp_path, capsys, monkeypatch):
    one_hot = F.one_hot(torch.arange(40) % 3, 3).float()
    _, weights, data, _ = _setup(tmp_path, monkeypatch, "one_hot", 3, one_hot)
    run = _eigen(capsys, weights, data, "one_hot")
    assert_one_line_error(run, 2, "--loss", "mse", "binary-cross-entropy")
    # named, it runs and is the MSE the user chose
    named = _eigen(capsys, weights, data, "one_hot", "--loss", "mse", "--json", "-")
    assert named.code == 0, named.err
    assert named.json()["data"]["loss_source"] == "option"


def test_checkpoint_loss_is_named_as_stored(tmp_path, capsys):
    weights = tmp_path / "m.safetensors"
    train = run_cli(
        capsys, "train", "--data", "blobs:n=64", "--epochs", "1", "--out", weights, "--quiet"
    )
    assert train.code == 0, train.err
    run = run_cli(capsys, "trace", weights, "--max-matvecs", "4", "--json", "-")
    assert run.code == 0, run.err
    data = run.json()["data"]
    assert (data["loss"], data["loss_source"]) == ("cross-entropy", "checkpoint")
    assert str(weights) in data["loss_reason"]
    # the schema holds the provenance keys: a source it does not know is refused
    from sharpcli.report.envelope import validate_report

    report = run.json()
    validate_report(report)
    report["data"]["loss_source"] = "guessed"
    with pytest.raises(Exception, match="guessed"):
        validate_report(report)


def test_two_cross_entropy_readings_are_refused_unless_named(tmp_path, capsys, monkeypatch):
    """(N, 4, 4) outputs with (N, 4) labels: classes on dim 1 or last; nothing is picked."""
    source = textwrap.dedent(
        """
        from torch import nn

        class Square(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 16)

            def forward(self, x):
                return self.lin(x).view(x.shape[0], 4, 4)

        def build():
            return Square()
        """
    )
    model, weights = factory_checkpoint(tmp_path, monkeypatch, "square", source, seed=1)
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(6))
    y = torch.randint(0, 4, (12, 4), generator=torch.Generator().manual_seed(7))
    data = tmp_path / "square.npz"
    np.savez(data, x=x.numpy(), y=y.numpy())
    run = _eigen(capsys, weights, data, "square")
    assert_one_line_error(run, 2, "cross-entropy", "token-cross-entropy")
    named = _eigen(capsys, weights, data, "square", "--loss", "cross-entropy", "--json", "-")
    assert named.code == 0, named.err
    model = model.double().eval()
    expected = _top(model, x.double(), y, F.cross_entropy)  # classes on dim 1, torch's reading
    assert named.json()["results"]["eigenvalues"][0] == pytest.approx(expected, rel=1e-8)
