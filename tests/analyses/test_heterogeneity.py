"""Block heterogeneity of ``density --blocks`` (sharpcli/analyses/heterogeneity.py): the
Jensen-Shannon distances against scipy on densities recomputed here from the reported SLQ
nodes, zero between identical blocks, the block-diagonal density, ``--top`` and ``--plot``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from png_helpers import png_size
from scipy.spatial.distance import jensenshannon
from scipy.stats import norm

from fixtures.make_checkpoint_fixtures import tiny_mlp_spec, write_own_checkpoint
from sharpcli.analyses.heterogeneity import cell_masses, js_distance
from sharpcli.report.envelope import validate_report

DATA = "blobs:n=48,dim=4,classes=3,seed=4"
SLQ = ("--steps", "12", "--probes", "2", "--grid-points", "256", "--dtype", "float64")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = tiny_mlp_spec(d_in=4, classes=3, width=5, depth=1, activation="gelu")
    folder = tmp_path_factory.mktemp("heterogeneity")
    return write_own_checkpoint(folder / "tiny.safetensors", spec, data_spec=DATA, seed=5)


def _slq_density(block: dict, grid: np.ndarray) -> np.ndarray:
    """Gaussian-broadened SLQ density written out here, independently of sharp's."""
    sigma, out = block["sigma"], np.zeros_like(grid)
    for nodes, weights in zip(block["nodes"], block["weights"]):
        for t, w in zip(nodes, weights):
            out += w * np.exp(-0.5 * ((grid - t) / sigma) ** 2)
    return out / (len(block["nodes"]) * sigma * math.sqrt(2 * math.pi))


def _slq_cell_masses(block: dict, grid: np.ndarray) -> np.ndarray:
    """The broadened density's mass per grid cell (cells split at midpoints), by scipy's CDF."""
    half = (grid[1] - grid[0]) / 2
    edges = np.concatenate([[grid[0] - half], (grid[1:] + grid[:-1]) / 2, [grid[-1] + half]])
    out = np.zeros_like(grid)
    for nodes, weights in zip(block["nodes"], block["weights"]):
        for t, w in zip(nodes, weights):
            out += w * np.diff(norm.cdf(edges, loc=t, scale=block["sigma"]))
    return out / len(block["nodes"])


def test_a_block_narrower_than_the_grid_keeps_its_mass():
    """A block whose width is far below the grid spacing: its point values all vanish between
    its peaks (the distance used to read NaN as 0); its cell masses do not."""
    grid = np.linspace(-10.0, 500.0, 256)
    narrow = {"nodes": [[1.001, 1.002]], "weights": [[0.5, 0.5]], "sigma": 1e-5}
    wide = {"nodes": [[100.0, 300.0]], "weights": [[0.5, 0.5]], "sigma": 5.0}
    assert _slq_density(narrow, grid).sum() == 0.0
    masses = cell_masses(narrow["nodes"], narrow["weights"], narrow["sigma"], grid)
    assert masses.sum() == pytest.approx(1.0, abs=1e-9)
    other = cell_masses(wide["nodes"], wide["weights"], wide["sigma"], grid)
    assert js_distance(masses, other) == pytest.approx(math.sqrt(math.log(2)), abs=1e-6)
    with pytest.raises(ValueError):
        js_distance(np.zeros(4), np.ones(4))


def test_js_distance_is_scipys_and_zero_on_equal_densities():
    rng = np.random.default_rng(0)
    p, q = rng.random(50), rng.random(50)
    p[:5] = 0.0  # zeros on one side only
    assert js_distance(p, q) == pytest.approx(float(jensenshannon(p, q)), abs=1e-12)
    assert js_distance(p, 3 * p) == pytest.approx(0.0, abs=1e-7)  # sqrt of a rounding error
    assert js_distance([1, 0], [0, 1]) == pytest.approx(math.sqrt(math.log(2)), abs=1e-12)


