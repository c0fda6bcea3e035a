"""sharp train: checkpoints that rebuild their model, resume bit for bit, history, errors."""

from __future__ import annotations

import csv

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from safetensors.torch import load_file

from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.io.data.loading import load_dataset
from sharpcli.report.envelope import validate_report


def test_train_writes_checkpoint_that_rebuilds_identical_logits(tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    run = run_cli(capsys, "train", "--epochs", "2", "--out", out, "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    assert report["command"] == "train"
    assert [r["epoch"] for r in report["results"]["history"]] == [1, 2]
    assert report["results"]["final"]["train_accuracy"] > 0.5  # blobs are learnable in 2 epochs
    ckpt = load_checkpoint(out)
    assert (
        ckpt.sha256 == report["results"]["checkpoint"]["sha256"] == report["checkpoint"]["sha256"]
    )
    assert ckpt.train_config["seed"] == 0 and ckpt.train_config["regs"] == ["none"]
    data = load_dataset(ckpt.data_spec)
    x, _ = data.split("test")
    # the logits of the rebuilt model equal those of a model loaded from the raw tensors
    state = load_file(str(out))
    from sharpcli.models import build_model

    twin = build_model(ckpt.model_spec)
    twin.load_state_dict(state)
    ckpt.model.eval(), twin.eval()
    assert torch.equal(ckpt.model(x), twin(x))
    # history CSV mirrors the JSON history
    rows = list(csv.DictReader(open(report["results"]["history_csv"])))
    assert [float(r["train_loss"]) for r in rows] == pytest.approx(
        [h["train_loss"] for h in report["results"]["history"]], rel=1e-12
    )


def test_resume_after_interruption_is_bit_for_bit(tmp_path, capsys):
    common = [
        "train",
        "--epochs",
        "4",
        "--schedule",
        "cosine",
        "--reg",
        "dropout:p=0.2",
        "--seed",
        "3",
        "--quiet",
    ]
    full, part = tmp_path / "full.safetensors", tmp_path / "part.safetensors"
    assert run_cli(capsys, *common, "--out", full).code == 0
    assert run_cli(capsys, *common, "--out", part, "--stop-after", "2").code == 0
    resumed = run_cli(capsys, *common, "--out", part, "--resume", "--json", "-")
    assert resumed.code == 0, resumed.err
    assert resumed.json()["results"]["resumed_from_epoch"] == 2
    a, b = load_file(str(full)), load_file(str(part))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_with_other_settings_is_refused(tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    assert (
        run_cli(capsys, "train", "--epochs", "2", "--stop-after", "1", "--out", out, "--quiet").code
        == 0
    )
    run = run_cli(capsys, "train", "--epochs", "2", "--lr", "0.2", "--out", out, "--resume")
    assert_one_line_error(run, 2, "--resume", "lr")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--optimizer", "lion"], "--optimizer"),
        (["--schedule", "step"], "--schedule"),
        (["--epochs", "0"], "--epochs"),
        (["--reg", "nosuchreg"], "--reg"),
        (["--data", "missing-file.csv"], "missing-file.csv"),
        (["--model", "transformer"], "transformer"),
        (["--lr", "-1"], "--lr"),
        (["--label-noise", "1.5"], "--label-noise"),
    ],
)
def test_bad_train_input_exits_2_and_leaves_existing_out_untouched(tmp_path, capsys, args, needle):
    out = tmp_path / "keep.safetensors"
    out.write_bytes(b"precious")
    run = run_cli(capsys, "train", "--epochs", "1", "--out", out, *args)
    assert_one_line_error(run, 2, needle)
    assert out.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.safetensors"]


def test_json_error_object(tmp_path, capsys):
    run = run_cli(capsys, "train", "--data", tmp_path / "nope.npz", "--json", "-")
    assert run.code == 2
    doc = run.json()
    validate_report(doc)  # error documents are part of the schema too
    assert doc["error"]["type"] == "input" and "nope.npz" in doc["error"]["message"]
    assert doc["error"]["exit_code"] == 2


def test_label_noise_flips_exact_fraction():
    from sharpcli.training.loop import apply_label_noise

    y = torch.arange(1000) % 10
    noisy = apply_label_noise(y, 0.3, 10, seed=0)
    assert int((noisy != y).sum()) == 300
    assert int(noisy.min()) >= 0 and int(noisy.max()) <= 9


def test_augment_images_crop_and_flip_preserve_content():
    from sharpcli.training.loop import augment_images

    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8)
    g = torch.Generator().manual_seed(0)
    y = augment_images(x, g)
    assert y.shape == x.shape
    # every output pixel is either zero padding or a pixel of the same sample and channel
    for i in range(2):
        for c in range(3):
            vals = set(y[i, c].flatten().tolist()) - {0.0}
            assert vals <= set(x[i, c].flatten().tolist())


