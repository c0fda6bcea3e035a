"""``sharp train --precision``: autocast steps against float32 ones, the fp16 GradScaler's skipped
steps, and what the report, the checkpoint and ``--resume`` record (sharpcli.training.precision).
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import run_cli

from sharpcli.regularizers.registry import parse_regs
from sharpcli.regularizers.step import training_step
from sharpcli.training.precision import MixedPrecision

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def _model_and_batch(seed: int = 0):
    """A GELU MLP (smooth: no ReLU kink for a rounding to cross) and a batch of 32."""
    from sharpcli.models import build_model, default_model_args

    torch.manual_seed(seed)
    spec = {
        "name": "mlp",
        "args": default_model_args("mlp", (8,), 3, width=16, depth=2, activation="gelu"),
    }
    model = build_model(spec).train()
    gen = torch.Generator().manual_seed(seed + 1)
    return model, torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)


def _update(precision: str, regs: list[str], *, scale: float | None = None):
    """The weights' change of one SGD step (lr 0.1) under ``precision``, the step's stats and
    whether it moved the weights; ``scale`` forces the fp16 loss scale."""
    model, x, y = _model_and_batch()
    amp = MixedPrecision(precision, torch.device("cpu"), torch.float32)
    if scale is not None:
        amp.scaler.load_state_dict(amp.scaler.state_dict() | {"scale": scale})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    loss_scale = amp.loss_scale()
    stats = training_step(
        model,
        x,
        y,
        "cross-entropy",
        parse_regs(regs),
        torch.Generator().manual_seed(5),
        autocast_dtype=amp.autocast_dtype,
        loss_scale=loss_scale,
    )
    stepped = amp.step(optimizer, loss_scale)
    change = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)])
    return change, stats, stepped, amp


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("regs", [["none"], ["sam"], ["usam:rho=0.5"], ["gp:rho=0.1,p=2"]])
def test_autocast_update_equals_float32_within_its_precision(precision, regs):
    # usam steps rho g: from a gradient still scaled by S (2^16 under fp16) it would be off by S
    reference, ref_stats, _, _ = _update("fp32", regs)
    change, stats, stepped, amp = _update(precision, regs)
    assert stepped and amp.skipped_steps == 0
    error = float((change - reference).norm() / reference.norm())
    # a few roundings of the autocast dtype through two layers, not float32's 6e-8
    assert 0 < error < 8 * UNIT_ROUNDOFF[precision], error
    assert stats.loss == pytest.approx(ref_stats.loss, rel=8 * UNIT_ROUNDOFF[precision])
    assert stats.grad_evals == ref_stats.grad_evals  # the same passes
    for name, value in ref_stats.penalties.items():  # computed in float32 from float32 grads
        assert stats.penalties[name] == pytest.approx(value, rel=16 * UNIT_ROUNDOFF[precision])


@pytest.mark.parametrize("regs", [["none"], ["sam"]])
def test_fp16_overflowing_scale_skips_the_step_and_halves_the_scale(regs):
    # S = 2^60: the gradient reaching the float16 activations overflows to inf
    change, stats, stepped, amp = _update("fp16", regs, scale=2.0**60)
    assert not stepped and amp.skipped_steps == 1
    assert torch.count_nonzero(change) == 0  # the weights unchanged
    assert amp.loss_scale() == 2.0**59  # backed off, as torch's GradScaler does
    assert stats.grad_evals == 1  # sam's ascent pass not taken from an inf gradient


def test_gradscaler_step_with_an_injected_inf_is_skipped_and_a_finite_one_is_exact():
    model, _, _ = _model_and_batch()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.5)
    amp = MixedPrecision("fp16", torch.device("cpu"), torch.float32)
    scale = amp.loss_scale()
    grads = [torch.full_like(p, 0.25) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    params[1].grad[0] = float("inf")
    before = [p.detach().clone() for p in params]
    assert amp.step(optimizer, scale) is False
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert (amp.skipped_steps, amp.loss_scale()) == (1, scale / 2)
    for p, g in zip(params, grads):  # p.grad holds the unscaled gradient, as training_step leaves
        p.grad = g.clone()
    assert amp.step(optimizer, amp.loss_scale()) is True
    assert all(torch.equal(p, b - 0.5 * 0.25) for p, b in zip(params, before))
    assert amp.record()["skipped_steps"] == 1


TRAIN = "train --data blobs:n=60,dim=6,classes=3 --epochs 1 --batch-size 20 --json - --quiet"


def test_train_records_the_precision_in_report_and_checkpoint(tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "m.safetensors"
    run = run_cli(capsys, *TRAIN.split(), "--reg", "sam", "--precision", "fp16", "--out", out)
    assert run.code == 0, run.err
    results = run.json()["results"]
    assert results["precision"] == {
        "precision": "fp16",
        "autocast": "float16",
        "penalties": "float32",
        "loss_scale": 65536.0,
        "skipped_steps": 0,
    }
    assert results["history"][0]["skipped_steps"] == results["final"]["skipped_steps"] == 0
    assert results["data_parallel"] is None
    with safe_open(str(out), "pt") as handle:
        train = json.loads(handle.metadata()["sharpcli.train"])
    assert (train["precision"], train["ascent_sync"]) == ("fp16", "per-replica")


def test_mixed_precision_with_float64_is_one_line_exit_2(capsys):
    run = run_cli(capsys, *TRAIN.split(), "--precision", "bf16", "--dtype", "float64")
    assert run.code == 2
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and "--precision" in lines[0] and "float64" in lines[0], run.err


def test_resume_of_a_state_saved_before_the_options(tmp_path):
    """A state written before ``precision`` and ``ascent_sync`` existed resumes as fp32,
    per-replica (what those runs did)."""
    from sharpcli.training.config import TrainConfig
    from sharpcli.training.resume import _check_same_identity

    cfg = TrainConfig(epochs=2)
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("precision", "ascent_sync")}
    _check_same_identity(cfg, {"config": old, "epoch": 1})
    from sharpcli.errors import UsageError

    with pytest.raises(UsageError, match="precision"):
        _check_same_identity(TrainConfig(epochs=2, precision="bf16"), {"config": old, "epoch": 1})


def test_fp16_resume_restores_the_loss_scale_bit_for_bit(tmp_path, monkeypatch):
    """A start at S = 2^30 overflows the float16 backward for the first steps: the scaler skips
    them, halving S, across the interruption. Resumed after epoch 2, the run continues from the
    saved scale and skip count and ends with the uninterrupted run's weights, bit for bit."""
    import functools

    from safetensors.torch import load_file

    from sharpcli.training.loop import TrainConfig, train

    monkeypatch.setattr(
        torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**30)
    )

    def config():
        return TrainConfig(
            data="blobs:n=64,dim=6,classes=3", epochs=4, batch_size=8, precision="fp16"
        )

    whole = train(config(), tmp_path / "whole.safetensors")
    train(config(), tmp_path / "parts.safetensors", stop_after=2)
    parts = train(config(), tmp_path / "parts.safetensors", resume=True)
    assert whole.precision == parts.precision
    skipped = whole.precision["skipped_steps"]
    assert 2 * 6 < skipped < 4 * 6  # some skipped before the interruption, and not all after
    assert [row["skipped_steps"] for row in whole.history] == [6, 6, skipped - 12, 0]
    a, b = (
        load_file(str(tmp_path / "whole.safetensors")),
        load_file(str(tmp_path / "parts.safetensors")),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
