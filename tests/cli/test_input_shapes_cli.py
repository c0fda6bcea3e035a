"""Data files reach the model in the shape they store, through the CLI: Conv1d ``(N, C, L)``,
Conv3d ``(N, C, D, H, W)``, token ids ``(N, T)`` into an ``nn.Embedding``, two named inputs
taken as keyword arguments or as one batch dict, and ``(N, 1)`` labels with binary
cross-entropy. ``(N, H, W)`` arrays are not read as one-channel images unless ``--x-shape``
says so (a refusal names the file and the option).

References: dense float64 Hessians by double backward of torch's own loss on the model
(tests/hessian_helpers.py), the Gauss-Newton matrix as ``J^T H_z J`` from autograd Jacobians.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.cli_helpers import assert_one_line_error, factory_checkpoint, run_cli
from tests.hessian_helpers import double_backward_hessian, jacobian_ggn

CONV1D = """
from torch import nn

def build():
    return nn.Sequential(
        nn.Conv1d(2, 3, kernel_size=3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4, 3)
    )
"""

CONV3D = """
from torch import nn

def build():
    return nn.Sequential(
        nn.Conv3d(2, 2, kernel_size=2), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 2 * 2 * 2, 3)
    )
"""

SEQUENCE = """
from torch import nn

class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.head = nn.Linear(3 * 5, 3)

    def forward(self, ids):
        return self.head(self.embed(ids).flatten(1))

def build():
    return Tagger()
"""

CONV2D = """
from torch import nn

def build():
    return nn.Sequential(
        nn.Conv2d(1, 2, kernel_size=2), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)
    )
"""

TWO_INPUTS = """
import torch
from torch import nn

