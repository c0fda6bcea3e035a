"""sharp weight-rescale: Dinh rescaling preserves the function but not lambda_max; ASAM sharpness is invariant."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import assert_one_line_error, run_cli
from torch.func import functional_call, hessian

from sharpcli.analyses.rescale import weight_rescale
from sharpcli.analyses.rescale_plan import apply_rescale, plan_rescale
from sharpcli.cli import cmd_diagnostics  # noqa: F401  (registers the commands)
from sharpcli.curvature.products.data import AnalysisData
from sharpcli.errors import UsageError
from sharpcli.io.checkpoints import save_checkpoint
from sharpcli.models.zoo import build_model
from sharpcli.report.envelope import validate_report

TIGHT = dict(tol=1e-10, trace_tol=1e-6, trace_max_matvecs=400)


def _mlp(activation="relu", seed=0):
    torch.manual_seed(seed)
    spec = {
        "name": "mlp",
        "args": {
            "in_features": 3,
            "num_classes": 3,
            "depth": 2,
            "width": 4,
            "activation": activation,
        },
    }
    return build_model(spec).double().eval(), spec


def _cnn(batch_norm=False, seed=0):
    torch.manual_seed(seed)
    spec = {
        "name": "cnn",
        "args": {
            "in_channels": 1,
            "image_size": 4,
            "num_classes": 3,
            "channels": [2, 2],
            "batch_norm": batch_norm,
        },
    }
    model = build_model(spec).double()
    if batch_norm:
        with torch.no_grad():
            bn = model.features[1]
            bn.running_mean.copy_(torch.tensor([0.3, -0.2]))
            bn.running_var.copy_(torch.tensor([0.5, 2.0]))
            bn.weight.copy_(torch.tensor([1.3, 0.8]))
            bn.bias.copy_(torch.tensor([0.1, -0.05]))
    return model.eval(), spec


def _vector_data(n=32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, dtype=torch.float64, generator=gen), torch.randint(
        0, 3, (n,), generator=gen
    )


def _image_data(n=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 4, 4, dtype=torch.float64, generator=gen), torch.randint(
        0, 3, (n,), generator=gen
    )


def _dense_hessian(model, x, y):
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    flat0 = torch.cat([params[n].detach().reshape(-1) for n in names])

    def loss(flat):
        parts, start = {}, 0
        for n in names:
            parts[n] = flat[start : start + params[n].numel()].view(params[n].shape)
            start += params[n].numel()
        return F.cross_entropy(functional_call(model, parts, (x,)), y)

    return hessian(loss)(flat0).detach(), flat0, names, params


def _trained_mlp():
    """The tiny ReLU MLP after 200 full-batch Adam steps on a learnable labelling (~90% accuracy)."""
    model, _ = _mlp()
    x, _ = _vector_data()
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(200):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval(), x, y


def test_layer_rescale_of_relu_mlp_moves_lambda_max_but_not_function_or_invariant():
    model, x, y = _trained_mlp()
    data = AnalysisData(x, y, "cross-entropy", 16)
    result = weight_rescale(model, data, [10.0, 0.1], mode="layer", layer="2", **TIGHT)
    assert (
        result.plan.mode == "layer" and result.plan.next_layer == "4" and result.plan.path == ["3"]
    )
    assert result.plan.function_preserving
    H, flat0, names, params = _dense_hessian(model, x, y)
    base_eigs = torch.linalg.eigvalsh(H)
    assert result.baseline.lambda_max == pytest.approx(float(base_eigs[-1]), rel=1e-9)
    assert result.baseline.trace == pytest.approx(float(H.trace()), rel=1e-6)
    w = flat0.abs()
    invariant = float(torch.linalg.eigvalsh(w[:, None] * H * w[None, :])[-1])
    for row in result.rows:
        alpha = row.alpha
        assert row.max_logit_change <= 1e-10
        # H' = D^-1 H D^-1 with D = alpha on layer 2 (weight, bias), 1/alpha on 4.weight
        d = torch.cat(
            [
                torch.full(
                    (params[n].numel(),),
                    alpha if n.startswith("2.") else (1 / alpha if n == "4.weight" else 1.0),
                    dtype=torch.float64,
                )
                for n in names
            ]
        )
        exact = torch.linalg.eigvalsh(H / d[:, None] / d[None, :])[-1]
        assert row.lambda_max == pytest.approx(float(exact), rel=1e-9)
        assert row.invariant_lambda_max == pytest.approx(invariant, rel=1e-6)
        assert row.accuracy == result.baseline.accuracy
        assert row.loss == pytest.approx(result.baseline.loss, rel=1e-12)
    _adaptive_sharpness_invariant_standard_not(result)
    ten = result.rows[0]
    assert result.baseline.accuracy > 0.8
    # the head's Hessian block grows by alpha^2 = 100: lambda_max and the trace by well over 10x
    assert ten.lambda_max / result.baseline.lambda_max > 30
    assert ten.trace / result.baseline.trace > 30


def test_layer_rescale_of_relu_cnn_preserves_logits_and_invariant():
    model, _ = _cnn()
    x, y = _image_data()
    data = AnalysisData(x, y, "cross-entropy", 8)
    result = weight_rescale(
        model, data, [10.0], mode="layer", **TIGHT
    )  # default: the first hidden layer
    assert result.plan.layer == "features.0" and result.plan.next_layer == "features.3"
    assert result.plan.path == ["features.1", "features.2"]  # ReLU, max-pool
    (row,) = result.rows
    assert row.max_logit_change <= 1e-10
    assert row.invariant_lambda_max == pytest.approx(result.baseline.invariant_lambda_max, rel=1e-6)
    assert abs(row.lambda_max / result.baseline.lambda_max - 1) > 0.5
    _adaptive_sharpness_invariant_standard_not(result)


def _adaptive_sharpness_invariant_standard_not(result):
    """[Andriushchenko2023]'s adaptive worst-case sharpness is the same after the rescale (to
    float64 rounding: the ascent's path in u = delta / |w| is the same); the standard one moves."""
    base = result.baseline
    assert base.adaptive_sharpness > 0 and base.standard_sharpness > 0
    for row in result.rows:
        assert row.adaptive_sharpness == pytest.approx(base.adaptive_sharpness, rel=1e-8)
        assert abs(row.standard_sharpness / base.standard_sharpness - 1) > 0.1


