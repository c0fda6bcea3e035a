"""sharp sharpness and sharp landscape: the JSON report (schema), the table, CSV and plot, bad input as one line and exit 2."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

from sharpcli.io.checkpoints import save_checkpoint
from sharpcli.models.zoo import build_model
from sharpcli.report.envelope import validate_report


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    spec = {
        "name": "mlp",
        "args": {"in_features": 3, "num_classes": 3, "depth": 2, "width": 5, "activation": "relu"},
    }
    model = build_model(spec).eval()
    gen = torch.Generator().manual_seed(1)
    data_path = tmp_path / "data.pt"
    torch.save(
        {"x": torch.randn(30, 3, generator=gen), "y": torch.randint(0, 3, (30,), generator=gen)},
        data_path,
    )
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, model, spec, data_spec=str(data_path))
    return path


def test_json_report_per_rho(checkpoint, capsys):
    run = run_cli(
        capsys, "sharpness", checkpoint, "--rho", "0.05,0.1", "--m", "10", "--steps", "8",
        "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    results = report["results"]
    assert results["kind"] == "worst-case" and results["adaptive"] is True
    assert results["batches"] == 3 and results["m"] == 10 and results["steps"] == 8
    assert [row["rho"] for row in results["rows"]] == [0.05, 0.1]
    for row in results["rows"]:
        assert row["perturbation_norm"] <= row["rho"] * (1 + 1e-6)
        assert len(row["history"]) == 9 and row["stderr"] > 0
    assert report["settings"]["rho"] == [0.05, 0.1]

    average = run_cli(
        capsys, "sharpness", checkpoint, "--kind", "average", "--norm", "linf", "--no-adaptive",
        "--noise-draws", "10", "--json", "-",
    )  # fmt: skip
    assert average.code == 0, average.err
    results = average.json()["results"]
    validate_report(average.json())
    assert results["noise"] == "uniform" and results["scale"] == "1"
    assert results["rows"][0]["stderr_noise"] > 0 and results["rows"][0]["history"] is None

    table = run_cli(capsys, "sharpness", checkpoint, "--steps", "4")
    assert table.code == 0, table.err
    assert "worst-case sharpness" in table.out and "best after step 0/1/2/4" in table.out


@pytest.mark.parametrize(
    "args, needle",
    [
        (("--rho", "0"), "--rho"),
        (("--rho", "0.1,-2"), "--rho"),
        (("--rho", "ten"), "--rho"),
        (("--m", "0"), "--m"),
        (("--steps", "0"), "--steps"),
        (("--noise-draws", "1", "--kind", "average"), "--noise-draws"),
        (("--kind", "best"), "--kind"),
        (("--norm", "l1"), "--norm"),
        (("--params", "nothing.*"), "--params"),
        # an empty item is refused, not dropped
        (("--rho", "0.01,,0.05"), "--rho"),
        (("--rho", "0.05,"), "--rho"),
        # m above the 30 samples is refused, not cut to 30 (another m-sharpness)
        (("--m", "31"), "--m"),
    ],
)
def test_bad_input_is_one_line_naming_the_option(checkpoint, capsys, args, needle):
    assert_one_line_error(run_cli(capsys, "sharpness", checkpoint, *args), 2, needle)


def test_m_above_the_data_names_the_data_size(checkpoint, capsys):
    run = run_cli(capsys, "sharpness", checkpoint, "--m", "31", "--json", "-")
    assert_one_line_error(run, 2, "--m", "31", "30 samples")
    assert run.json()["error"]["source"] == "--m"


@pytest.mark.parametrize("adaptive", ["--adaptive", "--no-adaptive"])
def test_a_radius_past_float32_is_a_numerical_failure_not_sharpness_0(checkpoint, capsys, adaptive):
    """rho 1e30 in a float32 model: the ball's points have an infinite loss, exit 3 naming
    --rho. (The float32 norm of the perturbation overflowed to Inf, the projection scaled it
    to 0: worst-case sharpness 0 with exit 0, a larger ball with a smaller maximum.)"""
    run = run_cli(capsys, "sharpness", checkpoint, "--rho", "1e30", adaptive, "--steps", "3",
                  "--json", "-")  # fmt: skip
    assert_one_line_error(run, 3, "--rho", "not finite")
    error = run.json()["error"]
    assert error["type"] == "numerical" and error["source"] == "--rho"


# ----------------------------------------------------------------------------------- landscape
def test_landscape_json_csv_plot_and_saved_directions(checkpoint, tmp_path, capsys):
    from png_helpers import png_size

    out = tmp_path / "out"
    out.mkdir()
    run = run_cli(
        capsys, "landscape", checkpoint, "--steps", "5", "--csv", out / "grid.csv",
        "--plot", out / "plane.png", "--save-directions", out / "d.safetensors", "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    results = report["results"]
    assert results["dims"] == 2 and len(results["loss"]) == 5 and len(results["loss"][0]) == 5
    assert results["loss"][2][2] == results["centre_loss"]
    lines = (out / "grid.csv").read_text().splitlines()
    assert lines[0] == "x,y,loss,accuracy" and len(lines) == 26
    assert png_size(out / "plane.png") == (960, 600)
    again = run_cli(
        capsys, "landscape", checkpoint, "--steps", "5", "--directions", out / "d.safetensors",
        "--seed", "9", "--json", "-",
    )  # fmt: skip
    assert again.code == 0, again.err
    assert again.json()["results"]["loss"] == results["loss"]  # the figure, redone

    line = run_cli(capsys, "landscape", checkpoint, "--dims", "1", "--steps", "5")
    assert line.code == 0, line.err
    assert "loss along the line" in line.out


def test_landscape_along_a_second_checkpoint(checkpoint, tmp_path, capsys):
    torch.manual_seed(5)
    spec = {
        "name": "mlp",
        "args": {"in_features": 3, "num_classes": 3, "depth": 2, "width": 5, "activation": "relu"},
    }
    second = tmp_path / "second.safetensors"
    save_checkpoint(second, build_model(spec).eval(), spec)
    run = run_cli(capsys, "landscape", checkpoint, "--along", second, "--steps", "5", "--json", "-")
    assert run.code == 0, run.err
    results = run.json()["results"]
    assert results["dims"] == 1 and results["x"] == [-0.5, 0.0, 0.5, 1.0, 1.5]
    assert results["loss"][1] == results["centre_loss"]

    spec["args"]["width"] = 6  # another architecture
    wider = tmp_path / "wider.safetensors"
    save_checkpoint(wider, build_model(spec).eval(), spec)
    refused = run_cli(capsys, "landscape", checkpoint, "--along", wider)
    assert_one_line_error(refused, 2, "--along", "another architecture")


@pytest.mark.parametrize(
    "args, needle",
    [
        (("--span", "0"), "--span"),
        (("--steps", "1"), "--steps"),
        (("--dims", "3"), "--dims"),
        (("--bias-bn", "one"), "--bias-bn"),
        (("--along", "missing.safetensors"), "missing.safetensors"),
        (("--directions", "missing.safetensors"), "missing.safetensors"),
    ],
)
def test_landscape_bad_input_is_one_line_naming_the_option(checkpoint, capsys, args, needle):
    assert_one_line_error(run_cli(capsys, "landscape", checkpoint, *args), 2, needle)