def test_density_blocks_heterogeneity_matches_scipy_on_the_same_grid(tiny, capsys, tmp_path):
    png = tmp_path / "blocks.png"
    run = run_cli(
        capsys, "density", tiny, "--blocks", "params", *SLQ, "--top", "2", "--plot", str(png),
        "--json", "-",
    )  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    validate_report(report)
    res = report["results"]
    blocks, het, diag = res["blocks"], res["heterogeneity"], res["block_diagonal"]
    grid = np.linspace(het["grid_min"], het["grid_max"], het["grid_points"])
    phis = [_slq_density(b, grid) for b in blocks]
    masses = [_slq_cell_masses(b, grid) for b in blocks]
    n = len(blocks)
    assert het["names"] == [b["name"] for b in blocks] and het["pairs"] == n * (n - 1) // 2
    pairs = []
    for i in range(n):
        assert het["js_distance"][i][i] == 0.0
        for j in range(i + 1, n):
            expected = float(jensenshannon(masses[i], masses[j]))
            assert het["js_distance"][i][j] == pytest.approx(expected, abs=1e-9)
            assert het["js_distance"][j][i] == het["js_distance"][i][j]
            pairs.append(expected)
    assert het["mean"] == pytest.approx(sum(pairs) / len(pairs), abs=1e-9)
    assert het["max"] == pytest.approx(max(pairs), abs=1e-9) and het["max"] > 0.05
    # block-diagonal density: the blocks' densities weighted by size; the full one beside it
    numel = sum(b["numel"] for b in blocks)
    mixture = sum(b["numel"] / numel * phi for b, phi in zip(blocks, phis))
    assert np.allclose(diag["grid"], grid) and diag["numel"] == numel
    assert np.allclose(diag["density"], mixture, rtol=1e-9, atol=1e-12)
    full = _slq_density(res, grid)
    assert np.allclose(diag["full_density"], full, rtol=1e-9, atol=1e-12)
    mass_mixture = sum(b["numel"] / numel * m for b, m in zip(blocks, masses))
    assert diag["js_distance_to_full"] == pytest.approx(
        float(jensenshannon(mass_mixture, _slq_cell_masses(res, grid))), abs=1e-9
    )
    assert png_size(png) == (960, 600)


def test_identical_blocks_are_at_distance_zero(tiny, capsys):
    """Two blocks of the same parameters, probed with the same seed: identical densities."""
    run = run_cli(capsys, "density", tiny, "--blocks", "a=*,b=*", *SLQ, "--json", "-")
    assert run.code == 0, run.err
    het = run.json()["results"]["heterogeneity"]
    assert het["js_distance"] == [[0.0, 0.0], [0.0, 0.0]] and het["max"] == 0.0


def test_top_shows_the_largest_blocks_and_fits_80_columns(tiny, capsys):
    run = run_cli(capsys, "density", tiny, "--blocks", "params", *SLQ, "--top", "2")
    assert run.code == 0, run.err
    lines = run.out.splitlines()
    assert max(len(line) for line in lines) <= 80
    shown = [line.split()[1] for line in lines if line.startswith("│ ") and "." in line.split()[1]]
    assert shown[:2] == ["0.weight", "2.weight"]  # 20 and 15 parameters, then 5 and 3 left out
    assert "2 smaller blocks not shown" in run.out
    bad = run_cli(capsys, "density", tiny, "--blocks", "params", "--top", "0")
    assert_one_line_error(bad, 2, "--top")


@pytest.mark.parametrize("command", ["eigen", "trace"])
def test_top_on_the_eigen_and_trace_blocks_tables(tiny, capsys, command):
    run = run_cli(capsys, command, tiny, "--blocks", "params", "--top", "1")
    assert run.code == 0, run.err
    rows = [line.split()[1] for line in run.out.splitlines() if line.startswith("│ ")]
    assert "0.weight" in rows and not {"2.weight", "0.bias", "2.bias"} & set(rows)
    assert "3 smaller blocks not shown (--top 1; all in --json)" in run.out
