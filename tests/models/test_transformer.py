"""A small transformer classifier (token embedding, a TransformerEncoderLayer with multi-head
attention and LayerNorm, a linear head) through every analysis command, and its curvature
against dense float64 Hessians.

Hessian products need the math attention backend (the fused kernels have no double backward)
and the encoder's fast path off; both are switched for the run and restored afterwards.
"""

from __future__ import annotations

import importlib
import textwrap

import numpy as np
import pytest
import torch
from cli_helpers import run_cli
from conftest import dense_reference

from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope, exact_ggn_trace
from sharpcli.curvature.products.differentiable import twice_differentiable

FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    class TinyTransformer(nn.Module):
        def __init__(self, vocab=5, dim=4, heads=2, classes=3, length=3):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.pos = nn.Parameter(0.1 * torch.randn(length, dim))
            self.enc = nn.TransformerEncoderLayer(
                dim, heads, dim_feedforward=6, dropout=0.0, batch_first=True
            )
            self.head = nn.Linear(dim, classes)

        def forward(self, x):
            return self.head(self.enc(self.emb(x) + self.pos).mean(1))

    def build():
        return TinyTransformer()
""")


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("transformer")
    (folder / "tiny_transformer.py").write_text(FACTORY)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(folder))
    module = importlib.import_module("tiny_transformer")
    torch.manual_seed(0)
    model = module.build()
    weights = folder / "transformer.pt"
    torch.save(model.state_dict(), weights)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 5, (16, 3), generator=gen)
    y = torch.randint(0, 3, (16,), generator=gen)
    data = folder / "tokens.npz"
    np.savez(data, x=x.numpy(), y=y.numpy())
    model = model.double().eval()
    with twice_differentiable():
        H, G, names = dense_reference(model, x, y, "cross-entropy")
    base = ["--model-factory", "tiny_transformer:build", "--data", str(data), "--dtype", "float64"]
    yield {
        "model": model,
        "x": x,
        "y": y,
        "H": H,
        "G": G,
        "names": names,
        "ckpt": weights,
        "base": base,
    }
    mp.undo()


def test_products_and_exact_ggn_trace_match_dense(transformer):
    t = transformer
    model, x, y = t["model"], t["x"], t["y"]
    scope = ParamScope.resolve(model)
    assert list(scope.names) == t["names"]
    # the library switches attention itself: no context needed around library calls
    engine = CurvatureEngine(model, AnalysisData(x, y, "cross-entropy", batch_size=10), scope)
    V = torch.randn(scope.numel, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    HV, GV, NV = (op.matmat(V) for op in (engine.hessian(), engine.ggn(), engine.nme()))
    trace = exact_ggn_trace(model, AnalysisData(x, y, "cross-entropy", batch_size=7), scope)
    assert torch.backends.mha.get_fastpath_enabled()  # the user's setting, restored
    H, G = t["H"], t["G"]
    assert float((HV - H @ V).abs().max()) < 1e-10
    assert float((GV - G @ V).abs().max()) < 1e-10
    assert float((HV - GV - NV).abs().max()) < 1e-12  # H = G + N per vector
    assert trace.estimate == pytest.approx(float(G.trace()), rel=1e-10)
    for name, sl in scope.blocks().items():
        assert trace.by_layer[name]["estimate"] == pytest.approx(
            float(G[sl, sl].trace()), rel=1e-8, abs=1e-13
        )


def test_eigen_and_trace_through_the_cli(transformer, capsys):
    t = transformer
    evals = torch.linalg.eigvalsh(t["H"])
    run = run_cli(
        capsys,
        "eigen",
        t["ckpt"],
        *t["base"],
        "--top-k",
        "3",
        "--which",
        "both",
        "--tol",
        "1e-10",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    got = run.json()["results"]["eigenvalues"]
    assert got[:3] == pytest.approx(evals.flip(0)[:3].tolist(), rel=1e-6)
    assert sorted(got[3:]) == pytest.approx(evals[:3].tolist(), rel=1e-6, abs=1e-9)
    run = run_cli(
        capsys,
        "trace",
        t["ckpt"],
        *t["base"],
        "--operator",
        "ggn",
        "--estimator",
        "exact",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    assert run.json()["results"]["trace"]["estimate"] == pytest.approx(
        float(t["G"].trace()), rel=1e-8
    )
    # the user's attention settings are back after the run
    assert torch.backends.mha.get_fastpath_enabled()


@pytest.mark.parametrize(
    "command",
    [
        ("gn-nme", "--max-matvecs", "60"),
        ("density", "--probes", "2", "--steps", "10"),
        ("analyze", "--metrics", "eigen,trace", "--tol", "0.2", "--max-matvecs", "30"),
        ("activation-stats",),
        ("bound-check", "--sigma", "0.01", "--perturbations", "2"),
        ("eigen", "--engine", "pyhessian", "--method", "power", "--top-k", "1"),
        ("weight-rescale",),
    ],
)
def test_every_analysis_command_runs_on_a_transformer(transformer, capsys, command, tmp_path):
    """Each command runs; weight-rescale says why it cannot: the encoder's feed-forward
    activation is functional, so no layer compensates a rescaling (one line, exit 2)."""
    t = transformer
    name, *extra = command
    run = run_cli(capsys, name, t["ckpt"], *t["base"], *extra, "--json", tmp_path / "r.json")
    if name == "weight-rescale":
        assert run.code == 2 and "nothing can compensate" in run.err, run.err
        return
    assert run.code == 0, run.err
    assert "internal error" not in run.err
