"""A training run that collapses is flagged: warning line, ``results.diverged``, and with
``--stop-on-divergence`` (or its first spelling, ``--stop-diverged``) exit 3 with the best
epoch's weights in the checkpoint.

Before, ``fa`` on the built-in CNN with 900 training images went from loss 1.31 to 47.6 in one
epoch and ended at 11-45 % test accuracy with exit 0 and nothing said.
"""

from __future__ import annotations

import pytest
import torch
from cli_helpers import run_cli

from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.report.envelope import validate_report
from sharpcli.training.divergence import divergence

# SGD at lr 1 on these blobs: loss 1.30, 0.62 (epoch 2, the best), 1.14, 2.00, 3.70 (epoch 5)
UNSTABLE = ("--data", "blobs:n=300", "--width", "16", "--lr", "1", "--quiet")


def _rows(losses, accuracies=None):
    accuracies = accuracies or [None] * len(losses)
    return [
        {"epoch": i + 1, "train_loss": loss, "train_accuracy": acc}
        for i, (loss, acc) in enumerate(zip(losses, accuracies))
    ]


def test_the_rule_on_histories():
    collapsed = divergence(_rows([2.0, 1.5, 1.31, 47.6, 3.0]), num_classes=10)
    assert collapsed["epoch"] == 4 and collapsed["best_epoch"] == 3
    assert collapsed["best_train_loss"] == 1.31 and "47.6" in collapsed["reason"]
    # a well-trained net whose tiny loss wobbles by 5x stays below its first epoch's loss
    assert divergence(_rows([1.2, 0.01, 0.002, 0.011, 0.004]), num_classes=10) is None
    # back at chance (10 classes: at most 0.19) after reaching 0.55 or more
    fallen = divergence(_rows([2.0, 1.0, 2.2], [0.3, 0.8, 0.12]), num_classes=10)
    assert fallen["epoch"] == 3 and "chance" in fallen["reason"]
    assert divergence(_rows([2.0, 1.9, 2.1], [0.15, 0.4, 0.12]), num_classes=10) is None
    assert divergence(_rows([2.0, 1.0, 2.2], [0.3, 0.8, 0.12])) is None  # regression: no chance
    assert divergence([]) is None and divergence(_rows([5.0])) is None


def test_a_diverging_run_is_flagged_and_keeps_exit_0(tmp_path, capsys):
    run = run_cli(
        capsys, "train", *UNSTABLE, "--epochs", "6", "--out", str(tmp_path / "m.safetensors"),
        "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    validate_report(run.json())
    results = run.json()["results"]
    assert results["diverged"] is True and results["stopped_on_divergence"] is False
    assert results["divergence"]["epoch"] == 5 and results["divergence"]["best_epoch"] == 2
    assert "sharp train: warning: training diverged at epoch 5" in run.err
    assert "--stop-on-divergence stops such a run" in run.err
    assert len(results["history"]) == 6


@pytest.mark.parametrize("flag", ["--stop-on-divergence", "--stop-diverged"])
def test_stop_on_divergence_exits_3_with_the_best_epoch(tmp_path, capsys, flag):
    out = tmp_path / "m.safetensors"
    run = run_cli(
        capsys, "train", *UNSTABLE, "--epochs", "8", flag, "--out", str(out),
        "--json", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert run.code == 3, run.err
    assert "stopped;" in run.err and "holds epoch 2" in run.err
    import json

    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert results["diverged"] and results["stopped_on_divergence"]
    assert len(results["history"]) == 5  # stopped at the diverged epoch
    # the checkpoint holds epoch 2's weights: those of the same run trained for 2 epochs
    two = tmp_path / "two.safetensors"
    assert run_cli(capsys, "train", *UNSTABLE, "--epochs", "2", "--out", str(two)).code == 0
    kept, reference = load_checkpoint(out).model, load_checkpoint(two).model
    for (name, a), (_, b) in zip(kept.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    assert results["final"]["train_loss"] < 1.0  # the best epoch's, not the collapsed one's


def test_a_stable_run_is_not_flagged(tmp_path, capsys):
    run = run_cli(
        capsys, "train", "--data", "blobs:n=300", "--width", "16", "--epochs", "3",
        "--stop-on-divergence", "--out", str(tmp_path / "m.safetensors"), "--json", "-", "--quiet",
    )  # fmt: skip
    assert run.code == 0, run.err
    results = run.json()["results"]
    assert results["diverged"] is False and results["divergence"] is None
    assert "warning" not in run.err
