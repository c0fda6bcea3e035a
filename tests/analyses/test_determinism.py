"""Determinism and numerical failures (issue "Scale and robustness" parts 4 and 5).

- Two ``sharp analyze`` runs with the same seed give identical ``results`` (every probe and
  label draw comes from seeded CPU generators; timing aside).
- A model that is random in analysis mode is refused: dropout/BatchNorm left in training mode
  (``sharpcli.curvature.determinism_check`` and the session check), and a forward that applies
  dropout whatever the mode (a ``--model-factory`` model), exit 2 naming the problem.
- Inf appearing during a computation stops it with exit 3, naming the operator and the batch.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from conftest import make_data, make_mlp
from torch import nn


@pytest.fixture
def checkpoint(tmp_path):
    from sharpcli.io.checkpoints import save_checkpoint
    from sharpcli.models import build_model, default_model_args

    spec = {
        "name": "mlp",
        "args": default_model_args("mlp", (8,), 3, width=8, depth=2, activation="gelu"),
    }
    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, build_model(spec), spec, data_spec="blobs:n=96,dim=8,classes=3,seed=2")
    return path


def test_two_analyze_runs_with_the_same_seed_give_identical_results(checkpoint, capsys):
    argv = [
        "analyze",
        str(checkpoint),
        "--metrics",
        "eigen,trace,gn-nme",
        "--seed",
        "5",
        "--samples",
        "60",
        "--batch-size",
        "32",
        "--max-matvecs",
        "24",
        "--json",
        "-",
    ]
    first = run_cli(capsys, *argv)
    second = run_cli(capsys, *argv)
    assert first.code == second.code == 0, first.err
    a, b = first.json(), second.json()
    assert a["results"] == b["results"]  # bit-identical floats, not merely close
    assert a["settings"]["seed"] == 5
    # a different seed changes the random parts (Hutchinson probes), so the check has teeth
    changed = [("trace" if a == "eigen,trace,gn-nme" else "6" if a == "5" else a) for a in argv]
    other = run_cli(capsys, *changed).json()
    assert other["results"]["hessian"]["trace"] != a["results"]["hessian"]["trace"]


def test_determinism_check_detects_dropout_in_train_mode():
    from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope, determinism_check

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.GELU(), nn.Linear(6, 3)).double()
    x, y = make_data("vector")
    data = AnalysisData(x, y, "cross-entropy", 8)
    op = CurvatureEngine(model, data, ParamScope.resolve(model)).hessian()
    model.train()
    with pytest.raises(Exception) as info:
        determinism_check(model, data, op)
    assert info.value.exit_code == 2 and "active in 1:" in info.value.message
    model.eval()
    determinism_check(model, data, op)  # eval mode: two passes agree exactly, no error


def test_session_refuses_batchnorm_stuck_in_training_mode():
    from sharpcli.errors import InputError
    from sharpcli.preflight import check_deterministic_forward

    class StuckBatchNorm(nn.BatchNorm1d):
        def train(self, mode: bool = True):  # ignores eval(): stays on batch statistics
            return super().train(True)

    model = (
        nn.Sequential(nn.Linear(4, 5), StuckBatchNorm(5), nn.ReLU(), nn.Linear(5, 3))
        .double()
        .eval()
    )
    x, _ = make_data("vector")
    with pytest.raises(InputError) as info:  # a problem of the model file, not of the options
        check_deterministic_forward(model, x, source="model.pt")
    assert "training mode after eval() in 1 (" in info.value.message
    check_deterministic_forward(make_mlp(), x, source="model.pt")  # a plain eval-mode MLP passes


def test_the_determinism_check_reuses_a_given_first_pass():
    """With ``first`` (an earlier no-grad pass on the same samples, as the session's loss read
    gives it) the check runs one forward pass, and still refuses a model that is random."""
    from sharpcli.errors import InputError
    from sharpcli.preflight import check_deterministic_forward

    calls = []
    model = make_mlp().eval()
    model.register_forward_hook(lambda module, args, out: calls.append(1))
    x, _ = make_data("vector")
    with torch.no_grad():
        first = model(x)
    check_deterministic_forward(model, x, source="model.pt", first=first)
    assert len(calls) == 2  # the given pass and one more
    check_deterministic_forward(model, x, source="model.pt")
    assert len(calls) == 4  # two of its own without it

    class AlwaysDropout(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(x.shape[1], 8).double()

        def forward(self, inputs):
            return torch.nn.functional.dropout(self.first(inputs), 0.5, training=True)

    noisy = AlwaysDropout().eval()
    with torch.no_grad():
        given = noisy(x)
    with pytest.raises(InputError) as info:
        check_deterministic_forward(noisy, x, source="model.pt", first=given)
    assert "not deterministic" in info.value.message


def test_cli_refuses_a_model_that_is_random_in_eval_mode(tmp_path, capsys, monkeypatch):
    from safetensors.torch import save_file

    (tmp_path / "noisy_factory.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        class AlwaysDropout(nn.Module):
            def __init__(self):
                super().__init__()
                self.first = nn.Linear(8, 8)
                self.head = nn.Linear(8, 3)

            def forward(self, x):
                return self.head(torch.nn.functional.dropout(self.first(x), 0.5, training=True))

        def build():
            return AlwaysDropout()
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(0)
    import importlib

    module = importlib.import_module("noisy_factory")
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in module.build().state_dict().items()}, str(weights))
    run = run_cli(
        capsys,
        "eigen",
        str(weights),
        "--model-factory",
        "noisy_factory:build",
        "--data",
        "blobs:n=40,dim=8,classes=3",
    )
    assert_one_line_error(run, 2, "not deterministic", str(weights))


def test_inf_during_a_hessian_product_exits_3_naming_operator_and_batch(
    checkpoint, tmp_path, capsys
):
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    y = torch.randint(0, 3, (64,), generator=gen)
    x[37] = 1e25  # finite input; its second derivatives overflow float32 (batch 2 of 16 samples)
    data = tmp_path / "overflow.safetensors"
    save_file({"x": x, "y": y}, str(data))
    run = run_cli(
        capsys, "eigen", str(checkpoint), "--data", str(data), "--batch-size", "16", "--json", "-"
    )
    assert run.code == 3, run.err
    line = run.err.strip()
    assert "\n" not in line and "Hessian" in line and "batch 2" in line
    error = run.json()["error"]
    assert (
        error["type"] == "numerical" and error["exit_code"] == 3 and "batch 2" in error["message"]
    )


def test_float32_overflow_of_a_finite_product_is_blamed_on_its_own_batch(tmp_path, capsys):
    """A ReLU net and one huge input: that batch's Hessian product is finite entry by entry, but
    its norm (and so the Lanczos normalisation) overflows float32. The error must name that batch,
    not the next product's first batch (which then sees the NaN vector Lanczos made of it)."""
    from safetensors.torch import save_file

    from sharpcli.io.checkpoints import save_checkpoint
    from sharpcli.models import build_model, default_model_args

    spec = {
        "name": "mlp",
        "args": default_model_args("mlp", (8,), 3, width=8, depth=2, activation="relu"),
    }
    torch.manual_seed(0)
    model = build_model(spec).eval()
    checkpoint = tmp_path / "relu.safetensors"
    save_checkpoint(checkpoint, model, spec, data_spec="blobs:n=96,dim=8,classes=3,seed=2")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    y = torch.randint(0, 3, (64,), generator=gen)
    x[37] = 1e30  # batch 2 of 16 samples
    with torch.no_grad():
        logits = model(x[37:38])
    assert torch.isfinite(logits).all() and logits.abs().max() > 1e25  # finite, but enormous
    # a label the saturated softmax gets wrong: dl/dz != 0, so the NME part (dl/dz times the
    # bilinear second derivatives of the ReLU net, ~1e30) is large; a right label would zero it
    y[37] = (int(logits.argmax()) + 1) % 3
    data = tmp_path / "overflow.safetensors"
    save_file({"x": x, "y": y}, str(data))

    run = run_cli(
        capsys, "eigen", str(checkpoint), "--data", str(data), "--batch-size", "16", "--json", "-"
    )
    assert run.code == 3, run.err
    line = run.err.strip()
    assert "\n" not in line and "Hessian" in line and "batch 2" in line and "float32" in line, line
    assert "batch 2" in run.json()["error"]["message"]
    # float64 has the range: the same data is analysed
    assert (
        run_cli(
            capsys,
            "eigen",
            str(checkpoint),
            "--data",
            str(data),
            "--batch-size",
            "16",
            "--dtype",
            "float64",
            "--quiet",
        ).code
        == 0
    )


def test_identical_training_runs_write_identical_checkpoints(tmp_path, capsys):
    """No wall-clock time in the checkpoint: the same command gives the same sha256."""
    from cli_helpers import run_cli

    shas = []
    for name in ("a", "b"):
        run = run_cli(
            capsys,
            "train",
            "--data",
            "blobs:n=64,dim=4,classes=3",
            "--epochs",
            "1",
            "--width",
            "8",
            "--out",
            tmp_path / f"{name}.safetensors",
            "--json",
            "-",
        )
        assert run.code == 0, run.err
        shas.append(run.json()["results"]["checkpoint"]["sha256"])
    assert shas[0] == shas[1]
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
