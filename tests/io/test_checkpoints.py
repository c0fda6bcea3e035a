"""Checkpoints: own files rebuild their model; foreign state_dicts load via --arch or --model-factory;
pickles are refused unless trusted; broken files are one-line input errors."""

from __future__ import annotations

import pytest
import torch

from fixtures.make_checkpoint_fixtures import (
    tiny_mlp_spec,
    write_broken_files,
    write_foreign_state_dict,
    write_own_checkpoint,
    write_pickled_module,
    write_user_module,
)
from sharpcli.errors import InputError, UsageError
from sharpcli.io.checkpoints import load_checkpoint, sha256_file
from sharpcli.models import build_model


def test_own_checkpoint_round_trip(tmp_path):
    path = write_own_checkpoint(tmp_path / "m.safetensors")
    ckpt = load_checkpoint(path)
    assert ckpt.origin == "sharpcli"
    assert ckpt.model_spec == tiny_mlp_spec()
    assert ckpt.data_spec["name"] == "blobs"
    assert ckpt.sha256 == sha256_file(path) and len(ckpt.sha256) == 64
    torch.manual_seed(0)
    original = build_model(tiny_mlp_spec())
    x = torch.randn(5, 16)
    assert torch.equal(ckpt.model(x), original(x))


def test_model_factory_loads_users_state_dict(tmp_path, monkeypatch):
    write_user_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    usermodel = importlib.import_module("usermodel")
    torch.manual_seed(1)
    model = usermodel.make()
    x = torch.randn(7, 16)
    for suffix in (".pt", ".safetensors"):
        path = write_foreign_state_dict(tmp_path / f"user{suffix}", model)
        ckpt = load_checkpoint(path, model_factory="usermodel:make")
        assert ckpt.origin == "state_dict"
        assert torch.equal(ckpt.model(x), model(x))
    # arguments are passed through --arch-args
    wide = usermodel.make(hidden=20)
    path = write_foreign_state_dict(tmp_path / "wide.pt", wide)
    ckpt = load_checkpoint(path, model_factory="usermodel:make", arch_args={"hidden": 20})
    assert torch.equal(ckpt.model(x), wide(x))


NON_PERSISTENT_MODULE = """
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        # drawn by an initialiser and left out of the state dict: only construction sets it
        self.register_buffer("scale", nn.init.uniform_(torch.empty(3), 1.0, 2.0), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale


def make():
    torch.manual_seed(3)
    return Scaled()
"""


def test_loading_skips_initial_draws_but_not_a_buffer_the_file_lacks(tmp_path, monkeypatch):
    """A factory model is built without torch.nn.init's random draws (every weight is then
    loaded, strictly), the initialisers are restored afterwards, and a model with a
    non-persistent buffer (not in the file, set only by its construction) is built as written."""
    from torch import nn

    from sharpcli.io.checkpoints import skipped_initialisation

    uniform = nn.init.uniform_
    with skipped_initialisation():
        assert nn.init.uniform_ is not uniform
        assert torch.equal(nn.init.normal_(torch.zeros(3)), torch.zeros(3))  # untouched
    assert nn.init.uniform_ is uniform
    (tmp_path / "scaledmodel.py").write_text(NON_PERSISTENT_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    model = importlib.import_module("scaledmodel").make()
    assert 1.0 <= float(model.scale.min()) and float(model.scale.max()) <= 2.0
    path = write_foreign_state_dict(tmp_path / "scaled.safetensors", model)
    ckpt = load_checkpoint(path, model_factory="scaledmodel:make")
    assert torch.equal(ckpt.model.scale, model.scale)
    x = torch.randn(5, 4)
    assert torch.equal(ckpt.model(x), model(x))
    assert nn.init.uniform_ is uniform


def test_arch_and_arch_args_load_plain_state_dict(tmp_path):
    spec = tiny_mlp_spec(width=6)
    torch.manual_seed(2)
    model = build_model(spec)
    path = write_foreign_state_dict(tmp_path / "plain.pth", model)
    ckpt = load_checkpoint(path, arch="mlp", arch_args=spec["args"])
    x = torch.randn(3, 16)
    assert torch.equal(ckpt.model(x), model(x))
    with pytest.raises(InputError, match="no sharpcli metadata"):
        load_checkpoint(path)


def test_pickled_module_refused_unless_trusted(tmp_path):
    torch.manual_seed(3)
    model = build_model(tiny_mlp_spec())
    path = write_pickled_module(tmp_path / "whole.pt", model)
    with pytest.raises(InputError, match="`trust_pickle`") as info:
        load_checkpoint(path)
    assert str(path) in info.value.one_line()
    ckpt = load_checkpoint(path, trust_pickle=True)
    x = torch.randn(2, 16)
    assert ckpt.origin == "pickle" and torch.equal(ckpt.model(x), model(x))


@pytest.mark.parametrize(
    "name", ["garbage.safetensors", "truncated.safetensors", "empty.safetensors", "garbage.pt"]
)
def test_broken_files_are_input_errors(tmp_path, name):
    files = write_broken_files(tmp_path)
    with pytest.raises(InputError) as info:
        load_checkpoint(files[name])
    line = info.value.one_line()
    assert str(files[name]) in line and "\n" not in line


def test_missing_and_wrong_extension(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_checkpoint(tmp_path / "nope.safetensors")
    other = tmp_path / "model.onnx"
    other.write_bytes(b"x")
    with pytest.raises(InputError, match="unknown checkpoint format"):
        load_checkpoint(other)


def test_shape_mismatch_and_nan_weights(tmp_path):
    model = build_model(tiny_mlp_spec(width=8))
    path = write_foreign_state_dict(tmp_path / "w8.pt", model)
    with pytest.raises(InputError, match="shape mismatch"):
        load_checkpoint(path, arch="mlp", arch_args=tiny_mlp_spec(width=9)["args"])
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    path = write_foreign_state_dict(tmp_path / "nan.pt", model)
    with pytest.raises(InputError, match="NaN"):
        load_checkpoint(path, arch="mlp", arch_args=tiny_mlp_spec(width=8)["args"])


def test_bad_factory_is_usage_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_foreign_state_dict(tmp_path / "m.pt", build_model(tiny_mlp_spec()))
    with pytest.raises(UsageError, match="cannot import 'no_such_module_xyz'") as info:
        load_checkpoint(path, model_factory="no_such_module_xyz:make")
    assert info.value.source == "model_factory"
    with pytest.raises(UsageError, match="module:function"):
        load_checkpoint(path, model_factory="justaname")
