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

from fixtures.causal_lm import CAUSAL_LM, build_causal_lm, next_token_data
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope, exact_ggn_trace
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
    engine = CurvatureEngine(model, AnalysisData(x, y, loss, batch_size=4), scope)
    eye = torch.eye(scope.numel, dtype=torch.float64)
    assert float((engine.hessian().matmat(eye) - H).abs().max()) < 1e-10
    assert float((engine.ggn().matmat(eye) - G).abs().max()) < 1e-10
    assert float((engine.nme().matmat(eye) - (H - G)).abs().max()) < 1e-10
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


def test_causal_language_model_through_the_cli(tmp_path, capsys, monkeypatch):
    """A user's causal transformer LM with (N, T) next-token labels (padding -100): the loss is
    inferred as token-level cross-entropy, and eigen, the exact GGN trace and gn-nme's identity
    match dense float64 matrices built from torch's own cross_entropy."""
    from safetensors.torch import save_file

    from sharpcli.curvature.products.differentiable import twice_differentiable

    model, weights = factory_checkpoint(tmp_path, monkeypatch, "causal_lm", CAUSAL_LM, seed=4)
    x, y = next_token_data(9, seed=5)  # predict the next token; y[2, 3:], y[6, 2:] padded
    data = tmp_path / "lm.safetensors"
    save_file({"x": x, "y": y}, str(data))
    model = model.double().eval()
    with twice_differentiable():
        H, G = _dense(model, x, y, _token_mean)
    # per-sample averaging (the default, the mean over all tokens: tests/test_token_reduction.py)
    base = ["--model-factory", "causal_lm:build", "--data", data, "--dtype", "float64"]
    base += ["--token-reduction", "samples"]

    run = run_cli(
        capsys, "eigen", weights, *base, "--top-k", "2", "--eig-tol", "1e-10", "--json", "-"
    )
    assert run.code == 0, run.err
    report = run.json()
    assert report["data"]["loss"] == "token-cross-entropy"  # inferred from (N, T) labels
    assert report["results"]["eigenvalues"] == pytest.approx(
        torch.linalg.eigvalsh(H).flip(0)[:2].tolist(), rel=1e-8
    )

    run = run_cli(
        capsys, "trace", weights, *base, "--operator", "ggn", "--estimator", "exact", "--json", "-"
    )
    assert run.code == 0, run.err
    assert run.json()["results"]["trace"]["estimate"] == pytest.approx(float(G.trace()), rel=1e-9)

    run = run_cli(capsys, "gn-nme", weights, *base, "--trace-max-matvecs", "40", "--json", "-")
    assert run.code == 0, run.err
    res = run.json()["results"]
    h, g, n = (res[op]["trace"]["estimate"] for op in ("hessian", "ggn", "nme"))
    assert h == pytest.approx(g + n, rel=1e-9)  # H = G + N on shared probes
    assert res["ggn_trace_check"]["exact"] == pytest.approx(float(G.trace()), rel=1e-9)

    # loss and accuracy: per sample the mean over its labelled positions; accuracy per position
    run = run_cli(capsys, "analyze", weights, *base, "--metrics", "eigen", "--json", "-")
    assert run.code == 0, run.err
    with torch.no_grad():
        z = model(x)
    labelled = y != IGNORE_INDEX
    expected = int(((z.argmax(-1) == y) & labelled).sum()) / int(labelled.sum())
    assert run.json()["results"]["accuracy"] == pytest.approx(expected, rel=1e-12)
    assert run.json()["results"]["loss"] == pytest.approx(float(_token_mean(z, y)), rel=1e-12)
    # activation-stats and weight-rescale count accuracy as the loss does, too
    run = run_cli(capsys, "activation-stats", weights, *base, "--json", "-")
    assert run.code == 0, run.err
    assert run.json()["results"]["output"]["accuracy"] == pytest.approx(expected, rel=1e-12)
    from sharpcli.analyses.rescale import evaluate_outputs
    from sharpcli.curvature import AnalysisData

    outputs = evaluate_outputs(model, AnalysisData(x, y, "token-cross-entropy", batch_size=4))
    assert outputs.accuracy == pytest.approx(expected, rel=1e-12)

    # training takes the per-position labels: token cross-entropy, recorded in the checkpoint
    trained = tmp_path / "lm-trained.safetensors"
    train_args = ("--model-factory", "causal_lm:build", "--data", data, "--dtype", "float64")
    train_args += ("--token-reduction", "samples")  # as base analyses (the default: tokens)
    run = run_cli(capsys, "train", *train_args, "--epochs", "2", "--out", trained, "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    assert report["checkpoint"]["train"]["loss"] == "token-cross-entropy"
    final = report["results"]["final"]
    run = run_cli(capsys, "analyze", trained, *base, "--metrics", "eigen", "--json", "-")
    assert run.code == 0, run.err
    analysed = run.json()
    assert analysed["data"]["loss"] == "token-cross-entropy"  # from the checkpoint's record
    # the trained model's loss and accuracy per labelled position, recomputed here from the
    # checkpoint's float64 tensors
    from safetensors.torch import load_file

    lm = build_causal_lm().eval()
    lm.load_state_dict(load_file(str(trained)))
    with torch.no_grad(), twice_differentiable():  # the math path, as the CLI runs it
        z = lm(x)
    accuracy = int(((z.argmax(-1) == y) & labelled).sum()) / int(labelled.sum())
    assert final["train_accuracy"] == pytest.approx(accuracy, rel=1e-12)
    assert analysed["results"]["accuracy"] == pytest.approx(accuracy, rel=1e-12)
    assert final["train_loss"] == pytest.approx(float(_token_mean(z, y)), rel=1e-12)


@pytest.mark.parametrize(
    "labels, needle",
    [
        ([[0, -100], [-100, -100], [1, 2]], None),  # -100 marks padding: accepted
        ([[-100, -100], [-100, -100], [-100, -100]], "no labelled position"),
        ([[0, -3], [1, 1], [2, 0]], "negative label other than -100"),
        ([[-100], [1], [2]], "negative label (-100)"),  # one label per sample: no padding
    ],
)
def test_token_label_files(tmp_path, labels, needle):
    """(N, T) label files: -100 is padding, only in per-position labels; the error names the file."""
    from safetensors.torch import save_file

    from sharpcli.errors import InputError
    from sharpcli.io.data.loading import load_dataset

    path = tmp_path / "tokens.safetensors"
    save_file({"x": torch.zeros(3, 2, dtype=torch.int64), "y": torch.tensor(labels)}, str(path))
    if needle is None:
        x, y = load_dataset(str(path)).split("train")
        assert y.dtype == torch.int64 and y.tolist() == labels
        return
    with pytest.raises(InputError) as caught:
        load_dataset(str(path))
    assert needle in caught.value.message and str(path) in str(caught.value.source)


def test_attention_mask_buffers_may_hold_inf_but_weights_and_statistics_may_not(tmp_path):
    """A causal mask buffer is -Inf above the diagonal by design; NaN in any buffer, or Inf in a
    parameter or a BatchNorm statistic, is an input error naming the tensor."""
    from sharpcli.errors import InputError
    from sharpcli.io.checkpoints import check_finite_weights

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.norm = nn.BatchNorm1d(2)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(3))

    model = Masked()
    check_finite_weights(model, "m.pt")  # -Inf in the mask is fine
    for tensor, name in (
        (model.mask, "mask"),
        (model.norm.running_var, "norm.running_var"),
        (model.lin.weight, "lin.weight"),
    ):
        saved = tensor.clone()
        with torch.no_grad():
            tensor.view(-1)[1] = float("nan") if name == "mask" else float("inf")
        with pytest.raises(InputError, match=name):
            check_finite_weights(model, "m.pt")
        with torch.no_grad():
            tensor.copy_(saved)


