"""sharp landscape: the grid against direct evaluations, [Li2018]'s filter normalization, the
eigenvector directions against a dense float64 Hessian, saved directions redo a figure."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharpcli.analyses.landscape import LandscapeConfig, grid_coordinates, loss_landscape
from sharpcli.analyses.landscape_directions import (
    filter_normalized_direction,
    load_directions,
    save_directions,
)
from sharpcli.curvature.products.data import AnalysisData
from sharpcli.errors import InputError, UsageError


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return (
        nn.Sequential(
            nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 3)
        )
        .double()
        .eval()
    )


def _data(n: int = 20, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 4, 4, dtype=torch.float64, generator=gen)
    return x, torch.randint(0, 3, (n,), generator=gen)


def _loss_at(model: nn.Module, weights: dict, x, y) -> float:
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(weights[name])
    with torch.no_grad():
        return float(F.cross_entropy(twin(x), y))


def test_the_centre_is_the_checkpoint_and_every_point_a_direct_evaluation():
    model = _net()
    x, y = _data()
    before = copy.deepcopy(model.state_dict())
    config = LandscapeConfig(dims=2, steps=5, span=0.5)
    result, (d1, d2), names = loss_landscape(model, AnalysisData(x, y, "cross-entropy", 7), config)
    assert result.x == result.y == [-0.5, -0.25, 0.0, 0.25, 0.5]
    with torch.no_grad():
        direct = float(F.cross_entropy(model(x), y))
    assert result.centre_loss == pytest.approx(direct, rel=1e-12)
    assert result.loss[2][2] == pytest.approx(direct, rel=1e-12)
    w0 = dict(model.named_parameters())
    for j, i in [(0, 0), (1, 3), (4, 2)]:
        a, b = result.x[i], result.y[j]
        weights = {n: w0[n].detach() + a * u + b * v for n, u, v in zip(names, d1, d2)}
        assert result.loss[j][i] == pytest.approx(_loss_at(model, weights, x, y), rel=1e-12)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])  # restored


def test_the_line_between_two_checkpoints_is_the_interpolation():
    model, other = _net(0), _net(1)
    x, y = _data()
    config = LandscapeConfig(along="checkpoint", dims=1, steps=7)
    result, _, _ = loss_landscape(
        model, AnalysisData(x, y, "cross-entropy", 20), config, other=other
    )
    assert result.x == pytest.approx([-0.5, -0.1666667, 0.1666667, 0.5, 0.8333333, 1.1666667, 1.5])
    w0, w1 = dict(model.named_parameters()), dict(other.named_parameters())
    for t, loss in zip(result.x, result.loss):
        weights = {n: (1 - t) * w0[n].detach() + t * w1[n].detach() for n in w0}
        assert loss == pytest.approx(_loss_at(model, weights, x, y), rel=1e-10)


def test_filter_normalized_directions_have_the_filters_norms():
    model = _net()
    weights = [p.detach() for p in model.parameters()]
    for bias_bn in ("zero", "weights"):
        direction = filter_normalized_direction(weights, torch.Generator().manual_seed(3), bias_bn)
        for w, d in zip(weights, direction):
            if w.dim() <= 1:  # biases, BatchNorm's gamma and beta
                assert torch.equal(d, torch.zeros_like(w) if bias_bn == "zero" else w)
                continue
            for w_i, d_i in zip(w, d):  # each output channel / neuron
                assert float(d_i.norm()) == pytest.approx(float(w_i.norm()), rel=1e-9)
            assert not torch.allclose(d / d.norm(), w / w.norm())  # random, not the weights


def test_eigen_directions_are_the_top_eigenvectors_of_a_dense_hessian():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 3, dtype=torch.float64, generator=gen), torch.randint(0, 3, (16,))
    config = LandscapeConfig(along="eigen", dims=2, steps=3, eig_tol=1e-10)
    result, directions, _ = loss_landscape(model, AnalysisData(x, y, "cross-entropy", 16), config)
    params = list(model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    rows = [torch.cat([h.reshape(-1) for h in torch.autograd.grad(g, params, retain_graph=True)])
            for g in flat]  # fmt: skip
    values, vectors = torch.linalg.eigh(torch.stack(rows))
    assert result.directions["eigenvalues"] == pytest.approx(values.flip(0)[:2].tolist(), rel=1e-8)
    for k, direction in enumerate(directions):
        v = torch.cat([t.reshape(-1) for t in direction])
        assert abs(float(v @ vectors[:, -1 - k])) == pytest.approx(1.0, abs=1e-6)
    assert result.directions["norms"] == pytest.approx([1.0, 1.0])


def test_saved_directions_redo_the_same_grid(tmp_path):
    model = _net()
    x, y = _data()
    data = AnalysisData(x, y, "cross-entropy", 20)
    first, used, names = loss_landscape(model, data, LandscapeConfig(dims=2, steps=3, seed=7))
    path = tmp_path / "d.safetensors"
    save_directions(path, names, used, first.directions)
    loaded, info = load_directions(path, model, names)
    again, _, _ = loss_landscape(
        model, data, LandscapeConfig(along="file", dims=2, steps=3), directions=loaded,
        directions_info=info,
    )  # fmt: skip
    assert again.loss == first.loss and info["seed"] == 7
    with pytest.raises(InputError):
        load_directions(path, nn.Linear(2, 2).double(), ["weight", "bias"])


def test_a_second_checkpoint_of_another_architecture_is_refused():
    x, y = _data()
    other = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3)).double()
    with pytest.raises(UsageError) as info:
        loss_landscape(
            _net(), AnalysisData(x, y, "cross-entropy", 20),
            LandscapeConfig(along="checkpoint", dims=1, steps=3), other=other,
        )  # fmt: skip
    assert info.value.source == "along" and "another architecture" in str(info.value)


@pytest.mark.parametrize(
    "field, value, source",
    [("span", 0.0, "span"), ("steps", 1, "steps"), ("dims", 3, "dims"), ("along", "up", "along")],
)
def test_bad_settings_name_their_parameter(field, value, source):
    with pytest.raises(UsageError) as info:
        LandscapeConfig(**{field: value}).validate()
    assert info.value.source == source


def test_grid_coordinates_hold_zero_exactly():
    assert grid_coordinates(21, -1.0, 1.0)[10] == 0.0
    assert grid_coordinates(3, -0.5, 1.5) == [-0.5, 0.5, 1.5]
