"""Labels that do not fit the loss are a one-line input error (exit 2), never an internal error.

Found on data written by hand: one-hot rows instead of class indices, as integers (read as
per-position labels ``(N, C)``: the cross-entropy call failed inside torch, exit 4) or as
floats (read as regression targets: ``analyze`` failed counting accuracy, exit 4, and ``eigen``
silently treated them as probability targets).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.cli_helpers import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A ``sharp train`` MLP checkpoint (cross-entropy, 3 classes) and its class labels."""
    from tests.cli_helpers import run_in_process

    folder = tmp_path_factory.mktemp("labels")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    np.savez(folder / "classes.npz", x=x, y=y)
    ckpt = folder / "mlp.safetensors"
    run = run_in_process(
        "train", "--model", "mlp", "--data", str(folder / "classes.npz"), "--epochs", "1",
        "--out", str(ckpt), "--quiet",
    )  # fmt: skip
    assert run.code == 0, run.err
    return folder, ckpt, x, y


def test_one_hot_float_labels_are_probability_targets(classifier, capsys):
    """Float one-hot rows are cross-entropy's probability targets as torch reads them: the
    same loss, so the same eigenvalues, as the class indices."""
    folder, ckpt, x, y = classifier
    np.savez(folder / "onehot_probabilities.npz", x=x, y=np.eye(3)[y].astype(np.float32))
    runs = [
        run_cli(
            capsys,
            "eigen",
            str(ckpt),
            "--data",
            str(folder / name),
            "--dtype",
            "float64",
            "--tol",
            "1e-10",
            "--json",
            "-",
        )
        for name in ("classes.npz", "onehot_probabilities.npz")
    ]
    assert [r.code for r in runs] == [0, 0], runs[1].err
    values = [r.json()["results"]["eigenvalues"] for r in runs]
    assert values[1] == pytest.approx(values[0], rel=1e-8)


@pytest.mark.parametrize("command", ["eigen", "analyze", "trace"])
@pytest.mark.parametrize("encoding, needle", [("int", "labels have shape (60, 3)")])
def test_one_hot_labels_are_an_input_error(classifier, capsys, command, encoding, needle):
    folder, ckpt, x, y = classifier
    one_hot = np.eye(3)[y].astype(np.int64 if encoding == "int" else np.float32)
    data = folder / f"onehot_{encoding}.npz"
    np.savez(data, x=x, y=one_hot)
    run = run_cli(capsys, command, str(ckpt), "--data", str(data), "--quiet")
    assert_one_line_error(run, 2, str(data), needle)
