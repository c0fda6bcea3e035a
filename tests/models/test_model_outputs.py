"""Models that return a tuple, a dict or an output object: the analysis sees one logits tensor,
chosen by default or by --output, and its eigenvalues equal those of the plain model."""

from __future__ import annotations

import textwrap

import pytest
import torch
from cli_helpers import assert_one_line_error, factory_checkpoint, run_cli
from conftest import dense_reference

from sharpcli.errors import UsageError
from sharpcli.models.outputs import select_output

FACTORY = textwrap.dedent("""
    from dataclasses import dataclass

    import torch
    from torch import nn


    @dataclass
    class Output:
        hidden: torch.Tensor
        logits: torch.Tensor


    class Multi(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind
            self.body = nn.Sequential(nn.Linear(5, 6), nn.Tanh())
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            h = self.body(x)
            z = self.head(h)
            if self.kind == "plain":
                return z
            if self.kind == "tuple":
                return z, h.square().mean()  # logits first, an auxiliary loss term after
            if self.kind == "aux-first":
                return h, z
            if self.kind == "dict":
                return {"hidden": h, "logits": z}
            if self.kind == "scores":
                return {"hidden": h, "scores": z}
            return Output(hidden=h, logits=z)


    def build(kind="plain"):
        return Multi(kind)
""")


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    model, weights = factory_checkpoint(tmp_path, monkeypatch, "multi_factory", FACTORY)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(25, 5, generator=gen), torch.randint(0, 3, (25,), generator=gen)
    data = tmp_path / "d.safetensors"
    save_file({"x": x, "y": y}, str(data))
    H, _, _ = dense_reference(model.double(), x.double(), y, "cross-entropy")
    return weights, data, torch.linalg.eigvalsh(H).flip(0)[:2].tolist()


@pytest.mark.parametrize(
    "kind, selector",
    [
        ("tuple", None),
        ("dict", None),
        ("object", None),
        ("aux-first", "1"),
        ("scores", "scores"),
        ("object", "logits"),
    ],
)
def test_selected_logits_give_the_plain_models_eigenvalues(setup, capsys, kind, selector):
    weights, data, expected = setup
    args = ["--model-factory", "multi_factory:build", "--arch-args", f'{{"kind": "{kind}"}}']
    args += ["--data", data, "--dtype", "float64", "--top-k", "2", "--tol", "1e-10"]
    if selector is not None:
        args += ["--output", selector]
    run = run_cli(capsys, "eigen", weights, *args, "--json", "-")
    assert run.code == 0, run.err
    assert run.json()["results"]["eigenvalues"] == pytest.approx(expected, rel=1e-8)


def test_an_output_without_logits_is_a_one_line_usage_error(setup, capsys):
    weights, data, _ = setup
    args = ["--model-factory", "multi_factory:build", "--arch-args", '{"kind": "scores"}']
    run = run_cli(capsys, "eigen", weights, *args, "--data", data, "--output", "nope")
    assert_one_line_error(run, 2, "--output", "no tensor at 'nope'")


def test_select_output_rules():
    z, h = torch.zeros(2, 3), torch.ones(2, 4)
    assert select_output(z) is z
    assert select_output((z, h)) is z and select_output((h, z), "1") is z
    assert select_output({"a": h, "logits": z}) is z and select_output({"a": h, "b": z}) is h
    assert select_output([h, z], "-1") is z
    with pytest.raises(UsageError, match="`output`"):
        select_output((h, z), "5")
    with pytest.raises(UsageError, match="no logits tensor"):
        select_output(("text",))
