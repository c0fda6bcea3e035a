"""``sharp train`` on a sequence model with per-position labels (token-level cross-entropy).

A user's tiny causal transformer LM (fixtures/causal_lm.py) with next-token labels ``(N, T)``,
``-100`` on unlabelled positions:

- every regularizer that applies trains it (finite loss that fell), ``dropout`` is refused;
- the penalties with an exact meaning match independent float64 computations on the token
  model: ``gn-trace``'s expectation over its sampled labels is ``tr(G)`` (enumerated exactly),
  ``ad`` is the mean over labelled positions of ``||h_t||^2``, ``sam`` steps to
  ``theta + rho g/||g||``; accuracy counts labelled positions;
- label noise changes labelled positions only.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, jacrev

from fixtures.causal_lm import CAUSAL_LM, build_causal_lm, next_token_data
from sharpcli.curvature.products.differentiable import twice_differentiable
from sharpcli.errors import UsageError
from sharpcli.losses import IGNORE_INDEX, token_reduction
from sharpcli.regularizers.penalties.nme import GaussNewtonTrace
from sharpcli.regularizers.registry import parse_reg
from sharpcli.regularizers.step import training_step
from sharpcli.training.loop import TrainConfig, apply_label_noise, evaluate, train


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _token_mean(z, y):
    # torch's own cross_entropy: per sample the mean over its labelled positions, then samples
    ce = F.cross_entropy(z.transpose(1, 2), y, ignore_index=IGNORE_INDEX, reduction="none")
    valid = (y != IGNORE_INDEX).double()
    return ((ce * valid).sum(1) / valid.sum(1).clamp_min(1)).mean()


def _token_share(nbar):
    # the token mean over a set with nbar labelled positions per sample: each sample's share
    def loss(z, y):
        ce = F.cross_entropy(z.transpose(1, 2), y, ignore_index=IGNORE_INDEX, reduction="none")
        return (ce * (y != IGNORE_INDEX)).sum() / (nbar * z.shape[0])

    return loss


def _flat_grad(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.fixture
def lm_data(tmp_path, monkeypatch):
    """The factory module importable as ``causal_lm``, and a learnable next-token data file
    (the next token is ``(token + 1) mod 5``; two sequences padded)."""
    import sys

    from safetensors.torch import save_file

    (tmp_path / "causal_lm.py").write_text(CAUSAL_LM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "causal_lm", raising=False)  # not an earlier test's copy
    x = torch.randint(0, 5, (48, 4), generator=torch.Generator().manual_seed(0))
    y = (x + 1) % 5
    y[3, 2:] = y[10, 1:] = IGNORE_INDEX
    path = tmp_path / "lm.safetensors"
    save_file({"x": x, "y": y}, str(path))
    return path


TRAINING_REGS = [
    "none",
    "wd",
    "ad",
    "sam",
    "usam",
    "asam",
    "gp",
    "gp:mode=fd",
    "hessian-trace",
    "hessian-trace:mode=fd",
    "gn-trace",
    "fa",
    "fa:mode=fd",
    "weight-noise",
    "nso",
]


@pytest.mark.parametrize("reg", TRAINING_REGS)
def test_each_regularizer_trains_a_causal_lm(tmp_path, lm_data, reg):
    cfg = TrainConfig(
        model_factory="causal_lm:build",
        data=str(lm_data),
        epochs=3,
        batch_size=16,
        lr=0.05,
        regs=[reg],
    )
    with twice_differentiable():
        result = train(cfg, tmp_path / "lm.safetensors")
    assert result.config["loss"] == "token-cross-entropy"
    losses = [row["train_loss"] for row in result.history]
    assert all(math.isfinite(v) for v in losses) and math.isfinite(result.final["train_loss"])
    assert result.final["train_loss"] < 0.8 * losses[0], losses  # it learns the next token
    for row in result.history:
        assert all(math.isfinite(v) for v in row["penalties"].values())
        assert 0.0 <= row["train_accuracy"] <= 1.0
    assert 0.0 <= result.final["train_accuracy"] <= 1.0


def test_dropout_is_refused_for_a_factory_lm(tmp_path, lm_data):
    cfg = TrainConfig(model_factory="causal_lm:build", data=str(lm_data), regs=["dropout"])
    with pytest.raises(UsageError, match="model_factory") as err:
        train(cfg, tmp_path / "lm.safetensors")
    assert err.value.source == "regs"


def _tiny_batch():
    """Two sequences: labelled at positions 0 and 2 of the first, 3 of the second."""
    x, y = next_token_data(2, seed=11, padded=())
    y[0, 1] = y[0, 3] = IGNORE_INDEX
    y[1, :3] = IGNORE_INDEX
    return x, y


def _dense_ggn_trace(model, x, y, sample_loss=_token_mean):
    """``tr(G)`` of the loss ``(1/N) sum_i sample_loss(z_i, y_i)`` from per-sample Jacobians and
    output Hessians (float64, torch's own cross_entropy; no sharp code)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    total = 0.0
    for i in range(x.shape[0]):

        def logits(p, i=i):
            return functional_call(model, p, (x[i : i + 1],))[0]  # (T, V)

        jac = jacrev(logits)(params)
        J = torch.cat([j.reshape(*j.shape[:2], -1) for j in jac.values()], dim=-1)  # (T, V, P)
        z = logits(params).detach()

        def loss_i(z, i=i):
            return sample_loss(z[None], y[i : i + 1])

        Hz = torch.autograd.functional.hessian(loss_i, z).reshape(z.numel(), z.numel())
        Jf = J.reshape(z.numel(), -1)
        total += float(torch.trace(Jf.T @ Hz @ Jf))
    return total / x.shape[0]


@pytest.mark.parametrize("reduction", ["samples", "tokens"])
def test_gn_trace_is_unbiased_for_the_token_ggn_trace(monkeypatch, reduction):
    """The expectation of the penalty over its sampled labels, enumerated over every draw of
    the 3 labelled positions (5^3) with its probability, is sigma2 tr(G) exactly, G of the
    token loss averaged per sample or over all labelled tokens (as training averages it)."""
    model = build_causal_lm(seed=2).eval()
    x, y = _tiny_batch()
    nbar = int((y != IGNORE_INDEX).sum()) / y.shape[0]
    sample_loss = _token_mean if reduction == "samples" else _token_share(nbar)
    labelled = y != IGNORE_INDEX
    with torch.no_grad(), twice_differentiable():
        p = torch.softmax(model(x), dim=-1)
    positions = labelled.nonzero().tolist()
    draws = iter(())
    monkeypatch.setattr(GaussNewtonTrace, "sample_labels", lambda self, *a: next(draws))
    expectation = 0.0
    with twice_differentiable(), token_reduction(reduction, y):
        for combo in itertools.product(range(5), repeat=len(positions)):
            y_hat = torch.zeros_like(y)
            prob = 1.0
            for (i, t), c in zip(positions, combo):
                y_hat[i, t] = c
                prob *= float(p[i, t, c])
            draws = iter([y_hat])
            gen = torch.Generator().manual_seed(0)
            stats = training_step(
                model, x, y, "token-cross-entropy", [parse_reg("gn-trace:sigma2=2")], gen
            )
            expectation += prob * stats.penalties["gn-trace"]
    with twice_differentiable():
        exact = _dense_ggn_trace(model, x, y, sample_loss)
    assert expectation == pytest.approx(2 * exact, rel=1e-9)


def test_gn_trace_draws_one_label_per_labelled_position():
    model = build_causal_lm(seed=2).eval()
    x, y = _tiny_batch()
    with torch.no_grad(), twice_differentiable():
        z = model(x)
    gen = torch.Generator().manual_seed(0)
    y_hat = parse_reg("gn-trace").sample_labels(z, "token-cross-entropy", gen)
    assert y_hat.shape == y.shape and int(y_hat.min()) >= 0 and int(y_hat.max()) < 5


@pytest.mark.parametrize("reduction", ["samples", "tokens"])
def test_ad_penalises_the_labelled_positions_of_the_heads_input(reduction):
    model = build_causal_lm(seed=3).eval()
    x, y = _tiny_batch()
    sigma = 0.7
    with twice_differentiable():
        gen = torch.Generator().manual_seed(0)
        with token_reduction(reduction, y):
            stats = training_step(
                model, x, y, "token-cross-entropy", [parse_reg(f"ad:sigma={sigma}")], gen
            )
        step_grad = _flat_grad(model)
        model.zero_grad()
        # independently: h = the head's input per position; per sample the mean over its
        # labelled positions of ||h_t||^2, then the mean over samples; or the mean over all
        # labelled positions, with the loss of the same reduction
        h = model.block(model.emb(x) + model.pos[: x.shape[1]], src_mask=model.mask, is_causal=True)
        labelled = (y != IGNORE_INDEX).double()
        if reduction == "samples":
            per_sample = (h.pow(2).sum(-1) * labelled).sum(1) / labelled.sum(1)
            loss = _token_mean(model.head(h), y)
        else:
            per_sample = (h.pow(2).sum(-1) * labelled).sum(1) / (labelled.sum() / y.shape[0])
            loss = F.cross_entropy(model.head(h).transpose(1, 2), y, ignore_index=IGNORE_INDEX)
        penalty = 0.5 * sigma**2 * per_sample.mean()
        (loss + penalty).backward()
    assert stats.penalties["ad"] == pytest.approx(float(penalty.detach()), rel=1e-12)
    assert torch.allclose(step_grad, _flat_grad(model), rtol=1e-10, atol=1e-14)


def test_sam_ascends_along_the_normalised_token_loss_gradient():
    model = build_causal_lm(seed=4).eval()
    x, y = _tiny_batch()
    rho = 0.3
    with twice_differentiable():
        gen = torch.Generator().manual_seed(0)
        stats = training_step(
            model, x, y, "token-cross-entropy", [parse_reg(f"sam:rho={rho}")], gen
        )
        step_grad = _flat_grad(model)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}

        def loss_at(p):
            return _token_mean(functional_call(model, p, (x,)), y)

        g = torch.func.grad(loss_at)(params)
        norm = torch.sqrt(sum((v * v).sum() for v in g.values()))
        ascended = {n: params[n] + rho * g[n] / norm for n in params}
        expected = torch.func.grad(loss_at)(ascended)
    flat = torch.cat([expected[n].reshape(-1) for n, _ in model.named_parameters()])
    assert torch.allclose(step_grad, flat, rtol=1e-10, atol=1e-14)
    assert stats.loss == pytest.approx(float(loss_at(params)), rel=1e-12)  # the clean pass


