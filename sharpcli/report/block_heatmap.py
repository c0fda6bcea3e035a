"""``sharp eigen --blocks ... --plot``: the blocks' top eigenvalues as a heatmap by layer.

Rows are a model's repeated layers and columns the parameter kind within a layer, read from
the block names that ``params`` and ``modules`` give: ``transformer.h.3.attn.c_attn.weight``
is layer ``transformer.h.3``, kind ``attn.c_attn.weight`` (the name split at its first
all-digit component). The layers are those of the stack (``transformer.h``) with the most
blocks; the blocks outside it (embeddings, the final norm) are counted in the title. Blocks
that do not form such a grid (at least two layers and two kinds), e.g. those of ``layers``
or named globs, are drawn as a bar chart instead. Where every value is positive the colours
are on a log scale (the blocks' curvatures span decades, [Zhang2024]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from sharpcli import catalogue
from sharpcli.report.plots import _figure, _save

__all__ = ["BlockGrid", "block_grid", "block_top_eigenvalue", "plot_block_eigenvalues"]

_MAX_ANNOTATED = 100  # cells written into the heatmap; above, colours only
_MAX_BARS = 30


@dataclass(frozen=True)
class BlockGrid:
    """Where each block sits in the heatmap.

    Attributes:
        layers: the row labels (layer names, in index order).
        kinds: the column labels (parameter kinds, in order of first appearance).
        cells: ``{block name: (row, column)}`` for the blocks in the grid.
        outside: the names of the blocks outside it.
    """

    layers: list[str]
    kinds: list[str]
    cells: dict[str, tuple[int, int]]
    outside: list[str]


def _split(name: str) -> tuple[str, int, str] | None:
    """``(stack, index, kind)`` of a block name at its first all-digit component, with a
    kind after it; None otherwise."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i + 1 < len(parts):
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def block_grid(names: list[str]) -> BlockGrid | None:
    """The heatmap's layers x kinds grid of the block ``names`` (module docstring).

    Args:
        names: the blocks' names, in the model's order.

    Returns:
        The grid, or None when the blocks do not form one (fewer than two layers or kinds,
        or two blocks in one cell).
    """
    split = {n: _split(n) for n in names}
    stacks: dict[str, int] = {}
    for parts in split.values():
        if parts is not None:
            stacks[parts[0]] = stacks.get(parts[0], 0) + 1
    if not stacks:
        return None
    stack = max(stacks, key=lambda s: stacks[s])  # the first of the largest on ties
    inside = {n: p for n, p in split.items() if p is not None and p[0] == stack}
    indices = sorted({p[1] for p in inside.values()})
    kinds = list(dict.fromkeys(p[2] for p in inside.values()))
    if len(indices) < 2 or len(kinds) < 2:
        return None
    cells = {n: (indices.index(p[1]), kinds.index(p[2])) for n, p in inside.items()}
    if len(set(cells.values())) < len(cells):
        return None
    layers = [f"{stack}.{i}" if stack else str(i) for i in indices]
    return BlockGrid(layers, kinds, cells, [n for n in names if n not in inside])


def block_top_eigenvalue(block: dict, which: str) -> float:
    """The block's figure in the plot: its smallest eigenvalue for ``which="smallest"``,
    its largest otherwise."""
    values = [v for v in block["eigenvalues"] if v is not None and math.isfinite(v)]
    if not values:
        return float("nan")
    return min(values) if which == "smallest" else max(values)


def _short(label: str, width: int = 24) -> str:
    return label if len(label) <= width else "..." + label[-(width - 3) :]


def _norm(values: list[float]):
    from matplotlib.colors import LogNorm, Normalize

    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) > min(finite):
        return LogNorm(vmin=min(finite), vmax=max(finite)), "viridis"
    if finite and min(finite) < 0 < max(finite):
        bound = max(abs(v) for v in finite)
        return Normalize(vmin=-bound, vmax=bound), "RdBu_r"
    return None, "viridis"


