"""The manipulation paper's interventions as train options: fixed masks (Table 1), repeated batches
(Table 2), per-sample mean-variance normalisation (5.1), a final noisy epoch (Table 4)."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import run_cli
from safetensors.torch import load_file

from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.models import build_model, default_model_args
from sharpcli.models.manipulations import FeatureMask, HeStandardizedWeight, PerSampleNorm

DATA = "blobs:n=200,dim=6,classes=3"


def test_fixed_mask_gives_exact_death_frequency_and_survives_training(tmp_path, capsys):
    out = tmp_path / "masked.safetensors"
    run = run_cli(
        capsys,
        "train",
        "--epochs",
        "2",
        "--data",
        DATA,
        "--width",
        "20",
        "--mask-ratio",
        "0.6",
        "--out",
        out,
        "--quiet",
    )
    assert run.code == 0, run.err
    ckpt = load_checkpoint(out)
    masks = {n: m.mask for n, m in ckpt.model.named_modules() if isinstance(m, FeatureMask)}
    assert len(masks) == 2
    fresh = build_model(
        ckpt.model_spec
    )  # the masks are a function of the spec (seeded), fixed in training
    for name, module in fresh.named_modules():
        if isinstance(module, FeatureMask):
            assert torch.equal(module.mask, masks[name])
    stats = run_cli(capsys, "activation-stats", out, "--json", "-").json()["results"]["layers"]
    for layer, mask in zip(stats, masks.values()):
        assert layer["death_frequency"] == pytest.approx(
            int((mask == 0).sum()) / mask.numel(), abs=1e-12
        )


def test_per_sample_norm_fixes_activation_and_weight_statistics():
    x = torch.randn(5, 3, 4, 4, dtype=torch.float64) * 7 + 3
    y = PerSampleNorm()(x)
    assert torch.allclose(y.mean(dim=(1, 2, 3)), torch.zeros(5, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(
        y.var(dim=(1, 2, 3), unbiased=False), torch.ones(5, dtype=torch.float64), atol=1e-5
    )
    w = HeStandardizedWeight(fan_in=8)(torch.randn(10, 8, dtype=torch.float64) * 5 + 1)
    assert float(w.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(w.pow(2).mean()) == pytest.approx(2 / 8, rel=1e-6)
    spec = {
        "name": "mlp",
        "args": default_model_args("mlp", (6,), 3, width=12, per_sample_norm=True),
    }
    model = build_model(spec).double().eval()
    inputs = torch.randn(4, 6, dtype=torch.float64)
    before = model(inputs)
    with torch.no_grad():  # the norms are fixed: scaling the raw weights changes nothing
        for name, p in model.named_parameters():
            if name.endswith("original"):
                p.mul_(3.7)
    assert torch.allclose(model(inputs), before, atol=1e-10)


def test_repeat_batch_and_noise_finetune(tmp_path, capsys):
    base = ["train", "--data", DATA, "--width", "8", "--epochs", "2", "--quiet"]
    once = run_cli(capsys, *base, "--out", tmp_path / "a.safetensors", "--json", "-").json()[
        "results"
    ]["history"]
    twice = run_cli(
        capsys, *base, "--repeat-batch", "3", "--out", tmp_path / "b.safetensors", "--json", "-"
    ).json()["results"]["history"]
    assert [r["grad_evals"] for r in twice] == [3 * r["grad_evals"] for r in once]
    noisy = run_cli(
        capsys, *base, "--noise-finetune", "0.5", "--out", tmp_path / "c.safetensors", "--json", "-"
    )
    rows = noisy.json()["results"]["history"]
    assert [r["noise_finetune"] for r in rows] == [False, False, True]
    # the first two epochs are the plain run's, bit for bit
    part = run_cli(
        capsys,
        *base,
        "--noise-finetune",
        "0.5",
        "--stop-after",
        "2",
        "--out",
        tmp_path / "d.safetensors",
    )
    assert part.code == 0, part.err
    a, d = load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "d.safetensors"))
    assert all(torch.equal(a[k], d[k]) for k in a)
    # the third epoch differs from a plain third epoch (same batches, same lr) only by the input noise
    plain = run_cli(
        capsys, *base[:-3], "--epochs", "3", "--quiet", "--out", tmp_path / "e.safetensors"
    )
    assert plain.code == 0, plain.err
    c, e = load_file(str(tmp_path / "c.safetensors")), load_file(str(tmp_path / "e.safetensors"))
    assert not all(torch.equal(c[k], e[k]) for k in c)
