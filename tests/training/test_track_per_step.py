"""Training that can show the edge of stability, and curvature tracked per optimizer step.

``--track-every Nsteps`` records one row per tracked step (``results.tracked``, the CSV beside
the checkpoint) from ONE curvature engine and ONE StepContext kept for the run; tracking,
on the fixed subset or on each step's batch, leaves the trajectory as it is and an
interrupted run resumes bit for bit. Runs count steps (``--steps``, the last epoch partial),
warm up linearly, follow the cosine per step and train full-batch; the optimizers are
torch's own with the spec's hyper-parameters. A tanh MLP under MSE on one-hot targets,
trained by full-batch gradient descent, settles lambda_max at 2/lr ([Cohen2021]).
"""

from __future__ import annotations

import math

import pytest
import torch
from png_helpers import png_size
from torch import nn

from sharpcli.analyses.tracking import RunTracker
from sharpcli.errors import UsageError
from sharpcli.losses import get_loss
from sharpcli.report.plots import _threshold_pairs, plot_training_history
from sharpcli.training.config import TrainConfig
from sharpcli.training.epochs import _make_optimizer
from sharpcli.training.loop import train

SMALL = "blobs:n=96,dim=4,classes=3"


def _cfg(**kw) -> TrainConfig:
    base = dict(data=SMALL, model_args={"width": 8, "depth": 1}, epochs=2, batch_size=32, seed=3)
    return TrainConfig(**{**base, **kw})


def _weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _same_weights(a, b) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_per_step_rows_each_step_and_tracking_leaves_the_trajectory(tmp_path):
    plain = train(_cfg(), tmp_path / "plain.safetensors")
    for track_on in ("subset", "batch"):
        out = tmp_path / f"{track_on}.safetensors"
        cfg = _cfg(track=["eigen"], track_every="2steps", track_on=track_on)
        result = train(cfg, out, tracker=RunTracker(["eigen"], seed=3))
        assert _same_weights(out, tmp_path / "plain.safetensors"), track_on
        assert [r["step"] for r in result.tracked] == [2, 4, 6]  # 3 batches of 32, 2 epochs
        assert [r["epoch"] for r in result.tracked] == [1, 2, 2]
        keys = {"step", "epoch", "lr", "lambda_max", "lambda_max_threshold", "matvecs"}
        assert all(set(r) == keys for r in result.tracked)
        assert all(r["matvecs"] > 0 for r in result.tracked)
        # the run's optimizer reached the quantity: heavy ball's (2 + 2 mu) / lr
        assert all(
            r["lambda_max_threshold"] == pytest.approx((2 + 2 * 0.9) / 0.05, rel=1e-12)
            for r in result.tracked
        )
        assert all("tracked" not in row for row in result.history)
        assert (tmp_path / f"{track_on}.tracked.csv").read_text().splitlines()[0] == (
            "step,epoch,lr,lambda_max,lambda_max_threshold,matvecs"
        )
    assert plain.tracked == [] and plain.tracked_csv is None


def test_epoch_tracking_keeps_its_history_rows_and_adds_the_tracked_list(tmp_path):
    cfg = _cfg(track=["eigen"], track_every=1)
    result = train(cfg, tmp_path / "m.safetensors", tracker=RunTracker(["eigen"], seed=3))
    keys = {"lambda_max", "lambda_max_threshold"}
    assert [set(row["tracked"]) for row in result.history] == [keys] * 2
    assert [r["step"] for r in result.tracked] == [3, 6]
    assert [r["lambda_max"] for r in result.tracked] == [
        row["tracked"]["lambda_max"] for row in result.history
    ]


def test_an_interrupted_run_with_per_step_tracking_resumes_bit_for_bit(tmp_path):
    def run(out, **kw):
        cfg = _cfg(epochs=3, track=["eigen"], track_every="1steps")
        return train(cfg, out, tracker=RunTracker(["eigen"], seed=3), **kw)

    whole = run(tmp_path / "whole.safetensors")
    run(tmp_path / "cut.safetensors", stop_after=1)
    resumed = run(tmp_path / "cut.safetensors", resume=True)
    assert _same_weights(tmp_path / "whole.safetensors", tmp_path / "cut.safetensors")
    assert [r["step"] for r in resumed.tracked] == list(range(1, 10))
    assert [r["lambda_max"] for r in resumed.tracked] == [r["lambda_max"] for r in whole.tracked]