def test_tracked_curvature_in_history_json_and_csv_without_changing_training(tmp_path, capsys):
    base = [
        "train",
        "--epochs",
        "2",
        "--data",
        "blobs:n=200,dim=6,classes=3",
        "--width",
        "8",
        "--quiet",
    ]
    tracked, plain = tmp_path / "tracked.safetensors", tmp_path / "plain.safetensors"
    run = run_cli(
        capsys,
        *base,
        "--out",
        tracked,
        "--track",
        "eigen,trace,gn-nme",
        "--track-samples",
        "64",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    history = run.json()["results"]["history"]
    for row in history:
        t = row["tracked"]
        assert t["lambda_max"] > 0 and t["trace"] > 0
        assert t["nme_share"] == pytest.approx(
            t["nme_trace"] / (t["ggn_trace"] + t["nme_trace"]), rel=1e-5
        )
    rows = list(csv.DictReader(open(run.json()["results"]["history_csv"])))
    assert [float(r["tracked.lambda_max"]) for r in rows] == pytest.approx(
        [h["tracked"]["lambda_max"] for h in history]
    )
    assert run_cli(capsys, *base, "--out", plain).code == 0
    a, b = load_file(str(tracked)), load_file(str(plain))
    assert all(torch.equal(a[k], b[k]) for k in a)
    bad = run_cli(capsys, *base, "--out", plain, "--track", "vibes")
    assert_one_line_error(bad, 2, "--track")


def test_track_every_k_tracks_every_kth_and_the_last_epoch(tmp_path, capsys):
    run = run_cli(
        capsys,
        "train",
        "--epochs",
        "5",
        "--data",
        "blobs:n=120,dim=6,classes=3",
        "--width",
        "8",
        "--quiet",
        "--out",
        tmp_path / "m.safetensors",
        "--track",
        "trace",
        "--track-every",
        "2",
        "--track-samples",
        "32",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    history = run.json()["results"]["history"]
    assert [row["epoch"] for row in history if row.get("tracked")] == [2, 4, 5]
    assert all(row["tracked"]["trace"] > 0 for row in history if row.get("tracked"))
    rows = list(csv.DictReader(open(run.json()["results"]["history_csv"])))
    assert [r["tracked.trace"] != "" for r in rows] == [False, True, False, True, True]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--optimizer", "adamw:beta3=0.9"), ("--optimizer", "unknown parameter 'beta3'")),
        (("--track-every", "10minutes"), ("--track-every", "Nsteps")),
        (("--batch-size", "half"), ("--batch-size", "'full'")),
        (("--track-on", "test"), ("--track-on", "subset")),
        (("--steps", "0"), ("--steps", "at least 1")),
        (("--track", "preconditioned", "--optimizer", "sgd"), ("--track", "adaptive optimizer")),
    ],
)
def test_bad_per_step_training_options_are_exit_2_in_one_line_and_write_nothing(
    args, words, tmp_path, capsys
):
    """The edge-of-stability options: refused in one line naming the option, before any
    checkpoint is written (the tracked quantity that needs Adam is refused before training)."""
    out = tmp_path / "m.safetensors"
    run = run_cli(
        capsys, "train", "--data", "blobs:n=64", "--epochs", "1", "--out", str(out), *args
    )
    assert_one_line_error(run, 2, *words)
    assert list(tmp_path.iterdir()) == []
