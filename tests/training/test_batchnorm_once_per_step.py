"""BatchNorm running statistics under two-pass regularizers: updated once per training step, by
the clean pass at theta; the perturbed pass of sam, usam and asam (and any extra pass) leaves
them as the clean pass left them (sharpcli.regularizers.passes.StepPasses's buffer snapshot).
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import run_cli

from sharpcli.regularizers.registry import parse_regs
from sharpcli.regularizers.step import training_step


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.GELU(), torch.nn.Linear(7, 3)
    ).train()


@pytest.mark.parametrize("reg", ["sam:rho=0.5", "usam:rho=0.5", "asam:rho=2", "fa:mode=fd"])
def test_running_statistics_are_the_clean_pass_s(reg):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 5, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    model, clean = _bn_model(), _bn_model()
    with torch.no_grad():
        clean(x)  # one forward at theta: the statistics a single pass leaves
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        stats = training_step(model, x, y, "cross-entropy", parse_regs([reg]), gen)
        assert stats.grad_evals >= 2  # a second pass ran, at perturbed weights
        assert int(model[1].num_batches_tracked) == step
        if step == 1:
            assert torch.equal(model[1].running_mean, clean[1].running_mean)
            assert torch.equal(model[1].running_var, clean[1].running_var)
        optimizer.step()


@pytest.mark.parametrize("reg", ["sam", "asam", "none"])
def test_train_advances_num_batches_tracked_once_per_step(tmp_path, capsys, reg):
    # 40 images, 30 in the training split: 3 batches of 10, each stepped twice (--repeat-batch)
    out = tmp_path / "bn.safetensors"
    model_args = json.dumps({"channels": [4], "batch_norm": True})
    argv = "train --model cnn --data images:n=40,size=8,classes=3 --batch-size 10 --epochs 2"
    run = run_cli(
        capsys,
        *argv.split(),
        "--model-args",
        model_args,
        "--repeat-batch",
        "2",
        "--reg",
        reg,
        "--out",
        out,
        "--quiet",
    )
    assert run.code == 0, run.err
    from safetensors.torch import load_file

    tracked = {k: v for k, v in load_file(str(out)).items() if k.endswith("num_batches_tracked")}
    assert tracked and all(int(v) == 2 * 3 * 2 for v in tracked.values()), tracked


BN1D_FACTORY = """
import torch


def build(num_features=6, num_classes=3):
    return torch.nn.Sequential(
        torch.nn.Linear(num_features, 8), torch.nn.BatchNorm1d(8), torch.nn.GELU(),
        torch.nn.Linear(8, num_classes),
    )
"""


def test_a_batchnorm1d_factory_model_trains_with_sam(tmp_path, monkeypatch):
    """The preflight pass on one sample runs in eval mode: a BatchNorm1d model (which refuses a
    batch of one in train mode) trains, and its statistics count the training steps only."""
    import sys

    from safetensors.torch import load_file

    from sharpcli.training.loop import TrainConfig, train

    (tmp_path / "bn1d_factory.py").write_text(BN1D_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bn1d_factory", raising=False)
    cfg = TrainConfig(
        model_factory="bn1d_factory:build",
        data="blobs:n=64,dim=6,classes=3",
        epochs=2,
        batch_size=16,
        regs=["sam"],
    )
    result = train(cfg, tmp_path / "bn1d.safetensors")
    steps = 2 * -(-int(64 * 0.75) // 16)
    assert sum(row["grad_evals"] for row in result.history) == 2 * steps
    assert int(load_file(str(tmp_path / "bn1d.safetensors"))["1.num_batches_tracked"]) == steps
