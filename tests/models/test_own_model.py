"""Bring your own model: `sharp train --model-factory` under every regularizer, the checkpoint
rebuilding itself for the analyses, a CNN with BatchNorm, a transformer on token ids, and the
guard that a file's metadata never runs an installed package's function."""

from __future__ import annotations

import math
import sys
import textwrap

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

from sharpcli.regularizers.registry import REGISTRY

FACTORIES = textwrap.dedent("""
    import torch
    from torch import nn


    class MLP(nn.Module):
        # returns a dict, as many research models do: the logits are picked by --output
        def __init__(self, d_in=16, hidden=12, classes=4):
            super().__init__()
            self.body = nn.Sequential(
                nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU()
            )
            self.classifier = nn.Linear(hidden, classes)

        def forward(self, x):
            h = self.body(x)
            return {"features": h, "logits": self.classifier(h)}


    def mlp(hidden=12):
        return MLP(hidden=hidden)


    def cnn():
        return nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
        )


    class Tagger(nn.Module):
        def __init__(self, vocab=7, dim=8, classes=3):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.enc = nn.TransformerEncoderLayer(
                dim, 2, dim_feedforward=16, dropout=0.0, batch_first=True
            )
            self.head = nn.Linear(dim, classes)

        def forward(self, x):
            return self.head(self.enc(self.emb(x)).mean(1))


    def transformer():
        return Tagger()
""")


@pytest.fixture()
def own(tmp_path, monkeypatch):
    (tmp_path / "own_models.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)  # the factory module is found in the working directory
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "own_models", raising=False)  # this test's own copy
    return tmp_path


def _train(capsys, *args):
    run = run_cli(capsys, "train", "--epochs", "1", "--batch-size", "32", *args, "--json", "-")
    return run, (run.json() if run.out.strip() else None)


REGS = list(REGISTRY)


@pytest.mark.parametrize("reg", REGS)
def test_every_regularizer_trains_a_factory_model_or_says_why_not(own, capsys, reg):
    run, report = _train(
        capsys,
        "--model-factory",
        "own_models:mlp",
        "--model-args",
        '{"hidden": 10}',
        "--data",
        "blobs:n=96,dim=16,classes=4",
        "--reg",
        reg,
        "--out",
        own / f"{reg}.safetensors",
    )
    if reg == "dropout":  # dropout is a zoo-model argument: refused with the reason
        assert_one_line_error(run, 2, "--reg", "factory")
        return
    assert run.code == 0, run.err
    final = report["results"]["final"]
    assert math.isfinite(final["train_loss"])
    assert report["checkpoint"]["model"]["name"] == "factory:own_models:mlp"


def test_factory_checkpoint_rebuilds_itself_for_analysis(own, capsys):
    run, _ = _train(
        capsys,
        "--model-factory",
        "own_models:mlp",
        "--data",
        "blobs:n=96,dim=16,classes=4",
        "--reg",
        "ad:sigma=0.1",
        "--out",
        own / "m.safetensors",
    )
    assert run.code == 0, run.err
    run = run_cli(capsys, "eigen", own / "m.safetensors", "--top-k", "1", "--json", "-")
    assert run.code == 0, run.err
    assert run.json()["results"]["scope"]["numel"] == 16 * 12 + 12 + 12 * 12 + 12 + 12 * 4 + 4


def test_penultimate_option_names_the_representation_ad_penalises(own, capsys):
    common = ["--model-factory", "own_models:mlp", "--data", "blobs:n=96,dim=16,classes=4"]
    run_a, a = _train(capsys, *common, "--reg", "ad:sigma=0.5", "--out", own / "a.safetensors")
    run_b, b = _train(
        capsys,
        *common,
        "--reg",
        "ad:sigma=0.5",
        "--penultimate",
        "body.2",
        "--out",
        own / "b.safetensors",
    )
    assert run_a.code == 0 and run_b.code == 0, (run_a.err, run_b.err)
    # body.2 (the Linear before the last GELU) is not the classifier's input: another penalty
    assert a["results"]["final"]["train_loss"] != b["results"]["final"]["train_loss"]
    run, _ = _train(capsys, *common, "--reg", "ad", "--penultimate", "nope", "--out", own / "c.st")
    assert_one_line_error(run, 2, "--penultimate", "nope")


def test_cnn_with_batchnorm_trains_and_analyses(own, capsys):
    run, _ = _train(
        capsys,
        "--model-factory",
        "own_models:cnn",
        "--data",
        "images:n=64,size=8,channels=1,classes=3",
        "--reg",
        "sam",
        "--out",
        own / "cnn.safetensors",
    )
    assert run.code == 0, run.err
    run = run_cli(
        capsys,
        "trace",
        own / "cnn.safetensors",
        "--operator",
        "ggn",
        "--estimator",
        "exact",
        "--samples",
        "32",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    assert run.json()["results"]["trace"]["estimate"] > 0


def test_transformer_trains_and_analyses_on_token_ids(own, capsys):
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 7, (48, 5), generator=gen)
    y = (x[:, 0] % 3).long()
    np.savez(own / "tokens.npz", x=x.numpy(), y=y.numpy())
    run, _ = _train(
        capsys,
        "--model-factory",
        "own_models:transformer",
        "--data",
        own / "tokens.npz",
        "--reg",
        "hessian-trace:sigma2=0.01,mode=exact",
        "--out",
        own / "tf.safetensors",
    )
    assert run.code == 0, run.err
    run = run_cli(capsys, "eigen", own / "tf.safetensors", "--top-k", "2", "--json", "-")
    assert run.code == 0, run.err
    assert len(run.json()["results"]["eigenvalues"]) == 2


def test_metadata_never_runs_an_installed_packages_function(own, capsys, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "evil.safetensors"
    meta = {"sharpcli.model": '{"name": "factory:subprocess:run", "args": {"args": ["true"]}}'}
    save_file({"w": torch.zeros(1)}, str(path), metadata=meta)
    run = run_cli(capsys, "eigen", path, "--data", "blobs")
    assert_one_line_error(run, 2, str(path), "subprocess")


def test_the_own_model_guide_runs(tmp_path, capsys, monkeypatch):
    """docs/own-model.md: its module block, written to mynet.py, and its sharp commands."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "own-model.md").read_text()
    module = re.search(r"```python\n# mynet.py\n(.*?)```", text, re.S).group(1)
    commands = re.search(r"```sh\n(.*?)```", text, re.S).group(1).strip().splitlines()
    (tmp_path / "mynet.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mynet", raising=False)
    assert [c.split()[1] for c in commands] == ["train", "eigen", "trace"]
    for command in commands:
        run = run_cli(capsys, *shlex.split(command)[1:], "--quiet")
        assert run.code == 0, (command, run.err)
    assert (tmp_path / "mynet.safetensors").exists()