def test_step_and_evaluate_count_accuracy_per_labelled_position():
    model = build_causal_lm(seed=5).eval()
    x, y = next_token_data(9, seed=5)
    with twice_differentiable():
        stats = training_step(
            model, x, y, "token-cross-entropy", [parse_reg("none")], torch.Generator()
        )
        ev = evaluate(model, x, y, "token-cross-entropy", batch_size=4)
        with torch.no_grad():
            z = model(x)
    labelled = y != IGNORE_INDEX
    right = int(((z.argmax(-1) == y) & labelled).sum())
    assert (stats.correct, stats.counted, stats.count) == (right, int(labelled.sum()), 9)
    assert int(labelled.sum()) == 9 * 4 - 1 - 2  # two sequences padded
    assert ev["accuracy"] == pytest.approx(right / int(labelled.sum()), rel=1e-15)
    assert ev["loss"] == pytest.approx(float(_token_mean(z, y)), rel=1e-12)


def test_binary_cross_entropy_has_an_accuracy_in_training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(11, 3)
    y = torch.randint(0, 2, (11,))
    stats = training_step(
        model, x, y, "binary-cross-entropy", [parse_reg("none")], torch.Generator()
    )
    with torch.no_grad():
        right = int(((model(x).reshape(-1) > 0).long() == y).sum())
    assert (stats.correct, stats.counted) == (right, 11)
    assert evaluate(model, x, y, "binary-cross-entropy")["accuracy"] == pytest.approx(right / 11)
    # gn-trace samples labels 0/1 from sigmoid(z) for binary cross-entropy
    y_hat = parse_reg("gn-trace").sample_labels(model(x), "binary-cross-entropy", torch.Generator())
    assert set(y_hat.unique().tolist()) <= {0.0, 1.0}