def _heatmap(fig, ax, grid: BlockGrid, value_of: dict[str, float], label: str) -> None:
    import numpy as np

    table = np.full((len(grid.layers), len(grid.kinds)), np.nan)
    for name, (row, col) in grid.cells.items():
        table[row, col] = value_of[name]
    norm, cmap = _norm(list(table.flat))
    image = ax.imshow(np.ma.masked_invalid(table), aspect="auto", cmap=cmap, norm=norm)
    fig.colorbar(image, ax=ax, label=label)
    small = 7 if len(grid.kinds) <= 8 else 5
    ax.set_xticks(range(len(grid.kinds)), [_short(k) for k in grid.kinds], fontsize=small)
    ax.tick_params(axis="x", labelrotation=35)
    for tick in ax.get_xticklabels():
        tick.set_horizontalalignment("right")
    rows_font = 7 if len(grid.layers) <= 16 else 5
    ax.set_yticks(range(len(grid.layers)), [_short(n) for n in grid.layers], fontsize=rows_font)
    ax.set_xlabel("parameter kind")
    ax.set_ylabel("layer")
    if table.size <= _MAX_ANNOTATED:
        for (row, col), value in np.ndenumerate(table):
            if math.isfinite(value):
                dark = float(image.norm(value)) < 0.45  # white on the colour map's dark end
                color = "white" if dark and cmap == "viridis" else "black"
                ax.text(
                    col, row, f"{value:.3g}", ha="center", va="center", fontsize=small, color=color
                )


def _bars(ax, blocks: list[dict], value_of: dict[str, float], label: str) -> int:
    """The blocks as horizontal bars in the model's order, the largest ``_MAX_BARS`` of them;
    returns how many were left out."""
    largest = {b["name"] for b in sorted(blocks, key=lambda b: -b["numel"])[:_MAX_BARS]}
    shown = [b for b in blocks if b["name"] in largest]
    values = [value_of[b["name"]] for b in shown]
    ax.barh(range(len(shown)), values, color="tab:blue")
    ax.set_yticks(range(len(shown)), [_short(b["name"], 32) for b in shown], fontsize=7)
    ax.invert_yaxis()  # the model's first block on top
    if values and min(values) > 0 and max(values) > 10 * min(values):
        ax.set_xscale("log")
    ax.set_xlabel(label)
    ax.grid(True, axis="x", alpha=0.3)
    return len(blocks) - len(shown)


def plot_block_eigenvalues(
    results: dict, path: str | Path, *, operator: str = catalogue.HESSIAN, which: str = "largest"
) -> Path:
    """The blocks' top eigenvalues (``sharp eigen --blocks`` results) as a layers x kinds
    heatmap, or a bar chart when the blocks do not form a grid (module docstring).

    Args:
        results: ``results`` with ``blocks`` (``name``, ``numel``, ``eigenvalues``).
        path: the PNG to write (960 x 600 pixels).
        operator: the operator's name, for the title.
        which: ``smallest`` plots each block's smallest eigenvalue, else its largest.

    Returns:
        ``path``.
    """
    blocks = results["blocks"]
    value_of = {b["name"]: block_top_eigenvalue(b, which) for b in blocks}
    end = "smallest" if which == "smallest" else "largest"
    label = f"{end} eigenvalue of the block"
    grid = block_grid([b["name"] for b in blocks])
    plt, fig, ax = _figure()
    if grid is not None:
        _heatmap(fig, ax, grid, value_of, label)
        left = f"; {len(grid.outside)} blocks outside the layers not shown" if grid.outside else ""
        title = f"{operator}: {end} eigenvalue per block, by layer{left}"
    else:
        hidden = _bars(ax, blocks, value_of, label)
        left = f"; {hidden} smaller blocks not shown" if hidden else ""
        title = f"{operator}: {end} eigenvalue per block{left}"
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, path)