def test_float64_weights_reach_a_float64_analysis_exactly(tmp_path, capsys, monkeypatch):
    """A factory builds a float32 model; a float64 checkpoint loaded into it must not be rounded
    to float32 on the way to ``--dtype float64`` (loss and eigenvalues to float64 precision)."""
    from safetensors.torch import save_file

    source = textwrap.dedent("""
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    """)
    model, _ = factory_checkpoint(tmp_path, monkeypatch, "wide_factory", source, seed=6)
    gen = torch.Generator().manual_seed(7)
    state = {  # float64 values that float32 cannot hold
        k: v.double() + 1e-9 * torch.randn(v.shape, generator=gen, dtype=torch.float64)
        for k, v in model.state_dict().items()
    }
    weights = tmp_path / "wide.safetensors"
    save_file(state, str(weights))
    x = torch.randn(30, 4, generator=gen).double()  # features are read as float32: exact ones
    y = torch.randint(0, 3, (30,), generator=gen)
    data = tmp_path / "wide-data.safetensors"
    save_file({"x": x, "y": y}, str(data))
    exact = model.double()
    exact.load_state_dict(state)
    H, _ = _dense(exact.eval(), x, y, lambda z, t: F.cross_entropy(z, t))
    with torch.no_grad():
        loss = float(F.cross_entropy(exact(x), y))
    base = ["--model-factory", "wide_factory:build", "--data", data, "--dtype", "float64"]
    run = run_cli(
        capsys, "analyze", weights, *base, "--metrics", "eigen", "--eig-tol", "1e-12", "--json", "-"
    )
    assert run.code == 0, run.err
    results = run.json()["results"]
    assert results["loss"] == pytest.approx(loss, rel=1e-14)
    assert results["hessian"]["lambda_max"] == pytest.approx(
        float(torch.linalg.eigvalsh(H)[-1]), rel=1e-11
    )
