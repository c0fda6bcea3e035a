"""``Curvature(...).eigenvalues/trace/density(blocks=...)``: each block's figures are those of
the dense float64 principal sub-block, as ``sharp eigen|trace|density --blocks`` gives them."""

from __future__ import annotations

import pytest
import torch
from hessian_helpers import double_backward_hessian
from torch import nn

from sharpcli import Curvature
from sharpcli.errors import UsageError


@pytest.fixture(scope="module")
def tiny():
    """A tanh MLP in float64 on 40 samples, its Curvature, dense Hessian and parameter slices."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(40, 4, dtype=torch.float64), torch.randint(0, 3, (40,))
    curvature = Curvature(model, nn.CrossEntropyLoss(), (x, y))
    named = dict(model.named_parameters())
    H = double_backward_hessian(model, list(named.values()), x, y)
    slices, start = {}, 0
    for name, p in named.items():
        slices[name] = slice(start, start + p.numel())
        start += p.numel()
    return curvature, H, slices


def test_block_eigenvalues_are_the_dense_principal_sub_blocks(tiny):
    curvature, H, slices = tiny
    blocks = curvature.eigenvalues(top_k=2, which="both", tol=1e-9, blocks="params")
    assert [b["name"] for b in blocks] == list(slices)
    for block in blocks:
        sl = slices[block["name"]]
        exact = torch.linalg.eigvalsh(H[sl, sl])
        k = len(block["eigenvalues"]) // 2
        assert block["numel"] == sl.stop - sl.start and all(block["converged"])
        assert block["parameters"] == [block["name"]]
        got = torch.tensor(sorted(block["eigenvalues"]), dtype=H.dtype)
        assert torch.allclose(got, torch.cat([exact[:k], exact[-k:]]), atol=1e-7, rtol=0)


def test_named_blocks_as_a_mapping_and_their_exact_traces(tiny):
    """A mapping names the blocks (the top eigenvalue of each is the dense sub-block's); the
    Hessian block traces by Hutch++ are within four standard errors of the dense sub-blocks'."""
    curvature, H, slices = tiny
    blocks = curvature.eigenvalues(top_k=1, tol=1e-9, blocks={"hidden": "0.*", "head": "2.*"})
    hidden = torch.cat(
        [torch.arange(slices[n].start, slices[n].stop) for n in ("0.weight", "0.bias")]
    )
    assert [(b["name"], b["parameters"]) for b in blocks] == [
        ("hidden", ["0.weight", "0.bias"]),
        ("head", ["2.weight", "2.bias"]),
    ]
    exact_top = torch.linalg.eigvalsh(H[hidden][:, hidden])[-1]
    assert blocks[0]["eigenvalues"][0] == pytest.approx(float(exact_top), rel=1e-7)
    traces = curvature.trace(estimator="hutchpp", tol=1e-3, max_matvecs=400, blocks="modules")
    assert [t["name"] for t in traces] == ["0", "2"]
    for row, names in zip(traces, (("0.weight", "0.bias"), ("2.weight", "2.bias"))):
        exact = sum(float(H[slices[n], slices[n]].trace()) for n in names)
        assert abs(row["estimate"] - exact) <= 4 * row["stderr"] + 1e-9


def test_block_traces_sum_to_the_full_exact_trace(tiny):
    curvature, _, _ = tiny
    blocks = curvature.trace("ggn", estimator="exact", blocks="hidden=0.*,head=2.*")
    full = curvature.trace("ggn", estimator="exact")
    assert sum(b["estimate"] for b in blocks) == pytest.approx(full.estimate, rel=1e-12)
    assert sum(b["numel"] for b in blocks) == curvature.num_params


def test_block_densities_span_the_dense_sub_blocks_spectra(tiny):
    """As many Lanczos steps as a block's size: its SLQ nodes are the sub-block's eigenvalues."""
    curvature, H, slices = tiny
    blocks = curvature.density(probes=2, steps=40, grid_points=64, blocks="params")
    assert [b["name"] for b in blocks] == list(slices)
    for block in blocks:
        exact = torch.linalg.eigvalsh(H[slices[block["name"]], slices[block["name"]]])
        assert block["lambda_max"] == pytest.approx(float(exact[-1]), abs=1e-8)
        assert block["lambda_min"] == pytest.approx(float(exact[0]), abs=1e-8)
        assert len(block["grid"]) == len(block["density"]) == 64


def test_bad_blocks_name_the_argument(tiny):
    curvature = tiny[0]
    with pytest.raises(UsageError, match="matches no parameter") as info:
        curvature.trace(blocks={"x": "nothing*"})
    assert info.value.source == "blocks"
    with pytest.raises(UsageError) as info:
        curvature.eigenvalues(blocks="params", return_eigenvectors=True)
    assert info.value.source == "return_eigenvectors"
    with pytest.raises(UsageError, match="give one of params, modules"):
        curvature.density(blocks=" ")
