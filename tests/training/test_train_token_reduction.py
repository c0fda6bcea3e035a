"""``sharp train`` minimises the token loss the analyses measure: by default the mean over all
labelled tokens (Hugging Face's causal-LM loss), with ``--token-reduction samples`` the mean of
each sample's mean over its labelled positions; the choice is stored in the checkpoint, where
``analyze`` reports it, and ``sweep`` trains and analyses with it.

The reference losses are torch's own ``cross_entropy`` on a tiny causal LM
(fixtures/causal_lm.py) in float64, on next-token labels of different lengths (``-100``
padding), with no sharp code.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import run_cli

from fixtures.causal_lm import CAUSAL_LM, build_causal_lm
from sharpcli.errors import UsageError
from sharpcli.losses import IGNORE_INDEX
from sharpcli.training.loop import TrainConfig, train

REDUCTIONS = ("tokens", "samples")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _reference(reduction: str):
    """The loss of a reduction from torch's ``cross_entropy`` alone."""

    def loss(z, y):
        if reduction == "tokens":  # Hugging Face's: one mean over every labelled token
            return F.cross_entropy(z.transpose(1, 2), y, ignore_index=IGNORE_INDEX)
        ce = F.cross_entropy(z.transpose(1, 2), y, ignore_index=IGNORE_INDEX, reduction="none")
        valid = (y != IGNORE_INDEX).to(ce.dtype)
        return ((ce * valid).sum(1) / valid.sum(1)).mean()

    return loss


def _tokens(n: int, seed: int, lengths: dict[int, int]):
    """Learnable next-token data (next = token + 1 mod 5); ``y[i, t:] = -100`` for
    ``t = lengths[i]``."""
    x = torch.randint(0, 5, (n, 4), generator=torch.Generator().manual_seed(seed))
    y = (x + 1) % 5
    for i, t in lengths.items():
        y[i, t:] = IGNORE_INDEX
    return x, y


@pytest.fixture
def lm_file(tmp_path, monkeypatch):
    """``causal_lm:build`` importable, and a data file whose training and test sequences have
    labelled lengths 1 to 4 (so the two reductions differ on both splits)."""
    import sys

    from safetensors.torch import save_file

    (tmp_path / "causal_lm.py").write_text(CAUSAL_LM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "causal_lm", raising=False)
    x, y = _tokens(24, 0, {0: 1, 1: 1, 2: 2, 5: 3, 9: 1, 17: 2})
    x_test, y_test = _tokens(10, 1, {0: 1, 3: 2, 4: 1})
    path = tmp_path / "lm.safetensors"
    save_file({"x": x, "y": y, "x_test": x_test, "y_test": y_test}, str(path))
    return path, (x, y), (x_test, y_test)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_training_minimises_the_chosen_token_mean(tmp_path, lm_file, reduction):
    """One full-batch SGD step without momentum: the recorded loss is the reference loss at
    the initial weights, the step is its gradient, and the final and test losses are the
    reference losses of the trained model on each split."""
    path, (x, y), (x_test, y_test) = lm_file
    loss = _reference(reduction)
    lr = 0.5
    cfg = TrainConfig(
        model_factory="causal_lm:build",
        data=str(path),
        epochs=1,
        batch_size=x.shape[0],
        lr=lr,
        momentum=0.0,
        dtype="float64",
        token_reduction=reduction,
    )
    result = train(cfg, tmp_path / "lm.safetensors")
    assert result.config["token_reduction"] == reduction

    model = build_causal_lm(seed=0, dtype=torch.float64)  # train seeds its factory with 0
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    initial = loss(torch.func.functional_call(model, start, (x,)), y)
    grads = torch.func.grad(lambda p: loss(torch.func.functional_call(model, p, (x,)), y))(start)
    other = _reference("samples" if reduction == "tokens" else "tokens")
    with torch.no_grad():
        assert abs(float(initial) - float(other(model(x), y))) > 1e-3 * float(initial)
    assert result.history[0]["train_loss"] == pytest.approx(float(initial), rel=1e-12)

    from safetensors.torch import load_file

    trained = load_file(str(tmp_path / "lm.safetensors"))
    for name, value in start.items():
        assert torch.allclose(trained[name], value - lr * grads[name], rtol=1e-10, atol=1e-13)
    with torch.no_grad():
        model.load_state_dict(trained, strict=False)
        final_train, final_test = loss(model(x), y), loss(model(x_test), y_test)
    assert result.final["train_loss"] == pytest.approx(float(final_train), rel=1e-12)
    assert result.final["test_loss"] == pytest.approx(float(final_test), rel=1e-12)
    assert result.history[0]["test_loss"] == pytest.approx(float(final_test), rel=1e-12)


