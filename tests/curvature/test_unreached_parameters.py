"""Trainable parameters the loss does not reach are named in a note (stderr and data.notes).

An auxiliary head used only in training mode has zero rows in every curvature matrix of the
eval-mode analysis; without a word that reads like a flat direction.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.cli_helpers import run_cli

AUX_MODULE = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)
        self.aux = nn.Linear(6, 3)  # a training-time auxiliary head

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h) + (0.1 * self.aux(h) if self.training else 0)


def make():
    return Net()
"""


def test_an_unused_auxiliary_head_is_named(tmp_path, monkeypatch, capsys):
    (tmp_path / "auxmodel.py").write_text(AUX_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {}
    exec(compile(AUX_MODULE, "auxmodel.py", "exec"), namespace)
    torch.manual_seed(0)
    torch.save(namespace["make"]().state_dict(), tmp_path / "aux.pt")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((30, 5)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
    run = run_cli(
        capsys, "eigen", "aux.pt", "--model-factory", "auxmodel:make", "--data", "data.npz",
        "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    (note,) = run.json()["data"]["notes"]
    assert "2 trainable parameter tensor(s) do not reach the loss" in note
    assert "(aux.weight, aux.bias)" in note
    assert note in " ".join(run.err.split())
