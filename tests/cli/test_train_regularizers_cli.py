"""A short run of every regularizer (and the NME paper's activations) through `sharp train`:
finite loss, a history, and a checkpoint whose metadata records the regularizers."""

from __future__ import annotations

import math

import pytest
from cli_helpers import assert_one_line_error, run_cli

from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.regularizers.registry import REGISTRY

DATA = "blobs:n=128,dim=6,classes=3"
REG_OPTIONS = {
    "none": "none",
    "wd": "wd:sigma=0.01",
    "dropout": "dropout:p=0.2",
    "ad": "ad:sigma=0.2",
    "sam": "sam:rho=0.05",
    "usam": "usam:rho=0.05",
    "asam": "asam:rho=0.5,eta=0.01",
    "gp": "gp:rho=0.01,p=2",
    "hessian-trace": "hessian-trace:sigma2=0.01,probes=1",
    "gn-trace": "gn-trace:sigma2=0.01",
    "weight-noise": "weight-noise:sigma=0.01",
    "nso": "nso:sigma=0.01,k=2",
    "fa": "fa:lambda=0.01",
}


def test_every_registered_regularizer_is_covered():
    assert set(REG_OPTIONS) == set(REGISTRY)


@pytest.mark.parametrize("name", sorted(REG_OPTIONS))
def test_short_run_of_each_regularizer(tmp_path, capsys, name):
    out = tmp_path / f"{name}.safetensors"
    run = run_cli(
        capsys,
        "train",
        "--epochs",
        "1",
        "--data",
        DATA,
        "--width",
        "8",
        "--batch-size",
        "32",
        "--reg",
        REG_OPTIONS[name],
        "--out",
        out,
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    report = run.json()
    history = report["results"]["history"]
    assert len(history) == 1 and math.isfinite(history[0]["train_loss"])
    assert (
        history[0]["grad_evals"] >= 3
    )  # 96 training samples: three batches, at least one gradient each
    ckpt = load_checkpoint(out)
    recorded = ckpt.train_config["regs"]
    assert len(recorded) == 1 and recorded[0].split(":")[0] == name
    for key_value in REG_OPTIONS[name].split(":")[1:]:
        for kv in key_value.split(","):
            k, v = kv.split("=")
            assert f"{k}=" in recorded[0] and float(
                recorded[0].split(f"{k}=")[1].split(",")[0]
            ) == float(v)


def test_combined_regularizers_and_nme_activations(tmp_path, capsys):
    out = tmp_path / "combo.safetensors"
    run = run_cli(
        capsys,
        "train",
        "--epochs",
        "1",
        "--data",
        DATA,
        "--width",
        "8",
        "--reg",
        "ad:sigma=0.1",
        "--reg",
        "sam:rho=0.05",
        "--activation",
        "augmented-relu:beta=4",
        "--out",
        out,
        "--quiet",
    )
    assert run.code == 0, run.err
    ckpt = load_checkpoint(out)
    assert [r.split(":")[0] for r in ckpt.train_config["regs"]] == ["ad", "sam"]
    assert ckpt.model_spec["args"]["activation"] == "augmented-relu:beta=4.0"
    both = run_cli(
        capsys,
        "train",
        "--epochs",
        "1",
        "--data",
        DATA,
        "--width",
        "8",
        "--reg",
        "ad:sigma=0.1",
        "--reg",
        "wd:sigma=0.01",
        "--out",
        tmp_path / "adwd.safetensors",
        "--json",
        "-",
    )
    assert both.code == 0, both.err
    row = both.json()["results"]["history"][0]
    assert (
        math.isfinite(row["train_loss"])
        and row["penalties"]["ad"] > 0
        and row["penalties"]["wd"] > 0
    )
    assert load_checkpoint(tmp_path / "adwd.safetensors").train_config["regs"] == [
        "ad:sigma=0.1",
        "wd:sigma=0.01",
    ]
    for act in ("beta-gelu:beta=4", "diminished-gelu"):
        assert (
            run_cli(
                capsys,
                "train",
                "--epochs",
                "1",
                "--data",
                DATA,
                "--width",
                "8",
                "--activation",
                act,
                "--out",
                tmp_path / "a.safetensors",
                "--quiet",
            ).code
            == 0
        )


@pytest.mark.parametrize(
    "spec, needle",
    [("bogus", "sam"), ("sam:rho=-1", "rho"), ("gp:p=3", "p"), ("sam:rho=0.1", "at most one")],
)
def test_bad_regularizer_lists_what_is_accepted(tmp_path, capsys, spec, needle):
    extra = ["--reg", "nso:sigma=0.01"] if "at most one" in needle else []
    run = run_cli(
        capsys,
        "train",
        "--epochs",
        "1",
        "--data",
        DATA,
        "--reg",
        spec,
        *extra,
        "--out",
        tmp_path / "x.safetensors",
    )
    assert_one_line_error(run, 2, "--reg", needle)
