"""torch's loss options on the command line (``--loss NAME:k=v,...``) with a data file and a
``--model-factory``: the eigenvalues against a dense float64 double-backward Hessian of
torch's own loss module with the same options on the whole file."""

from __future__ import annotations

import textwrap

import pytest
import torch
from cli_helpers import assert_one_line_error, factory_checkpoint, run_cli
from hessian_helpers import double_backward_hessian
from torch import nn

FACTORY = textwrap.dedent("""
    from torch import nn

    def build():
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, {outputs}){head})
""")


def _setup(tmp_path, monkeypatch, name, outputs, y, head=""):
    from safetensors.torch import save_file

    source = FACTORY.format(outputs=outputs, head=head)
    model, weights = factory_checkpoint(tmp_path, monkeypatch, name, source, seed=2)
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(3))
    data = tmp_path / f"{name}_data.safetensors"
    save_file({"x": x, "y": y}, str(data))
    return model.double(), x.double(), weights, data


def _eigen(capsys, weights, factory, data, loss, *extra):
    return run_cli(
        capsys,
        "eigen",
        weights,
        "--model-factory",
        f"{factory}:build",
        "--data",
        data,
        "--dtype",
        "float64",
        "--batch-size",
        "5",
        "--top-k",
        "2",
        "--tol",
        "1e-10",
        "--loss",
        loss,
        "--json",
        "-",
        *extra,
    )


def _top_two(model, x, y, module):
    H = double_backward_hessian(model, list(model.parameters()), x, y, loss_fn=module)
    return torch.linalg.eigvalsh(H).flip(0)[:2].tolist()


CASES = [
    (
        "cross-entropy:weight=1;2;0.5;3,label_smoothing=0.1,reduction=sum",
        4,
        "classes",
        nn.CrossEntropyLoss(
            weight=torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64),
            label_smoothing=0.1,
            reduction="sum",
        ),
    ),
    (
        "binary-cross-entropy:pos_weight=2;0.5;3",
        3,
        "multi-label",
        nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0, 0.5, 3.0], dtype=torch.float64)),
    ),
    ("binary-cross-entropy", 1, "one-column", nn.BCEWithLogitsLoss()),
    ("huber:delta=0.5,reduction=sum", 2, "regression", nn.HuberLoss(delta=0.5, reduction="sum")),
    ("smooth-l1:beta=0.3", 2, "regression", nn.SmoothL1Loss(beta=0.3)),
    ("mse:reduction=sum", 2, "regression", nn.MSELoss(reduction="sum")),
]


@pytest.mark.parametrize("spec, outputs, labels, module", CASES, ids=[c[0] for c in CASES])
def test_loss_options_on_the_command_line(
    tmp_path, capsys, monkeypatch, spec, outputs, labels, module
):
    gen = torch.Generator().manual_seed(4)
    if labels == "classes":
        y = torch.randint(0, outputs, (16,), generator=gen)
    elif labels == "regression":
        y = torch.randn(16, outputs, generator=gen)
    else:
        y = torch.randint(0, 2, (16, outputs), generator=gen).float()
    name = f"factory_{labels.replace('-', '_')}"
    model, x, weights, data = _setup(tmp_path, monkeypatch, name, outputs, y)
    run = _eigen(capsys, weights, name, data, spec)
    assert run.code == 0, run.err
    report = run.json()
    assert report["data"]["loss"].startswith(spec.split(":")[0])
    y_ref = y.double() if y.is_floating_point() else y
    assert report["results"]["eigenvalues"] == pytest.approx(
        _top_two(model, x, y_ref, module), rel=1e-8
    )


def test_nll_after_log_softmax_on_the_command_line(tmp_path, capsys, monkeypatch):
    y = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(5))
    head = ", nn.LogSoftmax(dim=1)"
    model, x, weights, data = _setup(tmp_path, monkeypatch, "factory_nll", 4, y, head)
    run = _eigen(capsys, weights, "factory_nll", data, "nll")
    assert run.code == 0, run.err
    assert run.json()["results"]["eigenvalues"] == pytest.approx(
        _top_two(model, x, y, nn.NLLLoss()), rel=1e-8
    )


def test_nll_on_logits_is_refused_on_the_command_line(tmp_path, capsys, monkeypatch):
    y = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(5))
    _, _, weights, data = _setup(tmp_path, monkeypatch, "factory_logits", 4, y)
    run = _eigen(capsys, weights, "factory_logits", data, "nll")
    assert_one_line_error(run, 2, "log-probabilities")


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("cross-entropy:smoothing=0.1", "accepted: reduction, weight, label_smoothing"),
        ("cross-entropy:reduction=none", "reduction must be one of mean, sum"),
        ("cross-entropy:weight=1;x", "numbers separated by ';'"),
        ("cross-entropy:ignore_index=3", "ignore_index is the library's"),
        ("hinge", "unknown loss 'hinge'; accepted: cross-entropy"),
    ],
)
def test_bad_loss_options_exit_2_in_one_line(tmp_path, capsys, monkeypatch, spec, needle):
    y = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(5))
    _, _, weights, data = _setup(tmp_path, monkeypatch, "factory_bad", 4, y)
    run = _eigen(capsys, weights, "factory_bad", data, spec)
    assert_one_line_error(run, 2, needle)
