"""Binary cross-entropy with one logit and token-level cross-entropy: Hessian, Gauss-Newton
and NME products and the exact Gauss-Newton trace against dense float64 references computed
here from torch's own loss functions (not sharp's loss registry)."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import factory_checkpoint, run_cli
from torch import nn
from torch.func import functional_call, jacrev

from sharpcli.curvature import AnalysisData, CurvaturePass, ParamScope, exact_ggn_trace
from sharpcli.losses import IGNORE_INDEX, LOSSES


def _bce_mean(z, y):
    return F.binary_cross_entropy_with_logits(z.reshape(-1), y.double())


def _token_mean(z, y):
    # per sample: the mean over its labelled positions; then the mean over samples
    ce = F.cross_entropy(z.transpose(1, 2), y, ignore_index=IGNORE_INDEX, reduction="none")
    valid = (y != IGNORE_INDEX).double()
    return ((ce * valid).sum(1) / valid.sum(1).clamp_min(1)).mean()


def _dense(model, x, y, mean_loss):
    """``(H, G)`` of ``mean_loss(model(x), y)``: H by double backward, G from per-sample
    Jacobians and per-sample output Hessians (each by double backward of the loss alone)."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])

    def logits(flat):
        out, start = {}, 0
        for n, shape in zip(names, shapes):
            out[n] = flat[start : start + shape.numel()].view(shape)
            start += shape.numel()
        return functional_call(model, out, (x,))

    H = torch.autograd.functional.hessian(lambda f: mean_loss(logits(f), y), flat0)
    J = jacrev(logits)(flat0).reshape(x.shape[0], -1, flat0.numel())  # (N, outputs, P)
    z = logits(flat0).detach()
    N = x.shape[0]
    G = torch.zeros_like(H)
    for i in range(N):
        # the mean over N samples gives sample i the weight 1/N of its own loss
        Hz = torch.autograd.functional.hessian(
            lambda zi: mean_loss(zi.reshape(z[i : i + 1].shape), y[i : i + 1]), z[i].reshape(-1)
        )
        G += J[i].T @ Hz @ J[i] / N
    return H, G


def _token_model():
    torch.manual_seed(0)

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 3)
            self.mix = nn.Linear(3, 3)
            self.norm = nn.LayerNorm(3)
            self.out = nn.Linear(3, 5)

        def forward(self, x):
            return self.out(self.norm(torch.tanh(self.mix(self.emb(x)))))  # (B, T, 5)

    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 6, (7, 4), generator=gen)
    y = torch.randint(0, 5, (7, 4), generator=gen)
    y[0, 1] = y[3, 0] = y[3, 2] = IGNORE_INDEX
    y[5] = IGNORE_INDEX  # a sample with no labelled position contributes 0
    return Tagger().double().eval(), x, y


def _bce_model():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 1)).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 4, dtype=torch.float64, generator=gen)
    return model, x, torch.randint(0, 2, (11,), generator=gen)


CASES = {
    "binary-cross-entropy": (_bce_model, _bce_mean),
    "token-cross-entropy": (_token_model, _token_mean),
}


@pytest.mark.parametrize("loss", list(CASES))
def test_products_and_exact_ggn_trace_match_dense(loss):
    make, mean_loss = CASES[loss]
    model, x, y = make()
    H, G = _dense(model, x, y, mean_loss)
    with torch.no_grad():
        assert float(LOSSES[loss].mean(model(x), y)) == pytest.approx(float(mean_loss(model(x), y)))
    scope = ParamScope.resolve(model)
    cpass = CurvaturePass(model, AnalysisData(x, y, loss, batch_size=4), scope)
    eye = torch.eye(scope.numel, dtype=torch.float64)
    assert float((cpass.hessian().matmat(eye) - H).abs().max()) < 1e-10
    assert float((cpass.ggn().matmat(eye) - G).abs().max()) < 1e-10
    assert float((cpass.nme().matmat(eye) - (H - G)).abs().max()) < 1e-10
    trace = exact_ggn_trace(model, AnalysisData(x, y, loss, batch_size=3), scope)
    assert trace.estimate == pytest.approx(float(G.trace()), rel=1e-10)
    for name, sl in scope.blocks().items():
        assert trace.by_layer[name]["estimate"] == pytest.approx(
            float(G[sl, sl].trace()), rel=1e-9, abs=1e-14
        )


def test_one_logit_binary_classifier_through_the_cli(tmp_path, capsys, monkeypatch):
    from safetensors.torch import save_file

    source = textwrap.dedent("""
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 1))
    """)
    model, weights = factory_checkpoint(tmp_path, monkeypatch, "binary_factory", source, seed=2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 4, generator=gen)
    y = torch.randint(0, 2, (20,), generator=gen)
    data = tmp_path / "binary.safetensors.data.safetensors"
    save_file({"x": x, "y": y}, str(data))
    H, _ = _dense(model.double(), x.double(), y, _bce_mean)
    run = run_cli(
        capsys,
        "eigen",
        weights,
        "--model-factory",
        "binary_factory:build",
        "--data",
        data,
        "--dtype",
        "float64",
        "--top-k",
        "2",
        "--tol",
        "1e-10",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    report = run.json()
    assert report["data"]["loss"] == "binary-cross-entropy"  # inferred from the one logit
    assert report["results"]["eigenvalues"] == pytest.approx(
        torch.linalg.eigvalsh(H).flip(0)[:2].tolist(), rel=1e-8
    )
