"""Curvature(...).sharpness(...) and .landscape(...): the same numbers as the analyses on the
same model and data ([Andriushchenko2023]; [Li2018]); the Tracker tracks adaptive sharpness."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharpcli import Curvature
from sharpcli.analyses.sharpness import SharpnessConfig, sharpness
from sharpcli.curvature.products.data import AnalysisData


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(30, 3, dtype=torch.float64, generator=gen)
    return model, x, torch.randint(0, 3, (30,), generator=gen)


def test_sharpness_matches_the_analysis_and_leaves_the_model():
    model, x, y = _setup()
    before = copy.deepcopy(model.state_dict())
    found = Curvature(model, "cross-entropy", (x, y), batch_size=8).sharpness(
        rho=(0.05, 0.1), m=10, steps=10
    )
    expected = sharpness(
        model.eval(), AnalysisData(x, y, "cross-entropy", 8),
        SharpnessConfig(rhos=(0.05, 0.1), m=10, steps=10),
    )  # fmt: skip
    assert [r["sharpness"] for r in found["rows"]] == pytest.approx(
        [r.sharpness for r in expected.rows], rel=1e-12
    )
    assert found["batches"] == 3 and found["adaptive"] is True
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_landscape_centre_and_line_to_another_model():
    model, x, y = _setup()
    curvature = Curvature(model, "cross-entropy", (x, y))
    plane = curvature.landscape(steps=3, seed=2)
    with torch.no_grad():
        direct = float(F.cross_entropy(model(x), y))
    assert plane["loss"][1][1] == pytest.approx(direct, rel=1e-12)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    line = curvature.landscape(along="checkpoint", other=other, dims=1, steps=5, span=0.0)
    assert line["x"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    with torch.no_grad():
        assert line["loss"][-1] == pytest.approx(float(F.cross_entropy(other(x), y)), rel=1e-12)


def test_the_tracker_tracks_adaptive_sharpness():
    from sharpcli import Tracker

    model, x, y = _setup()
    tracker = Tracker("cross-entropy", (x, y), every=1, metrics=("sharpness",), seed=0)
    values = tracker.measure(model)
    expected = sharpness(
        copy.deepcopy(model).eval(), AnalysisData(x, y, "cross-entropy", 256),
        SharpnessConfig(rhos=(0.05,), steps=10),
    )  # fmt: skip
    assert values["sharpness/adaptive_sharpness"] == pytest.approx(
        expected.rows[0].sharpness, rel=1e-12
    )