def test_a_minibatch_loss_is_its_share_of_the_token_mean(tmp_path, lm_file):
    """With minibatches each step's loss is ``sum of its token losses / (B nbar)``, ``nbar``
    the training set's mean labelled positions: the epoch's batch-weighted mean of step
    losses at a learning rate too small to move the weights is the token mean of the set."""
    path, (x, y), _ = lm_file
    cfg = TrainConfig(
        model_factory="causal_lm:build",
        data=str(path),
        epochs=1,
        batch_size=5,
        lr=1e-300,
        momentum=0.0,
        dtype="float64",
    )
    result = train(cfg, tmp_path / "lm.safetensors")
    model = build_causal_lm(seed=0, dtype=torch.float64)
    with torch.no_grad():
        expected = float(_reference("tokens")(model(x), y))
    assert result.history[0]["train_loss"] == pytest.approx(expected, rel=1e-12)


def test_an_unknown_reduction_is_refused_naming_the_option(tmp_path, lm_file):
    path, _, _ = lm_file
    cfg = TrainConfig(model_factory="causal_lm:build", data=str(path), token_reduction="token")
    with pytest.raises(UsageError, match="accepted: tokens, samples") as err:
        train(cfg, tmp_path / "lm.safetensors")
    assert err.value.source == "token_reduction"


def test_the_checkpoint_says_which_and_analyze_reports_it(tmp_path, lm_file, capsys):
    path, _, _ = lm_file
    for reduction in REDUCTIONS:
        out = tmp_path / f"{reduction}.safetensors"
        argv = ["--model-factory", "causal_lm:build", "--data", path, "--epochs", "1"]
        if reduction == "samples":
            argv += ["--token-reduction", "samples"]
        run = run_cli(capsys, "train", *argv, "--out", out, "--json", "-", "--quiet")
        assert run.code == 0, run.err
        assert run.json()["checkpoint"]["train"]["token_reduction"] == reduction
        run = run_cli(capsys, "analyze", out, *argv[:2], "--metrics", "eigen", "--json", "-", "-q")
        assert run.code == 0, run.err
        assert run.json()["checkpoint"]["train"]["token_reduction"] == reduction
        assert run.json()["data"]["token_reduction"] == "tokens"  # the analysis's own option


def test_sweep_trains_and_analyses_with_the_reduction(tmp_path, lm_file, capsys, monkeypatch):
    path, _, _ = lm_file
    monkeypatch.chdir(tmp_path)
    run = run_cli(
        capsys,
        "sweep",
        "--reg",
        "ad",
        "--grid",
        "sigma=0.5",
        "--model-factory",
        "causal_lm:build",
        "--data",
        path,
        "--token-reduction",
        "samples",
        "--set",
        "epochs=1",
        "--metrics",
        "eigen",
        "--out-dir",
        tmp_path / "sweep",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    assert run.json()["settings"]["train"]["token_reduction"] == "samples"
    (analysis,) = (tmp_path / "sweep").glob("*.analyze.json")
    doc = json.loads(analysis.read_text())
    assert doc["data"]["token_reduction"] == "samples"
    assert doc["checkpoint"]["train"]["token_reduction"] == "samples"


def test_a_state_saved_before_the_option_resumes_as_per_sample(tmp_path, lm_file):
    """A resumable state without ``token_reduction`` trained token losses per sample: it
    resumes with ``samples`` and is refused, naming the option, with ``tokens``."""
    from sharpcli.training.resume import _check_same_identity

    path, _, _ = lm_file
    cfg = TrainConfig(
        model_factory="causal_lm:build",
        data=str(path),
        loss="token-cross-entropy",
        token_reduction="samples",
    )
    saved = cfg.to_dict()
    del saved["token_reduction"]
    _check_same_identity(cfg, {"config": saved, "epoch": 1})
    cfg.token_reduction = "tokens"
    with pytest.raises(UsageError, match="`token_reduction`"):
        _check_same_identity(cfg, {"config": saved, "epoch": 1})
    plain = TrainConfig()  # no token loss: the saved state resumes whatever the option
    saved = plain.to_dict()
    del saved["token_reduction"]
    _check_same_identity(plain, {"config": saved, "epoch": 1})
