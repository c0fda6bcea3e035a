"""sharp activation-stats: MAN section 2 frequencies against hand counts, Gini, the Jacobian norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import assert_one_line_error, run_cli
from torch.func import jacrev

from sharpcli.analyses.activations import activation_stats
from sharpcli.cli import cmd_diagnostics  # noqa: F401  (registers the commands)
from sharpcli.curvature.products.data import AnalysisData
from sharpcli.io.checkpoints import save_checkpoint
from sharpcli.models.zoo import build_model
from sharpcli.report.envelope import validate_report


def _mlp(activation="relu", in_features=2, width=4, depth=1, classes=3, seed=0):
    torch.manual_seed(seed)
    spec = {
        "name": "mlp",
        "args": {
            "in_features": in_features,
            "num_classes": classes,
            "depth": depth,
            "width": width,
            "activation": activation,
        },
    }
    return build_model(spec).double().eval(), spec


def _hand_model():
    """Linear(2, 4) -> ReLU -> Linear(4, 3) with units: x0, x1, -1 (dead), -(x0 + x1)."""
    model, spec = _mlp()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [-1.0, -1.0]]))
        model[0].bias.copy_(torch.tensor([0.0, 0.0, -1.0, 0.0]))
    x = torch.tensor(
        [[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0], [2.0, 0.5]], dtype=torch.float64
    )
    y = torch.tensor([0, 1, 2, 0, 1])
    return model, spec, x, y


def test_planted_dead_unit_frequencies_equal_hand_counts():
    model, _, x, y = _hand_model()
    # active (pre-activation > 0) per sample: 2, 1 (unit 3 is exactly 0), 1, 1, 2 -> 7 of 5 x 3 alive
    result = activation_stats(model, AnalysisData(x, y, "cross-entropy", batch_size=2))
    (layer,) = result.layers
    assert layer.name == "1" and layer.kind == "relu" and layer.outputs == 4
    assert layer.dead_outputs == 1
    assert layer.death_frequency == 1 / 4
    assert layer.activation_frequency == pytest.approx(7 / 15, abs=1e-15)
    assert layer.activation_frequency_including_dead == pytest.approx(7 / 20, abs=1e-15)
    # ||a||^2 per sample: 2, 1, 1, 4, 4.25
    assert layer.mean_sq_norm == pytest.approx(12.25 / 5, abs=1e-14)
    assert result.penultimate_sq_norm == pytest.approx(12.25 / 5, abs=1e-14)
    assert result.penultimate_layer == "2"


def test_output_level_statistics_and_jacobian_match_direct_computation():
    model, _ = _mlp(in_features=3, width=5, depth=2, classes=4, seed=3)
    x = torch.randn(13, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 4, (13,), generator=torch.Generator().manual_seed(1))
    result = activation_stats(model, AnalysisData(x, y, "cross-entropy", batch_size=5))
    with torch.no_grad():
        z = model(x)
    p = torch.softmax(z, dim=1)
    out = result.output
    assert out.gini_impurity == pytest.approx(float((1 - (p * p).sum(1)).mean()), rel=1e-12)
    assert out.entropy == pytest.approx(float(-(p * p.log()).sum(1).mean()), rel=1e-12)
    assert out.confidence == pytest.approx(float(p.max(1).values.mean()), rel=1e-12)
    assert out.loss == pytest.approx(float(F.cross_entropy(z, y)), rel=1e-12)
    assert out.accuracy == pytest.approx(float((z.argmax(1) == y).double().mean()), abs=1e-15)
    rows = torch.arange(x.shape[0])
    J = jacrev(model)(x).detach()[rows, :, rows]  # (B, C, B, D) -> per-sample (B, C, D)
    Jp = jacrev(lambda inputs: torch.softmax(model(inputs), 1))(x).detach()[rows, :, rows]
    assert result.input_jacobian_fro == pytest.approx(
        float(torch.linalg.matrix_norm(J).mean()), rel=1e-12
    )
    assert result.input_jacobian_fro_softmax == pytest.approx(
        float(torch.linalg.matrix_norm(Jp).mean()), rel=1e-12
    )
    # penultimate = input of the head (model[4]) = output of the second activation
    with torch.no_grad():
        h = model[:4](x)
    assert result.penultimate_sq_norm == pytest.approx(float((h * h).sum(1).mean()), rel=1e-12)


def test_gelu_counts_come_from_pre_activation_signs():
    model, _ = _mlp("gelu", in_features=3, width=6, depth=1, seed=5)
    with torch.no_grad():
        model[0].bias[2] = -50.0  # unit 2 never crosses zero: dead although GELU(z) != 0
    x = torch.randn(40, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.zeros(40, dtype=torch.long)
    (layer,) = activation_stats(model, AnalysisData(x, y, "cross-entropy", 16)).layers
    pre = x @ model[0].weight.T + model[0].bias
    active = pre > 0
    dead = ~active.any(0)
    assert layer.kind == "gelu"
    assert layer.dead_outputs == int(dead.sum()) >= 1
    expected = active[:, ~dead].double().mean()
    assert layer.activation_frequency == pytest.approx(float(expected), abs=1e-15)
    assert 0.2 < layer.activation_frequency < 0.9  # not "output != 0", which is ~1 for GELU


def test_cnn_counts_every_channel_position():
    torch.manual_seed(0)
    spec = {
        "name": "cnn",
        "args": {"in_channels": 1, "image_size": 4, "num_classes": 3, "channels": [2]},
    }
    model = build_model(spec).double().eval()
    conv = model.features[0]
    with torch.no_grad():
        conv.weight[1].zero_()
        conv.bias[1] = -1.0  # channel 1 dead at all 16 positions
    x = torch.randn(9, 1, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    y = torch.zeros(9, dtype=torch.long)
    (layer,) = activation_stats(model, AnalysisData(x, y, "cross-entropy", 4)).layers
    pre = F.conv2d(x, conv.weight, conv.bias, padding=1).reshape(
        9, -1
    )  # 2 x 4 x 4 outputs per sample
    active = pre > 0
    dead = ~active.any(0)
    assert layer.outputs == 32 and layer.output_shape == [2, 4, 4]
    assert layer.dead_outputs == int(dead.sum()) >= 16
    assert layer.death_frequency == int(dead.sum()) / 32
    assert layer.activation_frequency == pytest.approx(
        float(active.sum()) / (9 * (32 - int(dead.sum()))), abs=1e-15
    )


def _write_fixture(tmp_path, model, spec, x, y):
    data_path = tmp_path / "data.pt"
    torch.save({"x": x.float(), "y": y}, data_path)
    ckpt = tmp_path / "model.safetensors"
    save_checkpoint(ckpt, model, spec, data_spec=str(data_path))
    return ckpt


def test_cli_json_validates_and_matches_library(tmp_path, capsys):
    model, spec, x, y = _hand_model()
    ckpt = _write_fixture(tmp_path, model, spec, x, y)
    run = run_cli(capsys, "activation-stats", ckpt, "--dtype", "float64", "--json", "-")
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    results = report["results"]
    assert results["layers"][0]["activation_frequency"] == pytest.approx(7 / 15, abs=1e-15)
    assert results["layers"][0]["death_frequency"] == 0.25
    assert results["penultimate_sq_norm"] == pytest.approx(2.45, abs=1e-14)
    for key in ("gini_impurity", "entropy", "accuracy", "loss", "confidence"):
        assert key in results["output"]
    table = run_cli(capsys, "activation-stats", ckpt, "--dtype", "float64", "--no-jacobian")
    assert table.code == 0, table.err
    assert "eta_all" in table.out and "0.466667" in table.out  # eta = 7/15 in the table


def test_cli_bad_options_are_one_line_errors(tmp_path, capsys):
    model, spec, x, y = _hand_model()
    ckpt = _write_fixture(tmp_path, model, spec, x, y)
    assert_one_line_error(
        run_cli(capsys, "activation-stats", ckpt, "--samples", "0"), 2, "--samples"
    )
    assert_one_line_error(
        run_cli(capsys, "activation-stats", tmp_path / "missing.safetensors"), 2, "missing"
    )