class {name}(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(4, 3)
        self.right = nn.Linear(4, 3)
        self.head = nn.Linear(3, 3)

    def logits(self, x1, x2):
        return self.head(torch.tanh(self.left(x1) + self.right(x2.flatten(1))))

    {forward}

def build():
    return {name}()
"""
KEYWORD_FORWARD = "def forward(self, x1, x2):\n        return self.logits(x1, x2)"
DICT_FORWARD = 'def forward(self, batch):\n        return self.logits(batch["x1"], batch["x2"])'

BCE = """
from torch import nn

def build():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
"""


def _run(capsys, command: str, weights, data, factory: str, *extra: str):
    return run_cli(
        capsys, command, weights, "--model-factory", f"{factory}:build", "--data", data,
        "--dtype", "float64", *extra, "--json", "-",
    )  # fmt: skip


def _eigen(capsys, weights, data, factory, *extra: str) -> list[float]:
    run = _run(
        capsys, "eigen", weights, data, factory, "--top-k", "2", "--eig-tol", "1e-10", *extra
    )
    assert run.code == 0, run.err
    return run.json()["results"]["eigenvalues"]


def _exact_ggn_trace(capsys, weights, data, factory, *extra: str) -> float:
    run = _run(
        capsys, "trace", weights, data, factory, "--operator", "ggn", "--estimator", "exact", *extra
    )
    assert run.code == 0, run.err
    return run.json()["results"]["trace"]["estimate"]


def _top(hessian: torch.Tensor, k: int = 2) -> list[float]:
    return torch.linalg.eigvalsh(hessian).flip(0)[:k].tolist()


def _model(tmp_path, monkeypatch, name: str, source: str):
    model, weights = factory_checkpoint(tmp_path, monkeypatch, name, source, seed=3)
    return model.double().eval(), weights


def _labels(n: int, classes: int = 3, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


def test_conv1d_inputs_n_c_l_from_safetensors(tmp_path, capsys, monkeypatch):
    """(N, C, L) floats reach a Conv1d as stored (they were read as (N, 1, C, L) images)."""
    model, weights = _model(tmp_path, monkeypatch, "conv1d_net", CONV1D)
    x = torch.randn(10, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = _labels(10)
    data = tmp_path / "signals.safetensors"
    save_file({"x": x, "y": y}, str(data))
    params = list(model.parameters())
    hessian = double_backward_hessian(model, params, x, y, loss_fn=F.cross_entropy)
    assert _eigen(capsys, weights, data, "conv1d_net") == pytest.approx(_top(hessian), rel=1e-8)
    ggn = jacobian_ggn(model, params, x, y, F.cross_entropy)
    trace = _exact_ggn_trace(capsys, weights, data, "conv1d_net")
    assert trace == pytest.approx(float(ggn.trace()), rel=1e-9)


def test_conv3d_inputs_n_c_d_h_w_from_npz(tmp_path, capsys, monkeypatch):
    """(N, C, D, H, W) volumes reach a Conv3d (they were refused as neither vectors nor images)."""
    model, weights = _model(tmp_path, monkeypatch, "conv3d_net", CONV3D)
    x = torch.randn(6, 2, 3, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = _labels(6)
    data = tmp_path / "volumes.npz"
    np.savez(data, x=x.numpy(), y=y.numpy())
    hessian = double_backward_hessian(model, list(model.parameters()), x, y)
    assert _eigen(capsys, weights, data, "conv3d_net") == pytest.approx(_top(hessian), rel=1e-8)


def test_token_ids_n_t_into_an_embedding_from_pt(tmp_path, capsys, monkeypatch):
    """int64 ids (N, T) reach an nn.Embedding as integers, as stored."""
    model, weights = _model(tmp_path, monkeypatch, "tagger_net", SEQUENCE)
    ids = torch.randint(0, 7, (9, 5), generator=torch.Generator().manual_seed(3))
    y = _labels(9)
    data = tmp_path / "tokens.pt"
    torch.save({"x": ids, "y": y}, data)
    params = list(model.parameters())
    hessian = double_backward_hessian(model, params, ids, y)
    assert _eigen(capsys, weights, data, "tagger_net") == pytest.approx(_top(hessian), rel=1e-8)
    ggn = jacobian_ggn(model, params, ids, y, F.cross_entropy)
    trace = _exact_ggn_trace(capsys, weights, data, "tagger_net")
    assert trace == pytest.approx(float(ggn.trace()), rel=1e-9)


@pytest.mark.parametrize("x2_shape", [(4,), (2, 2)], ids=["stacked", "concatenated"])
@pytest.mark.parametrize(
    ("name", "forward"), [("KeywordPair", KEYWORD_FORWARD), ("DictPair", DICT_FORWARD)]
)
def test_two_named_inputs_as_keywords_or_as_one_dict(
    tmp_path, capsys, monkeypatch, name, forward, x2_shape
):
    """Keys x1 (N, 4), x2 (N, 4) or (N, 2, 2) of a file: `forward(self, x1, x2)` takes them as
    keyword arguments, `forward(self, batch)` as one dict; the signature decides and both give
    torch's numbers, whether the inputs share a shape or not (they were refused when not)."""
    source = textwrap.dedent(TWO_INPUTS).format(name=name, forward=forward)
    model, weights = _model(tmp_path, monkeypatch, f"pair_{name.lower()}", source)
    gen = torch.Generator().manual_seed(4)
    x1 = torch.randn(11, 4, dtype=torch.float64, generator=gen)
    x2 = torch.randn(11, *x2_shape, dtype=torch.float64, generator=gen)
    y = _labels(11)
    data = tmp_path / "pairs.safetensors"
    save_file({"x1": x1, "x2": x2, "y": y}, str(data))

    def logits(_):
        return model.logits(x1, x2)

    hessian = double_backward_hessian(logits, list(model.parameters()), None, y)
    factory = f"pair_{name.lower()}"
    eigen = _eigen(capsys, weights, data, factory, "--x-key", "x1,x2")
    assert eigen == pytest.approx(_top(hessian), rel=1e-8)


def test_bce_with_n_by_1_labels(tmp_path, capsys, monkeypatch):
    """Outputs (48, 1), labels (48, 1), `--loss binary-cross-entropy`: torch's BCE-with-logits
    Hessian (it was refused: one sample's outputs (1, 1) were checked against all labels)."""
    model, weights = _model(tmp_path, monkeypatch, "bce_net", BCE)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(48, 3, dtype=torch.float64, generator=gen)
    y = (torch.rand(48, 1, generator=gen) > 0.5).double()
    data = tmp_path / "binary.safetensors"
    save_file({"x": x, "y": y}, str(data))
    hessian = double_backward_hessian(
        model, list(model.parameters()), x, y, loss_fn=F.binary_cross_entropy_with_logits
    )
    extra = ("--loss", "binary-cross-entropy", "--batch-size", "16")
    assert _eigen(capsys, weights, data, "bce_net", *extra) == pytest.approx(
        _top(hessian), rel=1e-8
    )


def test_bce_labels_outside_0_1_past_the_first_batch_are_refused(tmp_path, capsys, monkeypatch):
    """Every label is still checked, not only the first batch's: a 2 in the last row."""
    _, weights = _model(tmp_path, monkeypatch, "bce_net2", BCE)
    x = torch.randn(20, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    y = torch.zeros(20, 1, dtype=torch.float64)
    y[-1] = 2.0
    data = tmp_path / "bad_binary.safetensors"
    save_file({"x": x, "y": y}, str(data))
    run = _run(
        capsys, "eigen", weights, data, "bce_net2", "--loss", "binary-cross-entropy",
        "--batch-size", "8",
    )  # fmt: skip
    assert_one_line_error(run, 2, str(data), "labels in [0, 1]")


def test_n_h_w_arrays_are_not_images_without_x_shape(tmp_path, capsys, monkeypatch):
    """(N, 5, 5) floats for a Conv2d taking (1, 5, 5): refused naming the file and `--x-shape`
    (no silent channel axis); with `--x-shape 1,5,5` torch's numbers."""
    model, weights = _model(tmp_path, monkeypatch, "conv2d_net", CONV2D)
    x = torch.randn(8, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    y = _labels(8)
    data = tmp_path / "gray.npz"
    np.savez(data, x=x.numpy(), y=y.numpy())
    run = _run(capsys, "eigen", weights, data, "conv2d_net")
    assert_one_line_error(run, 2, str(data), "(5, 5)", "--x-shape 1,5,5")
    hessian = double_backward_hessian(model, list(model.parameters()), x.unsqueeze(1), y)
    eigen = _eigen(capsys, weights, data, "conv2d_net", "--x-shape", "1,5,5")
    assert eigen == pytest.approx(_top(hessian), rel=1e-8)
    run = _run(capsys, "eigen", weights, data, "conv2d_net", "--x-shape", "1,5,4")
    assert_one_line_error(run, 2, str(data), "hold 25 values", "holds 20")
    run = _run(capsys, "eigen", weights, data, "conv2d_net", "--x-shape", "1,five")
    assert_one_line_error(run, 2, "--x-shape", "1,28,28")


def test_a_forward_that_takes_neither_style_is_refused(tmp_path, capsys, monkeypatch):
    """`forward(self, a, b)` with keys x1, x2: neither keywords nor one dict; one line naming
    `--x-key` and the signature, exit 2."""
    forward = "def forward(self, a, b):\n        return self.logits(a, b)"
    source = textwrap.dedent(TWO_INPUTS).format(name="Neither", forward=forward)
    _, weights = _model(tmp_path, monkeypatch, "pair_neither", source)
    x = torch.randn(4, 4, dtype=torch.float64)
    data = tmp_path / "pairs.safetensors"
    save_file({"x1": x, "x2": x.clone(), "y": _labels(4)}, str(data))
    run = _run(capsys, "eigen", weights, data, "pair_neither", "--x-key", "x1,x2")
    assert_one_line_error(run, 2, "--x-key", "forward(a, b)", "x1, x2")


ARRAY_FORWARD = """
from torch import nn

class WantsArrays(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x.numpy())  # written for numpy inputs: torch raises a TypeError

def build():
    return WantsArrays()
"""


def test_a_forward_raising_type_error_on_the_data_is_a_data_error(tmp_path, capsys, monkeypatch):
    """The model's TypeError on the samples is the data's misfit (exit 2 naming the file), not
    an internal error of sharp (exit 4)."""
    _, weights = _model(tmp_path, monkeypatch, "wants_arrays", ARRAY_FORWARD)
    data = tmp_path / "arrays.npz"
    np.savez(data, x=np.random.default_rng(0).normal(size=(8, 4)), y=np.arange(8) % 3)
    run = run_cli(
        capsys, "eigen", weights, "--model-factory", "wants_arrays:build", "--data", data
    )  # fmt: skip
    assert_one_line_error(run, 2, "arrays.npz", "do not fit the model")
