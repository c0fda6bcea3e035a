"""Frozen parameters (fine-tuning: a frozen backbone) are outside the default scope.

The model is a user's, built by ``--model-factory`` with ``requires_grad=False`` on its first
layer; eigenvalues and traces are checked against dense float64 Hessians of the trainable
block (default) and of the whole model (a ``--params`` glob that names the frozen layer).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from cli_helpers import factory_checkpoint, run_cli
from conftest import dense_reference

FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    def build():
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        for p in model[0].parameters():
            p.requires_grad_(False)
        return model
""")


@pytest.fixture()
def frozen_setup(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    model, weights = factory_checkpoint(tmp_path, monkeypatch, "frozen_factory", FACTORY)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(30, 6, generator=gen)
    y = torch.randint(0, 3, (30,), generator=gen)
    data = tmp_path / "data.safetensors"
    save_file({"x": x, "y": y}, str(data))
    model = model.double().eval()
    names = [n for n, _ in model.named_parameters()]
    H_all, _, _ = dense_reference(model, x.double(), y, "cross-entropy", param_names=names)
    trainable = [n for n in names if not n.startswith("0.")]
    H_tr, _, _ = dense_reference(model, x.double(), y, "cross-entropy", param_names=trainable)
    base = ["--model-factory", "frozen_factory:build", "--data", str(data), "--dtype", "float64"]
    return weights, base, H_all, H_tr


def _eig(capsys, weights, base, *extra):
    run = run_cli(
        capsys, "eigen", weights, *base, "--top-k", "2", "--tol", "1e-10", *extra, "--json", "-"
    )
    assert run.code == 0, run.err
    return run.json()["results"]


def test_default_scope_is_the_trainable_parameters(frozen_setup, capsys):
    weights, base, H_all, H_tr = frozen_setup
    results = _eig(capsys, weights, base)
    exact = torch.linalg.eigvalsh(H_tr).flip(0)[:2]
    assert results["eigenvalues"] == pytest.approx(exact.tolist(), rel=1e-8)
    scope = results["scope"]
    assert scope["numel"] == H_tr.shape[0] == 8 * 8 + 8 + 3 * 8 + 3
    assert scope["frozen_excluded"] == ["0.weight", "0.bias"] and scope["frozen_included"] == []
    assert "not in the scope" in scope["notes"][0]
    # the whole model's top eigenvalue differs: including the frozen layer would be wrong
    assert abs(float(torch.linalg.eigvalsh(H_all)[-1]) - exact[0]) > 1e-3 * abs(float(exact[0]))

    run = run_cli(
        capsys, "trace", weights, *base, "--estimator", "hutchinson", "--tol", "0.05", "--json", "-"
    )
    assert run.code == 0, run.err
    assert set(run.json()["results"]["by_layer"]) == {"2", "4"}


def test_a_glob_naming_frozen_parameters_computes_them_with_a_note(frozen_setup, capsys):
    weights, base, H_all, _ = frozen_setup
    results = _eig(capsys, weights, base, "--params", "0.*")
    H_frozen = H_all[:56, :56]  # 0.weight (8x6) and 0.bias (8)
    exact = torch.linalg.eigvalsh(H_frozen).flip(0)[:2]
    assert results["eigenvalues"] == pytest.approx(exact.tolist(), rel=1e-8)
    scope = results["scope"]
    assert scope["frozen_included"] == ["0.weight", "0.bias"]
    assert "frozen" in scope["notes"][0] and "0.*" in scope["notes"][0]

    run = run_cli(capsys, "eigen", weights, *base, "--top-k", "1", "--params", "*")
    assert run.code == 0, run.err
    text = " ".join(run.err.split())  # notes: stderr, after the report
    assert "note: the scope includes 2 frozen parameter tensor(s)" in text
    # the table of the default scope says what was left out
    run = run_cli(capsys, "eigen", weights, *base, "--top-k", "1")
    assert "note: 2 frozen parameter tensor(s)" in " ".join(run.err.split())


def test_pyhessian_engine_sees_the_same_trainable_scope(frozen_setup, capsys):
    weights, base, _, H_tr = frozen_setup
    run = run_cli(
        capsys,
        "eigen",
        weights,
        *base,
        "--engine",
        "pyhessian",
        "--method",
        "power",
        "--top-k",
        "1",
        "--tol",
        "1e-8",
        "--max-matvecs",
        "500",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    lam = run.json()["results"]["eigenvalues"][0]
    top = torch.linalg.eigvalsh(H_tr)
    dominant = top[-1] if abs(top[-1]) >= abs(top[0]) else top[0]
    assert lam == pytest.approx(float(dominant), rel=1e-4)
