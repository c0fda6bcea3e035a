"""The quantities ``sharp train --track`` records: each declared beside its code, dispatched by name.

Every trackable writes the keys its declaration names, in the order a history row has always
held them, and its numbers are the curvature's: lambda_max against the dense float64 Hessian
by double backward, tr(G) + tr(N) = tr(H) on shared probes (the split's identity).
"""

from __future__ import annotations

import pytest
import torch

from sharpcli import catalogue
from sharpcli.analyses.tracking import StepContext, measure
from sharpcli.curvature import AnalysisData, CurvatureEngine, ParamScope
from sharpcli.errors import UsageError
from sharpcli.registry import declare
from tests.conftest import setup_and_reference

RECORDED = (
    "lambda_max",
    "preconditioned_sharpness",
    "preconditioned_threshold",
    "trace",
    "frobenius_sq",
    "ggn_trace",
    "nme_trace",
    "nme_share",
    "adaptive_sharpness",
    # the curvature along the step (under Adam: batch sharpness has no threshold)
    "batch_sharpness",
    "batch_sharpness_stderr",
    "batch_sharpness_batches",
    "gradient_share",
    "gradient_share_k",
    "critical_sharpness",
    "critical_sharpness_forward_passes",
    "critical_sharpness_threshold",
)


def _engine(model, x, y) -> CurvatureEngine:
    data = AnalysisData(x, y, loss="cross-entropy", batch_size=64)
    return CurvatureEngine(model, data, ParamScope.resolve(model, None))


def _adam_step(model) -> StepContext:
    """A training step's context with an Adam optimizer that has state but left the weights
    where they were (a step on zero gradients moves nothing), so the cached references hold."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return StepContext(optimizer=optimizer, step=1)


def test_every_trackable_writes_its_declared_keys_in_the_recorded_order():
    model, x, y, H, _ = setup_and_reference("gelu")
    names = list(catalogue.TRACKABLE.names())
    out, products = measure(_engine(model, x, y), names, step=_adam_step(model))
    assert tuple(out) == RECORDED  # the history's JSON and CSV keep this order
    for entry in catalogue.TRACKABLE.entries():
        alone, _ = measure(_engine(model, x, y), [entry.name], step=_adam_step(model))
        # lambda_max's and batch sharpness's thresholds are SGD's: with Adam they are left out
        sgd_only = ("lambda_max_threshold", "batch_sharpness_threshold")
        declared = tuple(k for k in entry.info["keys"] if k not in sgd_only)
        assert tuple(alone) == declared, entry.name
        assert all(alone[k] == out[k] for k in alone), entry.name  # seeded: the same numbers
    assert out["lambda_max"] == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-6)
    shared_trace = out["ggn_trace"] + out["nme_trace"]
    assert out["nme_share"] == pytest.approx(out["nme_trace"] / shared_trace, rel=1e-12)
    assert products > 0


def test_an_unknown_quantity_names_the_accepted_ones():
    with pytest.raises(UsageError, match="accepted: " + ", ".join(catalogue.TRACKABLE)):
        measure(None, ["curvature"])


def test_a_quantity_registered_beside_the_builtins_is_run_and_recorded_after_them():
    """A new quantity is one declared function: ``measure`` runs it from the registry, its
    keys after the built-ins' (no column declared), its value the dense reference's."""

    @declare(
        "trackable",
        "param-norm",
        "the squared norm of the parameters",
        info={"keys": ("param_norm_sq",)},
    )
    def track_param_norm(engine, out: dict, budget) -> int:
        out["param_norm_sq"] = float(
            sum((p.detach().double() ** 2).sum() for p in engine.scope.params)
        )
        return 0

    model, x, y, H, _ = setup_and_reference("gelu")
    catalogue.TRACKABLE.add(track_param_norm)
    try:
        out, _ = measure(_engine(model, x, y), ["param-norm", "eigen"])
    finally:
        catalogue.TRACKABLE.unregister("param-norm")
    assert tuple(out) == ("lambda_max", "param_norm_sq")
    reference = sum(float((p.detach().double() ** 2).sum()) for p in model.parameters())
    assert out["param_norm_sq"] == pytest.approx(reference, rel=1e-12)
    assert out["lambda_max"] == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-6)
    assert "param-norm" not in catalogue.TRACKABLE