def test_batchnorm_followed_layer_rescale_preserves_function():
    model, _ = _cnn(batch_norm=True)
    x, y = _image_data()
    data = AnalysisData(x, y, "cross-entropy", 8)
    result = weight_rescale(model, data, [10.0, 0.5], mode="layer", layer="features.0", **TIGHT)
    assert result.plan.mode == "batchnorm" and result.plan.batchnorm == "features.1"
    for row in result.rows:
        assert row.max_logit_change <= 1e-10
        assert row.invariant_lambda_max == pytest.approx(
            result.baseline.invariant_lambda_max, rel=1e-6
        )
    _adaptive_sharpness_invariant_standard_not(result)
    # scale invariance of a batch-normalised layer: its Hessian block shrinks by 1/alpha^2
    assert result.rows[0].lambda_max != pytest.approx(result.baseline.lambda_max, rel=1e-3)
    # the adjusted running statistics, by hand
    twin = _cnn(batch_norm=True)[0]
    apply_rescale(twin, result.plan, 10.0)
    bn = twin.features[1]
    assert torch.allclose(bn.running_mean, torch.tensor([3.0, -2.0], dtype=torch.float64))
    assert torch.allclose(
        bn.running_var, 100 * (torch.tensor([0.5, 2.0], dtype=torch.float64) + bn.eps) - bn.eps
    )


def test_gelu_layer_rescale_is_refused_unless_forced():
    model, _ = _mlp("gelu")
    x, _ = _vector_data()
    with pytest.raises(UsageError, match="not positively homogeneous") as info:
        plan_rescale(model, x[:4], "layer", "0")
    assert info.value.source == "layer"
    plan = plan_rescale(model, x[:4], "layer", "0", force=True)
    assert plan.problems and not plan.function_preserving