def test_one_engine_and_one_step_context_per_run_match_the_dense_hessian():
    """The tracker keeps its engine and context; after the weights move it measures the new
    Hessian (float64 double backward), not the cached graphs of the old weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x = torch.randn(20, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (20,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    tracker = RunTracker(["eigen"], seed=0)
    engines, contexts = set(), set()
    for step in (1, 2):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        values = tracker(
            model, x, y, "cross-entropy", optimizer=optimizer, step=step, batch_size=20
        )
        engines.add(id(tracker.engine))
        contexts.add(id(tracker.context))
        assert tracker.context.optimizer is optimizer and tracker.context.step == step
        assert tracker.context.batch_size == 20
        assert values["lambda_max"] == pytest.approx(_dense_lambda_max(model, x, y), rel=1e-6)
    assert len(engines) == 1 and len(contexts) == 1


def _dense_lambda_max(model, x, y) -> float:
    params = list(model.parameters())
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, create_graph=True)])
    rows = []
    for i in range(grads.numel()):
        row = torch.autograd.grad(grads[i], params, retain_graph=True)
        rows.append(torch.cat([r.reshape(-1) for r in row]))
    return float(torch.linalg.eigvalsh(torch.stack(rows))[-1])


def test_steps_end_the_last_epoch_partially_and_full_batch_takes_one_step(tmp_path):
    result = train(_cfg(steps=7), tmp_path / "steps.safetensors")
    assert [row["grad_evals"] for row in result.history] == [3, 3, 1]
    assert result.config["epochs"] == 3
    full = train(_cfg(batch_size="full", epochs=3), tmp_path / "full.safetensors")
    assert [row["grad_evals"] for row in full.history] == [1, 1, 1]
    beyond = train(_cfg(batch_size=10_000, epochs=3), tmp_path / "beyond.safetensors")
    assert _same_weights(tmp_path / "full.safetensors", tmp_path / "beyond.safetensors")
    assert [row["grad_evals"] for row in beyond.history] == [1, 1, 1]


def test_warmup_and_the_cosine_per_step_are_in_force_when_a_step_is_tracked(tmp_path):
    cfg = _cfg(steps=8, warmup=3, schedule="cosine", lr=0.2, track=["eigen"])
    cfg.track_every = "1steps"
    result = train(cfg, tmp_path / "m.safetensors", tracker=RunTracker(["eigen"]))
    for row in result.tracked:
        t = row["step"] - 1  # the rate of the step just taken
        want = 0.2 * 0.5 * (1 + math.cos(math.pi * t / 8)) * min(1.0, (t + 1) / 3)
        assert row["lr"] == pytest.approx(want, rel=1e-12), row["step"]
        # the threshold read that step's rate from the optimizer: (2 + 2 mu) / lr
        assert row["lambda_max_threshold"] == pytest.approx(3.8 / want, rel=1e-12)


@pytest.mark.parametrize(
    ("spec", "kind", "group"),
    [
        ("adamw:weight_decay=0.05,beta2=0.99", torch.optim.AdamW, {"betas": (0.9, 0.99)}),
        ("adam:eps=1e-6", torch.optim.Adam, {"eps": 1e-6, "weight_decay": 0.0}),
        ("rmsprop:alpha=0.9,momentum=0.5", torch.optim.RMSprop, {"alpha": 0.9, "momentum": 0.5}),
        ("sgd:nesterov=1", torch.optim.SGD, {"nesterov": True, "momentum": 0.9}),
        ("adamw", torch.optim.AdamW, {"weight_decay": 0.01}),  # torch's own default
    ],
)
def test_an_optimizer_spec_builds_torchs_class_with_its_hyper_parameters(spec, kind, group):
    optimizer = _make_optimizer(_cfg(optimizer=spec), nn.Linear(2, 2))
    assert type(optimizer) is kind
    for key, value in group.items():
        assert optimizer.param_groups[0][key] == value, key


@pytest.mark.parametrize(
    ("options", "source", "words"),
    [
        ({"optimizer": "adamw:beta3=0.9"}, "optimizer", "unknown parameter 'beta3'"),
        ({"optimizer": "lion"}, "optimizer", "accepted: sgd, adam, adamw, rmsprop"),
        ({"optimizer": "adam:beta1=1"}, "optimizer", "beta1 must be < 1"),
        ({"optimizer": "sgd:nesterov=1", "momentum": 0.0}, "optimizer", "momentum > 0"),
        ({"track_every": "10 minutes"}, "track_every", "Nsteps"),
        ({"track_every": "0steps"}, "track_every", "N >= 1"),
        ({"batch_size": "half"}, "batch_size", "'full'"),
        ({"track_on": "test"}, "track_on", "subset, batch"),
        ({"steps": 0}, "steps", "at least 1"),
        ({"warmup": -1}, "warmup", ">= 0"),
    ],
)
def test_bad_training_settings_are_refused_naming_the_setting(options, source, words, tmp_path):
    with pytest.raises(UsageError) as err:
        train(_cfg(**options), tmp_path / "m.safetensors")
    assert err.value.source == source and words in err.value.message


def test_mse_on_class_labels_regresses_one_hot_rows():
    z = torch.randn(6, 4, dtype=torch.float64)
    y = torch.tensor([0, 3, 1, 2, 2, 0])
    loss = get_loss("mse")
    onehot = torch.eye(4, dtype=torch.float64)[y]
    assert float(loss.mean(z, y)) == pytest.approx(float(((z - onehot) ** 2).mean()), rel=1e-14)
    assert loss.per_sample(z, y).tolist() == pytest.approx(((z - onehot) ** 2).mean(1).tolist())
    right, count = loss.correct(z, y)
    assert (int(right), count) == (int((z.argmax(1) == y).sum()), 6)
    assert loss.problem(z, torch.tensor([0, 4, 1, 2, 2, 0])) is not None  # label 4 of 4 outputs
    assert loss.correct(z, torch.randn(6, 4)) == (0, 0)  # real targets: no accuracy


def test_the_plot_draws_each_quantity_against_its_threshold(tmp_path):
    keys = ["lambda_max", "lambda_max_threshold", "preconditioned_sharpness"]
    keys += ["preconditioned_threshold", "trace"]
    assert _threshold_pairs(keys) == [
        ("lambda_max", "lambda_max_threshold"),
        ("preconditioned_sharpness", "preconditioned_threshold"),
    ]
    history = [{"epoch": 1, "train_loss": 1.0}, {"epoch": 2, "train_loss": 0.5}]
    tracked = [
        {"step": s, "epoch": 1 + s // 3, "lr": 1.0, "lambda_max": 1.9 + 0.01 * s}
        | {"lambda_max_threshold": 2.0, "trace": 5.0}
        for s in range(1, 7)
    ]
    path = plot_training_history(history, tmp_path / "p.png", tracked=tracked)
    assert png_size(path) == (960, 600)


def test_a_tanh_mlp_under_full_batch_gd_settles_lambda_max_at_2_over_lr(tmp_path):
    """[Cohen2021]'s edge of stability, small (docs/reproduce.md runs it at 800 steps): a
    tanh MLP (16-16-16-4) under MSE on one-hot targets, full-batch gradient descent at lr 1.
    lambda_max starts near a quarter of 2/lr, sharpens progressively up to 2/lr and hovers
    there: over the last quarter its mean is within 10% of 2/lr, each value within 25%
    (it oscillates about the threshold; measured 0.95-1.17 x 2/lr, mean 1.07)."""
    lr = 1.0
    cfg = TrainConfig(
        data="blobs:n=640,separation=1",
        model_args={"depth": 3, "width": 16, "activation": "tanh"},
        batch_size="full",
        momentum=0.0,
        lr=lr,
        loss="mse",
        steps=400,
        track=["eigen"],
        track_every="4steps",
    )
    result = train(cfg, tmp_path / "eos.safetensors", tracker=RunTracker(["eigen"]))
    ratios = [r["lambda_max"] * lr / 2 for r in result.tracked]
    last = ratios[-len(ratios) // 4 :]
    assert ratios[0] < 0.6  # well below the threshold at the start: it sharpens
    assert sum(last) / len(last) == pytest.approx(1.0, abs=0.10), [round(v, 3) for v in last]
    assert all(abs(v - 1) < 0.25 for v in last), [round(v, 3) for v in last]


# the edge of stability's network ([Cohen2021]): a tanh MLP 16-16-16-4 under MSE on one-hot
# targets of blobs that are not linearly separable, so that it sharpens instead of memorising
_EOS_DATA = "blobs:n=640,separation=1"
_EOS_MODEL = {"depth": 3, "width": 16, "activation": "tanh"}


def test_full_batch_adam_settles_its_preconditioned_sharpness_at_38_over_lr(tmp_path):
    """[Cohen2022]'s adaptive edge of stability, small (docs/reproduce.md runs lr 0.003 for
    2400 steps): full-batch Adam (beta1 0.9) at lr 0.01 on the network above. The
    preconditioned sharpness lambda_max(P^-1 H), P = diag(sqrt(v_hat) + eps) from Adam's state
    at the step, starts near a fifth of (2 + 2 beta1)/((1 - beta1) lr) = 38/lr, rises to it
    by step ~310 and hovers there: over the last quarter (steps 460-600) its mean is within
    15 % of 38/lr, each value within 30 % (measured: mean 1.00, 0.97-1.03 x 38/lr; seeds 1
    and 2 give means 0.98 and 0.99)."""
    lr = 0.01
    cfg = TrainConfig(
        data=_EOS_DATA,
        model_args=_EOS_MODEL,
        batch_size="full",
        optimizer="adam",
        lr=lr,
        loss="mse",
        steps=600,
        track=["preconditioned"],
        track_every="10steps",
    )
    tracker = RunTracker(["preconditioned"])
    result = train(cfg, tmp_path / "adam.safetensors", tracker=tracker)
    assert [r["step"] for r in result.tracked] == list(range(10, 601, 10))
    # the threshold is Adam's, from its own hyper-parameters: 38/lr at beta1 = 0.9
    assert all(r["preconditioned_threshold"] == pytest.approx(38 / lr) for r in result.tracked)
    ratios = [r["preconditioned_sharpness"] * lr / 38 for r in result.tracked]
    last = ratios[-len(ratios) // 4 :]
    assert ratios[0] < 0.5  # well below the threshold at the start: it sharpens
    assert sum(last) / len(last) == pytest.approx(1.0, abs=0.15), [round(v, 3) for v in last]
    assert all(abs(v - 1) < 0.30 for v in last), [round(v, 3) for v in last]


def test_mini_batch_sgd_settles_its_batch_sharpness_at_2_over_lr(tmp_path):
    """[Andreyev2024]'s edge of stochastic stability, small (docs/reproduce.md runs 3000
    steps): SGD without momentum, batches of 32, lr 2, on the network above. Batch sharpness,
    the mean over the tracked set's mini-batches of g_B^T H_B g_B / ||g_B||^2, starts near
    0.55 x 2/lr (the first ten), reaches 2/lr at step 1240 and hovers about it. The band is
    25 % on the mean of the last quarter (steps 1520-2000), wider than for the full-batch
    runs, because the measure is noisy: each measurement averages 15 batches whose ratios spread (standard
    error 0.01-0.34 x 2/lr) and the trajectory itself is stochastic (measured: mean 0.94,
    0.64-1.59 x 2/lr; seeds 1 and 2 give means 0.84 and 1.06)."""
    lr = 2.0
    cfg = TrainConfig(
        data=_EOS_DATA,
        model_args=_EOS_MODEL,
        batch_size=32,
        momentum=0.0,
        lr=lr,
        loss="mse",
        steps=2000,
        track=["batch-sharpness"],
        track_every="20steps",
    )
    tracker = RunTracker(["batch-sharpness"])
    result = train(cfg, tmp_path / "sgd.safetensors", tracker=tracker)
    assert [r["step"] for r in result.tracked] == list(range(20, 2001, 20))
    # 480 training samples: 15 batches of 32 per measurement, and plain SGD's threshold 2/lr
    assert all(r["batch_sharpness_batches"] == 15 for r in result.tracked)
    assert all(r["batch_sharpness_threshold"] == pytest.approx(2 / lr) for r in result.tracked)
    ratios = [r["batch_sharpness"] * lr / 2 for r in result.tracked]
    last = ratios[-len(ratios) // 4 :]
    assert sum(ratios[:10]) / 10 < 0.75  # below the threshold at the start: it sharpens
    assert sum(last) / len(last) == pytest.approx(1.0, abs=0.25), [round(v, 3) for v in last]
