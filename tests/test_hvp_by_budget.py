"""Exact or finite-difference products chosen by the memory plan (``--hvp`` left out).

A model whose activations outweigh its parameters (171 parameters, 300,000 samples in one
batch): the exact product's workspace (its first-order graph and about as much again for the
double backward) is about 3.5 times the finite-difference product's (four parameter-sized
vectors and the forward's activations). Under a budget between the two the run takes finite
differences, says so with the error bound, stays within its planned peak, and finds the dense
float64 Hessian's largest eigenvalue to within that bound; ``--hvp exact`` asked for under
the same budget is refused (exit 2, one line on ``--max-memory``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run_process
from hessian_helpers import double_backward_hessian
from test_memory_plan import _run_with_own_peak

SAMPLES = 300_000


@pytest.fixture(scope="module")
def wide_batch(tmp_path_factory):
    """``(checkpoint, data, model, x, y)``: a float64 tanh MLP 8-8-8-3 and its data."""
    from sharpcli.io.checkpoints import save_checkpoint
    from sharpcli.models import build_model, default_model_args

    spec = {
        "name": "mlp",
        "args": default_model_args("mlp", (8,), 3, width=8, depth=2, activation="tanh"),
    }
    torch.manual_seed(0)
    model = build_model(spec)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = torch.randint(0, 3, (SAMPLES,), generator=g)
    folder = tmp_path_factory.mktemp("wide")
    save_checkpoint(folder / "model.safetensors", model, spec)
    np.savez(folder / "data.npz", x=x.numpy(), y=y.numpy())
    return folder / "model.safetensors", folder / "data.npz", model, x, y


def _eigen(wide_batch, tmp_path, budget: str, *hvp: str):
    checkpoint, data = wide_batch[:2]
    return _run_with_own_peak(
        "eigen", checkpoint, "--data", data, "--batch-size", SAMPLES, "--dtype", "float64",
        "--eig-max-matvecs", 6, "--max-memory", budget, *hvp, "--json", "-", "--quiet",
        env={"SHARP_SCRATCH": str(tmp_path)},
    )  # fmt: skip


# one batch of 300,000 samples, three whole runs (about a minute of CPU): the slow tier
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM (Linux)")
def test_a_budget_that_holds_only_finite_differences_takes_them(wide_batch, tmp_path):
    code, roomy, _ = _eigen(wide_batch, tmp_path, "4G")
    assert code == 0 and "hvp" not in roomy["results"]  # exact where the budget holds it
    plan = roomy["timing"]["memory"]
    exact_workspace = plan["planned"]["product workspace (one batch)"]
    # room for 0.8 of the exact workspace: its product does not fit, finite differences do
    budget = f"{(plan['baseline_bytes'] + int(0.8 * exact_workspace)) >> 20}M"

    code, report, peak = _eigen(wide_batch, tmp_path, budget)
    assert code == 0
    results, plan = report["results"], report["timing"]["memory"]
    record = results["hvp"]
    assert record["method"] == "finite-difference" and record["by_budget"] is True
    assert plan["planned"]["product workspace (one batch)"] < 0.4 * exact_workspace
    assert any("do not fit the budget" in c for c in plan["choices"]), plan["choices"]
    note = next(n for n in results["notes"] if n.startswith("exact products do not fit"))
    assert f"{record['error_bound']:.3g}" in note
    assert peak <= plan["planned_peak_bytes"] <= plan["budget_bytes"], (peak >> 20, plan)

    # the dense float64 Hessian's largest eigenvalue, within beta and the Ritz residual
    model, x, y = wide_batch[2:]
    model = model.double()
    params = list(model.parameters())
    hessian = double_backward_hessian(model, params, x.double(), y)
    top = torch.linalg.eigvalsh((hessian + hessian.T) / 2)[-1].item()
    gap = abs(results["eigenvalues"][0] - top)
    assert gap <= record["error_bound"] + results["residuals"][0], (gap, record, results)
    assert results["eigenvalues"][0] == pytest.approx(roomy["results"]["eigenvalues"][0], 1e-6)

    # asked for by name, the exact product is refused under the same budget
    checkpoint, data = wide_batch[:2]
    run = run_process(
        "eigen", checkpoint, "--data", data, "--batch-size", SAMPLES, "--dtype", "float64",
        "--eig-max-matvecs", 6, "--max-memory", budget, "--hvp", "exact", "--quiet",
        env={"SHARP_SCRATCH": str(tmp_path)},
    )  # fmt: skip
    assert_one_line_error(run, 2, "--max-memory")
