"""The PNG of ``sharp landscape``: a line (1D) or a contour beside a surface (2D).

Same size and writing as every plot of :mod:`sharpcli.report.plots`.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.ticker import MaxNLocator

from sharpcli import catalogue
from sharpcli.report.plots import _figure, _finite, _save

__all__ = ["plot_landscape"]


def plot_landscape(results: dict, path: str | Path, *, title: str = "") -> Path:
    """Loss (and accuracy) along a line, or the loss's contour and surface over a plane.

    Args:
        results: ``sharp landscape``'s results (``x``, ``y``, ``loss``, ``accuracy``, ``along``).
        path: the PNG.
        title: the figure's title.

    Returns:
        The path written.
    """
    if results["y"] is None:
        return _line(results, path, title)
    return _plane(results, path, title)


def _axis_label(results: dict, axis: int) -> str:
    along = results["along"]
    if along == "checkpoint" and axis == 0:
        return "t: (1 - t) CKPT + t CKPT2"
    if along == catalogue.ALONG_EIGEN:
        return f"eigenvector {axis + 1} (unit norm)"
    return f"filter-normalized direction {axis + 1}"


def _line(results: dict, path, title: str) -> Path:
    plt, fig, ax = _figure()
    ax.plot(results["x"], _finite(results["loss"]), color="C0", marker=".", label="loss")
    ax.set_xlabel(_axis_label(results, 0))
    ax.set_ylabel("loss", color="C0")
    if results.get("accuracy") is not None:
        twin = ax.twinx()
        twin.plot(results["x"], results["accuracy"], color="C1", linestyle="--", label="accuracy")
        twin.set_ylabel("accuracy", color="C1")
    for mark in [0.0] + ([1.0] if results["along"] == "checkpoint" else []):
        ax.axvline(mark, color="grey", linewidth=0.6)
    ax.set_title(title)
    return _save(plt, fig, path)


def _plane(results: dict, path, title: str) -> Path:
    import numpy as np

    plt, fig, _ = _figure()
    fig.clf()
    x, y = np.array(results["x"]), np.array(results["y"])
    z = np.array([_finite(row) for row in results["loss"]])
    grid_x, grid_y = np.meshgrid(x, y)
    ax = fig.add_subplot(1, 2, 1)
    filled = ax.contourf(grid_x, grid_y, z, levels=30, cmap="viridis")
    ax.contour(grid_x, grid_y, z, levels=15, colors="white", linewidths=0.4)
    ax.plot([0], [0], marker="+", color="red", markersize=10)
    if results["along"] == "checkpoint":
        ax.plot([1], [0], marker="x", color="red", markersize=8)
    fig.colorbar(filled, ax=ax, label="loss")
    ax.set_xlabel(_axis_label(results, 0), fontsize=8)
    ax.set_ylabel(_axis_label(results, 1), fontsize=8)
    ax.set_aspect("auto")
    surface = fig.add_subplot(1, 2, 2, projection="3d")
    surface.plot_surface(grid_x, grid_y, z, cmap="viridis", linewidth=0, antialiased=True)
    surface.set_zlabel("loss", fontsize=8)
    surface.tick_params(labelsize=7)
    for axis in (surface.xaxis, surface.yaxis):  # the default 9 ticks run into each other
        axis.set_major_locator(MaxNLocator(5))
    surface.set_box_aspect(None, zoom=0.85)  # room for the z label
    fig.suptitle(title)
    return _save(plt, fig, path)
