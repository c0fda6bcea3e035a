"""The loss (and accuracy) on a line or a plane through a checkpoint ([Li2018];
[GoodfellowVinyals2015]).

``L(w0 + a d1)`` on a line, ``L(w0 + a d1 + b d2)`` on a plane, for ``a`` (and ``b``) on a grid
of ``steps`` points in ``[-span, span]``; along a second checkpoint's line ``d1 = w1 - w0`` and
``a`` in ``[-span, 1 + span]`` (``a = 0`` is CKPT, ``a = 1`` the second checkpoint). The
directions (:mod:`sharpcli.analyses.landscape_directions`) are filter-normalized Gaussian ones,
the top Hessian eigenvectors, or that line; each grid point is one pass over the analysis set
in batches, in eval mode (BatchNorm's running statistics stay those of CKPT).

Under ``torchrun`` (W ranks) the grid points are split across the ranks, point ``i`` to rank
``i mod W``, and each rank evaluates its points on the WHOLE analysis set (rebuilt once from
the ranks' shards by an all-reduce of zero-padded copies, which adds only zeros), in the same
batches as one process. Every point is then the very computation one process makes, so the
grid is bitwise the single-process grid (random, checkpoint and file directions; eigen
directions come from the data-parallel Hessian, equal to one process's up to summation
order). The points are gathered by one more all-reduce of zero-padded rows, on every rank;
rank 0 writes them. Splitting points rather than data needs no reduction per point and keeps
each evaluation identical to one process's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from sharpcli import catalogue, progress
from sharpcli.analyses.landscape_directions import (
    checkpoint_direction,
    filter_normalized_direction,
)
from sharpcli.analyses.perturbed import PerturbedModel, whole_analysis_set
from sharpcli.curvature.eigen.lanczos import lanczos
from sharpcli.curvature.products.data import AnalysisData, all_reduce_sum
from sharpcli.curvature.products.engine import CurvatureEngine
from sharpcli.curvature.products.scope import ParamScope
from sharpcli.errors import UsageError

__all__ = ["LandscapeConfig", "LandscapeResult", "grid_coordinates", "loss_landscape"]

ALONG = catalogue.LANDSCAPE_ALONG


@dataclass
class LandscapeConfig:
    """What :func:`loss_landscape` draws.

    Attributes:
        along: ``"random"``, ``"eigen"``, ``"checkpoint"`` (``other`` given to
            :func:`loss_landscape`) or ``"file"`` (``directions`` given).
        dims: 1 (a line) or 2 (a plane; along a checkpoint, the second direction is random).
        steps: grid points per axis, >= 2 (odd: the centre is on the grid).
        span: the half-width of the grid (along a checkpoint: the extrapolation beyond each end);
            None: 1 (0.5 along a checkpoint).
        bias_bn: the random directions on 1-D parameters: ``"zero"`` or ``"weights"``.
        params: the parameters that move (``all``, ``last``, globs).
        seed: seeds the random directions.
        eig_tol: Lanczos's tolerance for the eigenvectors.
        eig_max_matvecs: Lanczos's budget.
    """

    along: str = "random"
    dims: int = 2
    steps: int = 21
    span: float | None = None
    bias_bn: str = "zero"
    params: str | None = None
    seed: int = 0
    eig_tol: float = 1e-3
    eig_max_matvecs: int | None = None

    @property
    def half_width(self) -> float:
        """The span, its default filled in."""
        if self.span is not None:
            return float(self.span)
        return 0.5 if self.along == "checkpoint" else 1.0

    def validate(self) -> None:
        """UsageError naming the parameter of the first bad setting."""
        if self.along not in ALONG:
            raise UsageError(
                f"must be one of {', '.join(ALONG)}; got {self.along!r}", source="along"
            )
        if self.dims not in (1, 2):
            raise UsageError(f"must be 1 or 2, got {self.dims}", source="dims")
        if self.steps < 2:
            raise UsageError(f"must be >= 2, got {self.steps}", source="steps")
        if self.steps > 1001:
            raise UsageError(f"must be <= 1001, got {self.steps}", source="steps")
        span = self.half_width
        if not (math.isfinite(span) and (span > 0 or (span == 0 and self.along == "checkpoint"))):
            raise UsageError(f"must be a finite number > 0, got {span:g}", source="span")
        if self.bias_bn not in catalogue.LANDSCAPE_BIAS_BN:
            raise UsageError(
                f"must be one of {', '.join(catalogue.LANDSCAPE_BIAS_BN)}", source="bias_bn"
            )


def grid_coordinates(steps: int, low: float, high: float) -> list[float]:
    """``steps`` evenly spaced points from ``low`` to ``high``; the midpoint of a symmetric odd
    grid is exactly 0 (``low + (high - low) i / (steps - 1)`` in float64).

    Args:
        steps: the points, >= 2.
        low: the first.
        high: the last.
    """
    return [low + (high - low) * i / (steps - 1) for i in range(steps)]


@dataclass
class LandscapeResult:
    """The grid: coordinates, loss and accuracy (``[i]`` on a line, ``[j][i]`` on a plane:
    row j is the second coordinate ``y[j]``), and how the directions were made."""

    along: str
    dims: int
    x: list[float]
    y: list[float] | None
    loss: list
    accuracy: list | None
    centre_loss: float
    params: str
    num_params: int
    directions: dict
    evaluations: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "along": self.along,
            "dims": self.dims,
            "steps": len(self.x),
            "x": self.x,
            "y": self.y,
            "loss": self.loss,
            "accuracy": self.accuracy,
            "centre_loss": self.centre_loss,
            "loss_min": min(_flat(self.loss)),
            "loss_max": max(_flat(self.loss)),
            "params": self.params,
            "num_params": self.num_params,
            "directions": self.directions,
            "evaluations": self.evaluations,
            "notes": list(self.notes),
        }

    def csv_rows(self) -> list[dict]:
        """One dict per grid point: ``x`` (``y``), ``loss``, ``accuracy``."""
        rows = []
        for j, b in enumerate(self.y if self.y is not None else [None]):
            for i, a in enumerate(self.x):
                loss = self.loss[j][i] if self.y is not None else self.loss[i]
                acc = None
                if self.accuracy is not None:
                    acc = self.accuracy[j][i] if self.y is not None else self.accuracy[i]
                row = {"x": a} | ({"y": b} if b is not None else {})
                rows.append(row | {"loss": loss, "accuracy": acc})
        return rows


def _flat(values: list) -> list[float]:
    return [v for row in values for v in row] if values and isinstance(values[0], list) else values


def _eigen_directions(
    model: nn.Module, data: AnalysisData, scope: ParamScope, k: int, config: LandscapeConfig
) -> tuple[list[list[torch.Tensor]], dict]:
    hessian = CurvatureEngine(model, data, scope).hessian()
    result = lanczos(
        hessian,
        k,
        "largest",
        tol=config.eig_tol,
        max_matvecs=config.eig_max_matvecs,
        seed=config.seed,
        return_eigenvectors=True,
    )
    vectors = result.eigenvectors
    assert vectors is not None  # asked for (return_eigenvectors)
    directions = [
        [t.to(dtype=scope.dtype) for t in scope.unflatten(vectors[:, i].to(scope.device))]
        for i in range(k)
    ]
    info = {
        "eigenvalues": [float(v) for v in result.eigenvalues[:k]],
        "converged": [bool(c) for c in result.converged[:k]],
        "matvecs": int(result.matvecs),
    }
    return directions, info


def _evaluate_points(
    moved: PerturbedModel,
    x: torch.Tensor,
    y: torch.Tensor,
    flat: list[torch.Tensor],
    points: list[tuple[float, float | None]],
    rank: int,
    world: int,
) -> tuple[list[float], list[float | None], int]:
    """Loss and accuracy at every point, this rank evaluating points ``rank, rank + world, ...``
    and the rows gathered over the ranks (module docstring).

    Returns:
        The losses, the accuracies (None where the loss has none) and the passes over the set
        made by all ranks together.
    """
    mine = list(range(rank, len(points), world))
    # per point: loss, accuracy, has an accuracy; one more row: the passes made
    rows = torch.zeros(len(points) + 1, 3, dtype=torch.float64)
    with progress.start("landscape", total=len(mine), unit="points") as run:
        for done, index in enumerate(mine, start=1):
            a, b = points[index]
            u = a * flat[0] if b is None else a * flat[0] + b * flat[1]
            found = moved.evaluate(u, x, y)
            has_accuracy = found.accuracy is not None
            rows[index] = torch.tensor(
                [found.loss, found.accuracy if has_accuracy else 0.0, float(has_accuracy)],
                dtype=torch.float64,
            )
            run.update(done, detail=f"loss {found.loss:.4g}")
        run.finish(len(mine))
    rows[-1, 0] = moved.evaluations
    all_reduce_sum(rows)
    losses = [float(v) for v in rows[:-1, 0]]
    accuracies = [float(r[1]) if r[2] > 0 else None for r in rows[:-1]]
    return losses, accuracies, int(rows[-1, 0])


def _grid_directions(
    model: nn.Module,
    data: AnalysisData,
    scope: ParamScope,
    config: LandscapeConfig,
    other: nn.Module | None,
    directions: list[list[torch.Tensor]] | None,
    directions_info: dict | None,
) -> tuple[list[list[torch.Tensor]], dict]:
    """The grid's directions, one per axis, by ``config.along`` (module docstring), and how
    they were made (the result's ``directions``, before their norms)."""
    info: dict = {"along": config.along, "seed": config.seed, "bias_bn": config.bias_bn}
    if config.along == "file":
        if directions is None or len(directions) < config.dims:
            raise UsageError(
                f"the directions file holds fewer than {config.dims}", source="directions"
            )
        return directions[: config.dims], dict(directions_info or {}) | {"from_file": True}
    if config.along == catalogue.ALONG_EIGEN:
        chosen, found = _eigen_directions(model, data, scope, config.dims, config)
        return chosen, info | found
    gen = torch.Generator().manual_seed(int(config.seed))
    chosen = []
    if config.along == "checkpoint":
        if other is None:
            raise UsageError("needs the second checkpoint", source="along")
        chosen.append(checkpoint_direction(model, scope.names, other))
    weights = [p.detach() for p in scope.params]
    while len(chosen) < config.dims:
        chosen.append(filter_normalized_direction(weights, gen, config.bias_bn))
    return chosen, info


def _grid_axes(config: LandscapeConfig) -> tuple[list[float], list[float] | None]:
    """The grid's coordinates along the first direction and, on a plane, the second (None on
    a line); beside a checkpoint's line the first spans ``[-w, 1 + w]`` and the random axis
    ``[-1, 1]``."""
    span = config.half_width
    high = 1 + span if config.along == "checkpoint" else span
    xs = grid_coordinates(config.steps, -span, high)
    if config.dims != 2:
        return xs, None
    width = 1.0 if config.along == "checkpoint" else span
    return xs, grid_coordinates(config.steps, -width, width)


def _as_grid(
    losses: list[float], accuracies: list[float | None], columns: int, ys: list[float] | None
) -> tuple[list, list | None]:
    """The losses and accuracies of the points (row after row) as the result holds them: a
    list on a line, a row per ``ys`` on a plane; no accuracies unless every point has one."""
    loss_grid: list = losses
    acc_grid: list | None = None if any(a is None for a in accuracies) else accuracies
    if ys is not None:
        loss_grid = [losses[j * columns : (j + 1) * columns] for j in range(len(ys))]
        if acc_grid is not None:
            acc_grid = [accuracies[j * columns : (j + 1) * columns] for j in range(len(ys))]
    return loss_grid, acc_grid


def loss_landscape(
    model: nn.Module,
    data: AnalysisData,
    config: LandscapeConfig,
    *,
    other: nn.Module | None = None,
    directions: list[list[torch.Tensor]] | None = None,
    directions_info: dict | None = None,
) -> tuple[LandscapeResult, list[list[torch.Tensor]], list[str]]:
    """The loss and accuracy on a grid through ``model``'s weights (module docstring).

    The model's parameters move in place during the run and are restored exactly after it.
    Progress: a ``landscape`` run counting this rank's grid points. Under torchrun every rank
    returns the whole grid (module docstring); ``evaluations`` counts every rank's passes.

    Args:
        model: the model, in eval mode (CKPT).
        data: the analysis set.
        config: the grid and the directions.
        other: the second checkpoint's model (``along="checkpoint"``).
        directions: directions read from a file (``along="file"``), one list per axis.
        directions_info: how those were made (recorded in the result).

    Returns:
        The result, the directions used (to save) and the parameter names they cover.

    Raises:
        UsageError: a bad setting, a second checkpoint of another architecture, or
            directions that do not fit the grid's dimensions.
    """
    config.validate()
    scope = ParamScope.resolve(model, config.params)
    names = scope.names
    chosen, info = _grid_directions(model, data, scope, config, other, directions, directions_info)
    info["norms"] = [math.sqrt(sum(float(t.double().pow(2).sum()) for t in d)) for d in chosen]
    xs, ys = _grid_axes(config)
    flat = [torch.cat([t.reshape(-1) for t in d]) for d in chosen]
    rows: list[float | None] = list(ys) if ys else [None]  # a line: one row
    points: list[tuple[float, float | None]] = [(a, b) for b in rows for a in xs]
    x, y = whole_analysis_set(data)
    with PerturbedModel(model, names, None, data.loss, data.batch_size) as moved:
        moved.error_source = "span"
        centre = moved.evaluate(None, x, y).loss
        losses, accuracies, evaluations = _evaluate_points(
            moved, x, y, flat, points, data.rank, data.world_size
        )
    loss_grid, acc_grid = _as_grid(losses, accuracies, len(xs), ys)
    notes = []
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        notes.append("BatchNorm running statistics are CKPT's at every grid point (eval mode)")
    result = LandscapeResult(
        along=config.along,
        dims=config.dims,
        x=xs,
        y=ys,
        loss=loss_grid,
        accuracy=acc_grid,
        centre_loss=centre,
        params=scope.spec,
        num_params=scope.numel,
        directions=info,
        evaluations=evaluations,
        notes=notes,
    )
    return result, chosen, names
