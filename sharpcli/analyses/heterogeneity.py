"""Block heterogeneity of ``sharp density --blocks``: how far apart the blocks' spectra are.

[Zhang2024] compare the SLQ spectral densities of a model's parameter blocks by the
Jensen-Shannon distance between them: large distances ("block heterogeneity") in transformers,
small ones in CNNs. sharp evaluates every density (each block's Gaussian-broadened SLQ density
with its own width, and the full operator's) on one common grid spanning all their nodes as
the probability of each grid cell, ``p_i = integral of phi over the cell around t_i`` (Gaussian
CDF differences, so a block whose width is far below the grid spacing keeps its mass: point
values ``phi(t_i)`` can all fall between its peaks and vanish), and takes

.. math::

    \\mathrm{JS}(p, q) = \\sqrt{\\tfrac12 \\mathrm{KL}(p \\| m) + \\tfrac12 \\mathrm{KL}(q \\| m)},
    \\quad m = \\tfrac12 (p + q),

with natural logarithms (so ``0 <= JS <= sqrt(ln 2)``), as ``scipy.spatial.distance.jensenshannon``.

The block-diagonal operator ``diag(A_11, ..., A_BB)`` of a partition has the blocks'
eigenvalues together, so its density is the blocks' densities weighted by their sizes,
``sum_b (n_b / n) phi_b``; its distance to the full density measures what the block-diagonal
approximation of the spectrum misses (a figure of the same run, not a bound).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sharpcli.catalogue.values import DENSITY_KEY
from sharpcli.curvature.density import broadened_density

__all__ = ["block_heterogeneity", "cell_masses", "common_grid", "js_distance"]

_PAD_SIGMAS = 5.0


def js_distance(p, q) -> float:
    """The Jensen-Shannon distance between two discretised densities (module docstring).

    Args:
        p: non-negative values on a grid (normalised here).
        q: the same on the same grid.

    Returns:
        ``sqrt(JS divergence)`` with natural logarithms, in ``[0, sqrt(ln 2)]``.
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    for v in (p, q):
        # a vector without mass has no distribution: a NaN here used to read as distance 0
        if not (np.all(np.isfinite(v)) and np.all(v >= 0) and v.sum() > 0):
            raise ValueError("a Jensen-Shannon distance needs finite, non-negative mass")
    p, q = p / p.sum(), q / q.sum()
    m = 0.5 * (p + q)

    def kl(a):
        keep = a > 0  # 0 log 0 = 0; m > 0 wherever a > 0
        return float(np.sum(a[keep] * np.log(a[keep] / m[keep])))

    return math.sqrt(max(0.0, 0.5 * kl(p) + 0.5 * kl(q)))


def cell_masses(nodes: list, weights: list, sigma: float, grid) -> np.ndarray:
    """The broadened SLQ density's mass in each cell of ``grid`` (cells split at midpoints).

    ``sum_v sum_j tau_j^(v) [Phi((e_k+1 - theta_j^(v)) / sigma) - Phi((e_k - theta_j^(v)) /
    sigma)] / V`` with ``e_k`` the cell edges: exact whatever ``sigma`` is against the spacing.

    Args:
        nodes: per probe, the Ritz values.
        weights: per probe, their weights.
        sigma: the Gaussian width.
        grid: evenly spaced points, the cells' centres.

    Returns:
        The masses (float64), summing to about 1 on a grid padded beyond the nodes.
    """
    grid = torch.as_tensor(np.asarray(grid, dtype=np.float64))
    half = (grid[1] - grid[0]) / 2 if len(grid) > 1 else torch.tensor(1.0, dtype=torch.float64)
    edges = torch.cat([grid[:1] - half, (grid[1:] + grid[:-1]) / 2, grid[-1:] + half])
    masses = torch.zeros_like(grid)
    for probe_nodes, probe_weights in zip(nodes, weights):
        t = torch.as_tensor(probe_nodes, dtype=torch.float64)[:, None]
        w = torch.as_tensor(probe_weights, dtype=torch.float64)[:, None]
        cdf = 0.5 * (1 + torch.erf((edges[None, :] - t) / (sigma * math.sqrt(2))))
        masses += (w * (cdf[:, 1:] - cdf[:, :-1])).sum(0)
    return (masses / len(nodes)).numpy()


def common_grid(densities: list[dict], grid_points: int) -> np.ndarray:
    """One grid over every density's nodes, padded by five of the widest broadening.

    Args:
        densities: SLQ results with ``nodes`` (per probe) and ``sigma``.
        grid_points: the grid's number of points.

    Returns:
        The grid (float64).
    """
    nodes = [t for d in densities for probe in d["nodes"] for t in probe]
    pad = _PAD_SIGMAS * max(d["sigma"] for d in densities)
    return np.linspace(min(nodes) - pad, max(nodes) + pad, int(grid_points))


def block_heterogeneity(full: dict, blocks: list[dict], grid_points: int) -> tuple[dict, dict]:
    """The blocks' pairwise Jensen-Shannon distances and the block-diagonal density.

    Args:
        full: the full operator's SLQ result (``nodes``, ``weights``, ``sigma``).
        blocks: each block's (``name``, ``numel``, ``nodes``, ``weights``, ``sigma``), a
            partition of the full scope for the block-diagonal density to mean anything.
        grid_points: points of the common grid.

    Returns:
        ``({names, js_distance (matrix), mean, max, max_pair, pairs, grid_min, grid_max,
        grid_points}, {grid, density, js_distance_to_full, numel})``: the heterogeneity (mean
        and max over the pairs ``i < j``; None with one block) and the block-diagonal density
        on the common grid.
    """
    grid = common_grid([full, *blocks], grid_points)
    phis = [broadened_density(b["nodes"], b["weights"], b["sigma"], grid) for b in blocks]
    masses = [cell_masses(b["nodes"], b["weights"], b["sigma"], grid) for b in blocks]
    n = len(blocks)
    matrix = [[0.0] * n for _ in range(n)]
    pairs = []
    for i in range(n):
        for j in range(i + 1, n):
            matrix[i][j] = matrix[j][i] = js_distance(masses[i], masses[j])
            pairs.append((matrix[i][j], i, j))
    top = max(pairs, default=None)
    heterogeneity = {
        "names": [b["name"] for b in blocks],
        "js_distance": matrix,
        "pairs": len(pairs),
        "mean": sum(d for d, _, _ in pairs) / len(pairs) if pairs else None,
        "max": top[0] if top else None,
        "max_pair": [blocks[top[1]]["name"], blocks[top[2]]["name"]] if top else None,
        "grid_min": float(grid[0]),
        "grid_max": float(grid[-1]),
        "grid_points": int(grid_points),
    }
    numel = sum(b["numel"] for b in blocks)
    block_diagonal = sum(b["numel"] / numel * phi for b, phi in zip(blocks, phis))
    phi_full = broadened_density(full["nodes"], full["weights"], full["sigma"], grid)
    mass_diagonal = sum(b["numel"] / numel * m for b, m in zip(blocks, masses))
    mass_full = cell_masses(full["nodes"], full["weights"], full["sigma"], grid)
    diagonal = {
        "grid": grid.tolist(),
        DENSITY_KEY: np.asarray(block_diagonal).tolist(),
        "full_density": phi_full.tolist(),
        "js_distance_to_full": js_distance(mass_diagonal, mass_full),
        "numel": numel,
    }
    return heterogeneity, diagonal
