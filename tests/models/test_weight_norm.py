"""Weight-normalised layers: Hessians right although torch's ``_weight_norm`` kernel is not.

torch 2.13 gets the second derivative of ``torch._weight_norm`` wrong (a non-symmetric
double-backward Hessian); sharp computes weight norm from differentiable operations inside
:func:`sharpcli.curvature.products.differentiable.twice_differentiable`, which every model-running
command and :func:`sharpcli.training.loop.train` enter. The reference is central differences
of the float64 gradient, which involve first derivatives only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.weight_norm_model import wn_model, write_wn_checkpoint, write_wn_data, write_wn_module
from sharpcli.curvature.products.differentiable import twice_differentiable, weight_norm_composite
from tests.cli_helpers import run_cli
from tests.hessian_helpers import central_difference_hessian, double_backward_hessian


@pytest.fixture
def wn_files(tmp_path, monkeypatch):
    """``wnmodel.py`` importable from the cwd, its checkpoint and data: ``(wn.pt, wn.npz)``."""
    write_wn_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return write_wn_checkpoint(tmp_path / "wn.pt"), write_wn_data(tmp_path / "wn.npz")


def _data(n=40, seed=1):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((n, 5)))
    y = torch.from_numpy(((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()).numpy())
    return x, y


@pytest.mark.parametrize("style", ["parametrization", "legacy"])
@pytest.mark.parametrize("dim", [0, 1])
def test_double_backward_through_weight_norm_matches_central_differences(style, dim):
    model = wn_model(style, dim).double()
    x, y = _data()
    reference = central_difference_hessian(model, list(model.parameters()), x, y)
    with twice_differentiable():
        inside = double_backward_hessian(model, list(model.parameters()), x, y)
    scale = float(reference.abs().max())
    assert float((inside - reference).abs().max()) <= 1e-7 * scale
    assert float((inside - inside.T).abs().max()) <= 1e-12 * scale
    # outside the block torch's own kernel: if this starts to agree, torch fixed it
    outside = double_backward_hessian(model, list(model.parameters()), x, y)
    assert float((outside - reference).abs().max()) > 1e-3 * scale


def test_composite_is_weight_norm_and_the_block_restores_torch():
    v = torch.randn(6, 5, dtype=torch.float64)
    g = torch.rand(6, 1, dtype=torch.float64) + 0.5
    original = torch._weight_norm
    assert torch.allclose(weight_norm_composite(v, g, 0), original(v, g, 0), rtol=1e-15)
    with pytest.raises(RuntimeError, match="boom"), twice_differentiable():
        assert torch._weight_norm is weight_norm_composite
        raise RuntimeError("boom")
    assert torch._weight_norm is original


def test_eigen_of_a_weight_norm_model_matches_central_differences(wn_files, capsys):
    ckpt, data = wn_files
    run = run_cli(
        capsys, "eigen", str(ckpt), "--model-factory", "wnmodel:make", "--data", str(data),
        "--dtype", "float64", "--top-k", "2", "--eig-tol", "1e-10", "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    got = np.array(run.json()["results"]["eigenvalues"])
    model = wn_model().double()
    arrays = np.load(data)
    x, y = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])
    reference = central_difference_hessian(model, list(model.parameters()), x, y)
    expected = torch.linalg.eigvalsh((reference + reference.T) / 2).flip(0)[:2].numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-7)


def test_train_runs_its_steps_inside_the_block(monkeypatch, tmp_path):
    from sharpcli.training import loop

    seen = []
    original = loop._train_epoch

    def spy(*args, **kwargs):
        seen.append(torch._weight_norm is weight_norm_composite)
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "_train_epoch", spy)
    cfg = loop.TrainConfig(data="blobs:n=64", model="mlp", epochs=1, regs=["gp"])
    loop.train(cfg, tmp_path / "m.safetensors")
    assert seen == [True]
    assert torch._weight_norm is not weight_norm_composite


def test_weight_rescale_of_a_weight_normed_layer_says_why_it_refuses(wn_files, capsys):
    ckpt, data = wn_files
    run = run_cli(
        capsys, "weight-rescale", str(ckpt), "--model-factory", "wnmodel:make",
        "--arch-args", '{"act": "relu"}', "--data", str(data), "--quiet",
    )  # fmt: skip
    assert run.code == 2, run.err
    assert "is reparametrized (_WeightNorm)" in run.err and "--force" in run.err
