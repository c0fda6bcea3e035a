"""Token loss reduction: the mean over all labelled tokens (analyses' default, Hugging Face's
loss) against per-sample averaging, each against dense float64 Hessians of that loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import factory_checkpoint, run_cli
from test_losses_dense import _dense, _token_mean

from fixtures.causal_lm import CAUSAL_LM, next_token_data
from sharpcli.losses import IGNORE_INDEX


def _global_token_mean(mean_positions: float):
    """``sum_{i,t valid} CE_it / (nbar B)``: on the whole set (B = N) the mean over all
    labelled tokens; on one sample its share of it (what G's per-sample blocks need)."""

    def loss(z, y):
        ce = F.cross_entropy(z.transpose(1, 2), y, ignore_index=IGNORE_INDEX, reduction="none")
        return (ce * (y != IGNORE_INDEX)).sum() / (mean_positions * z.shape[0])

    return loss


@pytest.fixture(scope="module")
def padded_lm(tmp_path_factory):
    from safetensors.torch import save_file

    from sharpcli.curvature.products.differentiable import twice_differentiable

    folder = tmp_path_factory.mktemp("token_reduction")
    monkeypatch = pytest.MonkeyPatch()
    model, weights = factory_checkpoint(folder, monkeypatch, "causal_lm", CAUSAL_LM, seed=4)
    x, y = next_token_data(9, seed=5)  # y[2, 3:] and y[6, 2:] padded: lengths differ
    data = folder / "lm.safetensors"
    save_file({"x": x, "y": y}, str(data))
    model = model.double().eval()
    labelled = int((y != IGNORE_INDEX).sum())
    nbar = labelled / y.shape[0]
    with torch.no_grad():
        hf = F.cross_entropy(model(x).transpose(1, 2), y, ignore_index=IGNORE_INDEX)
        ours = _global_token_mean(nbar)(model(x), y)
    assert float(ours) == pytest.approx(float(hf), rel=1e-12)
    with twice_differentiable():
        dense = {
            "tokens": _dense(model, x, y, _global_token_mean(nbar)),
            "samples": _dense(model, x, y, _token_mean),
        }
    yield weights, data, dense, float(hf)
    monkeypatch.undo()


@pytest.mark.parametrize("reduction", ["tokens", "samples"])
def test_eigenvalues_and_ggn_trace_follow_the_reduction(capsys, padded_lm, reduction):
    weights, data, dense, _ = padded_lm
    H, G = dense[reduction]
    base = ["--model-factory", "causal_lm:build", "--data", data, "--dtype", "float64"]
    if reduction == "samples":
        base += ["--token-reduction", "samples"]
    run = run_cli(
        capsys, "eigen", weights, *base, "--top-k", "2", "--eig-tol", "1e-10", "--json", "-"
    )
    assert run.code == 0, run.err
    report = run.json()
    assert report["data"]["token_reduction"] == reduction
    assert report["results"]["eigenvalues"] == pytest.approx(
        torch.linalg.eigvalsh(H).flip(0)[:2].tolist(), rel=1e-8
    )
    run = run_cli(
        capsys, "trace", weights, *base, "--operator", "ggn", "--estimator", "exact", "--json", "-"
    )
    assert run.code == 0, run.err
    assert run.json()["results"]["trace"]["estimate"] == pytest.approx(float(G.trace()), rel=1e-9)


def test_the_two_reductions_differ_on_variable_lengths(padded_lm):
    _, _, dense, _ = padded_lm
    top = {r: float(torch.linalg.eigvalsh(H)[-1]) for r, (H, _) in dense.items()}
    assert abs(top["tokens"] - top["samples"]) > 1e-3 * abs(top["tokens"])


def test_the_default_loss_is_hugging_faces_token_mean(capsys, padded_lm):
    weights, data, _, hf = padded_lm
    base = ["--model-factory", "causal_lm:build", "--data", data, "--dtype", "float64"]
    run = run_cli(capsys, "analyze", weights, *base, "--metrics", "eigen", "--json", "-")
    assert run.code == 0, run.err
    assert run.json()["results"]["loss"] == pytest.approx(hf, rel=1e-12)