def test_global_mode_scales_every_parameter():
    model, _ = _mlp()
    x, y = _vector_data()
    result = weight_rescale(
        model, AnalysisData(x, y, "cross-entropy", 32), [2.0], mode="global", **TIGHT
    )
    twin = _mlp()[0]
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2.0)
        expected = (twin(x) - model(x)).abs().max()
    assert not result.plan.function_preserving
    assert result.rows[0].max_logit_change == pytest.approx(float(expected), rel=1e-12)
    assert result.rows[0].loss == pytest.approx(
        float(F.cross_entropy(twin(x), y).detach()), rel=1e-12
    )


def _write_fixture(tmp_path, model, spec, x, y):
    data_path = tmp_path / "data.pt"
    torch.save({"x": x.float(), "y": y}, data_path)
    ckpt = tmp_path / "model.safetensors"
    save_checkpoint(ckpt, model, spec, data_spec=str(data_path))
    return ckpt


def test_cli_json_plot_and_errors(tmp_path, capsys, monkeypatch):
    model, spec = _mlp()
    x, y = _vector_data()
    ckpt = _write_fixture(tmp_path, model, spec, x, y)
    plot = tmp_path / "rescale.png"
    run = run_cli(
        capsys,
        "weight-rescale",
        ckpt,
        "--alpha",
        "0.1,10",
        "--dtype",
        "float64",
        "--tol",
        "1e-8",
        "--plot",
        plot,
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    rows = report["results"]["rows"]
    assert [r["alpha"] for r in rows] == [0.1, 10.0]
    assert all(r["max_logit_change"] <= 1e-10 for r in rows)
    assert report["settings"]["alpha"] == [0.1, 10.0] and report["timing"]["matvecs"] > 0
    from png_helpers import png_size

    from sharpcli.report.plots import PIXELS

    assert png_size(plot) == PIXELS
    table = run_cli(capsys, "weight-rescale", ckpt, "--alpha", "10", "--dtype", "float64")
    assert table.code == 0, table.err
    assert "weight rescaling" in table.out and "0.1" not in table.out.split("\n", 3)[-1].split()[0]
    # written to a pipe (80 columns), the table is split, the alpha column repeated in each
    # part, so that no number is folded across lines
    monkeypatch.delenv("COLUMNS", raising=False)
    piped = run_cli(capsys, "weight-rescale", ckpt, "--alpha", "10", "--dtype", "float64").out
    parts = [line for line in piped.splitlines() if re.match(r"│ +10 │", line)]
    assert len(parts) >= 2 and max(len(line) for line in piped.splitlines()) <= 80
    cells = [c.strip() for row in parts for c in row.strip("│").split("│")[1:]]
    assert len(cells) == 9 and all(float(c) >= 0 for c in cells)

    assert_one_line_error(run_cli(capsys, "weight-rescale", ckpt, "--alpha", "0"), 2, "--alpha")
    assert_one_line_error(run_cli(capsys, "weight-rescale", ckpt, "--rho", "0"), 2, "--rho")
    assert_one_line_error(run_cli(capsys, "weight-rescale", ckpt, "--alpha", "-1,2"), 2, "--alpha")
    assert_one_line_error(
        run_cli(capsys, "weight-rescale", ckpt, "--layer", "nope"), 2, "--layer", "nope"
    )
    assert_one_line_error(
        run_cli(capsys, "weight-rescale", ckpt, "--layer", "4"), 2, "--layer"
    )  # the head
    assert_one_line_error(
        run_cli(capsys, "weight-rescale", ckpt, "--mode", "diagonal"), 2, "--mode"
    )

    gelu, gelu_spec = _mlp("gelu")
    gelu_dir = tmp_path / "gelu"
    gelu_dir.mkdir()
    gelu_ckpt = _write_fixture(gelu_dir, gelu, gelu_spec, x, y)
    refused = run_cli(capsys, "weight-rescale", gelu_ckpt, "--alpha", "10", "--json", "-")
    assert_one_line_error(refused, 2, "--layer", "gelu", "--force")
    assert refused.json()["error"]["exit_code"] == 2
    forced = run_cli(
        capsys,
        "weight-rescale",
        gelu_ckpt,
        "--alpha",
        "10",
        "--force",
        "--dtype",
        "float64",
        "--json",
        "-",
    )
    assert forced.code == 0, forced.err
    assert forced.json()["results"]["rows"][0]["max_logit_change"] > 1e-3
