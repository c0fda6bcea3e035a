"""``sharp diagonal``: the .safetensors file (the model's names and shapes, the dense
diagonal's values), the JSON report and its schema, bad input (exit 2, one line)."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from hessian_helpers import double_backward_hessian
from safetensors import safe_open
from safetensors.torch import load_file

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.io.data.loading import load_dataset
from sharpcli.report.envelope import validate_report

DATA = "blobs:n=48,dim=4,classes=3,seed=4"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diagonal")
    spec = tiny_mlp_spec(d_in=4, classes=3, width=5, depth=1, activation="gelu")
    return write_own_checkpoint(folder / "tiny.safetensors", spec, data_spec=DATA, seed=5)


def test_exact_diagonal_file_has_the_models_names_shapes_and_the_dense_diagonal(
    tiny, tmp_path, capsys
):
    out = tmp_path / "diag.safetensors"
    run = run_cli(
        capsys, "diagonal", tiny, "--estimator", "exact", "--dtype", "float64",
        "--out", out, "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    results = report["results"]
    assert (results["operator"], results["estimator"], results["output"]) == (
        "hessian",
        "exact",
        str(out),
    )
    model = load_checkpoint(tiny).model.double().eval()
    tensors = load_file(out)
    named = dict(model.named_parameters())
    assert sorted(tensors) == sorted(named)
    assert all(tensors[n].shape == p.shape for n, p in named.items())
    with safe_open(out, "pt") as handle:
        assert handle.metadata()["operator"] == "hessian"
    x, y = load_dataset(DATA).split("train")
    H = double_backward_hessian(model, list(named.values()), x.double(), y)
    flat = torch.cat([tensors[n].reshape(-1) for n in named])
    assert torch.allclose(flat, torch.diagonal(H), atol=1e-10, rtol=0)
    assert results["trace"]["sum"] == pytest.approx(float(H.trace()), abs=1e-10)
    assert [b["name"] for b in results["blocks"]] == list(named)
    assert [b["shape"] for b in results["blocks"]] == [list(p.shape) for p in named.values()]


@pytest.mark.parametrize(
    "args",
    [
        ("--estimator", "hutchinson", "--probes", "8"),
        ("--estimator", "gnb", "--probes", "4"),
        ("--estimator", "per-sample", "--operator", "ef"),
        ("--estimator", "exact", "--operator", "fisher"),
    ],
)
def test_estimators_write_a_file_and_a_table(tiny, tmp_path, capsys, args):
    out = tmp_path / "d.safetensors"
    run = run_cli(capsys, "diagonal", tiny, "--out", out, *args)
    assert run.code == 0, run.err
    assert "per parameter tensor" in run.out and "sum (trace)" in run.out
    assert max(len(line) for line in run.out.splitlines()) <= 80
    assert set(load_file(out)) == {n for n, _ in load_checkpoint(tiny).model.named_parameters()}


def test_params_scope_writes_only_its_parameters(tiny, tmp_path, capsys):
    out = tmp_path / "last.safetensors"
    run = run_cli(
        capsys, "diagonal", tiny, "--params", "last", "--estimator", "exact", "--out", out
    )
    assert run.code == 0, run.err
    last = [n for n, _ in load_checkpoint(tiny).model.named_parameters()][-2:]
    assert sorted(load_file(out)) == sorted(last)


def test_bad_input_is_one_line_and_exit_2(tiny, tmp_path, capsys):
    out = tmp_path / "bad.safetensors"
    run = run_cli(capsys, "diagonal", tiny, "--estimator", "exact", "--max-products", "10",
                  "--out", out)  # fmt: skip
    assert_one_line_error(run, 2, "--max-products", "needs 43 products")
    assert not out.exists()
    run = run_cli(capsys, "diagonal", tiny, "--estimator", "gnb", "--operator", "hessian",
                  "--out", out)  # fmt: skip
    assert_one_line_error(run, 2, "--operator ggn")
    run = run_cli(capsys, "diagonal", tiny, "--probes", "1", "--out", out)
    assert_one_line_error(run, 2, "--probes")
    run = run_cli(capsys, "diagonal", tiny, "--estimator", "bartlett", "--out", out)
    assert_one_line_error(run, 2, "--estimator")
    run = run_cli(capsys, "diagonal", tiny, "--out", tiny)  # the output would replace the input
    assert_one_line_error(run, 2, "--out")
    run = run_cli(capsys, "diagonal", tiny)
    assert run.code == 2 and "--out" in run.err


def test_a_diagonal_that_overflows_is_exit_3_with_its_source(tiny, tmp_path, capsys):
    """A sample at 1e160 (float64) labelled with each class: its gradient is finite (the
    mislabelled ones' not zero), its square overflows, so the per-sample empirical-Fisher
    diagonal is Inf. A numerical error (exit 3, one line) whose
    JSON error names its ``source`` like every other numerical error (docs/json.md)."""
    from safetensors.torch import save_file

    x, y = load_dataset(DATA).split("train")
    x = x.to(torch.float64).clone()
    y = y.clone()
    x[-3:], y[-3:] = 1e160, torch.arange(3)  # the last rows: the self-check reads the first
    bad = tmp_path / "overflow.safetensors"
    save_file({"x": x, "y": y}, str(bad))
    out = tmp_path / "diag.safetensors"
    run = run_cli(capsys, "diagonal", tiny, "--data", bad, "--dtype", "float64", "--operator",
                  "ef", "--estimator", "per-sample", "--out", out, "--json", "-")  # fmt: skip
    assert_one_line_error(run, 3, "per-sample ef diagonal", "not finite")
    error = run.json()["error"]
    assert error["type"] == "numerical" and error["source"] == "per-sample ef diagonal", error
    assert not out.exists()


def test_an_npz_out_is_an_npz_file_with_the_same_diagonal(tiny, tmp_path, capsys):
    """``--out diag.npz`` writes a NumPy archive (was: a safetensors file under that name):
    the same arrays as the .safetensors file, loadable without pickle, the metadata as JSON.
    Another format's extension is refused before the work, naming --out."""
    import json

    import numpy as np

    common = ("diagonal", tiny, "--estimator", "exact", "--dtype", "float64")
    st, npz = tmp_path / "diag.safetensors", tmp_path / "diag.npz"
    assert run_cli(capsys, *common, "--out", st).code == 0
    assert run_cli(capsys, *common, "--out", npz).code == 0
    want = load_file(str(st))
    with np.load(npz) as archive:  # allow_pickle=False, numpy's default
        assert sorted(archive.files) == sorted([*want, "__metadata__"])
        for name, tensor in want.items():
            np.testing.assert_array_equal(archive[name], tensor.numpy())
        metadata = json.loads(str(archive["__metadata__"]))
    assert metadata["operator"] == "hessian" and metadata["estimator"] == "exact"
    pt = tmp_path / "diag.pt"
    assert_one_line_error(run_cli(capsys, *common, "--out", pt), 2, "--out", ".pt")
    assert not pt.exists()
