"""docs/architecture.md, "Adding a curvature operator": the code block runs as written, and the
empirical Fisher it registers equals a dense float64 ``torch.func`` empirical Fisher
``F = (1/N) sum_i g_i g_i^T`` (per-sample loss gradients by ``jacrev``) to 1e-10, through the
library and through ``sharp eigen --operator``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from torch import nn
from torch.func import functional_call, jacrev

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope, build_operator
from sharpcli.curvature.operators.registry import OPERATORS, unregister_operator
from sharpcli.io.checkpoints import load_checkpoint
from sharpcli.io.data.loading import load_dataset
from sharpcli.losses import per_sample_loss

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
HEADING = "## Adding a curvature operator"
NAME = "empirical-fisher"


def example_code(index: int = 0) -> str:
    """The ``index``-th ``python`` block of the section under ``HEADING`` (up to the next
    heading): the example, then the catalogue record that makes it a built-in."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert HEADING in text, f"{ARCHITECTURE.name} has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1]
    section = re.split(r"^## ", section, maxsplit=1, flags=re.M)[0]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)
    assert len(blocks) > index, f"no python block {index} under {HEADING!r}"
    return blocks[index]


@pytest.fixture(scope="module")
def example():
    """The example's namespace, its operator registered for the module's tests, then removed."""
    assert NAME not in OPERATORS
    namespace = {"__name__": "architecture_example"}
    exec(compile(example_code(), f"{ARCHITECTURE}:{HEADING}", "exec"), namespace)
    try:
        yield namespace
    finally:
        unregister_operator(NAME)


def dense_empirical_fisher(model: nn.Module, x, y, loss: str, names: list[str]) -> torch.Tensor:
    """``(1/N) J^T J``, ``J[i] = d l_i / dtheta`` over ``names`` (jacrev of per-sample losses)."""
    fixed = {n: p.detach() for n, p in model.named_parameters()}
    sizes = [fixed[n].numel() for n in names]

    def per_sample_losses(flat):
        chunks = torch.split(flat, sizes)
        params = fixed | {n: c.reshape(fixed[n].shape) for n, c in zip(names, chunks)}
        return per_sample_loss(loss, functional_call(model, params, (x,)), y)

    J = jacrev(per_sample_losses)(torch.cat([fixed[n].reshape(-1) for n in names]))
    return J.T @ J / x.shape[0]


def tiny_problem(loss: str):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    x = torch.randn(11, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (11,)) if loss == "cross-entropy" else torch.randn(11, 2).double()
    return model, x, y


def test_example_block_runs_and_registers_its_operator(example):
    spec = OPERATORS[NAME]
    assert spec.symbol == "F" and spec.psd and spec.description
    assert all(example["top"].converged)


@pytest.mark.parametrize("loss", ["cross-entropy", "mse"])
@pytest.mark.parametrize("params", [None, "last"])
def test_registered_operator_equals_dense_empirical_fisher(example, loss, params):
    model, x, y = tiny_problem(loss)
    scope = ParamScope.resolve(model, params)
    # batch size 4 over 11 samples: unequal batches, so the 1/N weighting is checked too
    engine = CurvatureEngine(model, AnalysisData(x, y, loss=loss, batch_size=4), scope)
    fisher = build_operator(NAME, engine)
    dense = fisher.to_dense()
    reference = dense_empirical_fisher(model, x, y, loss, scope.names)
    assert dense.dtype == torch.float64 and dense.shape == reference.shape
    assert torch.allclose(dense, reference, atol=1e-10, rtol=0)
    assert fisher.matvecs == scope.numel


def test_example_model_top_eigenvalues_match_dense(example):
    ns = example
    reference = dense_empirical_fisher(
        ns["model"], ns["x"], ns["y"], "cross-entropy", ParamScope.resolve(ns["model"]).names
    )
    top = torch.linalg.eigvalsh(reference).flip(0)[:2]
    assert torch.allclose(
        torch.tensor(ns["top"].eigenvalues, dtype=torch.float64), top, atol=1e-10, rtol=1e-8
    )


def test_cli_lists_and_runs_the_registered_operator(example, tmp_path, capsys):
    help_run = run_cli(capsys, "eigen", "--help")
    assert help_run.code == 0
    assert NAME in " ".join(help_run.out.split()), help_run.out

    data = "blobs:n=40,dim=3,classes=3,seed=2"
    spec = tiny_mlp_spec(d_in=3, classes=3, width=4, depth=1, activation="gelu")
    path = write_own_checkpoint(tmp_path / "tiny.safetensors", spec, data_spec=data, seed=1)
    run = run_cli(
        capsys,
        "eigen",
        path,
        "--operator",
        NAME,
        "--dtype",
        "float64",
        "--tol",
        "1e-9",
        "--json",
        "-",
    )
    assert run.code == 0, run.err
    results = run.json()["results"]
    assert results["operator"] == NAME

    model = load_checkpoint(path).model.double().eval()
    x, y = load_dataset(data).split("train")
    names = [n for n, _ in model.named_parameters()]
    reference = dense_empirical_fisher(model, x.double(), y, "cross-entropy", names)
    lam_max = float(torch.linalg.eigvalsh(reference)[-1])
    assert results["eigenvalues"][0] == pytest.approx(lam_max, rel=1e-8, abs=1e-12)


def test_unknown_operator_error_lists_the_registered_one(example):
    from sharpcli.curvature.operators.registry import operator_spec
    from sharpcli.errors import UsageError

    with pytest.raises(UsageError, match=NAME) as info:
        operator_spec("no-such-operator")
    assert info.value.source == "operator"


def test_as_a_builtin_the_declaration_gives_symbol_description_and_psd(example):
    """The declaration states what the example registered; added by it
    (``OPERATORS.add(cls)``), the class is an operator whose symbol, description and PSD come
    from the declaration, and the --operator help lists it."""
    from sharpcli import catalogue
    from sharpcli.curvature.operators.registry import operator_spec, register_operator

    cls = example["EmpiricalFisherOperator"]
    namespace = dict(example)
    exec(compile(example_code(1), f"{ARCHITECTURE}:{HEADING} declaration", "exec"), namespace)
    entry = OPERATORS.entry(NAME)
    unregister_operator(NAME)
    try:
        OPERATORS.add(cls)
        declared = OPERATORS.entry(NAME)
        assert (declared.summary, dict(declared.info)) == (entry.summary, dict(entry.info))
        spec = operator_spec(NAME)
        assert (spec.symbol, spec.description, spec.psd, spec.build) == (
            "F",
            entry.summary,
            True,
            cls,
        )
        assert f"{NAME} (F: {entry.summary})" in catalogue.operator_help()
        assert declared.paper == "Kunstner2019"
    finally:
        unregister_operator(NAME)
        register_operator(NAME, cls, symbol="F", description=entry.summary, psd=True)