def test_label_noise_per_labelled_position_keeps_the_padding():
    y = torch.randint(0, 5, (40, 6), generator=torch.Generator().manual_seed(1))
    y[::3, 4:] = IGNORE_INDEX
    noisy = apply_label_noise(y, 0.25, 5, seed=0)
    labelled = y != IGNORE_INDEX
    assert torch.equal(noisy[~labelled], y[~labelled])  # -100 stays
    changed = noisy != y
    assert int(changed.sum()) == round(0.25 * int(labelled.sum()))  # each to another class
    assert int(noisy[labelled].min()) >= 0 and int(noisy[labelled].max()) < 5
    # one label per sample: the draws are those of a flat index over the samples
    flat = torch.arange(20) % 5
    g = torch.Generator().manual_seed(7919)
    idx = torch.randperm(20, generator=g)[:5]
    expected = flat.clone()
    expected[idx] = (flat[idx] + torch.randint(1, 5, (5,), generator=g)) % 5
    assert torch.equal(apply_label_noise(flat, 0.25, 5, seed=0), expected)


def test_gn_trace_is_unbiased_for_binary_cross_entropy(monkeypatch):
    """One logit per sample: labels drawn from Bernoulli(sigmoid(z)); the expectation over all
    2^B draws is sigma2 tr(G), tr(G) = (1/B) sum_i s_i (1 - s_i) ||grad_theta z_i||^2."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    model = model.double()
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0])
    s = torch.sigmoid(model(x).detach().reshape(-1))
    exact = 0.0
    for i in range(4):
        grads = torch.autograd.grad(model(x[i : i + 1]).sum(), list(model.parameters()))
        exact += float(s[i] * (1 - s[i]) * sum((g * g).sum() for g in grads)) / 4
    draws = iter(())
    monkeypatch.setattr(GaussNewtonTrace, "sample_labels", lambda self, *a: next(draws))
    expectation = 0.0
    for combo in itertools.product((0.0, 1.0), repeat=4):
        y_hat = torch.tensor(combo, dtype=torch.float64).reshape(4, 1)
        prob = float(torch.where(y_hat.reshape(-1) > 0, s, 1 - s).prod())
        draws = iter([y_hat])
        regs = [parse_reg("gn-trace:sigma2=1")]
        stats = training_step(model, x, y, "binary-cross-entropy", regs, torch.Generator())
        expectation += prob * stats.penalties["gn-trace"]
    assert expectation == pytest.approx(exact, rel=1e-10)


def test_a_one_logit_model_trains_with_binary_cross_entropy(tmp_path, monkeypatch):
    """The loss follows the model's outputs, as in the analyses: one logit per sample and 0/1
    labels train with binary cross-entropy (refused as a 1-class cross-entropy before), and
    the accuracy is the logit's sign against the label."""
    from safetensors.torch import load_file, save_file

    (tmp_path / "one_logit.py").write_text(
        "from torch import nn\n\n\ndef build():\n"
        "    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "one_logit", raising=False)
    x = torch.randn(60, 3, generator=torch.Generator().manual_seed(2))
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    save_file({"x": x, "y": y}, str(tmp_path / "binary.safetensors"))
    cfg = TrainConfig(
        model_factory="one_logit:build",
        data=str(tmp_path / "binary.safetensors"),
        epochs=5,
        batch_size=10,
        lr=0.1,
    )
    out = tmp_path / "binary-model.safetensors"
    result = train(cfg, out)
    assert result.config["loss"] == "binary-cross-entropy"
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model.load_state_dict(load_file(str(out)))
    with torch.no_grad():
        z = model(x).reshape(-1)
    assert result.final["train_accuracy"] == pytest.approx(
        float(((z > 0).long() == y).double().mean())
    )
    assert result.final["train_loss"] == pytest.approx(
        float(F.binary_cross_entropy_with_logits(z, y.float())), rel=1e-5
    )
    assert result.final["train_accuracy"] > 0.8


def test_sweep_trains_and_analyses_a_causal_lm(tmp_path, lm_data, capsys, monkeypatch):
    from cli_helpers import run_cli

    monkeypatch.chdir(tmp_path)
    run = run_cli(
        capsys,
        "sweep",
        "--reg",
        "ad",
        "--grid",
        "sigma=0.0,0.5",
        "--model-factory",
        "causal_lm:build",
        "--data",
        lm_data,
        "--set",
        "epochs=2",
        "--metrics",
        "eigen",
        "--out-dir",
        tmp_path / "sweep",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    runs = run.json()["results"]["runs"]
    assert [r["sigma"] for r in runs] == [0.0, 0.5]
    for r in runs:
        assert math.isfinite(r["lambda_max"]) and r["lambda_max"] > 0
        # accuracy over the 48 * 4 - 2 - 3 labelled positions
        assert round(r["train_accuracy"] * 187, 9) == round(r["train_accuracy"] * 187)
